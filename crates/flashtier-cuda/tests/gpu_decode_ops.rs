//! The decode engine's kernels against f64 references on random shapes:
//! every weight dtype (FP8 blocks with partial edges), row counts across a
//! pass boundary, vector and scalar paths, routing, routed experts from HBM
//! slots and from pinned memory in place, and split attention over several
//! chunks. Skips with a printed reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    clippy::too_many_arguments,
    reason = "test helpers: a broken kernel must fail the test loudly"
)]

mod common;

/// The engine's top-k (torch's CPU tie rule), compiled in as the oracle of
/// the routing kernels' choices: this crate sits below the engine.
#[allow(dead_code, reason = "only `kept` is the oracle here")]
#[path = "../../flashtier-engine/src/topk.rs"]
mod topk;

use std::sync::Arc;

use flashtier_cuda::PinnedMemory;
use flashtier_cuda::ops::attn::{DecodeRows, DevKvCache};
use flashtier_cuda::ops::buffers::{ActPool, DevMatrix, DevVector, RopeTable, WeightType};
use flashtier_cuda::ops::experts::ExpertSlots;
use flashtier_cuda::ops::moe::BlockOrder;
use flashtier_cuda::ops::{DecodeKernels, Tuning};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{act, gpu_or_skip, moe_reference, random_matrix, record, worst_rel};

#[test]
fn gemv_matches_f64_for_every_dtype_and_row_count() {
    let Some(gpu) = gpu_or_skip("gemv_matches_f64_for_every_dtype_and_row_count") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x6e76);
    let types = [
        WeightType::Bf16,
        WeightType::F16,
        WeightType::F32,
        WeightType::Fp8 { block: [16, 16] },
        WeightType::Fp8 { block: [128, 128] },
    ];
    for ty in types {
        for (m, kk) in [(37, 64), (300, 2048), (5, 40), (33, 29), (129, 136)] {
            if matches!(ty, WeightType::Fp8 { .. }) && kk % 8 != 0 {
                continue;
            }
            for rows in [1, 3, 8, 11] {
                let (bytes, scales, w) = random_matrix(&mut rng, m, kk, ty);
                let dm = DevMatrix::upload(&gpu, m, kk, ty, &bytes, scales.as_deref()).unwrap();
                let x: Vec<f32> = (0..rows * kk)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let xa = act(&k, &pool, rows, kk, &x);
                let mut out = pool.take(&gpu, rows, m).unwrap();
                k.gemv(&mut out, &dm, &xa).unwrap();
                let got = out.to_host(gpu.stream()).unwrap();
                let want: Vec<f64> = (0..rows * m)
                    .map(|i| {
                        let (r, o) = (i / m, i % m);
                        (0..kk)
                            .map(|c| w[o * kk + c] * f64::from(x[r * kk + c]))
                            .sum()
                    })
                    .collect();
                let err = worst_rel(&got, &want);
                assert!(err < 1e-5, "{ty:?} {m}x{kk} rows {rows}: {err:e}");
            }
        }
    }
}

/// Three matrices of one input in one launch (q, k, v) give what three
/// launches give, bit for bit, across a pass boundary of rows; the fused
/// residual add and norm equals an add then a norm.
#[test]
fn gemv_many_and_add_norm_equal_their_parts() {
    let Some(gpu) = gpu_or_skip("gemv_many_and_add_norm_equal_their_parts") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(21);
    let ty = WeightType::Bf16;
    let kk = 256;
    let mats: Vec<DevMatrix> = [300usize, 64, 64]
        .iter()
        .map(|&m| {
            let (b, s, _) = random_matrix(&mut rng, m, kk, ty);
            DevMatrix::upload(&gpu, m, kk, ty, &b, s.as_deref()).unwrap()
        })
        .collect();
    for rows in [1, 9] {
        let x: Vec<f32> = (0..rows * kk)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let xa = act(&k, &pool, rows, kk, &x);
        let mut o0 = pool.take(&gpu, rows, 300).unwrap();
        let mut o1 = pool.take(&gpu, rows, 64).unwrap();
        let mut o2 = pool.take(&gpu, rows, 64).unwrap();
        k.gemv_many(
            &mut [&mut o0, &mut o1, &mut o2],
            &[&mats[0], &mats[1], &mats[2]],
            &xa,
        )
        .unwrap();
        for (m, o) in mats.iter().zip([&o0, &o1, &o2]) {
            let mut one = pool.take(&gpu, rows, m.rows()).unwrap();
            k.gemv(&mut one, m, &xa).unwrap();
            let (a, b) = (
                one.to_host(gpu.stream()).unwrap(),
                o.to_host(gpu.stream()).unwrap(),
            );
            assert_eq!(a, b, "rows {rows}");
        }
    }
    let (rows, cols) = (3, 2048);
    let x: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let y: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let w: Vec<f32> = (0..cols).map(|_| rng.random_range(0.5..1.5)).collect();
    let wv = DevVector::upload(&gpu, &w).unwrap();
    let (mut x1, y1) = (
        act(&k, &pool, rows, cols, &x),
        act(&k, &pool, rows, cols, &y),
    );
    let mut n1 = pool.take(&gpu, rows, cols).unwrap();
    k.add_rms_norm(&mut x1, &y1, &wv, 1e-6, &mut n1).unwrap();
    let mut x2 = act(&k, &pool, rows, cols, &x);
    k.add(&mut x2, &y1).unwrap();
    let mut n2 = pool.take(&gpu, rows, cols).unwrap();
    k.rms_norm(&mut n2, &x2, &wv, 1e-6).unwrap();
    assert_eq!(
        x1.to_host(gpu.stream()).unwrap(),
        x2.to_host(gpu.stream()).unwrap()
    );
    assert_eq!(
        n1.to_host(gpu.stream()).unwrap(),
        n2.to_host(gpu.stream()).unwrap()
    );
}

