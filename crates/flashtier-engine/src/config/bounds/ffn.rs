//! The feed-forward layers against the config: every layer the config
//! makes sparse has a router and no other layer has one; the first dense
//! layer's `gate_proj` has `intermediate_size` rows; the first sparse
//! layer's router has one row per expert, its expert tensors (split or
//! fused) hold experts `0..num_experts` of the expert width, and its shared
//! expert the shared width. A mismatch names the config field that decides
//! it, in the family's spelling.

use std::collections::BTreeSet;

use super::{Tensors, mismatch, rule};
use crate::config::{Arch, ModelConfig};
use crate::error::EngineError;

/// The config field that sets the experts per layer in `arch`'s spelling.
fn experts_field(arch: Arch) -> &'static str {
    match arch {
        Arch::Mixtral => "num_local_experts",
        Arch::DeepseekV3 => "n_routed_experts",
        Arch::Qwen3Moe | Arch::Qwen2Moe => "num_experts",
    }
}

/// The router of layer `i`, if the checkpoint has one (transformers-5
/// fused checkpoints keep Mixtral's under `mlp`).
fn router(cfg: &ModelConfig, t: &Tensors<'_>, i: usize) -> Option<String> {
    [cfg.arch.moe_block_name(), "mlp"]
        .iter()
        .map(|block| format!("model.layers.{i}.{block}.gate.weight"))
        .find(|name| t.has(name))
}

/// The config field that decides which layers are sparse, and its value as
/// config.json spells it.
fn sparse_rule(cfg: &ModelConfig, raw: &serde_json::Value) -> (&'static str, String) {
    let field = match cfg.arch {
        Arch::DeepseekV3 => "first_k_dense_replace",
        Arch::Mixtral => experts_field(cfg.arch),
        Arch::Qwen3Moe | Arch::Qwen2Moe => match raw.get("decoder_sparse_step") {
            Some(step) if step.as_u64() != Some(1) && !step.is_null() => "decoder_sparse_step",
            _ => "mlp_only_layers",
        },
    };
    let value = raw
        .get(field)
        .filter(|v| !v.is_null())
        .map_or_else(|| "absent".to_string(), serde_json::Value::to_string);
    (field, value)
}

pub(super) fn check_ffn(
    cfg: &ModelConfig,
    t: &Tensors<'_>,
    raw: &serde_json::Value,
) -> Result<(), EngineError> {
    let (mut dense, mut sparse) = (None, None);
    for (i, &is_sparse) in cfg.sparse_layers.iter().enumerate() {
        match (is_sparse, router(cfg, t, i)) {
            (true, Some(r)) => sparse = sparse.or(Some((i, r))),
            (false, None) => dense = dense.or(Some(i)),
            (true, None) | (false, Some(_)) => {
                let (is, has) = if is_sparse {
                    ("sparse", "no")
                } else {
                    ("dense", "a")
                };
                let (field, value) = sparse_rule(cfg, raw);
                return Err(mismatch(
                    field,
                    value,
                    format!(
                        "layer {i} is {is} by the config and the checkpoint has {has} router for it"
                    ),
                ));
            }
        }
    }
    if let Some(i) = dense {
        let n = cfg.dense_intermediate;
        let name = format!("model.layers.{i}.mlp.gate_proj.weight");
        t.dim(
            &name,
            0,
            Some(n),
            rule("intermediate_size", n, "intermediate_size"),
        )?;
    }
    match sparse {
        Some((i, router)) => check_experts(cfg, t, i, &router),
        None => Ok(()),
    }
}

fn check_experts(
    cfg: &ModelConfig,
    t: &Tensors<'_>,
    i: usize,
    router: &str,
) -> Result<(), EngineError> {
    let (n, w) = (cfg.num_experts, cfg.expert_intermediate);
    let field = experts_field(cfg.arch);
    t.dim(
        router,
        0,
        Some(n),
        rule(field, n, "one router row per expert"),
    )?;
    let width_field = match cfg.arch {
        Arch::Mixtral => "intermediate_size",
        _ => "moe_intermediate_size",
    };
    let width = rule(width_field, w, "the expert width");
    let block = router.trim_end_matches("gate.weight");
    let fused = format!("{block}experts.gate_up_proj");
    if t.has(&fused) {
        t.dim(&fused, 0, Some(n), rule(field, n, "one slice per expert"))?;
        t.dim(
            &fused,
            1,
            w.checked_mul(2),
            rule(width_field, w, "2 x the expert width"),
        )?;
    } else {
        let prefix = format!("{block}experts.");
        let experts = checkpoint_experts(t, &prefix);
        if experts.len() != n || experts.last().is_some_and(|&e| e + 1 != n as u64) {
            let found = format!(
                "layer {i} has {} experts ({prefix}E.* for E in {})",
                experts.len(),
                describe_ids(&experts)
            );
            return Err(mismatch(field, n, found));
        }
        let gate = ["gate_proj.weight", "w1.weight"]
            .iter()
            .map(|s| format!("{prefix}0.{s}"))
            .find(|name| t.has(name))
            .ok_or_else(|| EngineError::MissingTensor {
                name: format!("{prefix}0.gate_proj.weight"),
            })?;
        t.dim(&gate, 0, Some(w), width)?;
    }
    check_shared(cfg, t, block)
}

fn check_shared(cfg: &ModelConfig, t: &Tensors<'_>, block: &str) -> Result<(), EngineError> {
    let Some(width) = cfg.shared_expert_intermediate else {
        return Ok(());
    };
    let (name, r) = if cfg.shared_expert_gated {
        let f = "shared_expert_intermediate_size";
        ("shared_expert", rule(f, width, f))
    } else {
        let n = width / cfg.expert_intermediate.max(1);
        (
            "shared_experts",
            rule(
                "n_shared_experts",
                n,
                "n_shared_experts x moe_intermediate_size",
            ),
        )
    };
    t.dim(
        &format!("{block}{name}.gate_proj.weight"),
        0,
        Some(width),
        r,
    )
}

/// The expert indices under `prefix` (`model.layers.L.mlp.experts.`).
fn checkpoint_experts(t: &Tensors<'_>, prefix: &str) -> BTreeSet<u64> {
    t.0.range(prefix.to_string()..)
        .map(|(name, _)| name)
        .take_while(|name| name.starts_with(prefix))
        .filter_map(|name| name.strip_prefix(prefix)?.split_once('.'))
        .filter_map(|(e, _)| e.parse().ok())
        .collect()
}

/// `0..=7`, `0..=7 without 3`, `none`: a set of ids for a message.
fn describe_ids(ids: &BTreeSet<u64>) -> String {
    let Some(&last) = ids.last() else {
        return "none".into();
    };
    match (0..=last).find(|i| !ids.contains(i)) {
        Some(gap) => format!("0..={last} without {gap}"),
        None => format!("0..={last}"),
    }
}
