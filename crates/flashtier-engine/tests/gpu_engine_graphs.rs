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

use common::two_resident_gpu_models;

const STEPS: usize = 12;

fn gpu_or_skip(test: &str) -> bool {
    match CudaDevice::open(0) {
        Ok(_) => true,
        Err(e) => {
            flashtier_io::skip::notice(test, &e.to_string());
            false
        }
    }
}

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

/// Kernels the launch path ran so far (one by one and inside graphs).
fn kernels(m: &Model<CudaDevice>) -> u64 {
    let s = m.device().graph_stats();
    s.direct_kernels + s.graph_kernels
}

/// The fused decode steps (q/k norm, RoPE and KV append inside the
/// attention's launch; the residual add and next norm inside the last
/// product's) against their own launches: the same bits at every step, in
/// fewer kernels, so the fused launches did run.
fn fusion(name: &str) {
    let fused = |d: &CudaDevice| d.set_fusion(true, true);
    let Some((p, f)) = against_plain(name, "fused launches", &fused) else {
        return;
    };
    assert!(
        f < p,
        "{name}: fusion ran no fewer kernels ({f} against {p})"
    );
}

/// The down product asking L2 for the next layer's q/k/v weights (a hint)
/// against the step without it: the same bits at every step.
fn prefetch_next(name: &str) {
    let hinted = |d: &CudaDevice| d.set_prefetch_next(true);
    let Some((p, h)) = against_plain(name, "next layer's weights prefetched", &hinted) else {
        return;
    };
    assert_eq!(p, h, "{name}: the hint rides in the down product's launch");
}

/// Decode with the default device and with `set` applied: every step's
/// logits the same bits; the kernels each ran (`None`: no GPU, skipped).
fn against_plain(name: &str, what: &str, set: &dyn Fn(&CudaDevice)) -> Option<(u64, u64)> {
    if !gpu_or_skip(&format!("gpu_engine_graphs {what} {name}")) {
        return None;
    }
    let (r, _tmp, mut plain, mut fused) = two_resident_gpu_models(name);
    plain.device().set_fusion(false, false);
    plain.device().set_prefetch_next(false);
    set(fused.device());
    let (p0, f0) = (kernels(&plain), kernels(&fused));
    let want = decode(&mut plain, &r.prompt);
    let got = decode(&mut fused, &r.prompt);
    let (p, f) = (kernels(&plain) - p0, kernels(&fused) - f0);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: step {i}: logits differ with the {what}");
    }
    println!("{name}: {p} kernels by default, {f} with the {what}");
    Some((p, f))
}

#[test]
fn qwen3_moe_fused_steps_equal_their_own_launches() {
    fusion("qwen3_moe");
}

#[test]
fn mixtral_fused_steps_equal_their_own_launches() {
    fusion("mixtral");
}

#[test]
fn deepseek_v3_fused_steps_equal_their_own_launches() {
    fusion("deepseek_v3");
}

#[test]
fn qwen3_moe_prefetched_next_weights_change_no_bit() {
    prefetch_next("qwen3_moe");
}

#[test]
fn qwen2_moe_prefetched_next_weights_change_no_bit() {
    prefetch_next("qwen2_moe");
}
