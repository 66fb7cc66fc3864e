//! The prompt chunk's tiled products and grouped experts
//! (`flashtier_cuda::ops::gemm`) against f64 references on random shapes
//! (every weight dtype, partial tiles in rows, columns and width), and the
//! property the engine relies on: an output row's bits do not depend on
//! which rows run with it (one row alone, the whole chunk, any grouping of
//! rows, three matrices in one launch or one each). BF16 runs three ways:
//! its dense products through cuBLASLt (`ops::lt`) and its experts on the
//! tensor cores, everything on the tensor cores (split inputs, `ops::mma`),
//! and as f32 tiles. Skips with a printed reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken kernel must fail the test loudly"
)]

mod common;

use std::sync::Arc;

use flashtier_cuda::PinnedMemory;
use flashtier_cuda::ops::buffers::{ActPool, DevMatrix, WeightType};
use flashtier_cuda::ops::experts::ExpertSlots;
use flashtier_cuda::ops::{DecodeKernels, Tuning};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use common::{act, gpu_or_skip, moe_reference, random_matrix, record, worst_rel};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The kernels with a BF16 prompt's dense products through cuBLASLt (and
/// its experts as tensor-core tiles), with every BF16 product as
/// tensor-core tiles, and with f32 tiles only.
fn prompt_kernels(gpu: &flashtier_cuda::Gpu) -> [DecodeKernels; 3] {
    let with = |prompt_mma, prompt_blas| {
        DecodeKernels::with_tuning(
            gpu,
            Tuning {
                prompt_mma,
                prompt_blas,
                ..Tuning::default()
            },
        )
        .unwrap()
    };
    let k = [with(true, true), with(true, false), with(false, true)];
    let tensor_cores = gpu.info().compute_capability.0 >= 8;
    let lt = tensor_cores && flashtier_cuda::ops::lt::cublaslt_present();
    if !lt {
        eprintln!("cuBLASLt products not tested: no libcublasLt or no tensor cores here");
    }
    assert_eq!(k[0].prompt_blas(), lt);
    assert_eq!(k[0].mma(WeightType::Bf16), tensor_cores);
    assert_eq!(k[1].mma(WeightType::Bf16), tensor_cores);
    assert!(!k[1].prompt_blas() && !k[2].prompt_blas());
    assert!(!k[2].mma(WeightType::Bf16));
    assert!(!k[0].mma(WeightType::F16) && !k[0].mma(WeightType::F32));
    k
}

/// A BF16 prompt's dense products through cuBLASLt at the row counts the
/// engine's prompt steps have (256-row chunks, 1024-row steps, a tail):
/// every row gets the bits it gets in the whole step (the algorithm is
/// pinned per shape), and the products are within the split inputs'
/// bound of f64.
#[test]
fn blas_products_give_a_row_the_same_bits_at_every_step_size() {
    let Some(gpu) = gpu_or_skip("blas_products_give_a_row_the_same_bits_at_every_step_size") else {
        return;
    };
    let k = &prompt_kernels(&gpu)[0];
    if !k.prompt_blas() {
        eprintln!("skipped: the cuBLASLt products do not run on this machine");
        return;
    }
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x1b1a);
    let rows = 1030;
    // Qwen3-30B-A3B's q and o shapes, a narrow one, and a width of 136.
    for (m, kk) in [(4096, 2048), (2048, 4096), (72, 2048), (264, 136)] {
        let (bytes, _, w) = random_matrix(&mut rng, m, kk, WeightType::Bf16);
        let dm = DevMatrix::upload(&gpu, m, kk, WeightType::Bf16, &bytes, None).unwrap();
        let x: Vec<f32> = (0..rows * kk)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let xa = act(k, &pool, rows, kk, &x);
        let mut out = pool.take(&gpu, rows, m).unwrap();
        k.gemm_many(&mut [&mut out], &[&dm], &xa).unwrap();
        let whole = out.to_host(gpu.stream()).unwrap();
        // f64 on a sample of outputs.
        let mut worst = 0f64;
        for i in (0..rows * m).step_by(997) {
            let (r, o) = (i / m, i % m);
            let (mut want, mut mag) = (0f64, 0f64);
            for c in 0..kk {
                let t = w[o * kk + c] * f64::from(x[r * kk + c]);
                want += t;
                mag += t.abs();
            }
            worst = worst.max((f64::from(whole[i]) - want).abs() / mag.max(1e-30));
        }
        assert!(worst < 1e-5, "{m}x{kk}: {worst:e} of the terms' magnitude");
        for (r0, n) in [
            (0, 256),
            (256, 256),
            (1024, 6),
            (0, 1024),
            (517, 1),
            (1029, 1),
            (3, 17),
        ] {
            let xs = act(k, &pool, n, kk, &x[r0 * kk..(r0 + n) * kk]);
            let mut o = pool.take(&gpu, n, m).unwrap();
            k.gemm_many(&mut [&mut o], &[&dm], &xs).unwrap();
            assert_eq!(
                bits(&o.to_host(gpu.stream()).unwrap()),
                bits(&whole[r0 * m..(r0 + n) * m]),
                "{m}x{kk}: rows {r0}..{}",
                r0 + n
            );
        }
    }
}

