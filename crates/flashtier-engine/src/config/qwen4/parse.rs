//! Reading the fields of a Qwen4-Exp text config, in a fixed order (the
//! layers, the unsupported fields, attention, experts, hyper-connections,
//! QSA, PLE), so a config with several faults is named by the same first
//! one every time.

use serde_json::{Map, Value};

use super::super::bounds;
use super::super::fields::Fields;
use super::super::parse::{eos_ids, layer_count};
use super::{
    LayerKind, LinearAttn, MAX_HC_COUNT, MAX_NGRAM_HEADS, MAX_NGRAM_SIZE, MAX_NGRAM_VOCAB_BASE,
    Ple, Qsa, Qwen4Config, in_scope,
};
use crate::error::EngineError;

pub(super) fn parse_text(
    obj: &Map<String, Value>,
    scope: &str,
    prefix: &str,
) -> Result<Qwen4Config, EngineError> {
    let c = Fields(obj);
    text_fields(&c, prefix).map_err(|e| in_scope(e, scope))
}

fn text_fields(c: &Fields<'_>, prefix: &str) -> Result<Qwen4Config, EngineError> {
    let hidden_size = c.positive("hidden_size")?;
    let num_layers = layer_count(c)?;
    let layers = layer_kinds(c, num_layers)?;
    check_supported(c)?;
    let (q_heads, kv_heads, head_dim, rope_dim, rope_theta) = attention(c)?;
    let num_experts = c.positive("num_experts")?;
    let top_k = c.positive("num_experts_per_tok")?;
    if top_k > num_experts {
        return Err(EngineError::config(
            "num_experts_per_tok",
            format!("{top_k} exceeds the {num_experts} experts"),
        ));
    }
    let hc_count = c.positive("hc_count")?;
    if !(2..=MAX_HC_COUNT).contains(&hc_count) {
        return Err(EngineError::config(
            "hc_count",
            format!("{hc_count} is outside 2..={MAX_HC_COUNT}"),
        ));
    }
    let eos_token_ids = eos_ids(c)?;
    let qsa = qsa(c, rope_dim)?;
    if qsa.is_none() && layers.contains(&LayerKind::Sparse) {
        return Err(EngineError::config(
            "indexer_n_heads",
            "missing (qwen_sparse_attention layers need the QSA indexer)",
        ));
    }
    let ple = ple(c, &layers, hidden_size, eos_token_ids.first().copied())?;
    let cfg = Qwen4Config {
        prefix: prefix.to_string(),
        vision_skipped: false,
        vocab_size: c.positive("vocab_size")?,
        hidden_size,
        layers,
        q_heads,
        kv_heads,
        head_dim,
        rope_dim,
        rope_theta,
        linear: linear(c)?,
        num_experts,
        top_k,
        expert_intermediate: c.positive("moe_intermediate_size")?,
        shared_intermediate: c.positive("shared_expert_intermediate_size")?,
        norm_topk_prob: c.opt_bool("norm_topk_prob")?.unwrap_or(true),
        hc_count,
        hc_lowrank: c.positive("hc_lowrank")?,
        ple,
        qsa,
        rms_norm_eps: c.float("rms_norm_eps")? as f32,
        max_positions: c.opt_positive("max_position_embeddings")?.unwrap_or(4096),
        tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        eos_token_ids,
    };
    check_widths(&cfg)?;
    Ok(cfg)
}

/// Every width the forward pass multiplies out (heads times head width,
/// streams times hidden) is a count too, so sums of a few of them cannot
/// overflow; the n-gram heads of all PLE layers are at most
/// [`MAX_NGRAM_HEADS`] (their primes are searched at load).
fn check_widths(cfg: &Qwen4Config) -> Result<(), EngineError> {
    let l = &cfg.linear;
    let mut widths = vec![
        (
            "num_attention_heads",
            2 * cfg.q_heads as u128 * cfg.head_dim as u128,
        ),
        (
            "num_key_value_heads",
            cfg.kv_heads as u128 * cfg.head_dim as u128,
        ),
        ("linear_num_key_heads", l.k_heads as u128 * l.k_dim as u128),
        (
            "linear_num_value_heads",
            l.v_heads as u128 * l.v_dim as u128,
        ),
        ("hc_count", cfg.hc_count as u128 * cfg.hidden_size as u128),
    ];
    if let Some(q) = &cfg.qsa {
        widths.push((
            "indexer_n_heads",
            (q.heads as u128 + 1) * q.head_dim as u128,
        ));
    }
    for (field, w) in widths {
        if w > u128::from(bounds::MAX_CONFIG_COUNT) {
            return Err(EngineError::config(
                field,
                format!(
                    "makes a {w}-wide activation, over the limit of {}",
                    bounds::MAX_CONFIG_COUNT
                ),
            ));
        }
    }
    if let Some(p) = &cfg.ple {
        let heads = p.heads() as u128 * p.layers.len() as u128;
        if heads > MAX_NGRAM_HEADS as u128 {
            return Err(EngineError::config(
                "heads_per_ngram",
                format!(
                    "{heads} hashed heads over the PLE layers, over the limit of {MAX_NGRAM_HEADS}"
                ),
            ));
        }
    }
    Ok(())
}

