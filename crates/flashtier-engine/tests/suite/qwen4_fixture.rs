//! Qwen4-Exp against HF transformers 5.17 (`tools/make_qwen4_fixtures.py`):
//! prompt logits within 1e-3, the same greedy tokens, and bit-identical
//! output at every expert budget on both pool backings, with the QSA
//! indexer dropping blocks and the PLE rows read from the split shards.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use std::path::Path;

use flashtier_engine::EngineError;
use flashtier_engine::config::qwen4::LayerKind;
use flashtier_engine::family::qwen4::Qwen4Model;
use flashtier_engine::load::LoadOptions;
use safetensors::Dtype;
use serde_json::Value;

use common::rewrite::{Tensors, wrap};
use common::{fixture, logit_rows, max_abs_diff, pack, reference, same_bits_at_every_budget};

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
    check_against_reference("qwen4_exp");
}

/// Tied embeddings, a sigmoid output gate, no top-k renormalisation, full
/// RoPE, 4-grams with one head each, hc_count 3, blocks of 4, an
/// `eos_token_id` list. (Its
/// random tied head makes greedy repeat one token: the logits, prompt and
/// decode, carry the check.)
#[test]
fn qwen4_exp_tied_variant_matches_transformers_at_every_budget() {
    check_against_reference("qwen4_exp_tied");
    check_decode_steps("qwen4_exp_tied");
}

/// Exact ties at the QSA indexer's keep/drop line: one index head, so
/// about half the blocks score exactly 0, and at three prompt queries
/// torch's `topk` keeps other zero-scoring blocks than the lowest indices
/// would (the fixture's generator searched for that, not for a margin).
/// The prompt also holds EOS twice.
#[test]
fn qwen4_exp_ties_at_the_indexer_line_match_transformers() {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen4_exp_ties").join("reference.json")).unwrap(),
    )
    .unwrap();
    let differs: u64 = v["indexer"]
        .as_object()
        .unwrap()
        .values()
        .map(|l| l["tie_queries_torch_differs"].as_u64().unwrap())
        .sum();
    assert!(
        differs >= 3,
        "{differs} tie queries where torch keeps other blocks"
    );
    let prompt: Vec<u64> = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(
        prompt.iter().filter(|&&t| t == 2).count() >= 2,
        "EOS inside the prompt"
    );
    check_against_reference("qwen4_exp_ties");
    check_decode_steps("qwen4_exp_ties");
}

fn check_against_reference(name: &str) {
    let dir = fixture(name);
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = report.out.clone();
    let mut model = Qwen4Model::open(&dir, &store, &LoadOptions::store(&store)).unwrap();
    let out = model.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap();
    let worst = max_abs_diff(&out.prompt_logits, &r.logits);
    println!("{name}: max abs logit error {worst:.3e}");
    assert!(
        worst <= MAX_ABS_ERR,
        "max abs logit error {worst} > {MAX_ABS_ERR}"
    );
    assert_eq!(
        out.generated_ids, r.greedy,
        "greedy tokens differ from transformers"
    );

    // The indexer really dropped blocks: as many as transformers' rule
    // gives for the prompt and the decode steps in each QSA layer, and the
    // fixture's count over its 28 positions matches the same rule.
    let cfg = model.config().clone();
    let qsa = cfg.qsa.clone().unwrap();
    let fed = r.prompt.len() + NEW_TOKENS - 1;
    let per_layer = dropped(fed, qsa.compress_ratio, qsa.blocks_kept());
    assert!(per_layer > 0);
    let sparse = cfg
        .layers
        .iter()
        .filter(|k| **k == LayerKind::Sparse)
        .count() as u64;
    assert_eq!(model.blocks_dropped(), sparse * per_layer);
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

    same_bits_at_every_budget(name, &report, cfg.top_k, &out, |opts| {
        let mut m = Qwen4Model::open(&dir, &store, opts).unwrap();
        let o = m.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap();
        (o, m.expert_stats())
    });
}

/// A copy of the `qwen4_exp` fixture in one safetensors file, its tensors
/// and config changed by `edit`.
fn rewritten(edit: impl FnOnce(&mut Tensors, &mut Value)) -> tempfile::TempDir {
    common::rewrite::rewritten(&fixture("qwen4_exp"), edit)
}

/// Pack `dir`'s experts and open it.
fn open(dir: &Path) -> Result<Qwen4Model, EngineError> {
    let report = pack(dir, dir);
    Qwen4Model::open(dir, &report.out, &LoadOptions::store(&report.out))
}