#[test]
fn tiled_products_match_f64_and_rows_do_not_depend_on_their_neighbours() {
    let Some(gpu) =
        gpu_or_skip("tiled_products_match_f64_and_rows_do_not_depend_on_their_neighbours")
    else {
        return;
    };
    for k in &prompt_kernels(&gpu) {
        tiled_products_on(&gpu, k);
    }
}

fn tiled_products_on(gpu: &flashtier_cuda::Gpu, k: &DecodeKernels) {
    let gpu = gpu.clone();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x7117);
    let types = [
        WeightType::Bf16,
        WeightType::F16,
        WeightType::F32,
        WeightType::Fp8 { block: [16, 16] },
        WeightType::Fp8 { block: [128, 128] },
    ];
    for ty in types {
        for (m, kk) in [(37, 64), (300, 2048), (129, 136), (64, 40), (5, 8)] {
            for rows in [9, 64, 65, 130] {
                let (bytes, scales, w) = random_matrix(&mut rng, m, kk, ty);
                let dm = DevMatrix::upload(&gpu, m, kk, ty, &bytes, scales.as_deref()).unwrap();
                let x: Vec<f32> = (0..rows * kk)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let xa = act(k, &pool, rows, kk, &x);
                let mut out = pool.take(&gpu, rows, m).unwrap();
                assert!(k.tiled(kk, rows));
                k.products(&mut [&mut out], &[&dm], &xa).unwrap();
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
                // The last row alone, and the first 9 rows alone, give the
                // bits they gave inside the whole chunk.
                for (r0, n) in [(rows - 1, 1), (0, 9)] {
                    let xs = act(k, &pool, n, kk, &x[r0 * kk..(r0 + n) * kk]);
                    let mut o = pool.take(&gpu, n, m).unwrap();
                    k.gemm_many(&mut [&mut o], &[&dm], &xs).unwrap();
                    assert_eq!(
                        bits(&o.to_host(gpu.stream()).unwrap()),
                        bits(&got[r0 * m..(r0 + n) * m]),
                        "{ty:?} {m}x{kk}: rows {r0}..{}",
                        r0 + n
                    );
                }
            }
        }
    }
    // Three matrices of one input in one launch give what three launches give.
    let (ty, kk, rows) = (WeightType::Bf16, 256, 70);
    let mats: Vec<DevMatrix> = [300usize, 64, 72]
        .iter()
        .map(|&m| {
            let (b, s, _) = random_matrix(&mut rng, m, kk, ty);
            DevMatrix::upload(&gpu, m, kk, ty, &b, s.as_deref()).unwrap()
        })
        .collect();
    let x: Vec<f32> = (0..rows * kk)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let xa = act(k, &pool, rows, kk, &x);
    let mut o0 = pool.take(&gpu, rows, 300).unwrap();
    let mut o1 = pool.take(&gpu, rows, 64).unwrap();
    let mut o2 = pool.take(&gpu, rows, 72).unwrap();
    k.gemm_many(
        &mut [&mut o0, &mut o1, &mut o2],
        &[&mats[0], &mats[1], &mats[2]],
        &xa,
    )
    .unwrap();
    for (m, o) in mats.iter().zip([&o0, &o1, &o2]) {
        let mut one = pool.take(&gpu, rows, m.rows()).unwrap();
        k.gemm_many(&mut [&mut one], &[m], &xa).unwrap();
        assert_eq!(
            bits(&one.to_host(gpu.stream()).unwrap()),
            bits(&o.to_host(gpu.stream()).unwrap())
        );
    }
    // A width that is not whole chunks of 8 is refused, not misread.
    let (b, s, _) = random_matrix(&mut rng, 16, 29, ty);
    let odd = DevMatrix::upload(&gpu, 16, 29, ty, &b, s.as_deref()).unwrap();
    let xo = act(k, &pool, 20, 29, &vec![0.5; 20 * 29]);
    let mut oo = pool.take(&gpu, 20, 16).unwrap();
    assert!(!k.tiled(29, 20));
    assert!(k.gemm_many(&mut [&mut oo], &[&odd], &xo).is_err());
}