#[test]
fn norms_rope_and_elementwise_match_the_reference() {
    let Some(gpu) = gpu_or_skip("norms_rope_and_elementwise_match_the_reference") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(7);
    let (rows, heads, d) = (3, 4, 48);
    let cols = heads * d;
    let x: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let w: Vec<f32> = (0..d).map(|_| rng.random_range(0.5..1.5)).collect();
    let xa = act(&k, &pool, rows, cols, &x);
    let wv = DevVector::upload(&gpu, &w).unwrap();
    let mut out = pool.take(&gpu, rows, cols).unwrap();
    k.rms_norm(&mut out, &xa, &wv, 1e-6).unwrap();
    let got = out.to_host(gpu.stream()).unwrap();
    let mut want = vec![0f64; rows * cols];
    for g in 0..rows * heads {
        let s = &x[g * d..(g + 1) * d];
        let ms: f64 = s.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..d {
            want[g * d + i] = f64::from(w[i]) * f64::from(s[i]) * inv;
        }
    }
    assert!(worst_rel(&got, &want) < 1e-5);
    // RoPE, both pairings, on the second half of each head.
    let (positions, half) = (16, 8);
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 16.0))
        .collect();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..positions {
        for f in &inv {
            cos.push((p as f32 * f).cos());
            sin.push((p as f32 * f).sin());
        }
    }
    let table = RopeTable::upload(&gpu, positions, half, &cos, &sin).unwrap();
    for interleaved in [false, true] {
        let mut xr = act(&k, &pool, rows, cols, &x);
        k.rope(&mut xr, &table, heads, d, 32, 16, interleaved, 5)
            .unwrap();
        let got = xr.to_host(gpu.stream()).unwrap();
        let mut want: Vec<f64> = x.iter().map(|v| f64::from(*v)).collect();
        for r in 0..rows {
            for h in 0..heads {
                let at = r * cols + h * d + 32;
                for i in 0..half {
                    let (c, s) = (
                        f64::from(cos[(5 + r) * half + i]),
                        f64::from(sin[(5 + r) * half + i]),
                    );
                    let (a, b) = if interleaved {
                        (f64::from(x[at + 2 * i]), f64::from(x[at + 2 * i + 1]))
                    } else {
                        (f64::from(x[at + i]), f64::from(x[at + half + i]))
                    };
                    want[at + i] = a * c - b * s;
                    want[at + half + i] = b * c + a * s;
                }
            }
        }
        assert!(worst_rel(&got, &want) < 1e-5, "interleaved {interleaved}");
    }
    // add_gated: acc += sigmoid(gate) * y; copy_heads with a broadcast.
    let y: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let g: Vec<f32> = (0..rows).map(|_| rng.random_range(-3.0..3.0)).collect();
    let mut acc = act(&k, &pool, rows, cols, &x);
    k.add_gated(
        &mut acc,
        &act(&k, &pool, rows, cols, &y),
        &act(&k, &pool, rows, 1, &g),
    )
    .unwrap();
    let got = acc.to_host(gpu.stream()).unwrap();
    let want: Vec<f64> = (0..rows * cols)
        .map(|i| f64::from(x[i]) + f64::from(y[i]) / (1.0 + (-f64::from(g[i / cols])).exp()))
        .collect();
    assert!(worst_rel(&got, &want) < 1e-5);
    let mut dst = pool.take(&gpu, rows, heads * 8).unwrap();
    k.copy_heads(&mut dst, &xa, heads, 8, (0, 3), (8, 0), 2.0)
        .unwrap();
    let got = dst.to_host(gpu.stream()).unwrap();
    for r in 0..rows {
        for h in 0..heads {
            for i in 0..8 {
                assert_eq!(got[r * heads * 8 + h * 8 + i], 2.0 * x[r * cols + 3 + i]);
            }
        }
    }
}

/// The fused per-head q/k norm + RoPE against its parts on the GPU
/// (rms_norm per head, then rope of whole heads), with and without norms,
/// over head widths that do and do not fill the block.
#[test]
fn fused_qk_norm_rope_equals_norm_then_rope() {
    let Some(gpu) = gpu_or_skip("fused_qk_norm_rope_equals_norm_then_rope") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(17);
    for (rows, q_heads, kv_heads, d) in [(1, 8, 2, 128), (3, 4, 4, 48), (2, 2, 1, 256)] {
        let half = d / 2;
        let positions = 12;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..positions {
            for i in 0..half {
                let f = 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32);
                cos.push((p as f32 * f).cos());
                sin.push((p as f32 * f).sin());
            }
        }
        let table = RopeTable::upload(&gpu, positions, half, &cos, &sin).unwrap();
        let mut vals =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let (qx, kx) = (vals(rows * q_heads * d), vals(rows * kv_heads * d));
        let (qw, kw) = (vals(d), vals(d));
        let (qn, kn) = (
            DevVector::upload(&gpu, &qw).unwrap(),
            DevVector::upload(&gpu, &kw).unwrap(),
        );
        for norms in [None, Some([&qn, &kn])] {
            let mut q = act(&k, &pool, rows, q_heads * d, &qx);
            let mut kk = act(&k, &pool, rows, kv_heads * d, &kx);
            k.qk_norm_rope(&mut q, &mut kk, norms, 1e-6, &table, d, false, 7 - rows)
                .unwrap();
            for (got, x, heads, w) in [
                (&q, &qx, q_heads, norms.map(|n| n[0])),
                (&kk, &kx, kv_heads, norms.map(|n| n[1])),
            ] {
                let mut want = act(&k, &pool, rows, heads * d, x);
                if let Some(w) = w {
                    let mut normed = pool.take(&gpu, rows, heads * d).unwrap();
                    k.rms_norm(&mut normed, &want, w, 1e-6).unwrap();
                    want = normed;
                }
                k.rope(&mut want, &table, heads, d, 0, d, false, 7 - rows)
                    .unwrap();
                let (g, w) = (
                    got.to_host(gpu.stream()).unwrap(),
                    want.to_host(gpu.stream()).unwrap(),
                );
                let worst = g
                    .iter()
                    .zip(&w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst <= 1e-6,
                    "d {d}, norms {}: differs by {worst}",
                    norms.is_some()
                );
            }
        }
    }
}

