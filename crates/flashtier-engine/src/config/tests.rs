use serde_json::{Value, json};

use super::*;
use crate::error::EngineError;

/// A Qwen3-MoE config in transformers 4.x spelling.
fn qwen_v4() -> Value {
    json!({
        "model_type": "qwen3_moe", "vocab_size": 384, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 2,
        "mlp_only_layers": [3], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "attention_bias": false, "use_sliding_window": false,
        "tie_word_embeddings": false, "max_position_embeddings": 128
    })
}

/// The same model in transformers 5.x spelling.
fn qwen_v5() -> Value {
    let mut v = qwen_v4();
    let o = v.as_object_mut().unwrap();
    let theta = o.remove("rope_theta").unwrap();
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": theta}),
    );
    let n = o.remove("num_experts").unwrap();
    o.insert("num_local_experts".into(), n);
    o.insert("head_dim".into(), json!(16));
    v
}

fn field_of(err: EngineError) -> String {
    match err {
        EngineError::Config { field, .. } => field,
        other => panic!("not a config error: {other}"),
    }
}

fn with(mut v: Value, key: &str, val: Value) -> Value {
    v.as_object_mut().unwrap().insert(key.into(), val);
    v
}

#[test]
fn v4_and_v5_spellings_agree() {
    let a = ModelConfig::from_json(&qwen_v4()).unwrap();
    let b = ModelConfig::from_json(&qwen_v5()).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        a.head_dim, 16,
        "derived from hidden_size / num_attention_heads"
    );
    assert_eq!(a.num_experts, 8);
    assert_eq!(a.rope_theta, 10000.0);
    // decoder_sparse_step 2: layers 1 and 3; mlp_only_layers removes 3.
    assert_eq!(a.sparse_layers, vec![false, true, false, false]);
    assert!(a.qk_norm && a.norm_topk_prob && !a.tie_word_embeddings);
}

#[test]
fn mixtral_defaults() {
    let v = json!({
        "model_type": "mixtral", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "head_dim": null, "sliding_window": null, "tie_word_embeddings": true
    });
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(c.arch, Arch::Mixtral);
    assert_eq!((c.head_dim, c.expert_intermediate), (16, 40));
    assert!(c.norm_topk_prob && !c.qk_norm && c.tie_word_embeddings);
    assert_eq!(c.sparse_layers, vec![true, true]);
    assert_eq!(c.sliding_window, None);
    let c = ModelConfig::from_json(&with(v, "sliding_window", json!(4096))).unwrap();
    assert_eq!(c.sliding_window, Some(4096));
}

#[test]
fn unsupported_values_name_their_field() {
    let cases = [
        (with(qwen_v4(), "model_type", json!("llama")), "model_type"),
        (with(qwen_v4(), "hidden_act", json!("gelu")), "hidden_act"),
        (
            with(qwen_v4(), "attention_bias", json!(true)),
            "attention_bias",
        ),
        (
            with(qwen_v4(), "use_sliding_window", json!(true)),
            "use_sliding_window",
        ),
        (
            with(qwen_v4(), "decoder_sparse_step", json!(0)),
            "decoder_sparse_step",
        ),
        (
            with(qwen_v4(), "mlp_only_layers", json!([9])),
            "mlp_only_layers",
        ),
        (
            with(qwen_v4(), "num_key_value_heads", json!(3)),
            "num_key_value_heads",
        ),
        (
            with(qwen_v4(), "num_experts_per_tok", json!(9)),
            "num_experts_per_tok",
        ),
        (
            with(qwen_v4(), "num_local_experts", json!(4)),
            "num_experts",
        ),
        (with(qwen_v4(), "hidden_size", json!("64")), "hidden_size"),
        (
            with(
                qwen_v4(),
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 4.0}),
            ),
            "rope_scaling",
        ),
        (
            with(
                qwen_v5(),
                "rope_parameters",
                json!({"rope_type": "dynamic", "rope_theta": 1.0}),
            ),
            "rope_parameters.rope_type",
        ),
        (
            // YaRN without its original context length.
            with(
                qwen_v5(),
                "rope_parameters",
                json!({"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}),
            ),
            "rope_parameters",
        ),
        (with(qwen_v4(), "rope_theta", json!(-1.0)), "rope_theta"),
        (
            with(qwen_v4(), "shared_expert_intermediate_size", json!(128)),
            "shared_expert_intermediate_size",
        ),
    ];
    for (v, field) in cases {
        assert_eq!(field_of(ModelConfig::from_json(&v).unwrap_err()), field);
    }
    let mut missing = qwen_v4();
    missing
        .as_object_mut()
        .unwrap()
        .remove("moe_intermediate_size");
    assert_eq!(
        field_of(ModelConfig::from_json(&missing).unwrap_err()),
        "moe_intermediate_size"
    );
    let mut no_experts = qwen_v4();
    no_experts.as_object_mut().unwrap().remove("num_experts");
    assert_eq!(
        field_of(ModelConfig::from_json(&no_experts).unwrap_err()),
        "num_experts"
    );
}

