//! Recognising the expert tensors of a checkpoint and laying out one record.
//!
//! Families (the tensor name decides; `config.json`'s `model_type` tells
//! Qwen from DeepSeek, which share a naming):
//! - Qwen2-MoE / Qwen3-MoE: `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`
//! - Mixtral: `model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}.weight`
//! - DeepSeek-V2/V3: `model.layers.L.mlp.experts.E.*`; shared experts
//!   (`mlp.shared_experts.*`) and dense layers do not match and stay dense.
//!
//! Two ways a checkpoint holds them ([`ExpertTensors`]): one tensor per
//! expert matrix (`split.rs`, the hub layout), or one pair per layer
//! (`fused.rs`, transformers 5). A fused record's tensors are stored under
//! the family's per-expert names (`gate_proj.weight`...; `w1.weight`... for
//! Mixtral), so a store packed from either layout reads the same.
//!
//! Before any of that, the config's counts are checked
//! ([`check_config_counts`]), so the manifest never records a count
//! the checkpoint does not have.
//!
//! Every (layer, expert) must hold the same tensor suffixes with the same
//! dtype and shape. A record holds them in the order gate, up, down (w1, w3,
//! w2), each matrix followed by its scales, each tensor at a
//! [`TENSOR_ALIGN_BYTES`]-aligned offset so a single matrix can be read
//! directly.

mod counts;
mod fused;
mod split;

use flashtier_format::{Dtype, RecordKey, TensorLayout};

pub use counts::check_config_counts;

use super::error::PackError;
use crate::checkpoint::files::{CheckpointFiles as Checkpoint, TensorInfo};

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
    pub source: ExpertTensors,
}

/// How a record's tensors sit in the checkpoint (the manifest's
/// `expert_tensors`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertTensors {
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

impl ExpertTensors {
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
    /// The layout of `tensors` (in record order, offsets not yet set), each
    /// placed at the next [`TENSOR_ALIGN_BYTES`] boundary.
    fn placed(
        family: ExpertFamily,
        keys: Vec<RecordKey>,
        mut tensors: Vec<TensorLayout>,
        source: ExpertTensors,
    ) -> Self {
        let mut offset = 0u64;
        for t in &mut tensors {
            offset = offset.next_multiple_of(TENSOR_ALIGN_BYTES);
            t.offset = offset;
            offset += t.len_bytes;
        }
        let dtype = tensors.first().map_or(Dtype::Bf16, |t| t.dtype);
        Self {
            family,
            keys,
            tensors,
            payload_bytes: offset,
            dtype,
            source,
        }
    }

    /// Where record tensor `t` of expert `key` comes from: the checkpoint
    /// tensor's name and the byte offset of `t`'s bytes within it (their
    /// length is `t.len_bytes`).
    #[must_use]
    pub fn source_of(&self, key: RecordKey, t: &TensorLayout) -> (String, u64) {
        match self.source {
            ExpertTensors::Split => (source_name(self.family.prefix_template(), key, &t.name), 0),
            ExpertTensors::Fused { prefix } => {
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

/// Find the experts of `ckpt` and lay out one record.
pub fn expert_layout(ckpt: &Checkpoint) -> Result<ExpertLayout, PackError> {
    check_config_counts(ckpt)?;
    let model_type = ckpt
        .config()
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    match fused::fused_layout(ckpt, model_type)? {
        Some(fused) => Ok(fused),
        None => split::split_layout(ckpt, model_type),
    }
}

const MATRIX_DTYPES: &str = "BF16, F16, F32, F8_E4M3";
const SCALE_DTYPES: &str = "F32, BF16, F16";

/// Record order of a tensor suffix: gate, up, down (w1, w3, w2), then
/// anything else; a matrix before its scales.
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

/// The dtype of tensor `name`, if a record may hold it in its role (a
/// matrix, or a scale when `suffix` says so).
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

#[cfg(test)]
mod tests {
    use super::*;

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