#[test]
fn routing_picks_the_reference_experts() {
    let Some(gpu) = gpu_or_skip("routing_picks_the_reference_experts") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(11);
    // Softmax top-k over expert counts below, at and past a warp multiple,
    // renormalised (Qwen3, Mixtral) or not (Qwen2-MoE), up to the limits.
    for (e, top, norm) in [
        (128, 8, true),
        (60, 2, true),
        (8, 2, true),
        (1024, 32, true),
        (512, 10, false),
    ] {
        let rows = 8;
        let mut logits: Vec<f32> = (0..rows * e).map(|_| rng.random_range(-4.0..4.0)).collect();
        // Rows 3.. tie across the keep/drop line: all equal, two values,
        // four values, one clear winner over a field of equals, and equal
        // values but for a NaN-free -0 / +0 mix. Equal logits give equal
        // probabilities; the kernel must keep the ones torch's topk keeps.
        for (r, row) in logits.chunks_exact_mut(e).enumerate().skip(3) {
            for (i, v) in row.iter_mut().enumerate() {
                *v = match r {
                    3 => 0.5,
                    4 => f32::from(rng.random_range(0u8..2)),
                    5 => f32::from(rng.random_range(0u8..4)) - 1.0,
                    6 => {
                        if i == e / 3 {
                            3.0
                        } else {
                            1.0
                        }
                    }
                    _ => {
                        if rng.random_bool(0.5) {
                            -0.0
                        } else {
                            0.0
                        }
                    }
                };
            }
        }
        let la = act(&k, &pool, rows, e, &logits);
        let routes = k.route_softmax(&la, top, norm).unwrap();
        let (ids, w) = routes.to_host(&k).unwrap();
        for r in 0..rows {
            let l = &logits[r * e..(r + 1) * e];
            // The logits' order and ties are the probabilities'.
            let want = topk::kept(l, top);
            let got: Vec<usize> = ids[r * top..(r + 1) * top]
                .iter()
                .map(|&i| i as usize)
                .collect();
            assert_eq!(got, want, "{e} experts, row {r}");
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let all: f64 = l.iter().map(|&x| f64::from(x - max).exp()).sum();
            let chosen: f64 = want.iter().map(|&i| f64::from(l[i] - max).exp()).sum();
            let denom = if norm { chosen } else { all };
            for (j, &i) in want.iter().enumerate() {
                let p = f64::from(l[i] - max).exp() / denom;
                assert!(
                    (f64::from(w[r * top + j]) - p).abs() < 1e-6,
                    "{e} experts, row {r} expert {i}"
                );
            }
        }
    }
    grouped_ties_keep_what_torch_keeps(&k, &pool, &mut rng);
    let (rows, e, top) = (5, 128, 8);
    let logits: Vec<f32> = (0..rows * e).map(|_| rng.random_range(-4.0..4.0)).collect();
    let la = act(&k, &pool, rows, e, &logits);
    // Grouped sigmoid routing: 8 groups of 16, choose 4 groups, top-8.
    let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.1..0.1)).collect();
    let bv = DevVector::upload(&gpu, &bias).unwrap();
    let routes = k
        .route_sigmoid_groups(&la, Some(&bv), top, 8, 4, 2.5, true)
        .unwrap();
    let (ids, w) = routes.to_host(&k).unwrap();
    for r in 0..rows {
        let l = &logits[r * e..(r + 1) * e];
        let score: Vec<f64> = l
            .iter()
            .map(|&x| 1.0 / (1.0 + f64::from(-x).exp()))
            .collect();
        let choice: Vec<f64> = score
            .iter()
            .zip(&bias)
            .map(|(s, b)| s + f64::from(*b))
            .collect();
        let mut gs: Vec<(usize, f64)> = choice
            .chunks(16)
            .map(|g| {
                let mut v = g.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v[0] + v[1]
            })
            .enumerate()
            .collect();
        gs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let kept: Vec<usize> = gs[..4].iter().map(|g| g.0).collect();
        let mut cand: Vec<usize> = (0..e).filter(|i| kept.contains(&(i / 16))).collect();
        cand.sort_by(|a, b| choice[*b].total_cmp(&choice[*a]));
        let mut want: Vec<usize> = cand[..top].to_vec();
        want.sort_unstable();
        let got: Vec<usize> = ids[r * top..(r + 1) * top]
            .iter()
            .map(|&i| i as usize)
            .collect();
        assert_eq!(got, want, "grouped row {r}");
        let total: f32 = w[r * top..(r + 1) * top].iter().sum();
        assert!(
            (total - 2.5).abs() < 1e-4,
            "grouped row {r}: weights sum to {total}"
        );
    }
}