/// The fused transformers-5 layout: `mlp.experts.gate_up_proj` `[E, 2I, H]`
/// and `mlp.experts.down_proj` `[E, H, I]` per layer.
fn fuse_experts(t: &mut Tensors, layers: usize, experts: usize) {
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp.experts");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        let (mut gu_shape, mut d_shape) = (Vec::new(), Vec::new());
        for e in 0..experts {
            let g = t.remove(&format!("{p}.{e}.gate_proj.weight")).unwrap();
            let u = t.remove(&format!("{p}.{e}.up_proj.weight")).unwrap();
            let d = t.remove(&format!("{p}.{e}.down_proj.weight")).unwrap();
            gate_up.extend(g.2);
            gate_up.extend(u.2);
            down.extend(d.2);
            gu_shape = vec![experts, 2 * g.1[0], g.1[1]];
            d_shape = vec![experts, d.1[0], d.1[1]];
        }
        t.insert(
            format!("{p}.gate_up_proj"),
            (Dtype::BF16, gu_shape, gate_up),
        );
        t.insert(format!("{p}.down_proj"), (Dtype::BF16, d_shape, down));
    }
}

#[test]
fn the_fused_expert_layout_decodes_the_same_bits() {
    let r = reference(&fixture("qwen4_exp"));
    let hub = rewritten(|_, _| {});
    let fused = rewritten(|t, _| fuse_experts(t, 4, 8));
    let mut outs = Vec::new();
    for dir in [&hub, &fused] {
        let mut m = open(dir.path()).unwrap();
        outs.push(m.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap());
    }
    assert!(max_abs_diff(&outs[1].prompt_logits, &r.logits) <= MAX_ABS_ERR);
    assert_eq!(outs[1].generated_ids, r.greedy);
    assert_eq!(outs[0].prompt_logits, outs[1].prompt_logits);
}

#[test]
fn bad_tables_tokens_and_lengths_are_typed_errors() {
    let shard = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_1.weight";
    let dir = rewritten(|t, _| {
        t.remove(shard);
    });
    match open(dir.path()).unwrap_err() {
        EngineError::MissingTensor { name } => assert_eq!(name, shard),
        other => panic!("{other}"),
    }
    // Other primes: the shards hold another number of rows than the hash needs.
    // (Without the checkpoint's own head buffers, which would say it first.)
    let dir = rewritten(|t, c| {
        t.retain(|n, _| !n.contains("ngram_heads_"));
        c["ngram_vocab_size_base"] = 90.into();
    });
    match open(dir.path()).unwrap_err() {
        EngineError::ConfigMismatch { field, found, .. } => {
            assert_eq!(field, "ngram_vocab_size_base");
            assert!(found.contains("432 rows"), "{found}");
        }
        other => panic!("{other}"),
    }
    // Another seed: the checkpoint's own multipliers disagree.
    let dir = rewritten(|_, c| c["seed"] = 99.into());
    match open(dir.path()).unwrap_err() {
        EngineError::ConfigMismatch { field, found, .. } => {
            assert_eq!(field, "seed");
            assert!(found.contains("layer_multipliers"), "{found}");
        }
        other => panic!("{other}"),
    }
    let dir = rewritten(|_, c| c["max_position_embeddings"] = 16.into());
    let mut m = open(dir.path()).unwrap();
    let r = reference(&fixture("qwen4_exp"));
    match m.generate(&r.prompt, NEW_TOKENS, &[], false).unwrap_err() {
        EngineError::ContextFull { len, max } => assert_eq!((len, max), (27, 16)),
        other => panic!("{other}"),
    }
    match m.forward(&[3, 256], false).unwrap_err() {
        EngineError::TokenOutOfRange { id, vocab } => assert_eq!((id, vocab), (256, 256)),
        other => panic!("{other}"),
    }
}

/// Each decode step's logits (the cached states: conv, recurrent, PLE
/// context and short conv, KV and index keys) against transformers'
/// full recompute of the sequence so far.
#[test]
fn decode_steps_match_the_full_recompute_of_transformers() {
    check_decode_steps("qwen4_exp");
}

fn check_decode_steps(name: &str) {
    let dir = fixture(name);
    let r = reference(&dir);
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let want = logit_rows(&v, "decode_logits");
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let mut m = Qwen4Model::open(&dir, &report.out, &LoadOptions::store(&report.out)).unwrap();
    let mut got = vec![m.forward(&r.prompt, false).unwrap()];
    for &t in &r.greedy[..NEW_TOKENS - 1] {
        got.push(m.forward(&[t], false).unwrap());
    }
    let worst = max_abs_diff(&got, &want);
    println!("{name} decode steps: max abs logit error {worst:.3e}");
    assert!(worst <= MAX_ABS_ERR, "decode logit error {worst}");
}

