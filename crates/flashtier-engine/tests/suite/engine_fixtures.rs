//! The engine against HF transformers: prompt logits within 1e-3 and the
//! same greedy tokens on the fixtures `tools/make_fixtures.py` made, and
//! bit-identical output at every expert budget on both pool backings.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use flashtier_engine::load::{LoadOptions, load_cpu};

use common::{fixture, max_abs_diff, pack, reference, same_bits_at_every_budget};

const NEW_TOKENS: usize = 8;
const MAX_ABS_ERR: f32 = 1e-3;

fn check_against_reference(name: &str) {
    let dir = fixture(name);
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = report.out.clone();
    let mut model = load_cpu(&dir, &LoadOptions::store(&store)).unwrap();
    let mut streamed = Vec::new();
    let out = model
        .generate(&r.prompt, NEW_TOKENS, &[], true, |t| streamed.push(t))
        .unwrap();
    let worst = max_abs_diff(&out.prompt_logits, &r.logits);
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

    // Every budget, from all records down to one token's top-k, on both
    // backings: the same bits.
    let top_k = model.config().top_k;
    same_bits_at_every_budget(name, &report, top_k, &out, |opts| {
        let mut m = load_cpu(&dir, opts).unwrap();
        let o = m
            .generate(&r.prompt, NEW_TOKENS, &[], true, |_| {})
            .unwrap();
        (o, m.expert_stats())
    });
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_against_reference("qwen3_moe");
}

/// Tied embeddings, the transformers-5 fused expert layout, sharded files.
#[test]
fn qwen3_moe_tied_fused_sharded_matches_transformers() {
    check_against_reference("qwen3_moe_tied");
}

#[test]
fn mixtral_matches_transformers() {
    check_against_reference("mixtral");
}

/// Qwen2-MoE: q/k/v bias, a shared expert gated by a sigmoid, a dense layer.
#[test]
fn qwen2_moe_matches_transformers() {
    check_against_reference("qwen2_moe");
}

/// DeepSeek-V3: latent attention with a low-rank query, YaRN RoPE with the
/// mscale softmax correction, grouped sigmoid routing with its correction
/// bias, two shared experts, a leading dense layer.
#[test]
fn deepseek_v3_matches_transformers() {
    check_against_reference("deepseek_v3");
}

/// DeepSeek-V3 as the hub ships it: FP8 E4M3 matrices with F32 block
/// scales (`quantization_config`, 16x16 blocks here), against transformers
/// in f32 on the dequantized weights; the packed store keeps the experts in
/// FP8 (half the bytes of BF16) and the engine dequantizes per block.
#[test]
fn deepseek_v3_fp8_matches_transformers() {
    check_against_reference("deepseek_v3_fp8");
}

/// Qwen3-MoE with YaRN (factor 4): the RoPE frequencies blend and cos/sin
/// carry the YaRN attention factor.
#[test]
fn qwen3_moe_yarn_matches_transformers() {
    check_against_reference("qwen3_moe_yarn");
}

/// A plain checkpoint runs through the store cache: packed on first use,
/// reused (not packed again) on the second, with the same output.
#[test]
fn plain_checkpoints_pack_once_into_the_store_cache() {
    use flashtier_pack::cache::{CachedStore, StoreCache};
    let dir = fixture("mixtral");
    let r = reference(&dir);
    let cache = tempfile::tempdir().unwrap();
    let sc = StoreCache::at(cache.path());
    let first = sc.ensure(&dir, &|_, _| {}).unwrap();
    assert!(matches!(first, CachedStore::Packed(_)), "{first:?}");
    let again = sc.ensure(&dir, &|_, _| {}).unwrap();
    assert!(matches!(again, CachedStore::Reused(_)), "{again:?}");
    assert_eq!(first.path(), again.path());
    assert!(first.path().starts_with(cache.path().join("stores")));
    let mut m = common::load(&dir, cache.path()).unwrap();
    let o = m
        .generate(&r.prompt, NEW_TOKENS, &[], false, |_| {})
        .unwrap();
    assert_eq!(o.generated_ids, r.greedy);
}
