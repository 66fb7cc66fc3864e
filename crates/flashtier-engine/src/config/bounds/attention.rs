//! The attention projections of layer 0 against the config's heads and
//! widths: grouped-query attention (`num_attention_heads`,
//! `num_key_value_heads`, `head_dim`) or multi-head latent attention
//! (`q_lora_rank`, `kv_lora_rank`, the per-head dims). A product of counts
//! that overflows is a mismatch, never a wrapped comparison.

use super::{Tensors, rule};
use crate::config::{Mla, ModelConfig};
use crate::error::EngineError;

pub(super) fn check_gqa(cfg: &ModelConfig, t: &Tensors<'_>) -> Result<(), EngineError> {
    let a = "model.layers.0.self_attn";
    let d = cfg.head_dim;
    let q = format!("{a}.q_proj.weight");
    let how = "num_attention_heads x head_dim";
    t.dim(
        &q,
        0,
        cfg.num_q_heads.checked_mul(d),
        rule("num_attention_heads", cfg.num_q_heads, how),
    )?;
    t.dim(
        &q,
        1,
        Some(cfg.hidden_size),
        rule("hidden_size", cfg.hidden_size, "hidden_size"),
    )?;
    let how = "num_key_value_heads x head_dim";
    t.dim(
        &format!("{a}.k_proj.weight"),
        0,
        cfg.num_kv_heads.checked_mul(d),
        rule("num_key_value_heads", cfg.num_kv_heads, how),
    )
}

pub(super) fn check_mla(cfg: &ModelConfig, m: &Mla, t: &Tensors<'_>) -> Result<(), EngineError> {
    let a = "model.layers.0.self_attn";
    let heads = cfg.num_q_heads;
    let qk_rows = heads.checked_mul(m.qk_head_dim());
    let how = "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)";
    let heads_rule = rule("num_attention_heads", heads, how);
    match m.q_lora_rank {
        Some(r) => {
            t.dim(
                &format!("{a}.q_a_proj.weight"),
                0,
                Some(r),
                rule("q_lora_rank", r, "q_lora_rank"),
            )?;
            t.dim(&format!("{a}.q_b_proj.weight"), 0, qk_rows, heads_rule)?;
        }
        None => t.dim(&format!("{a}.q_proj.weight"), 0, qk_rows, heads_rule)?,
    }
    let r = m.kv_lora_rank;
    let how = "kv_lora_rank + qk_rope_head_dim";
    t.dim(
        &format!("{a}.kv_a_proj_with_mqa.weight"),
        0,
        r.checked_add(m.qk_rope_head_dim),
        rule("kv_lora_rank", r, how),
    )?;
    let kv_b = format!("{a}.kv_b_proj.weight");
    let per_head = m.qk_nope_head_dim.checked_add(m.v_head_dim);
    let how = "num_attention_heads x (qk_nope_head_dim + v_head_dim)";
    let want = per_head.and_then(|p| p.checked_mul(heads));
    t.dim(&kv_b, 0, want, rule("num_attention_heads", heads, how))?;
    t.dim(&kv_b, 1, Some(r), rule("kv_lora_rank", r, "kv_lora_rank"))?;
    let how = "num_attention_heads x v_head_dim";
    t.dim(
        &format!("{a}.o_proj.weight"),
        1,
        heads.checked_mul(m.v_head_dim),
        rule("v_head_dim", m.v_head_dim, how),
    )
}
