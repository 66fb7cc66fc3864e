//! Recognising the expert tensors of a checkpoint and laying out one record.
//!
//! Families (the tensor name decides; `config.json`'s `model_type` tells
//! Qwen from DeepSeek, which share a naming):
//! - Qwen2-MoE / Qwen3-MoE: `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`
//! - Mixtral: `model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}.weight`
//! - DeepSeek-V2/V3: `model.layers.L.mlp.experts.E.*`; shared experts
//!   (`mlp.shared_experts.*`) and dense layers do not match and stay dense.
//!
//! - transformers 5 (fused): one pair per layer,
//!   `model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]` (each expert's
//!   gate rows, then its up rows) and `...experts.down_proj [E, H, I]`
//!   (`block_sparse_moe.experts.` is accepted too). A record's gate, up and
//!   down are contiguous byte ranges of them, stored under the family's
//!   per-expert names (`gate_proj.weight`...; `w1.weight`... for Mixtral),
//!   so a store packed from either layout reads the same.
//!
//! Before any of that, the config's counts are checked
//! ([`check_config_counts`]): `num_hidden_layers` is a count and the
//! checkpoint's `model.layers.N.*` tensors name exactly layers
//! `0..num_hidden_layers` (DeepSeek's `num_nextn_predict_layers` may
//! follow), so the manifest never records a layer count the checkpoint does
//! not have; every other count the manifest takes from the config is a
//! count when present (a field of the wrong type is named as such, not as
//! missing).
//!
//! Every (layer, expert) must hold the same tensor suffixes with the same
//! dtype and shape. A record holds them in the order gate, up, down (w1, w3,
//! w2), each matrix followed by its scales, each tensor at a 4096-aligned
//! offset so a single matrix can be read directly.

use std::collections::{BTreeMap, BTreeSet};

use flashtier_format::{Dtype, RecordKey, TensorLayout};

use super::error::PackError;
use crate::config::bounds::{checkpoint_layers, layer_mismatch};
use crate::error::dims;
use crate::source::{Checkpoint, TensorInfo};

/// The config fields the manifest takes counts from.
const COUNT_FIELDS: [&str; 9] = [
    "num_hidden_layers",
    "num_nextn_predict_layers",
    "hidden_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
];

/// The config's counts against the checkpoint (see the module docs).
pub fn check_config_counts(ckpt: &Checkpoint) -> Result<(), PackError> {
    let err = |field: &'static str, why: String| PackError::Config {
        path: ckpt.dir().join("config.json"),
        field,
        why,
    };
    let count = |field: &'static str| match ckpt.config().get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| err(field, format!("{v} is not a count"))),
    };
    for field in COUNT_FIELDS {
        count(field)?;
    }
    let layers =
        count("num_hidden_layers")?.ok_or_else(|| err("num_hidden_layers", "missing".into()))?;
    let extra = count("num_nextn_predict_layers")?.unwrap_or(0);
    let present = checkpoint_layers(ckpt.tensors().keys().map(String::as_str));
    match layer_mismatch(layers, extra, &present) {
        Some(found) => Err(err("num_hidden_layers", format!("{layers}, but {found}"))),
        None => Ok(()),
    }
}

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
    /// How the records' tensors sit in the checkpoint.
    pub source: ExpertSource,
}

/// How a record's tensors sit in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSource {
    /// One checkpoint tensor per record tensor (the hub layout).
    Split,
    /// The transformers-5 fused pair per layer under `prefix` (with
    /// `{layer}`): `{prefix}gate_up_proj [E, 2I, H]`, `{prefix}down_proj
    /// [E, H, I]`.
    Fused {
        /// Tensor prefix template, `{layer}` to substitute.
        prefix: &'static str,
    },
}

impl ExpertSource {
    /// The manifest's name for it (`split` or `fused`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Split => "split",
            Self::Fused { .. } => "fused",
        }
    }
}

