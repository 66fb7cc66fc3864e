//! Decode steps folded into fewer launches against their own launches, bit
//! for bit: the one-row attention that does its own q/k norm, RoPE and KV
//! append (`DecodeKernels::rope_attend`; outputs, and the cache's bytes
//! later steps read), and the products that add their output into the
//! residual stream and norm it (`gemv_add_norm`, `moe_add_norm`); and every
//! compile-time knob of the kernels (`Tuning`) giving the same bits. Skips
//! with a printed reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken kernel must fail the test loudly"
)]

mod common;

use std::sync::Arc;

use flashtier_cuda::PinnedMemory;
use flashtier_cuda::ops::attn::{CHUNK_POSITIONS, DevKvCache, RopeStep};
use flashtier_cuda::ops::buffers::{ActPool, DevMatrix, DevVector, RopeTable, WeightType};
use flashtier_cuda::ops::experts::ExpertSlots;
use flashtier_cuda::ops::fold::AddNormInto;
use flashtier_cuda::ops::{DecodeKernels, Tuning};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{act, gpu_or_skip, moe_reference, random_matrix, record, worst_rel};

fn rope_table(gpu: &flashtier_cuda::Gpu, positions: usize, d: usize) -> RopeTable {
    let half = d / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..positions {
        for i in 0..half {
            let f = 1.0 / 1_000_000f32.powf(2.0 * i as f32 / d as f32);
            cos.push((p as f32 * f).cos());
            sin.push((p as f32 * f).sin());
        }
    }
    RopeTable::upload(gpu, positions, half, &cos, &sin).unwrap()
}

fn vals(rng: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every complete resident chunk of every layer, as bytes.
fn chunks(gpu: &flashtier_cuda::Gpu, kv: &DevKvCache) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut host = PinnedMemory::new(gpu, kv.chunk_bytes()).unwrap();
    for layer in 0..kv.layers() {
        let len = kv.layer_len(layer).unwrap();
        for c in 0..len / CHUNK_POSITIONS {
            kv.download_chunk(layer, c, &mut host).unwrap();
            out.push(host.bytes_mut(0, kv.chunk_bytes()).unwrap().to_vec());
        }
    }
    out
}

#[test]
fn one_row_rope_attend_equals_norm_rope_then_attend() {
    let Some(gpu) = gpu_or_skip("one_row_rope_attend_equals_norm_rope_then_attend") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0xa77e);
    for (qh, kvh, d) in [(8, 2, 128), (4, 4, 64), (6, 3, 32)] {
        let table = rope_table(&gpu, 1024, d);
        let (qw, kw) = (vals(&mut rng, d), vals(&mut rng, d));
        let norms = [
            DevVector::upload(&gpu, &qw).unwrap(),
            DevVector::upload(&gpu, &kw).unwrap(),
        ];
        for with_norms in [true, false] {
            let rope = RopeStep {
                norms: with_norms.then(|| [&norms[0], &norms[1]]),
                eps: 1e-6,
                table: &table,
                interleaved: false,
            };
            let layers = 2;
            let mut split = DevKvCache::new(&gpu, layers, kvh, d, 1024).unwrap();
            let mut fused = DevKvCache::new(&gpu, layers, kvh, d, 1024).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            // A prompt of 250 rows, one-row steps across the first chunk
            // boundary, 250 rows more, then steps in a third chunk.
            for (rows, steps) in [(250usize, 12usize), (250, 5)] {
                let held = split.len();
                let (qx, kx, vx) = (
                    vals(&mut rng, rows * qh * d),
                    vals(&mut rng, rows * kvh * d),
                    vals(&mut rng, rows * kvh * d),
                );
                for kv in [&mut split, &mut fused] {
                    for layer in 0..layers {
                        let mut q = act(&k, &pool, rows, qh * d, &qx);
                        let mut kk = act(&k, &pool, rows, kvh * d, &kx);
                        let v = act(&k, &pool, rows, kvh * d, &vx);
                        k.qk_norm_rope(&mut q, &mut kk, rope.norms, 1e-6, &table, d, false, held)
                            .unwrap();
                        let mut out = pool.take(&gpu, rows, qh * d).unwrap();
                        k.attend(kv, layer, qh, &q, &kk, &v, scale, &mut out)
                            .unwrap();
                    }
                    kv.advance(rows);
                }
                for _ in 0..steps {
                    let held = split.len();
                    for layer in 0..layers {
                        let (qx, kx, vx) = (
                            vals(&mut rng, qh * d),
                            vals(&mut rng, kvh * d),
                            vals(&mut rng, kvh * d),
                        );
                        let mut q = act(&k, &pool, 1, qh * d, &qx);
                        let mut kk = act(&k, &pool, 1, kvh * d, &kx);
                        let v = act(&k, &pool, 1, kvh * d, &vx);
                        k.qk_norm_rope(&mut q, &mut kk, rope.norms, 1e-6, &table, d, false, held)
                            .unwrap();
                        let mut want = pool.take(&gpu, 1, qh * d).unwrap();
                        k.attend(&mut split, layer, qh, &q, &kk, &v, scale, &mut want)
                            .unwrap();
                        let (q, kk) = (
                            act(&k, &pool, 1, qh * d, &qx),
                            act(&k, &pool, 1, kvh * d, &kx),
                        );
                        let mut got = pool.take(&gpu, 1, qh * d).unwrap();
                        k.rope_attend(&mut fused, layer, qh, &q, (&kk, &v), rope, scale, &mut got)
                            .unwrap();
                        let (g, w) = (
                            got.to_host(gpu.stream()).unwrap(),
                            want.to_host(gpu.stream()).unwrap(),
                        );
                        assert!(w.iter().all(|x| x.is_finite()));
                        assert_eq!(
                            bits(&g),
                            bits(&w),
                            "{qh}/{kvh} heads of {d}, norms {with_norms}, layer {layer} at {held}"
                        );
                        // The raw projections are left as they came.
                        assert_eq!(bits(&q.to_host(gpu.stream()).unwrap()), bits(&qx));
                    }
                    split.advance(1);
                    fused.advance(1);
                }
            }
            assert_eq!(split.len(), 517);
            let (a, b) = (chunks(&gpu, &split), chunks(&gpu, &fused));
            assert_eq!(a.len(), 2 * layers);
            assert!(a == b, "{qh}/{kvh} heads of {d}: the caches' bytes differ");
        }
    }
}