/// The tensor cores' tiles staging 32 or 64 input columns at once
/// (`FLASHTIER_MMA_BK`) give the same bits: their sums run over k in the
/// same order (the grouped experts' tiles are the same `mma_tile`).
#[test]
fn tensor_core_k_tiles_give_the_same_bits() {
    let Some(gpu) = gpu_or_skip("tensor_core_k_tiles_give_the_same_bits") else {
        return;
    };
    if gpu.info().compute_capability.0 < 8 {
        flashtier_io::skip::notice(
            "tensor_core_k_tiles_give_the_same_bits",
            "no tensor-core tiles below compute capability 8.0",
        );
        return;
    }
    let with = |mma_bk| {
        DecodeKernels::with_tuning(
            &gpu,
            Tuning {
                mma_bk,
                ..Tuning::default()
            },
        )
        .unwrap()
    };
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0xb4);
    for (m, kk, rows) in [(300, 2048, 130), (64, 40, 65), (129, 136, 9)] {
        let (bytes, scales, _) = random_matrix(&mut rng, m, kk, WeightType::Bf16);
        let x: Vec<f32> = (0..rows * kk)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let outs: Vec<Vec<u32>> = [32, 64]
            .into_iter()
            .map(|bk| {
                let k = with(bk);
                let dm =
                    DevMatrix::upload(&gpu, m, kk, WeightType::Bf16, &bytes, scales.as_deref())
                        .unwrap();
                let xa = act(&k, &pool, rows, kk, &x);
                let mut out = pool.take(&gpu, rows, m).unwrap();
                k.gemm_many(&mut [&mut out], &[&dm], &xa).unwrap();
                bits(&out.to_host(gpu.stream()).unwrap())
            })
            .collect();
        assert_eq!(outs[0], outs[1], "{m}x{kk}, {rows} rows");
    }
}

#[test]
fn grouped_experts_match_f64_and_give_the_same_bits_in_any_grouping() {
    let Some(gpu) = gpu_or_skip("grouped_experts_match_f64_and_give_the_same_bits_in_any_grouping")
    else {
        return;
    };
    let k = prompt_kernels(&gpu);
    let outs: Vec<_> = k.iter().map(|k| grouped_experts_on(&gpu, k)).collect();
    // cuBLASLt takes only the dense products: beside it or not, the grouped
    // experts run the same tensor-core tiles, so the same bits.
    assert_eq!(
        outs[0], outs[1],
        "grouped experts beside cuBLASLt vs without"
    );
}

/// Every grouped case on the kernels `k`; the whole step's output bits of
/// each case, in order (the cases' inputs come from one fixed seed).
fn grouped_experts_on(gpu: &flashtier_cuda::Gpu, k: &DecodeKernels) -> Vec<Vec<u32>> {
    let gpu = gpu.clone();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x96);
    let mut outs = Vec::new();
    for ty in [
        WeightType::Bf16,
        WeightType::Fp8 { block: [16, 16] },
        WeightType::F32,
    ] {
        // Partial tiles everywhere: width 136 (4 tiles of 32 + 8), 72 expert
        // columns (64 + 8), and expert 1 chosen by more rows than a tile
        // holds; 300 rows give the experts 100 pairs each, a prompt step's
        // share (several full tiles per expert).
        for rows in [70, 300] {
            outs.push(grouped_case(&gpu, k, &pool, &mut rng, ty, rows, (136, 72)));
        }
    }
    // A wider expert (many k tiles, a partial last one; columns past a
    // whole tile) with 233 pairs per expert, seven full tiles and a part.
    outs.push(grouped_case(
        &gpu,
        k,
        &pool,
        &mut rng,
        WeightType::Bf16,
        700,
        (1032, 200),
    ));
    outs
}

