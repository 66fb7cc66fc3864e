//! Config counts the checkpoint contradicts, absurd or merely wrong, are
//! typed errors naming the field and what the checkpoint has, raised before
//! anything of their size is allocated; the packer never records a layer
//! count the tensors do not have.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use std::path::Path;

use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::config::bounds;
use flashtier_engine::store::PackError;
use flashtier_engine::{EngineError, ModelConfig};
use flashtier_pack::pack::plan_experts;
use serde_json::{Value, json};

use common::fixture;

/// A copy of fixture `name` (the safetensors linked, not copied) whose
/// config.json has `edits` applied.
fn edited(name: &str, edits: &[(&str, Value)]) -> tempfile::TempDir {
    let src = fixture(name);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (k, v) in edits {
        cfg[*k] = v.clone();
    }
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    std::os::unix::fs::symlink(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    dir
}

/// The engine's check of the edited fixture.
fn check(dir: &Path) -> Result<(), EngineError> {
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    bounds::check(&cfg, &Checkpoint::open(dir)?)
}

/// The field and the message of a mismatch.
fn mismatch(e: EngineError) -> (String, String) {
    let text = e.to_string();
    match e {
        EngineError::ConfigMismatch { field, .. } => (field, text),
        other => panic!("not a config mismatch: {other}"),
    }
}

#[test]
fn every_fixture_passes() {
    for name in [
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
        "deepseek_v3",
        "deepseek_v3_fp8",
    ] {
        check(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn a_layer_count_the_tensors_contradict_is_named() {
    for layers in [2u64, 4, 1_000] {
        let dir = edited("mixtral", &[("num_hidden_layers", json!(layers))]);
        let (field, text) = mismatch(check(dir.path()).unwrap_err());
        assert_eq!(field, "num_hidden_layers");
        assert!(text.contains(&format!("is {layers}")), "{text}");
        assert!(text.contains("3 layers"), "{text}");
    }
    // Absurd counts stop at the parser, before its per-layer list.
    for layers in [json!(1_000_000_000_000u64), json!(1u64 << 62)] {
        let dir = edited("mixtral", &[("num_hidden_layers", layers)]);
        match check(dir.path()).unwrap_err() {
            EngineError::Config { field, reason } => {
                assert_eq!(field, "num_hidden_layers");
                assert!(reason.contains("over the limit"), "{reason}");
            }
            other => panic!("{other}"),
        }
    }
}

/// A fixture, the config edits, the field the error names, and text its
/// message holds.
type Case<'a> = (&'a str, &'a [(&'a str, Value)], &'a str, &'a str);

#[test]
fn counts_are_held_against_the_tensors_that_carry_them() {
    // (fixture, config edit, field named, text the message holds)
    let cases: [Case<'_>; 9] = [
        (
            "mixtral",
            &[("vocab_size", json!(321))],
            "vocab_size",
            "model.embed_tokens.weight",
        ),
        (
            "mixtral",
            &[("hidden_size", json!(128))],
            "hidden_size",
            "model.embed_tokens.weight",
        ),
        (
            "mixtral",
            &[("num_local_experts", json!(1000))],
            "num_local_experts",
            "gate.weight",
        ),
        (
            "mixtral",
            &[("intermediate_size", json!(41))],
            "intermediate_size",
            "w1.weight",
        ),
        (
            "qwen3_moe",
            &[("num_attention_heads", json!(1_000_000))],
            "num_attention_heads",
            "q_proj",
        ),
        (
            "qwen3_moe",
            &[("intermediate_size", json!(97))],
            "intermediate_size",
            "layers.1.mlp.gate_proj",
        ),
        (
            "qwen2_moe",
            &[("shared_expert_intermediate_size", json!(50))],
            "shared_expert_intermediate_size",
            "shared_expert.gate_proj",
        ),
        (
            "deepseek_v3",
            &[("kv_lora_rank", json!(31))],
            "kv_lora_rank",
            "kv_a_proj_with_mqa",
        ),
        (
            "deepseek_v3",
            &[("first_k_dense_replace", json!(0))],
            "first_k_dense_replace",
            "layer 0 is sparse",
        ),
    ];
    for (name, edits, want_field, names) in cases {
        let dir = edited(name, edits);
        let (field, text) = mismatch(check(dir.path()).unwrap_err());
        assert_eq!(field, want_field, "{name} {edits:?}: {text}");
        assert!(text.contains(names), "{name} {edits:?}: {text}");
    }
    let dir = edited("deepseek_v3", &[("n_routed_experts", json!(32))]);
    let (field, _) = mismatch(check(dir.path()).unwrap_err());
    assert_eq!(field, "n_routed_experts");
}

/// The whole load path refuses before packing or loading anything: a store
/// cache that stays empty, a context limit over the KV cache's limit.
#[test]
fn loading_refuses_before_packing_or_allocating() {
    let cache = tempfile::tempdir().unwrap();
    let dir = edited("mixtral", &[("num_hidden_layers", json!(4))]);
    let err = common::load(dir.path(), cache.path())
        .map(drop)
        .unwrap_err();
    assert!(matches!(err, EngineError::ConfigMismatch { .. }), "{err}");
    assert!(
        !cache.path().join("stores").exists(),
        "nothing may be packed for a config the checkpoint contradicts"
    );
    let dir = edited(
        "mixtral",
        &[("max_position_embeddings", json!(1_000_000_000u64))],
    );
    let err = common::load(dir.path(), cache.path())
        .map(drop)
        .unwrap_err();
    match err {
        EngineError::TooLarge { unit, what, .. } => {
            assert_eq!(unit, "positions");
            assert!(what.contains("max_position_embeddings"), "{what}");
        }
        other => panic!("{other}"),
    }
}

/// The packer checks the layer count before planning: the manifest never
/// records a count the checkpoint does not have.
#[test]
fn the_packer_refuses_a_layer_count_the_tensors_contradict() {
    for layers in [json!(4), json!(2), json!(1_000_000_000_000u64)] {
        let dir = edited("mixtral", &[("num_hidden_layers", layers.clone())]);
        let src = flashtier_engine::checkpoint::files::CheckpointFiles::open(dir.path()).unwrap();
        match plan_experts(&src).unwrap_err() {
            PackError::Config { field, why, .. } => {
                assert_eq!(field, "num_hidden_layers");
                assert!(why.contains("3 layers"), "{layers}: {why}");
            }
            other => panic!("{layers}: {other}"),
        }
    }
}

/// `hidden_size` present but not a count says so; "missing" only when it is.
#[test]
fn a_wrong_type_is_not_called_missing() {
    let dir = edited("qwen3_moe", &[("hidden_size", json!("64"))]);
    let src = flashtier_engine::checkpoint::files::CheckpointFiles::open(dir.path()).unwrap();
    let text = plan_experts(&src).unwrap_err().to_string();
    assert!(
        text.contains("hidden_size") && text.contains("\"64\" is not a count"),
        "{text}"
    );
    assert!(!text.contains("missing"), "{text}");
    let err = ModelConfig::from_file(&dir.path().join("config.json")).unwrap_err();
    assert!(!err.to_string().contains("missing"), "{err}");
    let dir = edited("qwen3_moe", &[("hidden_size", Value::Null)]);
    let src = flashtier_engine::checkpoint::files::CheckpointFiles::open(dir.path()).unwrap();
    let text = plan_experts(&src).unwrap_err().to_string();
    assert!(text.contains("hidden_size: missing"), "{text}");
}

/// A safetensors length that disagrees with the shape names the byte counts
/// as numbers, not as Rust's `Some(16)`.
#[test]
fn header_errors_carry_no_debug_text() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), "{}").unwrap();
    let header = r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + 8, 0);
    std::fs::write(d.path().join("model.safetensors"), bytes).unwrap();
    let text = flashtier_engine::checkpoint::files::CheckpointFiles::open(d.path())
        .unwrap_err()
        .to_string();
    assert!(
        text.ends_with("tensor a: 8 bytes, but shape 2x2 of F32 needs 16"),
        "{text}"
    );
}
