//! DeepSeek-V3's parts of `config.json`: multi-head latent attention,
//! grouped sigmoid routing, shared experts and FP8 block quantization.

use serde_json::Value;

use super::fields::Fields;
use super::{Mla, Routing};
use crate::error::EngineError;

/// DeepSeek-V3's shared experts as one MLP: `n_shared_experts x
/// moe_intermediate_size` wide (`None` without shared experts).
pub(super) fn shared_experts_width(
    c: &Fields<'_>,
    expert_intermediate: usize,
) -> Result<Option<usize>, EngineError> {
    let Some(n) = c.opt_usize("n_shared_experts")?.filter(|&n| n > 0) else {
        return Ok(None);
    };
    n.checked_mul(expert_intermediate).map(Some).ok_or_else(|| {
        EngineError::config(
            "n_shared_experts",
            format!("{n} x moe_intermediate_size {expert_intermediate} overflows"),
        )
    })
}

/// The latent-attention dimensions of a DeepSeek-V3 config.
pub(super) fn mla(c: &Fields<'_>) -> Result<Mla, EngineError> {
    let m = Mla {
        q_lora_rank: c.opt_positive("q_lora_rank")?,
        kv_lora_rank: c.positive("kv_lora_rank")?,
        qk_nope_head_dim: c.positive("qk_nope_head_dim")?,
        qk_rope_head_dim: c.positive("qk_rope_head_dim")?,
        v_head_dim: c.positive("v_head_dim")?,
        rope_interleave: c.opt_bool("rope_interleave")?.unwrap_or(true),
    };
    if m.qk_rope_head_dim % 2 != 0 {
        return Err(EngineError::config(
            "qk_rope_head_dim",
            format!("{} is odd (RoPE)", m.qk_rope_head_dim),
        ));
    }
    Ok(m)
}

/// `quantization_config`: absent, or FP8 E4M3 in float32-scaled blocks
/// (`quant_method: fp8`, `weight_block_size: [rows, cols]`), the format
/// DeepSeek-V3 ships in.
pub(super) fn fp8_block(c: &Fields<'_>) -> Result<Option<[usize; 2]>, EngineError> {
    let Some(q) = c.get("quantization_config") else {
        return Ok(None);
    };
    let field = "quantization_config";
    let text = |k: &str| q.get(k).and_then(Value::as_str);
    if text("quant_method") != Some("fp8") {
        return Err(EngineError::config(
            field,
            format!("{q} is not supported (FP8 blocks: quant_method fp8)"),
        ));
    }
    if let Some(fmt) = text("fmt").filter(|f| *f != "e4m3") {
        return Err(EngineError::config(
            "quantization_config.fmt",
            format!("`{fmt}` is not supported (e4m3)"),
        ));
    }
    let block: Option<Vec<usize>> = q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
                .filter(|n| *n > 0)
                .collect()
        });
    match block.as_deref() {
        Some(&[r, c]) => Ok(Some([r, c])),
        _ => Err(EngineError::config(
            "quantization_config.weight_block_size",
            "needs two positive block sizes (per-tensor FP8 scales are not supported)",
        )),
    }
}

/// DeepSeek-V3's grouped sigmoid routing.
pub(super) fn routing(
    c: &Fields<'_>,
    num_experts: usize,
    top_k: usize,
) -> Result<Routing, EngineError> {
    for (field, want) in [("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")] {
        if let Some(v) = c.get(field) {
            if v.as_str() != Some(want) {
                return Err(EngineError::config(
                    field,
                    format!("{v} is not supported ({want}, DeepSeek-V3's)"),
                ));
            }
        }
    }
    if c.opt_usize("moe_layer_freq")?.is_some_and(|f| f != 1) {
        return Err(EngineError::config(
            "moe_layer_freq",
            "only 1 is supported (every layer after first_k_dense_replace is sparse)",
        ));
    }
    let n_group = c.opt_positive("n_group")?.unwrap_or(1);
    let topk_group = c.opt_positive("topk_group")?.unwrap_or(n_group);
    if num_experts % n_group != 0 || num_experts / n_group < 2 {
        return Err(EngineError::config(
            "n_group",
            format!("{n_group} groups of {num_experts} experts: need at least 2 experts per group"),
        ));
    }
    if topk_group > n_group || top_k > topk_group * (num_experts / n_group) {
        return Err(EngineError::config(
            "topk_group",
            format!(
                "{topk_group} of {n_group} groups cannot hold num_experts_per_tok {top_k} experts"
            ),
        ));
    }
    let routed_scaling_factor = c
        .get("routed_scaling_factor")
        .map(|v| {
            v.as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or_else(|| {
                    EngineError::config("routed_scaling_factor", "not a positive number")
                })
        })
        .transpose()?
        .unwrap_or(1.0) as f32;
    Ok(Routing::SigmoidGroups {
        n_group,
        topk_group,
        routed_scaling_factor,
    })
}
