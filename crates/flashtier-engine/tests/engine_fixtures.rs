//! The engine against HF transformers: prompt logits within 1e-3 and the
//! same greedy tokens on the fixtures `tools/make_fixtures.py` made, and
//! bit-identical output at every expert budget.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::path::{Path, PathBuf};

use flashtier_engine::{Checkpoint, CheckpointExperts, Model, ModelConfig};
use serde_json::Value;

const NEW_TOKENS: usize = 8;
const MAX_ABS_ERR: f32 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/engine")
        .join(name)
}

struct Reference {
    prompt: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let logits = v["prompt_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    Reference {
        prompt: ids("prompt_ids"),
        logits,
        greedy: ids("greedy_ids"),
    }
}

/// Bytes of one expert record (BF16 matrices, or FP8 codes plus their
/// F32 block scales) and of all experts of the fixture.
fn expert_bytes(dir: &Path) -> (u64, u64) {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = std::sync::Arc::new(Checkpoint::open(dir).unwrap());
    let record = CheckpointExperts::new(ckpt, &cfg, u64::MAX)
        .unwrap()
        .record_bytes();
    if cfg.fp8_block.is_none() {
        assert_eq!(record, (cfg.expert_weight_count() * 2) as u64);
    }
    (
        record,
        record * (cfg.num_experts * cfg.num_sparse_layers()) as u64,
    )
}

fn check_against_reference(name: &str) {
    let dir = fixture(name);
    let r = reference(&dir);
    let mut model = Model::load(&dir, None).unwrap();
    let mut streamed = Vec::new();
    let out = model
        .generate(&r.prompt, NEW_TOKENS, &[], true, |t| streamed.push(t))
        .unwrap();
    assert_eq!(out.prompt_logits.len(), r.logits.len());
    let mut worst = 0f32;
    for (got, want) in out.prompt_logits.iter().zip(&r.logits) {
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(want) {
            worst = worst.max((a - b).abs());
        }
    }
    println!("{name}: max abs logit error {worst:.3e}");
    assert!(
        worst <= MAX_ABS_ERR,
        "{name}: max abs logit error {worst} > {MAX_ABS_ERR}"
    );
    assert_eq!(
        out.generated_ids, r.greedy,
        "{name}: greedy tokens differ from transformers"
    );
    assert_eq!(
        streamed, out.generated_ids,
        "{name}: callback saw other tokens"
    );

    // Every budget, from all experts down to one token's top-k: same bits.
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let (record, all) = expert_bytes(&dir);
    let minimal = record * cfg.top_k as u64;
    for budget in [all, all / 2, minimal] {
        let ckpt = std::sync::Arc::new(Checkpoint::open(&dir).unwrap());
        let experts = CheckpointExperts::new(ckpt.clone(), &cfg, budget).unwrap();
        let mut m = Model::with_experts(&cfg, &ckpt, Box::new(experts)).unwrap();
        let o = m
            .generate(&r.prompt, NEW_TOKENS, &[], true, |_| {})
            .unwrap();
        assert_eq!(
            o.generated_ids, out.generated_ids,
            "{name}: budget {budget} changed the tokens"
        );
        assert_eq!(
            o.prompt_logits, out.prompt_logits,
            "{name}: budget {budget} changed the logits"
        );
        let s = m.expert_stats();
        println!(
            "{name}: budget {budget} B: hit rate {:.3}, {} B read",
            s.hit_rate(),
            s.bytes_read
        );
        if budget == minimal {
            assert!(s.misses > 0 && s.bytes_read == s.misses * record);
        }
    }
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_against_reference("qwen3_moe");
}

#[test]
fn qwen3_moe_tied_fused_sharded_matches_transformers() {
    check_against_reference("qwen3_moe_tied");
}

#[test]
fn mixtral_matches_transformers() {
    check_against_reference("mixtral");
}

