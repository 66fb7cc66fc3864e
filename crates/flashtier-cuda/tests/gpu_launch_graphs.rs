//! Recorded steps issued as CUDA graphs against the same kernels launched
//! one by one: a decode-shaped sequence (norm, q/k/v products, q/k norm
//! with RoPE, attention over two layers, output product, residual norm,
//! then the fused router with its top-k and the argmax over many blocks)
//! run for 300 positions, so the graphs replay with a new position each
//! step, rebuild when the attention splits change at 256 positions, and
//! follow the KV cache when it grows. Every step's output (the residual,
//! the routes, the pick) must be the same bits: with programmatic edges in
//! the graphs (the default) the kernels that wait themselves start early. Skips with a printed reason where there is no GPU.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken launch path must fail the test loudly"
)]

mod common;

use std::rc::Rc;

use flashtier_cuda::Gpu;
use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::attn::DevKvCache;
use flashtier_cuda::ops::buffers::{ActPool, DevAct, DevMatrix, DevVector, RopeTable, WeightType};
use flashtier_cuda::ops::route::DevRoutes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{bf16, gpu_or_skip};

const HIDDEN: usize = 256;
const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const DIM: usize = 64;
const LAYERS: usize = 2;
const POSITIONS: usize = 300;
const EXPERTS: usize = 64;

struct Weights {
    q: DevMatrix,
    k: DevMatrix,
    v: DevMatrix,
    o: DevMatrix,
    norm: DevVector,
    router: DevMatrix,
    qk: [DevVector; 2],
    rope: RopeTable,
}

fn matrix(gpu: &Gpu, rng: &mut SmallRng, rows: usize, cols: usize) -> DevMatrix {
    let bytes: Vec<u8> = (0..rows * cols)
        .flat_map(|_| bf16(rng.random_range(-0.1..0.1)).to_le_bytes())
        .collect();
    DevMatrix::upload(gpu, rows, cols, WeightType::Bf16, &bytes, None).unwrap()
}

fn weights(gpu: &Gpu) -> Weights {
    let mut rng = SmallRng::seed_from_u64(14);
    let vector = |rng: &mut SmallRng, n: usize| {
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(0.5..1.5)).collect();
        DevVector::upload(gpu, &v).unwrap()
    };
    let half = DIM / 2;
    let angle = |p: usize, i: usize| p as f32 * 10_000f32.powf(-(i as f32) / half as f32);
    let cos: Vec<f32> = (0..1024 * half)
        .map(|j| angle(j / half, j % half).cos())
        .collect();
    let sin: Vec<f32> = (0..1024 * half)
        .map(|j| angle(j / half, j % half).sin())
        .collect();
    Weights {
        q: matrix(gpu, &mut rng, Q_HEADS * DIM, HIDDEN),
        k: matrix(gpu, &mut rng, KV_HEADS * DIM, HIDDEN),
        v: matrix(gpu, &mut rng, KV_HEADS * DIM, HIDDEN),
        o: matrix(gpu, &mut rng, HIDDEN, Q_HEADS * DIM),
        norm: vector(&mut rng, HIDDEN),
        router: matrix(gpu, &mut rng, EXPERTS, HIDDEN),
        qk: [vector(&mut rng, DIM), vector(&mut rng, DIM)],
        rope: RopeTable::upload(gpu, 1024, half, &cos, &sin).unwrap(),
    }
}