/// Grouped sigmoid routing on rows whose groups and experts tie across the
/// line (no bias: equal logits give equal choices, so the host sees the
/// kernel's ties): the groups and experts torch's topk keeps.
fn grouped_ties_keep_what_torch_keeps(
    k: &DecodeKernels,
    pool: &std::rc::Rc<ActPool>,
    rng: &mut SmallRng,
) {
    for (e, n_group, topk_group, top) in [(128, 8, 4, 8), (256, 8, 4, 8), (64, 4, 2, 6)] {
        let rows = 4;
        let per = e / n_group;
        let logits: Vec<f32> = (0..rows * e)
            .map(|i| match i / e {
                0 => 0.25,
                1 => f32::from(rng.random_range(0u8..2)),
                2 => f32::from(rng.random_range(0u8..3)) - 1.0,
                // Whole groups alike: the group scores tie too.
                _ => f32::from(((i % e) / per % 2) as u8),
            })
            .collect();
        let la = act(k, pool, rows, e, &logits);
        let routes = k
            .route_sigmoid_groups(&la, None, top, n_group, topk_group, 1.0, true)
            .unwrap();
        let (ids, _) = routes.to_host(k).unwrap();
        for r in 0..rows {
            let choice: Vec<f32> = logits[r * e..(r + 1) * e]
                .iter()
                .map(|&x| 1.0 / (1.0 + (-x).exp()))
                .collect();
            let gscore: Vec<f32> = choice
                .chunks(per)
                .map(|g| topk::top_k(g, 2).iter().map(|p| p.1).sum())
                .collect();
            let groups = topk::kept(&gscore, topk_group);
            let masked: Vec<f32> = choice
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    if groups.contains(&(i / per)) {
                        c
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let want = topk::kept(&masked, top);
            let got: Vec<usize> = ids[r * top..(r + 1) * top]
                .iter()
                .map(|&i| i as usize)
                .collect();
            assert_eq!(got, want, "{e} experts in {n_group} groups, tie row {r}");
        }
    }
}

#[test]
fn routed_experts_match_f64_from_hbm_slots_and_in_place() {
    let Some(gpu) = gpu_or_skip("routed_experts_match_f64_from_hbm_slots_and_in_place") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(99);
    // hidden 66: the down product's last block has fewer rows than the
    // others (DOWN_ROWS), and the gate/up products take the scalar path.
    for (ty, h) in [
        (WeightType::Bf16, 64),
        (WeightType::Fp8 { block: [16, 16] }, 64),
        (WeightType::F32, 64),
        (WeightType::Bf16, 66),
        (WeightType::Fp8 { block: [16, 16] }, 66),
    ] {
        let (i, experts, rows, top) = (40, 6, 3, 2);
        let recs: Vec<_> = (0..experts).map(|_| record(&mut rng, h, i, ty)).collect();
        let spec = recs[0].1;
        let stride = recs[0].0.len().div_ceil(4096) * 4096;
        let mut pinned = PinnedMemory::new(&gpu, stride * experts).unwrap();
        for (e, (bytes, _, _)) in recs.iter().enumerate() {
            pinned.write(e * stride, bytes).unwrap();
        }
        let shared = Arc::new(pinned);
        let x: Vec<f32> = (0..rows * h).map(|_| rng.random_range(-1.0..1.0)).collect();
        let ids: Vec<u32> = vec![0, 3, 1, 5, 2, 3];
        let wts: Vec<f32> = (0..rows * top)
            .map(|_| rng.random_range(0.1..1.0))
            .collect();
        let routes = k.routes_from_host(&ids, &wts, top).unwrap();
        let mats: Vec<&[Vec<f64>; 3]> = recs.iter().map(|r| &r.2).collect();
        let want = moe_reference(&mats, &ids, &wts, &x, (h, i, top));
        for in_place in [false, true] {
            let mut slots = ExpertSlots::new(
                &gpu,
                if in_place { 0 } else { 3 },
                stride,
                recs[0].0.len(),
                experts,
            )
            .unwrap();
            let xa = act(&k, &pool, rows, h, &x);
            let mut out = pool.take(&gpu, rows, h).unwrap();
            let mut a = pool.take(&gpu, rows * top, i).unwrap();
            if in_place {
                for e in 0..experts {
                    slots
                        .point_to_pinned(e, &shared, e * stride, recs[0].0.len())
                        .unwrap();
                }
                slots.publish().unwrap();
                k.moe(&slots, 0, experts, &routes, &spec, &xa, &mut a, &mut out)
                    .unwrap();
                // Pair-fastest block order: the same bits (rows 0 and 2
                // share expert 3).
                let mut a2 = pool.take(&gpu, rows * top, i).unwrap();
                let mut out2 = pool.take(&gpu, rows, h).unwrap();
                let io = (&xa, &mut a2, &mut out2);
                k.moe_ordered(
                    &slots,
                    (0, experts),
                    &routes,
                    &spec,
                    io,
                    BlockOrder::PairsFast,
                )
                .unwrap();
                let (o1, o2) = (
                    out.to_host(gpu.stream()).unwrap(),
                    out2.to_host(gpu.stream()).unwrap(),
                );
                assert!(
                    o1.iter().zip(&o2).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{ty:?} hidden {h}: pair-fastest order changed a bit"
                );
            } else {
                // Three slots for six experts: rows one at a time, each row's
                // two experts loaded into free slots.
                let mut all = Vec::new();
                for r in 0..rows {
                    for e in 0..experts {
                        slots.clear(e).unwrap();
                    }
                    for j in 0..top {
                        let e = ids[r * top + j] as usize;
                        slots.load(j, &shared, e * stride, recs[0].0.len()).unwrap();
                        slots.point_to_slot(e, j).unwrap();
                    }
                    slots.publish().unwrap();
                    let one = k
                        .routes_from_host(
                            &ids[r * top..(r + 1) * top],
                            &wts[r * top..(r + 1) * top],
                            top,
                        )
                        .unwrap();
                    let xr = act(&k, &pool, 1, h, &x[r * h..(r + 1) * h]);
                    let mut ar = pool.take(&gpu, top, i).unwrap();
                    let mut or = pool.take(&gpu, 1, h).unwrap();
                    k.moe(&slots, 0, experts, &one, &spec, &xr, &mut ar, &mut or)
                        .unwrap();
                    slots.consumed().unwrap();
                    all.extend(or.to_host(gpu.stream()).unwrap());
                }
                out.upload(gpu.stream(), &all).unwrap();
            }
            let got = out.to_host(gpu.stream()).unwrap();
            let err = worst_rel(&got, &want);
            assert!(err < 1e-5, "{ty:?} hidden {h} in_place {in_place}: {err:e}");
        }
    }
}

#[test]
fn split_attention_matches_f64() {
    let Some(gpu) = gpu_or_skip("split_attention_matches_f64") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(5);
    for (qh, kvh, d) in [(8, 2, 64), (4, 4, 192), (4, 2, 16)] {
        let mut kv = DevKvCache::new(&gpu, 2, kvh, d, 1024).unwrap();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        // 600 positions in steps of 1, 7, 250 and more: growth, chunks, prefill rows.
        let mut held = 0;
        for step in [1usize, 7, 250, 1, 341] {
            let k_new: Vec<f32> = (0..step * kvh * d)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let v_new: Vec<f32> = (0..step * kvh * d)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let q: Vec<f32> = (0..step * qh * d)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            ks.extend_from_slice(&k_new);
            vs.extend_from_slice(&v_new);
            let mut out = pool.take(&gpu, step, qh * d).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            for layer in 0..2 {
                let (qa, ka, va) = (
                    act(&k, &pool, step, qh * d, &q),
                    act(&k, &pool, step, kvh * d, &k_new),
                    act(&k, &pool, step, kvh * d, &v_new),
                );
                k.attend(&mut kv, layer, qh, &qa, &ka, &va, scale, &mut out)
                    .unwrap();
            }
            kv.advance(step);
            let got = out.to_host(gpu.stream()).unwrap();
            let mut want = vec![0f64; step * qh * d];
            for r in 0..step {
                let len = held + r + 1;
                for h in 0..qh {
                    let g = h / (qh / kvh);
                    let qv = &q[(r * qh + h) * d..(r * qh + h + 1) * d];
                    let scores: Vec<f64> = (0..len)
                        .map(|p| {
                            let kp = &ks[(p * kvh + g) * d..(p * kvh + g + 1) * d];
                            qv.iter()
                                .zip(kp)
                                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                .sum::<f64>()
                                * f64::from(scale)
                        })
                        .collect();
                    let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let ws: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let sum: f64 = ws.iter().sum();
                    for (p, w) in ws.iter().enumerate() {
                        for i in 0..d {
                            want[(r * qh + h) * d + i] +=
                                w / sum * f64::from(vs[(p * kvh + g) * d + i]);
                        }
                    }
                }
            }
            let err = worst_rel(&got, &want);
            assert!(
                err < 1e-5,
                "{qh}/{kvh} heads of {d}, step {step} at {held}: {err:e}"
            );
            held += step;
        }
    }
}

/// A prompt chunk's attention as tiles (chunks of 16 rows or more), in
/// f32 (`attn_prompt_<D>`) and on the tensor cores (`attn_prompt_tc_<D>`,
/// heads of up to 128; wider ones keep the f32 tiles), against the per-row
/// decode kernel (`FLASHTIER_PROMPT_ATTN` off) on the same keys and
/// values: within f32 rounding for every head width the tiles take (16
/// and 192 read zeros past the head), over one and several splits. And a
/// row's bits depend on its own query and positions only: the same
/// whether its chunk starts at position 0 or 100, whatever the other rows'
/// queries are, and with a NaN value at a later position (which only the
/// rows at and after it may see).
#[test]
fn prompt_attention_tiles_match_the_row_kernel_and_rows_stand_alone() {
    let name = "prompt_attention_tiles_match_the_row_kernel_and_rows_stand_alone";
    let Some(gpu) = gpu_or_skip(name) else {
        return;
    };
    let rowwise = prompt_kernels(&gpu, false, false);
    for tc in [false, true] {
        if tc && gpu.info().compute_capability.0 < 8 {
            flashtier_io::skip::notice(name, "no TF32 tensor cores (compute capability below 8.0)");
            continue;
        }
        prompt_tiles_stand_alone(&gpu, &prompt_kernels(&gpu, true, tc), &rowwise, tc);
    }
}

/// Kernels with the prompt attention as tiles or not, and those tiles on
/// the tensor cores or not; the other knobs at their defaults.
fn prompt_kernels(
    gpu: &flashtier_cuda::Gpu,
    prompt_attn: bool,
    prompt_attn_tc: bool,
) -> DecodeKernels {
    DecodeKernels::with_tuning(
        gpu,
        Tuning {
            prompt_attn,
            prompt_attn_tc,
            ..Tuning::default()
        },
    )
    .unwrap()
}

/// The name of the tiled prompt kernel for heads of `d`: on the tensor
/// cores (`tc`) up to 128, else the f32 tiles.
fn prompt_kernel_for(d: usize, tc: bool) -> String {
    let tile = [64, 128, 256].into_iter().find(|&t| d <= t).unwrap();
    if tc && tile <= 128 {
        format!("attn_prompt_tc_{tile}")
    } else {
        format!("attn_prompt_{tile}")
    }
}

/// The body of the test above for one kernel set `tiled` (its tiles on
/// the tensor cores or not, `tc`).
fn prompt_tiles_stand_alone(
    gpu: &flashtier_cuda::Gpu,
    tiled: &DecodeKernels,
    rowwise: &DecodeKernels,
    tc: bool,
) {
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(17);
    for (qh, kvh, d) in [
        (32, 4, 128),
        (8, 2, 64),
        (4, 4, 192),
        (4, 2, 16),
        (6, 1, 256),
    ] {
        let len = 600;
        let rand = |rng: &mut SmallRng, n: usize| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
        };
        let (q, kk, vv) = (
            rand(&mut rng, len * qh * d),
            rand(&mut rng, len * kvh * d),
            rand(&mut rng, len * kvh * d),
        );
        let scale = 1.0 / (d as f32).sqrt();
        // Attend rows first..first + n of the prompt on `kv` with kernels `k`.
        let attend = |k: &DecodeKernels,
                      kv: &mut DevKvCache,
                      (first, n): (usize, usize),
                      q: &[f32],
                      v: &[f32]| {
            let qa = act(
                k,
                &pool,
                n,
                qh * d,
                &q[first * qh * d..(first + n) * qh * d],
            );
            let ka = act(
                k,
                &pool,
                n,
                kvh * d,
                &kk[first * kvh * d..(first + n) * kvh * d],
            );
            let va = act(
                k,
                &pool,
                n,
                kvh * d,
                &v[first * kvh * d..(first + n) * kvh * d],
            );
            let mut out = pool.take(gpu, n, qh * d).unwrap();
            k.attend(kv, 0, qh, &qa, &ka, &va, scale, &mut out).unwrap();
            kv.advance(n);
            out.to_host(gpu.stream()).unwrap()
        };
        let kernel = prompt_kernel_for(d, tc);
        assert_eq!(tiled.prompt_attention_kernel(20, d), Some(kernel.as_str()));
        assert_eq!(rowwise.prompt_attention_kernel(20, d), None);
        let what = format!("{kernel}, {qh}/{kvh} heads of {d}");
        // Chunks of 20 (one split), 236 (to a split's edge) and 344 (two
        // more splits): the tiles against the row kernel.
        let mut a = DevKvCache::new(gpu, 1, kvh, d, len).unwrap();
        let mut b = DevKvCache::new(gpu, 1, kvh, d, len).unwrap();
        let mut first = 0;
        for n in [20, 236, 344] {
            let got = attend(tiled, &mut a, (first, n), &q, &vv);
            let want = attend(rowwise, &mut b, (first, n), &q, &vv);
            let want: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
            let err = worst_rel(&got, &want);
            assert!(err < 1e-5, "{what}, rows {first}..+{n}: {err:e}");
            first += n;
        }
        // One chunk of 300 against 100 then 200; then the odd rows' queries
        // changed; then a NaN value at position 250.
        let once = {
            let mut c = DevKvCache::new(gpu, 1, kvh, d, len).unwrap();
            attend(tiled, &mut c, (0, 300), &q, &vv)
        };
        let split = {
            let mut c = DevKvCache::new(gpu, 1, kvh, d, len).unwrap();
            let mut o = attend(tiled, &mut c, (0, 100), &q, &vv);
            o.extend(attend(tiled, &mut c, (100, 200), &q, &vv));
            o
        };
        let row = qh * d;
        for r in 0..300 {
            assert_eq!(
                bits(&once[r * row..(r + 1) * row]),
                bits(&split[r * row..(r + 1) * row]),
                "{what}: row {r}, one chunk vs two"
            );
        }
        let mut q2 = q.clone();
        for r in (1..300).step_by(2) {
            for x in &mut q2[r * row..(r + 1) * row] {
                *x = -*x * 0.5;
            }
        }
        let other = {
            let mut c = DevKvCache::new(gpu, 1, kvh, d, len).unwrap();
            attend(tiled, &mut c, (0, 300), &q2, &vv)
        };
        for r in (0..300).step_by(2) {
            assert_eq!(
                bits(&once[r * row..(r + 1) * row]),
                bits(&other[r * row..(r + 1) * row]),
                "{what}: row {r}, its neighbours' queries changed"
            );
        }
        let mut v2 = vv.clone();
        v2[250 * kvh * d + 3] = f32::NAN;
        let poisoned = {
            let mut c = DevKvCache::new(gpu, 1, kvh, d, len).unwrap();
            attend(tiled, &mut c, (0, 300), &q, &v2)
        };
        for r in 0..250 {
            assert_eq!(
                bits(&once[r * row..(r + 1) * row]),
                bits(&poisoned[r * row..(r + 1) * row]),
                "{what}: row {r}, a NaN value at position 250"
            );
        }
        assert!(
            poisoned[250 * row..].iter().any(|x| x.is_nan()),
            "{what}: the NaN reaches the rows that attend to it"
        );
    }
}

