//! Qwen4-Exp against HF transformers 5.17 (`tools/make_qwen4_fixtures.py`):
//! prompt logits within 1e-3, the same greedy tokens, and bit-identical
//! output at every expert budget on both pool backings, with the QSA
//! indexer dropping blocks and the PLE rows read from the split shards.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use flashtier::experts::Backing;
use flashtier_engine::family::qwen4::Qwen4Model;
use flashtier_engine::load::LoadOptions;

use common::{fixture, max_abs_diff, pack, reference};

const NEW_TOKENS: usize = 8;
const MAX_ABS_ERR: f32 = 1e-3;

/// Blocks the indexer drops over queries at positions `0..positions`, per
/// layer (`ratio` tokens a block, `kept` blocks kept).
fn dropped(positions: usize, ratio: usize, kept: usize) -> u64 {
    (0..positions)
        .map(|t| ((t + 1) / ratio).saturating_sub(kept) as u64)
        .sum()
}

#[test]
fn qwen4_exp_matches_transformers_at_every_budget() {
    let dir = fixture("qwen4_exp");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = report.out.clone();
    let mut model = Qwen4Model::open(&dir, &store, &LoadOptions::store(&store)).unwrap();
    let out = model.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap();
    let worst = max_abs_diff(&out.prompt_logits, &r.logits);
    println!("qwen4_exp: max abs logit error {worst:.3e}");
    assert!(
        worst <= MAX_ABS_ERR,
        "max abs logit error {worst} > {MAX_ABS_ERR}"
    );
    assert_eq!(
        out.generated_ids, r.greedy,
        "greedy tokens differ from transformers"
    );

    // The indexer really dropped blocks: as many as transformers' rule
    // gives for the prompt and the decode steps (2 QSA layers), and the
    // fixture's count over its 28 positions matches the same rule.
    let cfg = model.config().clone();
    let qsa = cfg.qsa.clone().unwrap();
    let fed = r.prompt.len() + NEW_TOKENS - 1;
    let per_layer = dropped(fed, qsa.compress_ratio, qsa.blocks_kept());
    assert!(per_layer > 0);
    assert_eq!(model.blocks_dropped(), 2 * per_layer);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let want = v["indexer"]["1"]["blocks_dropped"].as_u64().unwrap();
    assert_eq!(
        dropped(fed + 1, qsa.compress_ratio, qsa.blocks_kept()),
        want
    );
    // One row per head, PLE layer and token fed.
    let ple = cfg.ple.clone().unwrap();
    assert_eq!(
        model.ple_rows_read(),
        (fed * ple.heads() * ple.layers.len()) as u64
    );

    let stride = report.stride_bytes;
    let all = stride * report.records;
    for backing in [Backing::Slots, Backing::Mapped] {
        for budget in [all, all / 2, stride * cfg.top_k as u64] {
            let mut opts = LoadOptions::store(&store).budget(budget);
            opts.backing = backing;
            opts.queue_depth = 4;
            let mut m = Qwen4Model::open(&dir, &store, &opts).unwrap();
            let o = m.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap();
            let what = format!("{backing:?} budget {budget}");
            assert_eq!(o.generated_ids, out.generated_ids, "{what}: tokens changed");
            assert_eq!(o.prompt_logits, out.prompt_logits, "{what}: logits changed");
            let s = m.expert_stats();
            println!(
                "{what} B: hit rate {:.3}, {} B read",
                s.hit_rate(),
                s.bytes_read
            );
            if budget == stride * cfg.top_k as u64 && backing == Backing::Slots {
                assert!(
                    s.misses > 0 && s.bytes_read >= s.misses * stride,
                    "{what}: {s:?}"
                );
            }
        }
    }
}