/// Pack the fixture's experts into a store and decode through the expert
/// pool, both backings, budgets from all records down to one step's top-k:
/// the same bits as the checkpoint source.
fn check_pool(name: &str) {
    use flashtier::experts::Backing;
    use flashtier_engine::pack::{PackOptions, pack_experts};
    use flashtier_engine::{StreamOptions, open_pool};

    let dir = fixture(name);
    let r = reference(&dir);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = std::sync::Arc::new(Checkpoint::open(&dir).unwrap());
    let mut base = Model::load(&dir, None).unwrap();
    let want = base
        .generate(&r.prompt, NEW_TOKENS, &[], true, |_| {})
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("experts.ftstore");
    let report = pack_experts(&PackOptions::new(&dir, &store), &|_| {}).unwrap();
    let stride = report.stride_bytes;
    for backing in [Backing::Slots, Backing::Mapped] {
        for budget in [
            stride * report.records,
            stride * report.records / 2,
            stride * cfg.top_k as u64,
        ] {
            let opts = StreamOptions {
                backing,
                budget_bytes: budget,
                queue_depth: 4,
            };
            let experts = open_pool(&store, &cfg, opts).unwrap();
            let mut m = Model::with_experts(&cfg, &ckpt, Box::new(experts)).unwrap();
            let o = m
                .generate(&r.prompt, NEW_TOKENS, &[], true, |_| {})
                .unwrap();
            assert_eq!(
                o.generated_ids, r.greedy,
                "{name} {backing:?} budget {budget}"
            );
            assert_eq!(
                o.prompt_logits, want.prompt_logits,
                "{name} {backing:?} budget {budget}"
            );
            let s = m.expert_stats();
            println!(
                "{name} pool {backing:?} budget {budget} B: hit rate {:.3}, {} B read",
                s.hit_rate(),
                s.bytes_read
            );
        }
    }
}

#[test]
fn qwen3_moe_through_the_expert_pool() {
    check_pool("qwen3_moe");
}

#[test]
fn mixtral_through_the_expert_pool() {
    check_pool("mixtral");
}

/// The transformers-5 fused layout, packed: the store reads the same as the
/// checkpoint's fused tensors, at every budget and on both backings.
#[test]
fn qwen3_moe_tied_fused_through_the_expert_pool() {
    check_pool("qwen3_moe_tied");
}

/// Qwen2-MoE: q/k/v bias, a shared expert gated by a sigmoid, a dense layer.
#[test]
fn qwen2_moe_matches_transformers() {
    check_against_reference("qwen2_moe");
}

#[test]
fn qwen2_moe_through_the_expert_pool() {
    check_pool("qwen2_moe");
}

/// DeepSeek-V3: latent attention with a low-rank query, YaRN RoPE with the
/// mscale softmax correction, grouped sigmoid routing with its correction
/// bias, two shared experts, a leading dense layer.
#[test]
fn deepseek_v3_matches_transformers() {
    check_against_reference("deepseek_v3");
}

#[test]
fn deepseek_v3_through_the_expert_pool() {
    check_pool("deepseek_v3");
}

/// DeepSeek-V3 as the hub ships it: FP8 E4M3 matrices with F32 block
/// scales (`quantization_config`, 16x16 blocks here), against transformers
/// in f32 on the dequantized weights; the packed store keeps the experts in
/// FP8 (half the bytes of BF16) and the engine dequantizes per block.
#[test]
fn deepseek_v3_fp8_matches_transformers() {
    check_against_reference("deepseek_v3_fp8");
}

#[test]
fn deepseek_v3_fp8_through_the_expert_pool() {
    check_pool("deepseek_v3_fp8");
}

/// Qwen3-MoE with YaRN (factor 4): the RoPE frequencies blend and cos/sin
/// carry the YaRN attention factor.
#[test]
fn qwen3_moe_yarn_matches_transformers() {
    check_against_reference("qwen3_moe_yarn");
}