/// The tensor-core prompt attention (`attn_prompt_tc_<D>`) against f64,
/// each output within 1e-5 of the sum of its terms' magnitudes: the
/// values' |p v| plus, for the scores' error, the largest |q| . |k| times
/// scale times the |p (v - o)| it moves. TF32x3 keeps each product to a
/// few parts in 2^22 (about 1e-6, the f32 tiles' order); one TF32 product
/// would be off by about 2^-11 (5e-4). Operands span 2^-3..2^3 so that
/// their low TF32 parts matter; chunks of 44, 300 and 256 rows start at
/// positions that are not multiples of 16 and cross three splits; heads of
/// 16, 64, 96 and 128, groups of 2, 6 and 8.
#[test]
fn prompt_attention_on_the_tensor_cores_matches_f64() {
    let name = "prompt_attention_on_the_tensor_cores_matches_f64";
    let Some(gpu) = gpu_or_skip(name) else {
        return;
    };
    if gpu.info().compute_capability.0 < 8 {
        flashtier_io::skip::notice(name, "no TF32 tensor cores (compute capability below 8.0)");
        return;
    }
    let k = prompt_kernels(&gpu, true, true);
    // The same kernel with the score products' fragment loads pipelined
    // (heads of 128): the same bits, step by step.
    let piped = DecodeKernels::with_tuning(
        &gpu,
        Tuning {
            prompt_attn_pipe: true,
            ..Tuning::default()
        },
    )
    .unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x7f32);
    for (qh, kvh, d) in [(32, 4, 128), (12, 2, 96), (8, 2, 64), (4, 2, 16)] {
        let steps = [44usize, 300, 256];
        let len: usize = steps.iter().sum();
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| rng.random_range(-2.0f32..2.0) * 2f32.powi(rng.random_range(-3..=3)))
                .collect()
        };
        let (q, kk, vv) = (rand(len * qh * d), rand(len * kvh * d), rand(len * kvh * d));
        let scale = 0.25 / (d as f32).sqrt();
        let mut kv: [DevKvCache; 2] =
            std::array::from_fn(|_| DevKvCache::new(&gpu, 1, kvh, d, len).unwrap());
        let mut first = 0;
        for n in steps {
            let kernel = prompt_kernel_for(d, true);
            assert_eq!(k.prompt_attention_kernel(n, d), Some(kernel.as_str()));
            let rows = |x: &[f32], w: usize| x[first * w..(first + n) * w].to_vec();
            let [got, got_piped] = [(&k, 0), (&piped, 1)].map(|(k, c)| {
                let qa = act(k, &pool, n, qh * d, &rows(&q, qh * d));
                let ka = act(k, &pool, n, kvh * d, &rows(&kk, kvh * d));
                let va = act(k, &pool, n, kvh * d, &rows(&vv, kvh * d));
                let mut out = pool.take(&gpu, n, qh * d).unwrap();
                k.attend(&mut kv[c], 0, qh, &qa, &ka, &va, scale, &mut out)
                    .unwrap();
                kv[c].advance(n);
                out.to_host(gpu.stream()).unwrap()
            });
            assert_eq!(
                bits(&got),
                bits(&got_piped),
                "{kernel}, {qh}/{kvh} heads of {d}, rows {first}..+{n}: pipelined vs not"
            );
            let mut worst = 0f64;
            for r in 0..n {
                let pos = first + r;
                for h in 0..qh {
                    let g = h / (qh / kvh);
                    let head = |x: &[f32], p: usize, w: usize, hh: usize| {
                        x[(p * w + hh) * d..(p * w + hh + 1) * d]
                            .iter()
                            .map(|&v| f64::from(v))
                            .collect::<Vec<f64>>()
                    };
                    let qv = head(&q, pos, qh, h);
                    let keys: Vec<Vec<f64>> = (0..=pos).map(|p| head(&kk, p, kvh, g)).collect();
                    let vals: Vec<Vec<f64>> = (0..=pos).map(|p| head(&vv, p, kvh, g)).collect();
                    let (o, bound) = attention_f64(&qv, &keys, &vals, f64::from(scale));
                    for i in 0..d {
                        let e = (f64::from(got[(r * qh + h) * d + i]) - o[i]).abs() / bound[i];
                        worst = worst.max(e);
                        assert!(
                            e < 1e-5,
                            "{kernel}, {qh}/{kvh} heads of {d}: row {pos} head {h} [{i}]: {} vs {} \
                             ({e:e} of the terms' sum {})",
                            got[(r * qh + h) * d + i],
                            o[i],
                            bound[i]
                        );
                    }
                }
            }
            println!(
                "{kernel}, {qh}/{kvh} heads of {d}, rows {first}..+{n}: worst {worst:e} of the terms"
            );
            first += n;
        }
    }
}