impl ExpertLayout {
    /// Where record tensor `t` of expert `key` comes from: the checkpoint
    /// tensor's name and the byte offset of `t`'s bytes within it (their
    /// length is `t.len_bytes`).
    #[must_use]
    pub fn source_of(&self, key: RecordKey, t: &TensorLayout) -> (String, u64) {
        match self.source {
            ExpertSource::Split => (source_name(self.family.prefix_template(), key, &t.name), 0),
            ExpertSource::Fused { prefix } => {
                let prefix = prefix.replace("{layer}", &key.layer.to_string());
                let e = u64::from(key.item);
                // Gate, up and down have the same byte length.
                let mat = t.len_bytes;
                match suffix_rank(&t.name).0 {
                    0 => (format!("{prefix}gate_up_proj"), e * 2 * mat),
                    1 => (format!("{prefix}gate_up_proj"), e * 2 * mat + mat),
                    _ => (format!("{prefix}down_proj"), e * mat),
                }
            }
        }
    }
}

/// The two fused-tensor prefixes transformers 5 writes.
const FUSED_PREFIXES: [&str; 2] = [
    "model.layers.{layer}.mlp.experts.",
    "model.layers.{layer}.block_sparse_moe.experts.",
];

/// A fused expert tensor's (prefix template, layer, which): `which` is
/// `gate_up_proj` or `down_proj`.
fn parse_fused_name(name: &str) -> Option<(&'static str, u32, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (prefix, which) = if let Some(w) = rest.strip_prefix("mlp.experts.") {
        (FUSED_PREFIXES[0], w)
    } else {
        (
            FUSED_PREFIXES[1],
            rest.strip_prefix("block_sparse_moe.experts.")?,
        )
    };
    matches!(which, "gate_up_proj" | "down_proj").then_some(())?;
    Some((prefix, layer.parse().ok()?, which))
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
    check_config_counts(ckpt)?;
    let model_type = ckpt
        .config()
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if let Some(fused) = fused_layout(ckpt, model_type)? {
        return Ok(fused);
    }
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
        source: ExpertSource::Split,
    })
}

