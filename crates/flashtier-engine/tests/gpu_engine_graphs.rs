//! The GPU engine's recorded decode steps (CUDA graphs) against the same
//! engine launching every kernel one by one: on every GPU fixture family,
//! each decode step's logits are the same bits, the greedy tokens are
//! transformers', and the graphs were built and replayed (not silently
//! skipped). Short segments make a step several graphs. Skips with a
//! printed reason where there is no GPU (CI).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use flashtier_engine::Model;
use flashtier_engine::device::cuda::CudaDevice;

use common::{gpu_or_skip, two_resident_gpu_models};

const STEPS: usize = 12;

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The prompt, then `STEPS` greedy steps one token at a time: each step's
/// logits.
fn decode(m: &mut Model<CudaDevice>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut last = m.forward(prompt, false).unwrap();
    let mut steps = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        last = m.forward(&[argmax(&last)], false).unwrap();
        steps.push(last.clone());
    }
    steps
}

fn check(name: &str) {
    if !gpu_or_skip(&format!("gpu_engine_graphs {name}")) {
        return;
    }
    let (r, _tmp, mut eager, mut graphs) = two_resident_gpu_models(name);
    eager.device().set_graphs(false);
    graphs.device().gpu().set_segment_launches(16);
    assert!(graphs.experts().resident_all(), "{name}: every record fits");
    let want = decode(&mut eager, &r.prompt);
    let got = decode(&mut graphs, &r.prompt);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{name}: step {i}: logits differ between graphs and launches"
        );
    }
    let tokens: Vec<u32> = want.iter().map(|l| argmax(l)).collect();
    // Step i's input is greedy token i (step 0's input comes from the
    // prompt), so step i's argmax is greedy token i + 1.
    let n = r.greedy.len().min(STEPS + 1);
    assert_eq!(
        &tokens[..n - 1],
        &r.greedy[1..n],
        "{name}: tokens differ from transformers"
    );
    let (e, g) = (eager.device().graph_stats(), graphs.device().graph_stats());
    println!("{name}: one by one {e:?}; graphs {g:?}");
    assert_eq!(e.graph_launches, 0, "{name}: graphs off launches no graph");
    assert!(g.builds > 0 && g.patched_nodes > 0, "{name}: {g:?}");
    assert!(
        g.graph_kernels > g.direct_kernels / 2,
        "{name}: the decode steps' kernels run inside graphs: {g:?}"
    );
}

#[test]
fn qwen3_moe_graphs_equal_launches() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_yarn_graphs_equal_launches() {
    check("qwen3_moe_yarn");
}

#[test]
fn mixtral_graphs_equal_launches() {
    check("mixtral");
}

#[test]
fn qwen2_moe_graphs_equal_launches() {
    check("qwen2_moe");
}

#[test]
fn deepseek_v3_graphs_equal_launches() {
    check("deepseek_v3");
}

#[test]
fn deepseek_v3_fp8_graphs_equal_launches() {
    check("deepseek_v3_fp8");
}
