//! Every compile-time knob of the decode kernels (`Tuning`: the down
//! product's rows per block, a one-row product's loads in flight, the
//! attention's positions loaded ahead, the evict-first hint) gives the
//! same bits as the defaults, for the routed experts and the decode
//! attention. Skips with a printed reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken kernel must fail the test loudly"
)]

mod common;

use std::sync::Arc;

use flashtier_cuda::PinnedMemory;
use flashtier_cuda::ops::attn::DevKvCache;
use flashtier_cuda::ops::buffers::{ActPool, WeightType};
use flashtier_cuda::ops::experts::ExpertSlots;
use flashtier_cuda::ops::{DecodeKernels, Tuning};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{act, gpu_or_skip, moe_reference, record, worst_rel};

fn vals(rng: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
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
    // Attention: 300 positions, then one decode step (two splits).
    let (qh, kvh, d) = (8, 2, 128);
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
    let mut out = pool.take(gpu, 1, qh * d).unwrap();
    k.attend(&mut kv, 0, qh, &q, &kk, &v, 0.088, &mut out)
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
        Tuning { down_rows: 1, ..d },
        Tuning { down_rows: 3, ..d },
        Tuning { down_rows: 8, ..d },
        Tuning {
            gemv_loads: 8,
            attn_ahead: 1,
            stream_weights: false,
            ..d
        },
        Tuning {
            gemv_loads: 1,
            attn_ahead: 8,
            down_rows: 16,
            ..d
        },
    ] {
        assert!(run_tuned(&gpu, t) == base, "{t:?} changed a result bit");
    }
}