/// The PLE rows' batch read: the same bytes as one read at a time, in the
/// order asked; a range past its tensor is refused, naming it.
#[test]
fn batched_row_reads_equal_single_reads_and_name_a_bad_range() {
    use flashtier_engine::checkpoint::Checkpoint;
    let ckpt = Checkpoint::open(&fixture("qwen4_exp")).unwrap();
    let shard =
        |k: usize| format!("model.layers.0.ple.ple_embedding.ngram_embedding.shard_{k}.weight");
    let (a, b) = (shard(2), shard(0));
    // 144 rows of 8 BF16 values (16 bytes) per shard.
    let ranges = [
        (a.as_str(), 16 * 143, 16),
        (b.as_str(), 0, 16),
        (a.as_str(), 16 * 7, 32),
    ];
    let batch = ckpt.read_ranges(&ranges).unwrap();
    for (got, &(name, start, len)) in batch.iter().zip(&ranges) {
        assert_eq!(&got[..], &ckpt.read_range(name, start, len).unwrap()[..]);
        assert_eq!(got.len(), len);
    }
    let bad = [(b.as_str(), 0, 16), (a.as_str(), 16 * 144, 16)];
    match ckpt.read_ranges(&bad).unwrap_err() {
        EngineError::TensorRange {
            name,
            start,
            tensor_bytes,
            ..
        } => assert_eq!(
            (name.as_str(), start, tensor_bytes),
            (a.as_str(), 2304, 2304)
        ),
        other => panic!("{other}"),
    }
}

/// The packer reads the wrapper's experts (counts from `text_config`,
/// names under `model.language_model.`): the same records as the text
/// checkpoint's, and the model decodes the same bits from them.
#[test]
fn the_wrapper_layout_packs_and_decodes_the_same_bits() {
    let text = rewritten(|_, _| {});
    let wrapped = rewritten(wrap);
    let a = pack(text.path(), text.path());
    let b = pack(wrapped.path(), wrapped.path());
    assert_eq!((a.records, a.stride_bytes), (b.records, b.stride_bytes));
    let (sa, sb) = (
        flashtier_format::Store::open(&a.out).unwrap(),
        flashtier_format::Store::open(&b.out).unwrap(),
    );
    assert_eq!(sa.manifest().keys, sb.manifest().keys);
    for i in 0..sa.record_count() {
        assert_eq!(
            sa.checksum(i).unwrap(),
            sb.checksum(i).unwrap(),
            "record {i}"
        );
    }
    // A store of the text checkpoint does not pair with the wrapper.
    let err = Qwen4Model::open(wrapped.path(), &a.out, &LoadOptions::store(&a.out)).unwrap_err();
    assert!(err.to_string().contains("does not belong"), "{err}");
    let r = reference(&fixture("qwen4_exp"));
    let mut outs = Vec::new();
    for (dir, store) in [(&text, &a.out), (&wrapped, &b.out)] {
        let mut m = Qwen4Model::open(dir.path(), store, &LoadOptions::store(store)).unwrap();
        outs.push(m.generate(&r.prompt, NEW_TOKENS, &[], true).unwrap());
    }
    assert_eq!(outs[1].generated_ids, r.greedy);
    assert_eq!(outs[0].prompt_logits, outs[1].prompt_logits);
}

/// A wrapper holding a tensor both under `model.language_model.` and
/// under the name its text part would give it is refused, naming it.
#[test]
fn a_wrapper_whose_text_names_collide_is_a_typed_error() {
    let dir = rewritten(|t, c| {
        wrap(t, c);
        let v = t["model.language_model.embed_tokens.weight"].clone();
        t.insert("model.embed_tokens.weight".into(), v);
    });
    let store = dir.path().join("experts.ftstore");
    let err = flashtier_pack::pack::pack_experts(
        &flashtier_pack::pack::PackOptions::new(dir.path(), &store),
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("model.embed_tokens.weight"), "{err}");
    assert!(!store.exists());
}

/// Inside the wrapper, config errors of the load and of the packer name
/// the field as it sits in `config.json`: `text_config.<field>`.
#[test]
fn a_wrappers_config_errors_name_the_text_config_field() {
    // The checkpoint's own multipliers disagree with another seed (load).
    let dir = rewritten(|t, c| {
        c["seed"] = 99.into();
        wrap(t, c);
    });
    match open(dir.path()).unwrap_err() {
        EngineError::ConfigMismatch { field, found, .. } => {
            assert_eq!(field, "text_config.seed");
            assert!(found.contains("layer_multipliers"), "{found}");
        }
        other => panic!("{other}"),
    }
    // A layer count the tensors contradict (the packer's check).
    let dir = rewritten(|t, c| {
        c["num_hidden_layers"] = 3.into();
        wrap(t, c);
    });
    let src = flashtier_engine::checkpoint::files::CheckpointFiles::open(dir.path()).unwrap();
    let err = flashtier_pack::pack::plan_experts(&src).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("field text_config.num_hidden_layers:"),
        "{text}"
    );
    let packed = flashtier_pack::pack::pack_experts(
        &flashtier_pack::pack::PackOptions::new(dir.path(), &dir.path().join("e.ftstore")),
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(packed.contains("text_config.num_hidden_layers"), "{packed}");
}