/// One query's attention over `keys` and `values` in f64: the output and,
/// per element, the sum of its terms' magnitudes that rounding scales with
/// (see the test above).
fn attention_f64(
    q: &[f64],
    keys: &[Vec<f64>],
    values: &[Vec<f64>],
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let dot = |a: &[f64], b: &[f64], f: fn(f64) -> f64| {
        a.iter().zip(b).map(|(x, y)| f(x * y)).sum::<f64>()
    };
    let scores: Vec<f64> = keys.iter().map(|k| dot(q, k, |x| x) * scale).collect();
    let spread = keys
        .iter()
        .map(|k| dot(q, k, f64::abs) * scale)
        .fold(0.0, f64::max);
    let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
    let sum: f64 = w.iter().sum();
    let d = q.len();
    let mut o = vec![0f64; d];
    for (p, v) in w.iter().zip(values) {
        for i in 0..d {
            o[i] += p / sum * v[i];
        }
    }
    let mut bound = vec![0f64; d];
    for (p, v) in w.iter().zip(values) {
        for i in 0..d {
            bound[i] += p / sum * (v[i].abs() + spread * (v[i] - o[i]).abs());
        }
    }
    (o, bound)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One decode row for each of six sequences (empty, inside a chunk, at
/// and past chunk edges, three splits) through the decode-rows kernels:
/// every output, and the next step's (which reads the keys and values the
/// first appended), has the bits of each sequence decoded alone.
#[test]
fn decode_rows_attend_as_each_sequence_alone() {
    let Some(gpu) = gpu_or_skip("decode_rows_attend_as_each_sequence_alone") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0xa77);
    let (layers, qh, kvh, d) = (2, 8, 2, 64);
    let held = [0usize, 5, 255, 256, 300, 600];
    let seqs = held.len();
    let positions = 1024;
    let half = d / 2;
    let angles: Vec<f32> = (0..positions * half)
        .map(|i| (i / half) as f32 * 0.9f32.powi((i % half) as i32))
        .collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let rope = RopeTable::upload(&gpu, positions, half, &cos, &sin).unwrap();
    let norm: Vec<f32> = (0..d).map(|_| rng.random_range(0.5..1.5)).collect();
    let (qn, kn) = (
        DevVector::upload(&gpu, &norm).unwrap(),
        DevVector::upload(&gpu, &norm.iter().rev().copied().collect::<Vec<_>>()).unwrap(),
    );
    let scale = 1.0 / (d as f32).sqrt();
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    // Two identical sets of caches, filled with the same prompts.
    let mut alone: Vec<DevKvCache> = Vec::new();
    let mut batched: Vec<DevKvCache> = Vec::new();
    for &n in &held {
        let mut a = DevKvCache::new(&gpu, layers, kvh, d, positions).unwrap();
        let mut b = DevKvCache::new(&gpu, layers, kvh, d, positions).unwrap();
        if n > 0 {
            let (q, kk, v) = (rand(n * qh * d), rand(n * kvh * d), rand(n * kvh * d));
            for c in [&mut a, &mut b] {
                let mut out = pool.take(&gpu, n, qh * d).unwrap();
                for layer in 0..layers {
                    let (qa, ka, va) = (
                        act(&k, &pool, n, qh * d, &q),
                        act(&k, &pool, n, kvh * d, &kk),
                        act(&k, &pool, n, kvh * d, &v),
                    );
                    k.attend(c, layer, qh, &qa, &ka, &va, scale, &mut out)
                        .unwrap();
                }
                c.advance(n);
            }
        }
        alone.push(a);
        batched.push(b);
    }
    let mut rows = DecodeRows::new();
    for step in 0..2 {
        for layer in 0..layers {
            let (q, kk, v) = (
                rand(seqs * qh * d),
                rand(seqs * kvh * d),
                rand(seqs * kvh * d),
            );
            let mut want = Vec::new();
            for (i, c) in alone.iter_mut().enumerate() {
                let mut qa = act(&k, &pool, 1, qh * d, &q[i * qh * d..(i + 1) * qh * d]);
                let mut ka = act(&k, &pool, 1, kvh * d, &kk[i * kvh * d..(i + 1) * kvh * d]);
                let va = act(&k, &pool, 1, kvh * d, &v[i * kvh * d..(i + 1) * kvh * d]);
                let first = c.layer_len(layer).unwrap();
                k.qk_norm_rope(
                    &mut qa,
                    &mut ka,
                    Some([&qn, &kn]),
                    1e-6,
                    &rope,
                    d,
                    false,
                    first,
                )
                .unwrap();
                let mut out = pool.take(&gpu, 1, qh * d).unwrap();
                k.attend(c, layer, qh, &qa, &ka, &va, scale, &mut out)
                    .unwrap();
                want.extend(out.to_host(gpu.stream()).unwrap());
            }
            let mut caches: Vec<&mut DevKvCache> = batched.iter_mut().collect();
            assert!(caches.iter().all(|c| c.takes_rows(layer)));
            let mut qa = act(&k, &pool, seqs, qh * d, &q);
            let mut ka = act(&k, &pool, seqs, kvh * d, &kk);
            let va = act(&k, &pool, seqs, kvh * d, &v);
            let at = k.rows_at(&mut rows, &mut caches, layer).unwrap();
            k.qk_norm_rope_at_rows(&mut qa, &mut ka, Some([&qn, &kn]), 1e-6, &rope, d, at)
                .unwrap();
            let mut out = pool.take(&gpu, seqs, qh * d).unwrap();
            k.attend_rows(
                &mut rows,
                &mut caches,
                layer,
                at,
                (qh, scale),
                (&qa, &ka, &va),
                &mut out,
            )
            .unwrap();
            let got = out.to_host(gpu.stream()).unwrap();
            for (i, (g, w)) in got
                .chunks_exact(qh * d)
                .zip(want.chunks_exact(qh * d))
                .enumerate()
            {
                let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "step {step} layer {layer}: sequence {i} at {} differs",
                    held[i]
                );
            }
        }
        for c in alone.iter_mut().chain(batched.iter_mut()) {
            c.advance(1);
        }
    }
    // A cache that cannot take the path is refused with a typed error.
    let mut full = DevKvCache::new(&gpu, layers, kvh, d, 1).unwrap();
    let mut other = DevKvCache::new(&gpu, layers, kvh, d, 16).unwrap();
    let (q1, k1, v1) = (rand(qh * d), rand(kvh * d), rand(kvh * d));
    let mut out = pool.take(&gpu, 1, qh * d).unwrap();
    for layer in 0..layers {
        let (qa, ka, va) = (
            act(&k, &pool, 1, qh * d, &q1),
            act(&k, &pool, 1, kvh * d, &k1),
            act(&k, &pool, 1, kvh * d, &v1),
        );
        k.attend(&mut full, layer, qh, &qa, &ka, &va, scale, &mut out)
            .unwrap();
    }
    full.advance(1);
    assert!(!full.takes_rows(0));
    let mut pair: Vec<&mut DevKvCache> = vec![&mut other, &mut full];
    assert!(k.rows_at(&mut rows, &mut pair, 0).is_err());
}