#[test]
fn rope_attend_refuses_what_it_cannot_fuse() {
    let Some(gpu) = gpu_or_skip("rope_attend_refuses_what_it_cannot_fuse") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let (qh, kvh) = (4, 2);
    for (d, rows, positions) in [(256, 1, 64), (64, 2, 64), (64, 1, 0)] {
        let table = rope_table(&gpu, positions.max(1), d);
        let mut kv = DevKvCache::new(&gpu, 1, kvh, d, 64).unwrap();
        if positions == 0 {
            // The table ends before the position: fill the cache past it.
            let v = vec![0.5f32; kvh * d];
            for _ in 0..2 {
                let kk = act(&k, &pool, 1, kvh * d, &v);
                k.kv_push(&mut kv, 0, &kk, &kk).unwrap();
                kv.advance(1);
            }
        }
        let q = act(&k, &pool, rows, qh * d, &vec![0.25; rows * qh * d]);
        let kk = act(&k, &pool, rows, kvh * d, &vec![0.25; rows * kvh * d]);
        let mut out = pool.take(&gpu, rows, qh * d).unwrap();
        let before = kv.layer_len(0).unwrap();
        let rope = RopeStep {
            norms: None,
            eps: 1e-6,
            table: &table,
            interleaved: false,
        };
        let err = k
            .rope_attend(&mut kv, 0, qh, &q, (&kk, &kk), rope, 0.1, &mut out)
            .unwrap_err();
        assert!(err.to_string().contains("fused attention"), "{err}");
        assert_eq!(
            kv.layer_len(0).unwrap(),
            before,
            "a refusal appends nothing"
        );
    }
}