#[test]
fn odd_derived_head_dim_is_rejected() {
    let v = with(
        with(qwen_v4(), "hidden_size", json!(60)),
        "num_attention_heads",
        json!(4),
    );
    assert_eq!(
        field_of(ModelConfig::from_json(&v).unwrap_err()),
        "head_dim"
    );
}

/// Qwen2-MoE in the 4.x spelling (no `qkv_bias`: the bias is always there)
/// and the 5.x one (`qkv_bias`, `rope_parameters`, `sliding_window: 0` with
/// `use_sliding_window: false`).
#[test]
fn qwen2_moe_spellings_and_shared_expert() {
    let v4 = with(
        with(qwen_v4(), "model_type", json!("qwen2_moe")),
        "shared_expert_intermediate_size",
        json!(48),
    );
    let a = ModelConfig::from_json(&v4).unwrap();
    assert_eq!(a.arch, Arch::Qwen2Moe);
    assert!(a.qkv_bias && !a.qk_norm);
    assert_eq!(a.shared_expert_intermediate, Some(48));
    assert_eq!(a.sparse_layers, vec![false, true, false, false]);
    let mut v5 = with(
        with(v4.clone(), "qkv_bias", json!(true)),
        "sliding_window",
        json!(0),
    );
    let o = v5.as_object_mut().unwrap();
    let theta = o.remove("rope_theta").unwrap();
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": theta}),
    );
    assert_eq!(ModelConfig::from_json(&v5).unwrap(), a);
    // No shared expert (0 or absent), no bias.
    let plain = with(
        with(v4.clone(), "shared_expert_intermediate_size", json!(0)),
        "qkv_bias",
        json!(false),
    );
    let p = ModelConfig::from_json(&plain).unwrap();
    assert_eq!((p.shared_expert_intermediate, p.qkv_bias), (None, false));
    // Sliding windows and DeepSeek's shared experts are not implemented.
    for (field, val) in [
        ("use_sliding_window", json!(true)),
        ("n_shared_experts", json!(2)),
    ] {
        let e = ModelConfig::from_json(&with(v4.clone(), field, val)).unwrap_err();
        assert_eq!(field_of(e), field);
    }
    // Qwen3 keeps refusing a shared expert it would not run.
    let e = ModelConfig::from_json(&with(
        qwen_v4(),
        "shared_expert_intermediate_size",
        json!(48),
    ))
    .unwrap_err();
    assert_eq!(field_of(e), "shared_expert_intermediate_size");
    // The hub's FP8 quantization.
    let fp8 = with(
        deepseek_hub(),
        "quantization_config",
        json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [128, 128]}),
    );
    assert_eq!(
        ModelConfig::from_json(&fp8).unwrap().fp8_block,
        Some([128, 128])
    );
    assert_eq!(p.fp8_block, None);
}

