//! Experts stored one checkpoint tensor per matrix (the hub layout):
//! `model.layers.L.mlp.experts.E.<suffix>` or
//! `model.layers.L.block_sparse_moe.experts.E.<suffix>`.
//!
//! Invariants of an accepted checkpoint: one of the two namings, never both;
//! every (layer, expert) holds exactly the suffixes of the first, with the
//! same dtype and shape; every F8 matrix has a scale tensor beside it.

use std::collections::{BTreeMap, BTreeSet};

use flashtier_format::{Dtype, RecordKey, TensorLayout};

use super::{ExpertFamily, ExpertLayout, ExpertTensors, check_dtype, source_name, suffix_rank};
use crate::checkpoint::files::CheckpointFiles as Checkpoint;
use crate::error::dims;
use crate::store::PackError;

/// Split an expert tensor name into (is_mixtral, layer, expert, suffix).
pub(super) fn parse_expert_name(name: &str) -> Option<(bool, u32, u32, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (mixtral, rest) = if let Some(r) = rest.strip_prefix("mlp.experts.") {
        (false, r)
    } else {
        (true, rest.strip_prefix("block_sparse_moe.experts.")?)
    };
    let (expert, suffix) = rest.split_once('.')?;
    if suffix.is_empty() {
        return None;
    }
    Some((mixtral, layer.parse().ok()?, expert.parse().ok()?, suffix))
}

type ExpertSuffixes<'a> = BTreeMap<RecordKey, BTreeSet<&'a str>>;

/// Expert suffixes by (layer, expert), and whether the naming is Mixtral's.
fn scan_experts(ckpt: &Checkpoint) -> Result<(bool, ExpertSuffixes<'_>), PackError> {
    let mut by_key = ExpertSuffixes::new();
    let mut first: Option<(bool, &str)> = None;
    for name in ckpt.tensors().keys() {
        let Some((mixtral, layer, expert, suffix)) = parse_expert_name(name) else {
            continue;
        };
        match first {
            None => first = Some((mixtral, name)),
            Some((m, f)) if m != mixtral => {
                return Err(PackError::MixedLayouts {
                    first: f.to_string(),
                    second: name.clone(),
                });
            }
            Some(_) => {}
        }
        by_key
            .entry(RecordKey::new(layer, expert))
            .or_default()
            .insert(suffix);
    }
    let Some((mixtral, _)) = first else {
        return Err(PackError::NoExperts {
            dir: ckpt.dir().to_path_buf(),
        });
    };
    Ok((mixtral, by_key))
}

/// The layout of a checkpoint whose experts are split (see the module
/// docs); `model_type` tells DeepSeek from Qwen, which share a naming.
pub(super) fn split_layout(ckpt: &Checkpoint, model_type: &str) -> Result<ExpertLayout, PackError> {
    let (mixtral, by_key) = scan_experts(ckpt)?;
    let family = match (mixtral, model_type.starts_with("deepseek")) {
        (true, _) => ExpertFamily::Mixtral,
        (false, true) => ExpertFamily::DeepSeek,
        (false, false) => ExpertFamily::QwenMoe,
    };
    let template = family.prefix_template();
    let mut entries = by_key.iter();
    let Some((&key0, suffixes0)) = entries.next() else {
        return Err(PackError::NoExperts {
            dir: ckpt.dir().to_path_buf(),
        });
    };
    let mut order: Vec<&str> = suffixes0.iter().copied().collect();
    order.sort_by_key(|s| suffix_rank(s));
    let tensors = order
        .iter()
        .map(|suffix| {
            let name = source_name(template, key0, suffix);
            let info = ckpt.tensor(&name)?;
            Ok(TensorLayout {
                name: (*suffix).to_string(),
                dtype: check_dtype(&name, info, suffix)?,
                shape: info.shape.clone(),
                offset: 0,
                len_bytes: info.len_bytes,
            })
        })
        .collect::<Result<Vec<_>, PackError>>()?;
    check_scales(template, key0, &tensors)?;
    for (&key, suffixes) in entries {
        check_same(ckpt, template, key, suffixes, &tensors)?;
    }
    Ok(ExpertLayout::placed(
        family,
        by_key.keys().copied().collect(),
        tensors,
        ExpertTensors::Split,
    ))
}

/// Every F8 matrix has a scale tensor next to it.
fn check_scales(template: &str, key: RecordKey, tensors: &[TensorLayout]) -> Result<(), PackError> {
    for t in tensors.iter().filter(|t| t.dtype == Dtype::F8E4M3) {
        let base = t.name.split('.').next().unwrap_or(&t.name);
        let has_scale = tensors
            .iter()
            .any(|s| s.name.starts_with(base) && s.name.contains("scale"));
        if !has_scale {
            return Err(PackError::MissingScale {
                tensor: source_name(template, key, &t.name),
            });
        }
    }
    Ok(())
}

/// Expert `key` holds exactly the tensors of `layout`, same dtypes and shapes.
fn check_same(
    ckpt: &Checkpoint,
    template: &str,
    key: RecordKey,
    suffixes: &BTreeSet<&str>,
    layout: &[TensorLayout],
) -> Result<(), PackError> {
    if let Some(extra) = suffixes
        .iter()
        .find(|s| !layout.iter().any(|t| t.name == **s))
    {
        return Err(PackError::Inconsistent {
            tensor: source_name(template, key, extra),
            why: "this tensor is not present for the other experts".into(),
        });
    }
    for t in layout {
        let name = source_name(template, key, &t.name);
        let info = ckpt.tensor(&name).map_err(|_| PackError::Inconsistent {
            tensor: name.clone(),
            why: "missing, while other experts have it".into(),
        })?;
        if info.dtype != t.dtype.name() || info.shape != t.shape {
            return Err(PackError::Inconsistent {
                tensor: name,
                why: format!(
                    "{} {}, other experts have {} {}",
                    info.dtype,
                    dims(&info.shape),
                    t.dtype,
                    dims(&t.shape)
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(
            parse_expert_name("model.layers.3.mlp.experts.17.gate_proj.weight"),
            Some((false, 3, 17, "gate_proj.weight"))
        );
        assert_eq!(
            parse_expert_name("model.layers.0.block_sparse_moe.experts.7.w2.weight"),
            Some((true, 0, 7, "w2.weight"))
        );
        assert_eq!(
            parse_expert_name("model.layers.3.mlp.shared_experts.gate_proj.weight"),
            None
        );
        assert_eq!(
            parse_expert_name("model.layers.3.mlp.shared_expert.up_proj.weight"),
            None
        );
        assert_eq!(parse_expert_name("model.layers.3.mlp.gate.weight"), None);
        assert_eq!(parse_expert_name("model.layers.x.mlp.experts.1.w"), None);
    }
}