/// The routed experts and the one-row attention under `t`: their outputs.
fn run_tuned(gpu: &flashtier_cuda::Gpu, t: Tuning) -> Vec<Vec<u32>> {
    let k = DecodeKernels::with_tuning(gpu, t).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x7e57);
    let mut outs = Vec::new();
    // Experts: widths of one and several load rounds per lane, a hidden
    // size no row count divides, every dtype family.
    for (ty, h, i) in [
        (WeightType::Bf16, 130, 768),
        (WeightType::Fp8 { block: [16, 16] }, 64, 96),
        (WeightType::F32, 66, 80),
        (WeightType::Bf16, 64, 2056),
    ] {
        let (experts, top, rows) = (5, 3, 2);
        let recs: Vec<_> = (0..experts).map(|_| record(&mut rng, h, i, ty)).collect();
        let spec = recs[0].1;
        let stride = recs[0].0.len().div_ceil(4096) * 4096;
        let mut pinned = PinnedMemory::new(gpu, stride * experts).unwrap();
        for (e, (bytes, _, _)) in recs.iter().enumerate() {
            pinned.write(e * stride, bytes).unwrap();
        }
        let shared = Arc::new(pinned);
        let mut slots = ExpertSlots::new(gpu, 0, stride, recs[0].0.len(), experts).unwrap();
        for e in 0..experts {
            slots
                .point_to_pinned(e, &shared, e * stride, recs[0].0.len())
                .unwrap();
        }
        slots.publish().unwrap();
        let x: Vec<f32> = (0..rows * h).map(|_| rng.random_range(-1.0..1.0)).collect();
        let ids = [0u32, 2, 4, 1, 2, 3];
        let wts: Vec<f32> = (0..rows * top)
            .map(|_| rng.random_range(0.1..1.0))
            .collect();
        let routes = k.routes_from_host(&ids, &wts, top).unwrap();
        let mats: Vec<_> = recs.iter().map(|r| &r.2).collect();
        let want = moe_reference(&mats, &ids, &wts, &x, (h, i, top));
        let xa = act(&k, &pool, rows, h, &x);
        let mut a = pool.take(gpu, rows * top, i).unwrap();
        let mut out = pool.take(gpu, rows, h).unwrap();
        k.moe(&slots, 0, experts, &routes, &spec, &xa, &mut a, &mut out)
            .unwrap();
        let got = out.to_host(gpu.stream()).unwrap();
        let err = worst_rel(&got, &want);
        assert!(err < 1e-5, "{t:?}: {ty:?} {h}x{i}: {err:e}");
        outs.push(bits(&got));
    }
    // Attention: 300 positions, then one fused step (two splits).
    let (qh, kvh, d) = (8, 2, 128);
    let table = rope_table(gpu, 512, d);
    let mut kv = DevKvCache::new(gpu, 1, kvh, d, 512).unwrap();
    let (kx, vx) = (vals(&mut rng, 300 * kvh * d), vals(&mut rng, 300 * kvh * d));
    let (kk, v) = (
        act(&k, &pool, 300, kvh * d, &kx),
        act(&k, &pool, 300, kvh * d, &vx),
    );
    k.kv_push(&mut kv, 0, &kk, &v).unwrap();
    kv.advance(300);
    let q = act(&k, &pool, 1, qh * d, &vals(&mut rng, qh * d));
    let (kk, v) = (
        act(&k, &pool, 1, kvh * d, &vals(&mut rng, kvh * d)),
        act(&k, &pool, 1, kvh * d, &vals(&mut rng, kvh * d)),
    );
    let rope = RopeStep {
        norms: None,
        eps: 1e-6,
        table: &table,
        interleaved: false,
    };
    let mut out = pool.take(gpu, 1, qh * d).unwrap();
    k.rope_attend(&mut kv, 0, qh, &q, (&kk, &v), rope, 0.088, &mut out)
        .unwrap();
    outs.push(bits(&out.to_host(gpu.stream()).unwrap()));
    outs
}

#[test]
fn every_tuning_gives_the_same_bits() {
    let Some(gpu) = gpu_or_skip("every_tuning_gives_the_same_bits") else {
        return;
    };
    let base = run_tuned(&gpu, Tuning::default());
    let d = Tuning::default();
    for t in [
        Tuning {
            down_together: true,
            ..d
        },
        Tuning { down_rows: 1, ..d },
        Tuning {
            down_rows: 3,
            down_together: true,
            ..d
        },
        Tuning {
            down_rows: 8,
            down_together: true,
            ..d
        },
        Tuning {
            gemv_loads: 8,
            attn_ahead: 1,
            stream_weights: false,
            ..d
        },
        // Staged down weights: tiles that fit (every dtype) and one that
        // does not (the 2056-wide BF16 case at 4 rows) in one build.
        Tuning {
            down_stage: true,
            ..d
        },
        Tuning {
            down_stage: true,
            down_rows: 3,
            ..d
        },
        Tuning {
            down_stage: true,
            down_rows: 8,
            stream_weights: false,
            ..d
        },
    ] {
        assert!(run_tuned(&gpu, t) == base, "{t:?} changed a result bit");
    }
}