/// DeepSeek-V3 as the hub's config.json spells it (transformers 4.x:
/// `rope_scaling` with `type: yarn`, `topk_method`, `scoring_func`, no
/// `head_dim`), and the refusals that keep it honest.
fn deepseek_hub() -> Value {
    json!({
        "model_type": "deepseek_v3", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
        "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": true, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    })
}

#[test]
fn deepseek_v3_hub_config() {
    let c = ModelConfig::from_json(&deepseek_hub()).unwrap();
    assert_eq!(c.arch, Arch::DeepseekV3);
    let m = c.mla.clone().unwrap();
    assert_eq!(
        (m.qk_head_dim(), m.v_head_dim, m.q_lora_rank),
        (192, 128, Some(48))
    );
    assert!(m.rope_interleave, "DeepSeek's default");
    // The cache holds 192-wide heads (values zero-padded), one per query head.
    assert_eq!((c.head_dim, c.num_kv_heads, c.rope_dim), (192, 4, 64));
    assert_eq!(c.sparse_layers, vec![false, true, true, true]);
    assert_eq!(c.shared_expert_intermediate, Some(24));
    assert!(!c.shared_expert_gated && c.norm_topk_prob);
    assert_eq!(
        c.routing,
        Routing::SigmoidGroups {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5
        }
    );
    let y = c.yarn.clone().unwrap();
    assert_eq!((y.factor, y.attention_factor), (40.0, 1.0));
    // DeepSeek-V3's softmax scale: 192^-0.5 * (0.1 ln 40 + 1)^2.
    let m = 0.1 * 40f64.ln() + 1.0;
    assert!((c.attention_scale() - m * m / 192f64.sqrt()).abs() < 1e-12);
    // YaRN keeps the fastest frequency and divides the slowest by the factor.
    let f = c.rope_inv_freq();
    assert_eq!(f.len(), 32);
    assert_eq!(f[0], 1.0);
    let plain_last = 1.0 / 10000f32.powf(62.0 / 64.0);
    assert!((f[31] - plain_last / 40.0).abs() < 1e-12);
    // A plain q_proj and non-interleaved RoPE are read too.
    let plain = with(
        with(deepseek_hub(), "q_lora_rank", Value::Null),
        "rope_interleave",
        json!(false),
    );
    let p = ModelConfig::from_json(&plain).unwrap();
    assert_eq!(
        p.mla.as_ref().map(|m| (m.q_lora_rank, m.rope_interleave)),
        Some((None, false))
    );
}

#[test]
fn deepseek_v3_refusals_name_their_field() {
    let cases = [
        (
            with(deepseek_hub(), "topk_method", json!("greedy")),
            "topk_method",
        ),
        (
            with(deepseek_hub(), "scoring_func", json!("softmax")),
            "scoring_func",
        ),
        (
            with(deepseek_hub(), "moe_layer_freq", json!(2)),
            "moe_layer_freq",
        ),
        (with(deepseek_hub(), "n_group", json!(5)), "n_group"),
        (with(deepseek_hub(), "topk_group", json!(5)), "topk_group"),
        (
            with(deepseek_hub(), "num_key_value_heads", json!(1)),
            "num_key_value_heads",
        ),
        (
            with(deepseek_hub(), "qk_rope_head_dim", json!(63)),
            "qk_rope_head_dim",
        ),
        (
            with(
                deepseek_hub(),
                "quantization_config",
                json!({"quant_method": "fp8"}),
            ),
            "quantization_config.weight_block_size",
        ),
        (
            with(
                deepseek_hub(),
                "quantization_config",
                json!({"quant_method": "awq"}),
            ),
            "quantization_config",
        ),
        (
            with(
                deepseek_hub(),
                "quantization_config",
                json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            ),
            "quantization_config.fmt",
        ),
        (
            with(
                deepseek_hub(),
                "rope_scaling",
                json!({"type": "dynamic", "factor": 2.0}),
            ),
            "rope_scaling",
        ),
        (
            with(
                qwen_v4(),
                "rope_scaling",
                // YaRN is accepted, but needs its original context length.
                json!({"type": "yarn", "factor": 2.0}),
            ),
            "rope_scaling",
        ),
    ];
    for (v, field) in cases {
        let got = field_of(ModelConfig::from_json(&v).unwrap_err());
        assert_eq!(got, field, "{v}");
    }
}

