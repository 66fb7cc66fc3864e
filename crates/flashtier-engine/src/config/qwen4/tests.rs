//! Qwen4-Exp config parsing: the fixture's config, the multimodal wrapper,
//! and a typed error naming the field for each value refused.

use serde_json::{Value, json};

use super::{LayerKind, Qwen4Config};
use crate::error::EngineError;

fn fixture_config() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/engine/qwen4_exp/config.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn field_of(v: &Value) -> String {
    match Qwen4Config::from_json(v) {
        Err(EngineError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn the_fixture_config_parses_as_transformers_reads_it() {
    let c = Qwen4Config::from_json(&fixture_config()).unwrap();
    use LayerKind::{Linear, Sparse};
    assert_eq!(c.layers, [Linear, Sparse, Linear, Sparse]);
    assert_eq!(
        (c.q_heads, c.kv_heads, c.head_dim, c.rope_dim),
        (4, 2, 16, 8)
    );
    assert_eq!(
        (c.hc_count, c.hc_lowrank, c.prefix.as_str()),
        (4, 16, "model")
    );
    let ple = c.ple.unwrap();
    assert_eq!(ple.layers, [0, 2]);
    assert_eq!(
        (ple.heads(), ple.row_dim(), ple.split_parts, ple.eos),
        (4, 8, 3, 2)
    );
    let qsa = c.qsa.unwrap();
    assert_eq!(
        (qsa.heads, qsa.blocks_kept(), qsa.compress_ratio),
        (2, 2, 2)
    );
    assert_eq!(
        (c.linear.k_heads, c.linear.v_heads, c.linear.sigmoid_gate),
        (2, 4, false)
    );
}

#[test]
fn the_wrapper_reads_its_text_config_and_skips_vision() {
    let text = fixture_config();
    let wrapped = json!({"model_type": "qwen4_exp", "text_config": text, "vision_config": {}});
    let c = Qwen4Config::from_json(&wrapped).unwrap();
    assert!(c.vision_skipped);
    assert_eq!(c.prefix, "model.language_model");
    let mut bad = wrapped.clone();
    bad["text_config"]["hc_count"] = json!(1);
    assert_eq!(field_of(&bad), "text_config.hc_count");
    assert_eq!(field_of(&json!({"model_type": "qwen4_exp"})), "text_config");
}

#[test]
fn bad_or_absurd_values_name_their_field() {
    let cases: [(&str, Value, &str); 14] = [
        (
            "linear_key_head_dim",
            json!(u32::MAX),
            "linear_num_key_heads",
        ),
        ("hidden_size", json!(u32::MAX), "hc_count"),
        ("hc_count", json!(1), "hc_count"),
        ("hc_count", json!(1_000_000), "hc_count"),
        ("num_hidden_layers", json!(1u64 << 40), "num_hidden_layers"),
        ("layer_types", json!(["linear_attention"]), "layer_types"),
        ("ple_layer_ids", json!([2]), "ple_layer_ids"),
        ("ple_layer_ids", json!([0]), "ple_layer_ids"),
        ("indexer_kv_heads", json!(2), "indexer_kv_heads"),
        ("indexer_budget", json!(5), "indexer_budget"),
        ("indexer_head_dim", json!(4), "indexer_head_dim"),
        (
            "ngram_vocab_size_base",
            json!(1u64 << 40),
            "ngram_vocab_size_base",
        ),
        ("ple_embed_dim", json!(30), "ple_embed_dim"),
        ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
    ];
    for (field, value, named) in cases {
        let mut v = fixture_config();
        v[field] = value;
        assert_eq!(field_of(&v), named, "{field}");
    }
    let mut v = fixture_config();
    v.as_object_mut().unwrap().remove("indexer_budget");
    assert_eq!(field_of(&v), "indexer_budget");
    let mut v = fixture_config();
    for f in [
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "indexer_budget",
    ] {
        v.as_object_mut().unwrap().remove(f);
    }
    v.as_object_mut().unwrap().remove("indexer_compress_ratio");
    assert_eq!(field_of(&v), "indexer_n_heads", "sparse layers without QSA");
    let mut v = fixture_config();
    v["eos_token_id"] = Value::Null;
    assert_eq!(field_of(&v), "eos_token_id");
    let mut v = fixture_config();
    v["rope_parameters"]["rope_type"] = json!("yarn");
    assert_eq!(field_of(&v), "rope_parameters.rope_type");
}

#[test]
fn layer_kinds_come_from_the_interval_or_the_real_spelling() {
    use LayerKind::{Linear, Sparse};
    let mut v = fixture_config();
    v.as_object_mut().unwrap().remove("layer_types");
    v["full_attention_interval"] = json!(2);
    assert_eq!(
        Qwen4Config::from_json(&v).unwrap().layers,
        [Linear, Sparse, Linear, Sparse]
    );
    v["full_attention_interval"] = json!(0);
    assert_eq!(field_of(&v), "full_attention_interval");
    // Without an interval every fourth layer is full (ple layer 3 stays linear).
    v.as_object_mut().unwrap().remove("full_attention_interval");
    assert_eq!(
        Qwen4Config::from_json(&v).unwrap().layers,
        [Linear, Linear, Linear, Sparse]
    );
    let mut v = fixture_config();
    v["layer_types"] = json!([
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention"
    ]);
    assert_eq!(
        Qwen4Config::from_json(&v).unwrap().layers,
        [Linear, Sparse, Linear, Sparse]
    );
    v["layer_types"][1] = json!("sliding_attention");
    assert_eq!(field_of(&v), "layer_types");
}