#[test]
fn products_with_their_add_and_norm_equal_their_own_launches() {
    let Some(gpu) = gpu_or_skip("products_with_their_add_and_norm_equal_their_own_launches") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0xadd);
    let types = [
        WeightType::Bf16,
        WeightType::F16,
        WeightType::F32,
        WeightType::Fp8 { block: [16, 16] },
    ];
    // The output product: widths 2048 (the step's, every norm register
    // used), 3000 (past them) and 40 (one block).
    for ty in types {
        for (m, kk) in [(2048, 512), (3000, 64), (40, 136)] {
            let (bytes, scales, _) = random_matrix(&mut rng, m, kk, ty);
            let w = DevMatrix::upload(&gpu, m, kk, ty, &bytes, scales.as_deref()).unwrap();
            let (xv, rv, nv) = (vals(&mut rng, kk), vals(&mut rng, m), vals(&mut rng, m));
            let norm = DevVector::upload(&gpu, &nv).unwrap();
            let x = act(&k, &pool, 1, kk, &xv);
            let (mut resid_a, mut resid_b) = (act(&k, &pool, 1, m, &rv), act(&k, &pool, 1, m, &rv));
            let (mut y_a, mut y_b) = (
                pool.take(&gpu, 1, m).unwrap(),
                pool.take(&gpu, 1, m).unwrap(),
            );
            let (mut out_a, mut out_b) = (
                pool.take(&gpu, 1, m).unwrap(),
                pool.take(&gpu, 1, m).unwrap(),
            );
            k.gemv(&mut y_a, &w, &x).unwrap();
            k.add_rms_norm(&mut resid_a, &y_a, &norm, 1e-6, &mut out_a)
                .unwrap();
            let into = AddNormInto {
                resid: &mut resid_b,
                norm: &norm,
                eps: 1e-6,
                out: &mut out_b,
            };
            k.gemv_add_norm(&mut y_b, &w, &x, into).unwrap();
            for (a, b, what) in [
                (&y_a, &y_b, "product"),
                (&resid_a, &resid_b, "residual"),
                (&out_a, &out_b, "norm"),
            ] {
                let (a, b) = (
                    a.to_host(gpu.stream()).unwrap(),
                    b.to_host(gpu.stream()).unwrap(),
                );
                assert!(a.iter().all(|v| v.is_finite()));
                assert_eq!(bits(&a), bits(&b), "{ty:?} {m}x{kk}: the {what} differs");
            }
        }
    }
    // The routed experts' down product, one row and two.
    for (ty, h, i) in [
        (WeightType::Bf16, 2048, 96),
        (WeightType::Fp8 { block: [16, 16] }, 66 * 8, 64),
    ] {
        let (experts, top) = (4, 2);
        let recs: Vec<_> = (0..experts).map(|_| record(&mut rng, h, i, ty)).collect();
        let spec = recs[0].1;
        let stride = recs[0].0.len().div_ceil(4096) * 4096;
        let mut pinned = PinnedMemory::new(&gpu, stride * experts).unwrap();
        for (e, (bytes, _, _)) in recs.iter().enumerate() {
            pinned.write(e * stride, bytes).unwrap();
        }
        let shared = Arc::new(pinned);
        let mut slots = ExpertSlots::new(&gpu, 0, stride, recs[0].0.len(), experts).unwrap();
        for e in 0..experts {
            slots
                .point_to_pinned(e, &shared, e * stride, recs[0].0.len())
                .unwrap();
        }
        slots.publish().unwrap();
        for rows in [1usize, 2] {
            let ids = &[3u32, 1, 0, 2][..rows * top];
            let wts: Vec<f32> = (0..rows * top)
                .map(|_| rng.random_range(0.1..1.0))
                .collect();
            let routes = k.routes_from_host(ids, &wts, top).unwrap();
            let (xv, rv, nv) = (
                vals(&mut rng, rows * h),
                vals(&mut rng, rows * h),
                vals(&mut rng, h),
            );
            let norm = DevVector::upload(&gpu, &nv).unwrap();
            let x = act(&k, &pool, rows, h, &xv);
            let (mut resid_a, mut resid_b) =
                (act(&k, &pool, rows, h, &rv), act(&k, &pool, rows, h, &rv));
            let mut scratch = pool.take(&gpu, rows * top, i).unwrap();
            let (mut y_a, mut y_b) = (
                pool.take(&gpu, rows, h).unwrap(),
                pool.take(&gpu, rows, h).unwrap(),
            );
            let (mut out_a, mut out_b) = (
                pool.take(&gpu, rows, h).unwrap(),
                pool.take(&gpu, rows, h).unwrap(),
            );
            k.moe(
                &slots,
                0,
                experts,
                &routes,
                &spec,
                &x,
                &mut scratch,
                &mut y_a,
            )
            .unwrap();
            k.add_rms_norm(&mut resid_a, &y_a, &norm, 1e-6, &mut out_a)
                .unwrap();
            let into = AddNormInto {
                resid: &mut resid_b,
                norm: &norm,
                eps: 1e-6,
                out: &mut out_b,
            };
            k.moe_add_norm(
                &slots,
                0,
                experts,
                &routes,
                &spec,
                &x,
                (&mut scratch, &mut y_b),
                into,
            )
            .unwrap();
            for (a, b, what) in [
                (&y_a, &y_b, "experts"),
                (&resid_a, &resid_b, "residual"),
                (&out_a, &out_b, "norm"),
            ] {
                let (a, b) = (
                    a.to_host(gpu.stream()).unwrap(),
                    b.to_host(gpu.stream()).unwrap(),
                );
                assert!(a.iter().all(|v| v.is_finite()));
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{ty:?} {h}x{i}, {rows} rows: the {what} differs"
                );
            }
        }
    }
}