/// Absurd counts are refused by the parser, before its own per-layer list
/// or a product of two counts is computed; a field of the wrong type says
/// so instead of "missing".
#[test]
fn absurd_counts_and_wrong_types_are_named() {
    let reason_of = |v: &Value| match ModelConfig::from_json(v).unwrap_err() {
        EngineError::Config { field, reason } => (field, reason),
        other => panic!("not a config error: {other}"),
    };
    for (field, value) in [
        ("num_hidden_layers", json!(1_000_000_000_000u64)),
        ("num_hidden_layers", json!(1u64 << 62)),
        ("hidden_size", json!(1u64 << 62)),
        ("vocab_size", json!(1_000_000_000_000u64)),
        ("num_experts", json!(1u64 << 62)),
        ("max_position_embeddings", json!(1u64 << 62)),
    ] {
        let (got, reason) = reason_of(&with(qwen_v4(), field, value));
        assert_eq!(got, field);
        assert!(reason.contains("over the limit"), "{field}: {reason}");
    }
    let (_, reason) = reason_of(&with(qwen_v4(), "num_hidden_layers", json!(70_000)));
    assert!(reason.contains("65536 layers"), "{reason}");
    for bad in [
        json!("64"),
        json!(64.5),
        json!(-3),
        json!(1e30),
        json!(true),
    ] {
        let (field, reason) = reason_of(&with(qwen_v4(), "hidden_size", bad.clone()));
        assert_eq!(field, "hidden_size");
        assert!(
            reason.contains("is not a count") && !reason.contains("missing"),
            "{bad}: {reason}"
        );
    }
    let (_, reason) = reason_of(&with(qwen_v4(), "hidden_size", json!(0)));
    assert_eq!(reason, "must be positive");
    let mut gone = qwen_v4();
    gone.as_object_mut().unwrap().remove("hidden_size");
    assert_eq!(reason_of(&gone).1, "missing");
    // DeepSeek's shared width is n_shared_experts x moe_intermediate_size.
    let v = with(
        with(deepseek_hub(), "n_shared_experts", json!(u32::MAX)),
        "moe_intermediate_size",
        json!(u32::MAX),
    );
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(
        c.shared_expert_intermediate,
        Some(u32::MAX as usize * u32::MAX as usize)
    );
}

/// A step's rows: the device's choice in whole chunks, never past the
/// widest activation's bound, never below one chunk.
#[test]
fn step_rows_keep_the_widest_activation_within_its_bound() {
    use crate::config::bounds::{MAX_ACTIVATION_BYTES, PREFILL_CHUNK, step_rows};
    let vocab = |v: u64| ModelConfig::from_json(&with(qwen_v4(), "vocab_size", json!(v))).unwrap();
    let small = vocab(384);
    assert_eq!(step_rows(&small, 1024), 1024);
    assert_eq!(step_rows(&small, 1000), 768, "rounded down to whole chunks");
    assert_eq!(step_rows(&small, 1), PREFILL_CHUNK, "at least one chunk");
    // 262,144 logits of f32 a row: 1 GiB is 1024 rows exactly.
    assert_eq!(step_rows(&vocab(262_144), 4096), 1024);
    let past = vocab(262_145);
    assert_eq!(step_rows(&past, 4096), 768);
    const { assert!(768 * 262_145 * 4 <= MAX_ACTIVATION_BYTES) };
    // The bound's own floor: a vocabulary whose chunk just fits.
    assert_eq!(step_rows(&vocab(1 << 20), 4096), PREFILL_CHUNK);
}