fn grouped_case(
    gpu: &flashtier_cuda::Gpu,
    k: &DecodeKernels,
    pool: &std::rc::Rc<ActPool>,
    rng: &mut SmallRng,
    ty: WeightType,
    rows: usize,
    (h, i): (usize, usize),
) -> Vec<u32> {
    let gpu = gpu.clone();
    {
        let (experts, top) = (6, 2);
        let recs: Vec<_> = (0..experts).map(|_| record(rng, h, i, ty)).collect();
        let spec = recs[0].1;
        assert!(k.grouped(&spec));
        let stride = recs[0].0.len().div_ceil(4096) * 4096;
        let mut pinned = PinnedMemory::new(&gpu, stride * experts).unwrap();
        for (e, (bytes, _, _)) in recs.iter().enumerate() {
            pinned.write(e * stride, bytes).unwrap();
        }
        let shared = Arc::new(pinned);
        let x: Vec<f32> = (0..rows * h).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut ids = Vec::with_capacity(rows * top);
        for r in 0..rows {
            let mut pick: Vec<u32> = if r % 5 == 4 {
                (0..experts as u32).collect()
            } else {
                vec![1, 2 + (r % 4) as u32]
            };
            pick.shuffle(rng);
            let mut two = pick[..top].to_vec();
            two.sort_unstable();
            ids.extend(two);
        }
        let wts: Vec<f32> = (0..rows * top)
            .map(|_| rng.random_range(0.1..1.0))
            .collect();
        let routes = k.routes_from_host(&ids, &wts, top).unwrap();
        let mats: Vec<&[Vec<f64>; 3]> = recs.iter().map(|r| &r.2).collect();
        let want = moe_reference(&mats, &ids, &wts, &x, (h, i, top));
        let mut slots = ExpertSlots::new(&gpu, experts, stride, recs[0].0.len(), experts).unwrap();
        for e in 0..experts {
            slots.load(e, &shared, e * stride, recs[0].0.len()).unwrap();
            slots.point_to_slot(e, e).unwrap();
        }
        slots.publish().unwrap();
        let xa = act(k, pool, rows, h, &x);
        let run_with =
            |groups: &[std::ops::Range<usize>], slots: &ExpertSlots, host: bool| -> Vec<f32> {
                let mut out = pool.take(&gpu, rows, h).unwrap();
                let mut a = pool.take(&gpu, rows * top, i).unwrap();
                let mut y = pool.take(&gpu, rows * top, h).unwrap();
                for g in groups {
                    k.moe_grouped(
                        slots,
                        (0, experts),
                        &routes,
                        host.then_some(ids.as_slice()),
                        g.clone(),
                        &spec,
                        &xa,
                        (&mut a, &mut y),
                        &mut out,
                    )
                    .unwrap();
                }
                out.to_host(gpu.stream()).unwrap()
            };
        let run =
            |groups: &[std::ops::Range<usize>], slots: &ExpertSlots| run_with(groups, slots, true);
        let run_on_device =
            |groups: &[std::ops::Range<usize>], slots: &ExpertSlots| run_with(groups, slots, false);
        let whole = run(std::slice::from_ref(&(0..rows)), &slots);
        let err = worst_rel(&whole, &want);
        assert!(err < 1e-5, "{ty:?} {rows} rows: {err:e}");
        // Grouped on the device instead: the same groups, the same bits,
        // whole and in two runs of rows.
        assert_eq!(
            bits(&run_on_device(std::slice::from_ref(&(0..rows)), &slots)),
            bits(&whole),
            "{ty:?} grouped on the device"
        );
        assert_eq!(
            bits(&run_on_device(&[0..7, 7..rows], &slots)),
            bits(&whole),
            "{ty:?} grouped on the device, two runs"
        );
        let one_by_one: Vec<_> = (0..rows).map(|r| r..r + 1).collect();
        assert_eq!(
            bits(&run(&one_by_one, &slots)),
            bits(&whole),
            "{ty:?} row by row"
        );
        assert_eq!(
            bits(&run(&[0..3, 3..40, 40..rows], &slots)),
            bits(&whole),
            "{ty:?} three groups"
        );
        // An expert that is not resident gives NaN for the rows that chose
        // it, never another expert's bytes; the other rows keep their bits.
        slots.clear(3).unwrap();
        slots.publish().unwrap();
        let holed = run(std::slice::from_ref(&(0..rows)), &slots);
        assert_eq!(
            bits(&run_on_device(std::slice::from_ref(&(0..rows)), &slots)),
            bits(&holed),
            "{ty:?} an expert missing, grouped on the device"
        );
        for r in 0..rows {
            let row = &holed[r * h..(r + 1) * h];
            if ids[r * top..(r + 1) * top].contains(&3) {
                assert!(row.iter().all(|v| v.is_nan()), "{ty:?} row {r}");
            } else {
                assert_eq!(
                    bits(row),
                    bits(&whole[r * h..(r + 1) * h]),
                    "{ty:?} row {r}"
                );
            }
        }
        bits(&whole)
    }
}