/// `layer_types` (`full_attention` read as `qwen_sparse_attention`), or
/// every `full_attention_interval`-th layer full (default 4).
fn layer_kinds(c: &Fields<'_>, n: usize) -> Result<Vec<LayerKind>, EngineError> {
    let Some(v) = c.get("layer_types") else {
        let every = c.opt_positive("full_attention_interval")?.unwrap_or(4);
        return Ok((0..n)
            .map(|i| {
                if (i + 1) % every == 0 {
                    LayerKind::Sparse
                } else {
                    LayerKind::Linear
                }
            })
            .collect());
    };
    let list = v
        .as_array()
        .ok_or_else(|| EngineError::config("layer_types", "not a list"))?;
    if list.len() != n {
        return Err(EngineError::config(
            "layer_types",
            format!("{} entries for {n} layers", list.len()),
        ));
    }
    list.iter()
        .map(|t| match t.as_str() {
            Some("linear_attention") => Ok(LayerKind::Linear),
            Some("qwen_sparse_attention" | "full_attention") => Ok(LayerKind::Sparse),
            _ => Err(EngineError::config(
                "layer_types",
                format!("{t} is not supported (linear_attention, qwen_sparse_attention)"),
            )),
        })
        .collect()
}

/// Fields whose values the engine would compute differently.
fn check_supported(c: &Fields<'_>) -> Result<(), EngineError> {
    if let Some(act) = c.get("hidden_act").filter(|a| a.as_str() != Some("silu")) {
        return Err(EngineError::config(
            "hidden_act",
            format!("{act} is not supported (silu)"),
        ));
    }
    if c.opt_bool("attention_bias")? == Some(true) {
        return Err(EngineError::config(
            "attention_bias",
            "true is not supported",
        ));
    }
    Ok(())
}

type AttnShape = (usize, usize, usize, usize, f64);

/// Heads, head width, RoPE width and base (`rope_parameters`, default type).
fn attention(c: &Fields<'_>) -> Result<AttnShape, EngineError> {
    let q = c.positive("num_attention_heads")?;
    let kv = c.positive("num_key_value_heads")?;
    if q % kv != 0 {
        return Err(EngineError::config(
            "num_key_value_heads",
            format!("{kv} does not divide num_attention_heads {q}"),
        ));
    }
    let d = c.positive("head_dim")?;
    let rope = c
        .get("rope_parameters")
        .and_then(Value::as_object)
        .ok_or_else(|| EngineError::config("rope_parameters", "missing or not an object"))?;
    let r = Fields(rope);
    match r.get("rope_type").and_then(Value::as_str) {
        None | Some("default") => {}
        Some(other) => {
            return Err(EngineError::config(
                "rope_parameters.rope_type",
                format!("`{other}` is not supported (default)"),
            ));
        }
    }
    let theta = r
        .float("rope_theta")
        .map_err(|e| in_scope(e, "rope_parameters."))?;
    let factor = match r.get("partial_rotary_factor") {
        None => 1.0,
        Some(v) => v
            .as_f64()
            .filter(|f| *f > 0.0 && *f <= 1.0)
            .ok_or_else(|| {
                EngineError::config(
                    "rope_parameters.partial_rotary_factor",
                    "not a number in (0, 1]",
                )
            })?,
    };
    // transformers truncates: int(head_dim * factor).
    let rope_dim = (d as f64 * factor) as usize;
    if rope_dim == 0 || rope_dim % 2 != 0 {
        return Err(EngineError::config(
            "rope_parameters.partial_rotary_factor",
            format!("rotates {rope_dim} of {d} dims (must be even and positive)"),
        ));
    }
    Ok((q, kv, d, rope_dim, theta))
}

fn linear(c: &Fields<'_>) -> Result<LinearAttn, EngineError> {
    let k_heads = c.positive("linear_num_key_heads")?;
    let v_heads = c.positive("linear_num_value_heads")?;
    if v_heads % k_heads != 0 {
        return Err(EngineError::config(
            "linear_num_value_heads",
            format!("{v_heads} is not a multiple of linear_num_key_heads {k_heads}"),
        ));
    }
    let gate = c
        .get("output_gate_type")
        .or_else(|| c.get("hidden_act"))
        .and_then(Value::as_str)
        .unwrap_or("silu");
    let sigmoid_gate = match gate {
        "sigmoid" => true,
        "silu" => false,
        other => {
            return Err(EngineError::config(
                "output_gate_type",
                format!("`{other}` is not supported (sigmoid, silu)"),
            ));
        }
    };
    Ok(LinearAttn {
        conv_kernel: c.positive("linear_conv_kernel_dim")?,
        k_heads,
        v_heads,
        k_dim: c.positive("linear_key_head_dim")?,
        v_dim: c.positive("linear_value_head_dim")?,
        sigmoid_gate,
    })
}