#[test]
fn argmax_takes_the_lowest_index_on_ties() {
    let Some(gpu) = gpu_or_skip("argmax_takes_the_lowest_index_on_ties") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut v = vec![0.5f32; 2 * 1000];
    v[17] = 3.0;
    v[900] = 3.0;
    v[1000 + 999] = 7.0;
    let a = act(&k, &pool, 2, 1000, &v);
    assert_eq!(k.argmax_rows(&a).unwrap(), vec![17, 999]);
}

#[test]
fn picks_left_on_the_device_embed_there_and_stale_ones_are_refused() {
    let Some(gpu) = gpu_or_skip("picks_left_on_the_device_embed_there_and_stale_ones_are_refused")
    else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x51C4);
    let (vocab, hidden) = (5000, 96);
    let (bytes, _, table_vals) = random_matrix(&mut rng, vocab, hidden, WeightType::Bf16);
    let table = DevMatrix::upload(&gpu, vocab, hidden, WeightType::Bf16, &bytes, None).unwrap();
    let mut tickets = Vec::new();
    for round in 0..4 {
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-1.0..1.0)).collect();
        let best = rng.random_range(0..vocab);
        logits[best] = 2.0;
        // A tie further on: the lower index wins, as on the host.
        logits[(best + 7) % vocab] = if best + 7 < vocab { 2.0 } else { 1.5 };
        let x = act(&k, &pool, 1, vocab, &logits);
        let t = k.argmax_ahead(&x).unwrap();
        // The next step's embedding reads the id on the device, issued
        // before the host reads it.
        let mut row = pool.take(&gpu, 1, hidden).unwrap();
        k.embed_picked(&mut row, &table, t).unwrap();
        assert_eq!(k.picked(t).unwrap() as usize, best, "round {round}");
        let got = row.to_host(gpu.stream()).unwrap();
        let want = &table_vals[best * hidden..(best + 1) * hidden];
        assert!(
            got.iter().zip(want).all(|(g, w)| f64::from(*g) == *w),
            "round {round}: the embedded row is table row {best}"
        );
        tickets.push(t);
    }
    // Two picks are kept: the one before the last still reads back, an
    // older one is refused, and only the latest can be embedded.
    assert!(k.picked(tickets[2]).is_ok());
    assert!(k.picked(tickets[1]).is_err(), "a pick two behind is gone");
    let mut row = pool.take(&gpu, 1, hidden).unwrap();
    assert!(k.embed_picked(&mut row, &table, tickets[2]).is_err());
    // A plain argmax overwrites the device's answer: the latest ticket no
    // longer embeds.
    let x = act(&k, &pool, 1, vocab, &vec![0.0; vocab]);
    assert_eq!(k.argmax_rows(&x).unwrap(), vec![0]);
    assert!(k.embed_picked(&mut row, &table, tickets[3]).is_err());
    // A pick from a row wider than the table has rows is refused.
    let wide = act(&k, &pool, 1, vocab + 1, &vec![0.0; vocab + 1]);
    let t = k.argmax_ahead(&wide).unwrap();
    assert_eq!(k.picked(t).unwrap(), 0);
    assert!(k.embed_picked(&mut row, &table, t).is_err());
}