/// One position of the decode-shaped sequence; updates the residual `x`
/// and routes its last norm.
fn step(
    k: &DecodeKernels,
    pool: &Rc<ActPool>,
    w: &Weights,
    kv: &mut DevKvCache,
    x: &mut DevAct,
    pos: usize,
) -> DevRoutes {
    let gpu = k.gpu();
    let take = |cols: usize| pool.take(gpu, 1, cols).unwrap();
    let mut normed = take(HIDDEN);
    k.rms_norm(&mut normed, x, &w.norm, 1e-6).unwrap();
    for layer in 0..LAYERS {
        let (mut q, mut kk, mut v) = (
            take(Q_HEADS * DIM),
            take(KV_HEADS * DIM),
            take(KV_HEADS * DIM),
        );
        k.gemv_many(&mut [&mut q, &mut kk, &mut v], &[&w.q, &w.k, &w.v], &normed)
            .unwrap();
        let [qn, kn] = &w.qk;
        k.qk_norm_rope(
            &mut q,
            &mut kk,
            Some([qn, kn]),
            1e-6,
            &w.rope,
            DIM,
            false,
            pos,
        )
        .unwrap();
        let mut heads = take(Q_HEADS * DIM);
        let scale = 1.0 / (DIM as f32).sqrt();
        k.attend(kv, layer, Q_HEADS, &q, &kk, &v, scale, &mut heads)
            .unwrap();
        let mut out = take(HIDDEN);
        k.gemv(&mut out, &w.o, &heads).unwrap();
        k.add_rms_norm(x, &out, &w.norm, 1e-6, &mut normed).unwrap();
    }
    let mut logits = take(EXPERTS);
    let routes = k
        .router_softmax(&w.router, &normed, &mut logits, 4, true)
        .unwrap();
    kv.advance(1);
    routes
}

/// Every step's residual, routes and argmax, on `gpu` with graphs on or off.
fn run(gpu: &Gpu, graphs: bool) -> Vec<Vec<f32>> {
    gpu.set_graphs(graphs);
    // Short segments: a step is several of them, the last one too short
    // for a graph.
    gpu.set_segment_launches(5);
    let k = DecodeKernels::new(gpu).unwrap();
    let pool = ActPool::new();
    let w = weights(gpu);
    let mut kv = DevKvCache::new(gpu, LAYERS, KV_HEADS, DIM, 1024).unwrap();
    let mut x = pool.take(gpu, 1, HIDDEN).unwrap();
    let start: Vec<f32> = (0..HIDDEN).map(|i| (i as f32 * 0.37).sin()).collect();
    x.upload(gpu.stream(), &start).unwrap();
    let mut outs = Vec::with_capacity(POSITIONS);
    for pos in 0..POSITIONS {
        gpu.begin_step().unwrap();
        let routes = step(&k, &pool, &w, &mut kv, &mut x, pos);
        // The argmax ends the recorded step.
        let pick = k.argmax_rows(&x).unwrap();
        gpu.flush().unwrap();
        let mut out = x.to_host(gpu.stream()).unwrap();
        let (ids, weights) = routes.to_host(&k).unwrap();
        out.extend(weights);
        out.extend(ids.iter().chain(&pick).map(|&i| i as f32));
        outs.push(out);
    }
    outs
}

#[test]
fn graph_replays_equal_launches_one_by_one() {
    let Some(eager_gpu) = gpu_or_skip("graph_replays_equal_launches_one_by_one") else {
        return;
    };
    let graph_gpu = Gpu::open(0).unwrap();
    let want = run(&eager_gpu, false);
    let got = run(&graph_gpu, true);
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "position {pos}: the graph path changed the output");
    }
    assert!(want.iter().flatten().all(|v| v.is_finite()));
    let (e, g) = (eager_gpu.graph_stats(), graph_gpu.graph_stats());
    println!("one by one: {e:?}\ngraphs: {g:?}");
    assert_eq!(e.graph_launches, 0, "graphs off launches no graph");
    // A shape is built the second time it comes: the steps before and
    // after the attention splits change (and the KV cache grows) at 256.
    assert!(g.builds >= 2, "{g:?}");
    assert!(g.patched_nodes > 0, "positions are rewritten into replays");
    // Each step is 15 launches (17 past 256 positions) in segments of 5:
    // past 256 a 2-launch tail is too short for a graph, so most kernels
    // run inside graphs.
    assert!(
        g.graph_kernels > 3 * g.direct_kernels,
        "most kernels run inside graphs: {g:?}"
    );
}