/// The indexer: all five fields or none; one key head; the budget a
/// multiple of the block; the RoPE width within the index head.
fn qsa(c: &Fields<'_>, rope_dim: usize) -> Result<Option<Qsa>, EngineError> {
    const FIELDS: [&str; 5] = [
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "indexer_budget",
        "indexer_compress_ratio",
    ];
    let vals = FIELDS
        .iter()
        .map(|f| c.opt_positive(f))
        .collect::<Result<Vec<_>, _>>()?;
    if vals.iter().all(Option::is_none) {
        return Ok(None);
    }
    let mut got = [0usize; 5];
    for ((slot, v), f) in got.iter_mut().zip(&vals).zip(FIELDS) {
        *slot =
            v.ok_or_else(|| EngineError::config(f, "missing (QSA needs all five indexer fields)"))?;
    }
    let [heads, kv_heads, head_dim, budget, compress_ratio] = got;
    if kv_heads != 1 {
        return Err(EngineError::config(
            "indexer_kv_heads",
            format!("{kv_heads}: QSA needs 1"),
        ));
    }
    if budget % compress_ratio != 0 {
        return Err(EngineError::config(
            "indexer_budget",
            format!("{budget} is not a multiple of indexer_compress_ratio {compress_ratio}"),
        ));
    }
    if rope_dim > head_dim {
        return Err(EngineError::config(
            "indexer_head_dim",
            format!("{head_dim} is narrower than the {rope_dim} RoPE dims"),
        ));
    }
    Ok(Some(Qsa {
        heads,
        head_dim,
        budget,
        compress_ratio,
    }))
}

/// `ple_layer_ids` (one-indexed, each a `linear_attention` layer) as
/// zero-based layers, ascending, once each; none when absent.
fn ple_layer_ids(c: &Fields<'_>, layers: &[LayerKind]) -> Result<Vec<usize>, EngineError> {
    let Some(list) = c.get("ple_layer_ids") else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .ok_or_else(|| EngineError::config("ple_layer_ids", "not a list of layer ids"))?;
    let mut ids = Vec::with_capacity(list.len().min(layers.len()));
    for item in list {
        let id = item.as_u64().and_then(|i| usize::try_from(i).ok());
        let idx = id
            .filter(|&i| (1..=layers.len()).contains(&i))
            .ok_or_else(|| {
                EngineError::config(
                    "ple_layer_ids",
                    format!("{item} is not in 1..={}", layers.len()),
                )
            })?
            - 1;
        if layers[idx] != LayerKind::Linear {
            return Err(EngineError::config(
                "ple_layer_ids",
                format!("layer {} is not linear_attention (PLE needs it)", idx + 1),
            ));
        }
        ids.push(idx);
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

fn ple(
    c: &Fields<'_>,
    layers: &[LayerKind],
    hidden: usize,
    eos: Option<u32>,
) -> Result<Option<Ple>, EngineError> {
    let ids = ple_layer_ids(c, layers)?;
    if ids.is_empty() {
        return Ok(None);
    }
    let eos = eos.ok_or_else(|| EngineError::config("eos_token_id", "missing (PLE needs it)"))?;
    let ngram_size = c.opt_positive("ngram_size")?.unwrap_or(3);
    if !(2..=MAX_NGRAM_SIZE).contains(&ngram_size) {
        return Err(EngineError::config(
            "ngram_size",
            format!("{ngram_size} is outside 2..={MAX_NGRAM_SIZE}"),
        ));
    }
    let heads_per_ngram = c.opt_positive("heads_per_ngram")?.unwrap_or(8);
    let embed_dim = c.opt_positive("ple_embed_dim")?.unwrap_or(hidden);
    let heads = (ngram_size - 1) * heads_per_ngram;
    if embed_dim % heads != 0 {
        return Err(EngineError::config(
            "ple_embed_dim",
            format!("{embed_dim} is not a multiple of the {heads} n-gram heads"),
        ));
    }
    let vocab_base = c
        .opt_positive("ngram_vocab_size_base")?
        .unwrap_or(20_000_000) as u64;
    if !(2..=MAX_NGRAM_VOCAB_BASE).contains(&vocab_base) {
        return Err(EngineError::config(
            "ngram_vocab_size_base",
            format!("{vocab_base} is outside 2..={MAX_NGRAM_VOCAB_BASE}"),
        ));
    }
    let seed = match c.get("seed") {
        None => 1234,
        Some(v) => v.as_u64().ok_or_else(|| {
            EngineError::config("seed", format!("{v} is not a non-negative integer"))
        })?,
    };
    Ok(Some(Ple {
        layers: ids,
        embed_dim,
        conv_kernel: c.opt_positive("ple_conv_kernel_size")?.unwrap_or(4),
        ngram_size,
        heads_per_ngram,
        vocab_base,
        vocab_divisor: c
            .opt_positive("make_ngram_vocab_size_divisible_by")?
            .unwrap_or(128) as u64,
        seed,
        split_parts: c.opt_positive("split_ngram_parts")?.unwrap_or(512),
        eos: u64::from(eos),
    }))
}
