//! Recognising the expert tensors of a checkpoint and laying out one record.
//!
//! Families (the tensor name decides; `config.json`'s `model_type` tells
//! Qwen from DeepSeek, which share a naming):
//! - Qwen2-MoE / Qwen3-MoE: `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`
//! - Mixtral: `model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}.weight`
//! - DeepSeek-V2/V3: `model.layers.L.mlp.experts.E.*`; shared experts
//!   (`mlp.shared_experts.*`) and dense layers do not match and stay dense.
//!
//! Every (layer, expert) must hold the same tensor suffixes with the same
//! dtype and shape. A record holds them in the order gate, up, down (w1, w3,
//! w2), each matrix followed by its scales, each tensor at a 4096-aligned
//! offset so a single matrix can be read directly.

use std::collections::{BTreeMap, BTreeSet};

use flashtier_format::{Dtype, RecordKey, TensorLayout};

use super::error::PackError;
use crate::checkpoint::{Checkpoint, TensorInfo};

/// Alignment of each tensor inside a record.
pub const TENSOR_ALIGN_BYTES: u64 = 4096;

/// The expert-tensor layout family of a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFamily {
    /// Qwen2-MoE / Qwen3-MoE.
    QwenMoe,
    /// Mixtral.
    Mixtral,
    /// DeepSeek-V2 / V3.
    DeepSeek,
}

impl ExpertFamily {
    /// Name stored in the manifest (`qwen_moe`, `mixtral`, `deepseek`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::QwenMoe => "qwen_moe",
            Self::Mixtral => "mixtral",
            Self::DeepSeek => "deepseek",
        }
    }

    /// Source tensor prefix template of a record (`{layer}`, `{expert}`).
    #[must_use]
    pub fn prefix_template(self) -> &'static str {
        match self {
            Self::Mixtral => "model.layers.{layer}.block_sparse_moe.experts.{expert}.",
            Self::QwenMoe | Self::DeepSeek => "model.layers.{layer}.mlp.experts.{expert}.",
        }
    }
}

/// Source name of tensor `suffix` of expert (layer, expert) under `template`.
#[must_use]
pub fn source_name(template: &str, key: RecordKey, suffix: &str) -> String {
    let prefix = template
        .replace("{layer}", &key.layer.to_string())
        .replace("{expert}", &key.item.to_string());
    format!("{prefix}{suffix}")
}

/// Split an expert tensor name into (is_mixtral, layer, expert, suffix).
fn parse_expert_name(name: &str) -> Option<(bool, u32, u32, &str)> {
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

/// The experts found in a checkpoint and the layout of one record.
#[derive(Clone, Debug)]
pub struct ExpertLayout {
    /// Layout family.
    pub family: ExpertFamily,
    /// Record keys (layer, expert), ascending: record `i` is `keys[i]`.
    pub keys: Vec<RecordKey>,
    /// Tensors of one record (name = source suffix), offsets assigned.
    pub tensors: Vec<TensorLayout>,
    /// Payload bytes of one record.
    pub payload_bytes: u64,
    /// Element type of the first matrix.
    pub dtype: Dtype,
}

const MATRIX_DTYPES: &str = "BF16, F16, F32, F8_E4M3";
const SCALE_DTYPES: &str = "F32, BF16, F16";

fn suffix_rank(suffix: &str) -> (u8, bool, String) {
    let base = suffix.split('.').next().unwrap_or(suffix);
    let rank = match base {
        "gate_proj" | "w1" => 0,
        "up_proj" | "w3" => 1,
        "down_proj" | "w2" => 2,
        _ => 3,
    };
    (rank, suffix.contains("scale"), suffix.to_string())
}

fn check_dtype(name: &str, info: &TensorInfo, suffix: &str) -> Result<Dtype, PackError> {
    let scale = suffix.contains("scale");
    let ok = match (scale, Dtype::from_name(&info.dtype)) {
        (false, Some(d @ (Dtype::Bf16 | Dtype::F16 | Dtype::F32 | Dtype::F8E4M3))) => Some(d),
        (true, Some(d @ (Dtype::Bf16 | Dtype::F16 | Dtype::F32))) => Some(d),
        _ => None,
    };
    ok.ok_or_else(|| PackError::UnsupportedDtype {
        tensor: name.to_string(),
        dtype: info.dtype.clone(),
        role: if scale { "scale" } else { "matrix" },
        supported: if scale { SCALE_DTYPES } else { MATRIX_DTYPES },
    })
}

/// Expert suffixes by (layer, expert), and whether the naming is Mixtral's.
fn scan_experts(ckpt: &Checkpoint) -> Result<(bool, ExpertSuffixes<'_>), PackError> {
    let mut by_key: BTreeMap<RecordKey, BTreeSet<&str>> = BTreeMap::new();
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

type ExpertSuffixes<'a> = BTreeMap<RecordKey, BTreeSet<&'a str>>;

/// Find the experts of `ckpt` and lay out one record.
pub fn expert_layout(ckpt: &Checkpoint) -> Result<ExpertLayout, PackError> {
    let (mixtral, by_key) = scan_experts(ckpt)?;
    let model_type = ckpt
        .config()
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
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
    let mut tensors = Vec::with_capacity(order.len());
    let mut offset = 0u64;
    for suffix in &order {
        let name = source_name(template, key0, suffix);
        let info = ckpt.tensor(&name)?;
        let dtype = check_dtype(&name, info, suffix)?;
        offset = offset.next_multiple_of(TENSOR_ALIGN_BYTES);
        tensors.push(TensorLayout {
            name: (*suffix).to_string(),
            dtype,
            shape: info.shape.clone(),
            offset,
            len_bytes: info.len_bytes,
        });
        offset += info.len_bytes;
    }
    check_scales(template, key0, &tensors)?;
    for (&key, suffixes) in entries {
        check_same(ckpt, template, key, suffixes, &tensors)?;
    }
    let dtype = tensors.first().map_or(Dtype::Bf16, |t| t.dtype);
    Ok(ExpertLayout {
        family,
        keys: by_key.keys().copied().collect(),
        tensors,
        payload_bytes: offset,
        dtype,
    })
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
                    "{} {:?}, other experts have {} {:?}",
                    info.dtype, info.shape, t.dtype, t.shape
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

    #[test]
    fn record_order_puts_scales_after_their_matrix() {
        let mut s = vec![
            "down_proj.weight",
            "gate_proj.weight_scale_inv",
            "up_proj.weight",
            "gate_proj.weight",
            "down_proj.weight_scale_inv",
        ];
        s.sort_by_key(|x| suffix_rank(x));
        assert_eq!(
            s,
            [
                "gate_proj.weight",
                "gate_proj.weight_scale_inv",
                "up_proj.weight",
                "down_proj.weight",
                "down_proj.weight_scale_inv"
            ]
        );
    }

    #[test]
    fn source_names_substitute() {
        let n = source_name(
            ExpertFamily::Mixtral.prefix_template(),
            RecordKey::new(2, 5),
            "w1.weight",
        );
        assert_eq!(n, "model.layers.2.block_sparse_moe.experts.5.w1.weight");
    }
}
