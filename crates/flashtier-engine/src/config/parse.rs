//! Parsing `config.json` into a [`ModelConfig`] (see the module docs of
//! [`super`] for the spellings accepted and refused).
//!
//! Fields are read in a fixed order, so a config with several faults is
//! named by the same first one every time: `model_type`, `hidden_size`,
//! `num_hidden_layers` (at most [`bounds::MAX_LAYERS`]), the attention
//! shape, the experts and `num_experts_per_tok`, the MLP widths, routing,
//! sparse layers, the unsupported fields, the family's extras, RoPE, then
//! the rest.

use std::path::Path;

use serde_json::Value;

use super::deepseek::{fp8_block, mla, routing, shared_experts_width};
use super::fields::Fields;
use super::rope::rope;
use super::{Arch, Mla, ModelConfig, Routing, bounds};
use crate::error::EngineError;

impl ModelConfig {
    /// Read and check `config.json` (a FIFO or device at `path` is refused,
    /// not waited on).
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let mut file = flashtier_format::open_regular_read(path)
            .map_err(crate::checkpoint::files::CheckpointError::from)?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| EngineError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&value)
    }

    /// Check a parsed `config.json`.
    pub fn from_json(value: &Value) -> Result<Self, EngineError> {
        let obj = value
            .as_object()
            .ok_or_else(|| EngineError::config("<root>", "config.json is not a JSON object"))?;
        let c = Fields(obj);
        let arch = arch_of(&c)?;
        let hidden_size = c.positive("hidden_size")?;
        let num_layers = layer_count(&c)?;
        let mla = match arch {
            Arch::DeepseekV3 => Some(mla(&c)?),
            _ => None,
        };
        let (num_q_heads, num_kv_heads, head_dim, rope_dim) =
            attention_shape(&c, mla.as_ref(), hidden_size)?;
        let num_experts = expert_count(&c)?;
        let top_k = c.positive("num_experts_per_tok")?;
        if num_experts > 0 && top_k > num_experts {
            return Err(EngineError::config(
                "num_experts_per_tok",
                format!("{top_k} exceeds the {num_experts} experts"),
            ));
        }
        let (intermediate, expert_intermediate, norm_topk_prob) = mlp_widths(&c, arch)?;
        let routing = match arch {
            Arch::DeepseekV3 => routing(&c, num_experts, top_k)?,
            _ => Routing::Softmax,
        };
        let sparse_layers = sparse_layers(&c, arch, num_layers, num_experts)?;
        c.check_supported(arch)?;
        let sliding_window = match arch {
            Arch::Mixtral => c.opt_positive("sliding_window")?,
            Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::DeepseekV3 => None,
        };
        let (qkv_bias, shared_expert_intermediate) = match arch {
            Arch::Qwen2Moe => (
                c.opt_bool("qkv_bias")?.unwrap_or(true),
                c.opt_usize("shared_expert_intermediate_size")?
                    .filter(|&n| n > 0),
            ),
            Arch::DeepseekV3 => (false, shared_experts_width(&c, expert_intermediate)?),
            Arch::Qwen3Moe | Arch::Mixtral => (false, None),
        };
        let (rope_theta, yarn) = rope(&c)?;
        Ok(Self {
            arch,
            vocab_size: c.positive("vocab_size")?,
            hidden_size,
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            yarn,
            mla,
            routing,
            dense_intermediate: intermediate,
            expert_intermediate,
            num_experts,
            top_k,
            norm_topk_prob,
            rms_norm_eps: c.float("rms_norm_eps")? as f32,
            rope_theta,
            sparse_layers,
            tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_positions: c.opt_positive("max_position_embeddings")?.unwrap_or(4096),
            sliding_window,
            qk_norm: arch == Arch::Qwen3Moe,
            qkv_bias,
            shared_expert_intermediate,
            shared_expert_gated: arch == Arch::Qwen2Moe,
            fp8_block: fp8_block(&c)?,
            eos_token_ids: eos_ids(&c)?,
        })
    }
}

/// `model_type`: one of the families the engine runs.
fn arch_of(c: &Fields<'_>) -> Result<Arch, EngineError> {
    match c.str("model_type")? {
        "qwen3_moe" => Ok(Arch::Qwen3Moe),
        "mixtral" => Ok(Arch::Mixtral),
        "qwen2_moe" => Ok(Arch::Qwen2Moe),
        "deepseek_v3" => Ok(Arch::DeepseekV3),
        "qwen4_exp" | "qwen4_exp_text" => Err(EngineError::config(
            "model_type",
            "Qwen4-Exp runs on its own decoder, `family::qwen4::Qwen4Model` (which \
             `engine::open` and `flashtier run` choose), not through this one",
        )),
        other => Err(EngineError::config(
            "model_type",
            format!("`{other}` is not supported (qwen3_moe, qwen2_moe, mixtral, deepseek_v3)"),
        )),
    }
}

/// `num_hidden_layers`: positive and at most [`bounds::MAX_LAYERS`] (every
/// family's config, Qwen4-Exp's included).
pub(super) fn layer_count(c: &Fields<'_>) -> Result<usize, EngineError> {
    let num_layers = c.positive("num_hidden_layers")?;
    if num_layers > bounds::MAX_LAYERS {
        return Err(EngineError::config(
            "num_hidden_layers",
            format!(
                "{num_layers} is over the limit of {} layers",
                bounds::MAX_LAYERS
            ),
        ));
    }
    Ok(num_layers)
}

