//! The decode engine on the GPU against HF transformers and the CPU
//! engine, on every committed fixture: the same greedy tokens, prompt
//! logits within 2e-3 of transformers' f32 reference, and bit-identical
//! output at every HBM and RAM budget, on the HBM and the in-place
//! (unified-memory) paths. Skips with a printed reason where there is no
//! GPU (CI).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::load::{LoadOptions, load_cpu, load_cuda};
use flashtier_engine::{Generation, Model};

use common::{assert_gpu_matches, fixture, gpu_opts, gpu_or_skip, pack, reference};

const NEW_TOKENS: usize = 8;
/// The GPU's bound against transformers' f32 logits (f32 activations and
/// accumulation; the reduction order differs from the CPU's).
const MAX_ABS_ERR: f32 = 2e-3;

fn generate(m: &mut Model<CudaDevice>, prompt: &[u32]) -> Generation {
    m.generate(prompt, NEW_TOKENS, &[], true, |_| {}).unwrap()
}

fn check(name: &str) {
    if !gpu_or_skip(&format!("gpu_engine {name}")) {
        return;
    }
    let dir = fixture(name);
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = LoadOptions::store(&report.out);
    let mut cpu = load_cpu(&dir, &store).unwrap();
    let cpu_out = cpu
        .generate(&r.prompt, NEW_TOKENS, &[], true, |_| {})
        .unwrap();
    let mut gpu = load_cuda(&dir, &store, &gpu_opts(None, 0, false)).unwrap();
    assert!(gpu.experts().resident_all(), "{name}: every record fits");
    let out = generate(&mut gpu, &r.prompt);
    assert_gpu_matches(name, &out, &cpu_out, &r, MAX_ABS_ERR);
    let stride = report.stride_bytes;
    let all = stride * report.records;
    let top_k = gpu.config().top_k as u64;
    for (hbm, ram, in_place) in [
        (Some(all / 2), 0, false),
        (Some(stride * top_k), 0, false),
        (Some(stride * top_k), all, false),
        (None, all / 2, true),
        (None, stride * 2 * top_k, true),
    ] {
        let mut m = load_cuda(&dir, &store, &gpu_opts(hbm, ram, in_place)).unwrap();
        let o = generate(&mut m, &r.prompt);
        let what = format!("{name} hbm {hbm:?} ram {ram} in_place {in_place}");
        assert_eq!(o.generated_ids, out.generated_ids, "{what}: tokens changed");
        assert_eq!(o.prompt_logits, out.prompt_logits, "{what}: logits changed");
        let s = m.expert_stats();
        println!(
            "{what}: hit rate {:.3}, {} B read, tiers {:?}",
            s.hit_rate(),
            s.bytes_read,
            m.experts().tier_stats()
        );
    }
}

#[test]
fn qwen3_moe_on_the_gpu() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_tied_fused_sharded_on_the_gpu() {
    check("qwen3_moe_tied");
}

#[test]
fn qwen3_moe_yarn_on_the_gpu() {
    check("qwen3_moe_yarn");
}

#[test]
fn mixtral_on_the_gpu() {
    check("mixtral");
}

#[test]
fn qwen2_moe_on_the_gpu() {
    check("qwen2_moe");
}

#[test]
fn deepseek_v3_on_the_gpu() {
    check("deepseek_v3");
}

#[test]
fn deepseek_v3_fp8_on_the_gpu() {
    check("deepseek_v3_fp8");
}

/// A prompt longer than one prefill chunk and than one attention split
/// (256 positions): chunked prefill and split-KV attention agree with the
/// CPU engine token for token.
#[test]
fn long_prompts_match_the_cpu() {
    if !gpu_or_skip("gpu_engine long_prompts_match_the_cpu") {
        return;
    }
    let dir = fixture("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = LoadOptions::store(&report.out);
    let mut cpu = load_cpu(&dir, &store).unwrap();
    let limit = cpu.context_limit();
    let len = 300.min(limit - NEW_TOKENS);
    let prompt: Vec<u32> = (0..len as u32).map(|i| (i * 7919 + 11) % 300).collect();
    let want = cpu
        .generate(&prompt, NEW_TOKENS, &[], false, |_| {})
        .unwrap();
    let mut gpu = load_cuda(&dir, &store, &gpu_opts(None, 0, false)).unwrap();
    let got = gpu
        .generate(&prompt, NEW_TOKENS, &[], false, |_| {})
        .unwrap();
    assert_eq!(got.generated_ids, want.generated_ids);
}
