//! The decode step's fused kernels against their parts: the one-row router
//! product with its softmax routing in one launch gives the logits and the
//! routes `gemv` then `route_softmax` give, bit for bit (every weight
//! dtype, expert counts across the warp and block sizes, launch after
//! launch, so the last-block counter is back at 0 each time); the one-row
//! argmax over many blocks picks what the host's argmax picks (ties across
//! blocks, NaN, all -inf). Skips with a printed reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken kernel must fail the test loudly"
)]

mod common;

use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::buffers::{ActPool, DevMatrix, WeightType};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{gpu_or_skip, random_matrix};

/// The host's argmax (`flashtier_engine`'s `kernels::argmax`): the first
/// index whose value beats every one before it.
fn host_argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn fused_router_equals_product_then_routing() {
    let Some(gpu) = gpu_or_skip("fused_router_equals_product_then_routing") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0x0517);
    let cases = [
        (WeightType::Bf16, 128, 2048, 8, true),
        (WeightType::Bf16, 60, 136, 4, true),
        (WeightType::F16, 8, 64, 2, true),
        (WeightType::F32, 512, 29, 10, false),
        (WeightType::Fp8 { block: [128, 128] }, 256, 512, 8, true),
        (WeightType::Bf16, 1024, 256, 32, true),
    ];
    for (ty, e, cols, top, norm) in cases {
        let (bytes, scales, _) = random_matrix(&mut rng, e, cols, ty);
        let w = DevMatrix::upload(&gpu, e, cols, ty, &bytes, scales.as_deref()).unwrap();
        // Several launches: each must find the counter at 0.
        for rep in 0..3 {
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut xa = pool.take(&gpu, 1, cols).unwrap();
            xa.upload(gpu.stream(), &x).unwrap();
            let mut fused_logits = pool.take(&gpu, 1, e).unwrap();
            let fused = k
                .router_softmax(&w, &xa, &mut fused_logits, top, norm)
                .unwrap();
            let mut logits = pool.take(&gpu, 1, e).unwrap();
            k.gemv(&mut logits, &w, &xa).unwrap();
            let parts = k.route_softmax(&logits, top, norm).unwrap();
            let what = format!("{ty:?} {e} experts x {cols}, top-{top}, launch {rep}");
            let (a, b) = (
                fused_logits.to_host(gpu.stream()).unwrap(),
                logits.to_host(gpu.stream()).unwrap(),
            );
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{what}: logits"
            );
            let (fi, fw) = fused.to_host(&k).unwrap();
            let (pi, pw) = parts.to_host(&k).unwrap();
            assert_eq!(fi, pi, "{what}: ids");
            assert!(fi.windows(2).all(|p| p[0] < p[1]), "{what}: sorted ids");
            assert!(
                fw.iter().zip(&pw).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{what}: weights"
            );
        }
    }
}

#[test]
fn device_argmax_picks_what_the_host_picks() {
    let Some(gpu) = gpu_or_skip("device_argmax_picks_what_the_host_picks") else {
        return;
    };
    let k = DecodeKernels::new(&gpu).unwrap();
    let pool = ActPool::new();
    let mut rng = SmallRng::seed_from_u64(0xa59);
    let n = 151_936;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base: Vec<f32> = (0..n).map(|_| rng.random_range(-8.0..8.0)).collect();
    rows.push(base.clone());
    // A tie between blocks: the lower index wins.
    let mut tie = base.clone();
    tie[5000] = 100.0;
    tie[140_000] = 100.0;
    rows.push(tie);
    // The largest in the last, partial block.
    let mut last = base.clone();
    last[n - 1] = 50.0;
    rows.push(last);
    // NaN elsewhere is passed over; a NaN first value gives 0.
    let mut nan = base.clone();
    nan[7] = f32::NAN;
    nan[90_000] = 60.0;
    rows.push(nan.clone());
    nan[0] = f32::NAN;
    rows.push(nan);
    rows.push(vec![f32::NEG_INFINITY; n]);
    rows.push(vec![0.25; 3000]);
    for (i, row) in rows.iter().enumerate() {
        let mut a = pool.take(&gpu, 1, row.len()).unwrap();
        a.upload(gpu.stream(), row).unwrap();
        let got = k.argmax_rows(&a).unwrap();
        assert_eq!(got, vec![host_argmax(row)], "row {i}");
    }
    // Several rows go one block each, as before.
    let mut two = vec![0.5f32; 2 * 1000];
    two[17] = 3.0;
    two[900] = 3.0;
    two[1000 + 999] = 7.0;
    let mut a = pool.take(&gpu, 2, 1000).unwrap();
    a.upload(gpu.stream(), &two).unwrap();
    assert_eq!(k.argmax_rows(&a).unwrap(), vec![17, 999]);
}