/// Query heads, key/value heads, the KV cache's head width and the RoPE
/// width: from the latent attention's dims with `mla`, else from the heads.
fn attention_shape(
    c: &Fields<'_>,
    mla: Option<&Mla>,
    hidden_size: usize,
) -> Result<(usize, usize, usize, usize), EngineError> {
    let Some(m) = mla else {
        let (q, kv, d) = attention_heads(c, hidden_size)?;
        return Ok((q, kv, d, d));
    };
    let heads = c.positive("num_attention_heads")?;
    if let Some(kv) = c.opt_positive("num_key_value_heads")? {
        if kv != heads {
            return Err(EngineError::config(
                "num_key_value_heads",
                format!(
                    "{kv}: latent attention expands one key/value head per query head ({heads})"
                ),
            ));
        }
    }
    let d = m.qk_head_dim().max(m.v_head_dim);
    Ok((heads, heads, d, m.qk_rope_head_dim))
}

/// The dense MLP width, one expert's width, and whether the top-k weights
/// are renormalised (the family's default when absent).
fn mlp_widths(c: &Fields<'_>, arch: Arch) -> Result<(usize, usize, bool), EngineError> {
    let intermediate = c.positive("intermediate_size")?;
    let (expert, norm_topk_prob) = match arch {
        Arch::Qwen3Moe | Arch::Qwen2Moe => (
            c.positive("moe_intermediate_size")?,
            c.opt_bool("norm_topk_prob")?.unwrap_or(false),
        ),
        Arch::DeepseekV3 => (
            c.positive("moe_intermediate_size")?,
            c.opt_bool("norm_topk_prob")?.unwrap_or(true),
        ),
        Arch::Mixtral => (intermediate, true),
    };
    Ok((intermediate, expert, norm_topk_prob))
}

/// Query heads, key/value heads and head width (present or derived).
fn attention_heads(
    c: &Fields<'_>,
    hidden_size: usize,
) -> Result<(usize, usize, usize), EngineError> {
    let num_q_heads = c.positive("num_attention_heads")?;
    let num_kv_heads = c
        .opt_positive("num_key_value_heads")?
        .unwrap_or(num_q_heads);
    if num_q_heads % num_kv_heads != 0 {
        return Err(EngineError::config(
            "num_key_value_heads",
            format!("{num_kv_heads} does not divide num_attention_heads {num_q_heads}"),
        ));
    }
    let head_dim = match c.opt_positive("head_dim")? {
        Some(d) => d,
        None if hidden_size % num_q_heads == 0 => hidden_size / num_q_heads,
        None => {
            return Err(EngineError::config(
                "head_dim",
                "absent, and hidden_size is not a multiple of num_attention_heads",
            ));
        }
    };
    if head_dim % 2 != 0 {
        return Err(EngineError::config(
            "head_dim",
            format!("{head_dim} is odd (RoPE)"),
        ));
    }
    Ok((num_q_heads, num_kv_heads, head_dim))
}

/// `num_experts` (Qwen, transformers 4.x), `num_local_experts` or
/// `n_routed_experts` (DeepSeek).
fn expert_count(c: &Fields<'_>) -> Result<usize, EngineError> {
    match (
        c.opt_usize("num_experts")?,
        c.opt_usize("num_local_experts")?
            .or(c.opt_usize("n_routed_experts")?),
    ) {
        (Some(a), Some(b)) if a != b => Err(EngineError::config(
            "num_experts",
            format!("{a} disagrees with num_local_experts {b}"),
        )),
        (Some(n), _) | (None, Some(n)) => Ok(n),
        (None, None) => Err(EngineError::config(
            "num_experts",
            "missing (neither num_experts nor num_local_experts)",
        )),
    }
}

/// Which layers are sparse: Qwen's `decoder_sparse_step` and
/// `mlp_only_layers` rule (as transformers applies it), every layer for Mixtral.
fn sparse_layers(
    c: &Fields<'_>,
    arch: Arch,
    num_layers: usize,
    num_experts: usize,
) -> Result<Vec<bool>, EngineError> {
    if arch == Arch::Mixtral {
        if num_experts == 0 {
            return Err(EngineError::config("num_local_experts", "must be positive"));
        }
        return Ok(vec![true; num_layers]);
    }
    if arch == Arch::DeepseekV3 {
        if num_experts == 0 {
            return Err(EngineError::config("n_routed_experts", "must be positive"));
        }
        let dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
        return Ok((0..num_layers).map(|i| i >= dense).collect());
    }
    let step = c.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(EngineError::config(
            "decoder_sparse_step",
            "must be positive",
        ));
    }
    let mut dense_only = vec![false; num_layers];
    if let Some(v) = c.0.get("mlp_only_layers").filter(|v| !v.is_null()) {
        let list = v
            .as_array()
            .ok_or_else(|| EngineError::config("mlp_only_layers", "not a list of layer indices"))?;
        for item in list {
            let i = item
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .filter(|i| *i < num_layers);
            let i = i.ok_or_else(|| {
                EngineError::config("mlp_only_layers", format!("{item} is not a layer index"))
            })?;
            dense_only[i] = true;
        }
    }
    Ok((0..num_layers)
        .map(|i| !dense_only[i] && num_experts > 0 && (i + 1) % step == 0)
        .collect())
}

/// `eos_token_id`: absent, null, one id or a list of ids.
pub(super) fn eos_ids(c: &Fields<'_>) -> Result<Vec<u32>, EngineError> {
    let bad = || EngineError::config("eos_token_id", "not a token id or a list of ids");
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)
    };
    match c.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}