/// The layout of a checkpoint whose experts are fused per layer
/// (transformers 5), or `None` when it has no fused expert tensor.
fn fused_layout(ckpt: &Checkpoint, model_type: &str) -> Result<Option<ExpertLayout>, PackError> {
    // (prefix, layer) -> (gate_up, down) tensor names.
    let mut layers: BTreeMap<u32, (&'static str, Option<&str>, Option<&str>)> = BTreeMap::new();
    let mut split: Option<&str> = None;
    for name in ckpt.tensors().keys() {
        if split.is_none() && parse_expert_name(name).is_some() {
            split = Some(name);
        }
        let Some((prefix, layer, which)) = parse_fused_name(name) else {
            continue;
        };
        let entry = layers.entry(layer).or_insert((prefix, None, None));
        if entry.0 != prefix {
            return Err(PackError::MixedLayouts {
                first: entry.1.or(entry.2).unwrap_or_default().to_string(),
                second: name.clone(),
            });
        }
        if which == "gate_up_proj" {
            entry.1 = Some(name);
        } else {
            entry.2 = Some(name);
        }
    }
    let Some((&first_layer, &(prefix, _, _))) = layers.iter().next() else {
        return Ok(None);
    };
    if let Some((_, &(_, g, d))) = layers.iter().find(|(_, (p, _, _))| *p != prefix) {
        return Err(PackError::MixedLayouts {
            first: layers
                .values()
                .find_map(|(_, g, d)| g.or(*d))
                .unwrap_or_default()
                .to_string(),
            second: g.or(d).unwrap_or_default().to_string(),
        });
    }
    if let Some(split) = split {
        let fused = layers
            .values()
            .find_map(|(_, g, d)| g.or(*d))
            .unwrap_or_default();
        return Err(PackError::MixedLayouts {
            first: fused.to_string(),
            second: split.to_string(),
        });
    }
    let family = match model_type {
        t if t.starts_with("mixtral") => ExpertFamily::Mixtral,
        t if t.starts_with("deepseek") => ExpertFamily::DeepSeek,
        _ => ExpertFamily::QwenMoe,
    };
    let fused_name = |layer: u32, which: &str| {
        format!("{}{which}", prefix.replace("{layer}", &layer.to_string()))
    };
    // Shapes and dtype from the first layer; every layer must agree.
    let (mut experts, mut inter, mut hidden, mut dtype) = (0u64, 0u64, 0u64, Dtype::Bf16);
    for (&layer, &(_, gate_up, down)) in &layers {
        let (Some(gate_up), Some(down)) = (gate_up, down) else {
            let have = gate_up.or(down).unwrap_or_default();
            let missing = if gate_up.is_none() {
                "gate_up_proj"
            } else {
                "down_proj"
            };
            return Err(PackError::Inconsistent {
                tensor: fused_name(layer, missing),
                why: format!("missing, while {have} is present"),
            });
        };
        let gu = ckpt.tensor(gate_up)?;
        let dn = ckpt.tensor(down)?;
        let d = check_dtype(gate_up, gu, "gate_up_proj")?;
        if d == Dtype::F8E4M3 {
            return Err(PackError::UnsupportedDtype {
                tensor: gate_up.to_string(),
                dtype: gu.dtype.clone(),
                role: "fused matrice",
                supported: "BF16, F16, F32",
            });
        }
        let bad = |tensor: &str, why: String| PackError::Inconsistent {
            tensor: tensor.to_string(),
            why,
        };
        let [e, two_i, h] = gu.shape[..] else {
            return Err(bad(
                gate_up,
                format!(
                    "shape {}, expected [experts, 2 * intermediate, hidden]",
                    dims(&gu.shape)
                ),
            ));
        };
        if two_i == 0 || two_i % 2 != 0 || e == 0 || h == 0 {
            return Err(bad(
                gate_up,
                format!(
                    "shape {}, expected [experts, 2 * intermediate, hidden]",
                    dims(&gu.shape)
                ),
            ));
        }
        let i = two_i / 2;
        if dn.shape != [e, h, i] || dn.dtype != gu.dtype {
            return Err(bad(
                down,
                format!(
                    "{} {}, but {gate_up} is {} {}: expected {} [{e}, {h}, {i}]",
                    dn.dtype,
                    dims(&dn.shape),
                    gu.dtype,
                    dims(&gu.shape),
                    gu.dtype
                ),
            ));
        }
        if layer == first_layer {
            (experts, inter, hidden, dtype) = (e, i, h, d);
        } else if (e, i, h, d) != (experts, inter, hidden, dtype) {
            return Err(bad(
                gate_up,
                format!(
                    "{} {}, but layer {first_layer}'s is {dtype} [{experts}, {}, {hidden}]",
                    gu.dtype,
                    dims(&gu.shape),
                    2 * inter
                ),
            ));
        }
    }
    let names: [&str; 3] = match family {
        ExpertFamily::Mixtral => ["w1.weight", "w3.weight", "w2.weight"],
        _ => ["gate_proj.weight", "up_proj.weight", "down_proj.weight"],
    };
    let shapes = [
        vec![inter, hidden],
        vec![inter, hidden],
        vec![hidden, inter],
    ];
    let len_bytes = inter * hidden * dtype.size_bytes();
    let mut offset = 0u64;
    let mut tensors = Vec::with_capacity(3);
    for (name, shape) in names.into_iter().zip(shapes) {
        offset = offset.next_multiple_of(TENSOR_ALIGN_BYTES);
        tensors.push(TensorLayout {
            name: name.to_string(),
            dtype,
            shape,
            offset,
            len_bytes,
        });
        offset += len_bytes;
    }
    let e = u32::try_from(experts).map_err(|_| PackError::Inconsistent {
        tensor: fused_name(first_layer, "gate_up_proj"),
        why: format!("{experts} experts"),
    })?;
    Ok(Some(ExpertLayout {
        family,
        keys: layers
            .keys()
            .flat_map(|&l| (0..e).map(move |x| RecordKey::new(l, x)))
            .collect(),
        tensors,
        payload_bytes: offset,
        dtype,
        source: ExpertSource::Fused { prefix },
    }))
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
