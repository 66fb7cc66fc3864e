//! The JSON manifest of a store file: what the records are and how to find
//! one by key.
//!
//! It holds the kind, the element type, the layout of one record (each
//! tensor's name, dtype, shape, offset and length inside the record), the
//! key of every record in index order (record `i` has key `keys[i]`), and for
//! expert stores the source checkpoint and model it was packed from.
//!
//! [`Manifest::validate`] checks the manifest's own rules (tensor lengths
//! match shape times element size, tensors lie inside the payload without
//! overlapping, the payload ends where the last tensor ends, keys are
//! unique); [`Manifest::check_against`] checks it agrees with the header.
//! Unknown JSON fields are ignored (a reader of v1 reads any v1 writer's
//! additions); extensions belong in `extra`.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::error::FormatError;
use crate::header::{FORMAT_VERSION, Header, StoreKind};
use crate::text::{or_overflow, shape};

/// Element type of a tensor in a record, named as safetensors names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Dtype {
    /// bfloat16.
    #[serde(rename = "BF16")]
    Bf16,
    /// IEEE half.
    #[serde(rename = "F16")]
    F16,
    /// IEEE single.
    #[serde(rename = "F32")]
    F32,
    /// 8-bit float E4M3 (e4m3fn), moved as raw bytes.
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    /// Raw bytes (row stores, packed blocks).
    #[serde(rename = "U8")]
    U8,
}

impl Dtype {
    /// Bytes per element.
    #[must_use]
    pub const fn size_bytes(self) -> u64 {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
            Self::F8E4M3 | Self::U8 => 1,
        }
    }

    /// The safetensors name (`BF16`, `F8_E4M3`...).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "BF16",
            Self::F16 => "F16",
            Self::F32 => "F32",
            Self::F8E4M3 => "F8_E4M3",
            Self::U8 => "U8",
        }
    }

    /// The dtype with safetensors name `name`, if this format holds it.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Bf16, Self::F16, Self::F32, Self::F8E4M3, Self::U8]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The key of a record: (layer, item), where the item is an expert id for
/// expert stores, a row group for row stores, a block for KV stores. The
/// manifest's `key_fields` names the two parts. Serialised as `[layer, item]`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(from = "[u32; 2]", into = "[u32; 2]")]
pub struct RecordKey {
    /// Layer index.
    pub layer: u32,
    /// Expert, row group or block index within the layer.
    pub item: u32,
}

impl RecordKey {
    /// The key (layer, item).
    #[must_use]
    pub const fn new(layer: u32, item: u32) -> Self {
        Self { layer, item }
    }
}

impl From<[u32; 2]> for RecordKey {
    fn from([layer, item]: [u32; 2]) -> Self {
        Self { layer, item }
    }
}

impl From<RecordKey> for [u32; 2] {
    fn from(k: RecordKey) -> Self {
        [k.layer, k.item]
    }
}

/// One tensor inside a record.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorLayout {
    /// Name within the record; for expert stores the suffix of the source
    /// tensor name after the expert prefix (`gate_proj.weight`, `w1.weight`,
    /// `down_proj.weight_scale_inv`).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost first (as safetensors).
    pub shape: Vec<u64>,
    /// Byte offset from the start of the record.
    pub offset: u64,
    /// Length in bytes (`product(shape) * dtype size`).
    pub len_bytes: u64,
}

/// The layout shared by every record of a store.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecordLayout {
    /// Meaningful bytes per record: the end of the last tensor.
    pub payload_bytes: u64,
    /// The tensors, in increasing offset order.
    pub tensors: Vec<TensorLayout>,
}

impl RecordLayout {
    /// The tensor named `name`.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&TensorLayout> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// One file of the source checkpoint, as it was when the store was packed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceFile {
    /// File name relative to the checkpoint folder.
    pub name: String,
    /// Length in bytes.
    pub len_bytes: u64,
    /// XXH3-64 of the safetensors header (8-byte length and JSON), 16 hex digits.
    pub header_xxh3: String,
}

/// The checkpoint a store was packed from. Non-expert tensors are read from
/// these files; the sizes and header checksums detect a mismatched pairing.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceCheckpoint {
    /// Checkpoint folder, as given to the packer (made absolute).
    pub path: String,
    /// XXH3-64 of `config.json`, 16 hex digits.
    pub config_xxh3: String,
    /// The safetensors files, sorted by name.
    pub files: Vec<SourceFile>,
    /// Source name of a record's tensors. With `expert_tensors` `split`:
    /// this template with `{layer}` and `{expert}` substituted, then the
    /// tensor's `name`. With `fused`: this template with `{layer}`
    /// substituted, then `gate_up_proj` (`[E, 2I, H]`: expert `e`'s gate is
    /// rows `2Ie..2Ie+I`, its up the next `I` rows) or `down_proj`
    /// (`[E, H, I]`, expert `e`'s slice).
    pub tensor_prefix: String,
    /// `split` (one checkpoint tensor per record tensor) or `fused` (the
    /// transformers-5 per-layer pair). Absent in stores packed before it
    /// existed, which are all `split`.
    #[serde(default = "split_tensors")]
    pub expert_tensors: String,
}

fn split_tensors() -> String {
    "split".to_string()
}

/// What the packer learnt about the model from `config.json`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelInfo {
    /// Expert-tensor layout family (`qwen_moe`, `mixtral`, `deepseek`).
    pub layout: String,
    /// `model_type` from config.json.
    pub model_type: String,
    /// First entry of `architectures` from config.json.
    pub architecture: String,
    /// `num_hidden_layers`.
    pub num_layers: u32,
    /// Routed experts per MoE layer.
    pub num_experts: u32,
    /// Experts chosen per token, when config.json says.
    pub experts_per_token: Option<u32>,
    /// `hidden_size`.
    pub hidden_size: u64,
    /// Intermediate size of one routed expert.
    pub expert_intermediate_size: u64,
    /// Layers that have routed experts, ascending.
    pub expert_layers: Vec<u32>,
}

/// The manifest of a store file.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// Format version (equals the header's).
    pub format_version: u32,
    /// What the records hold (equals the header's).
    pub kind: StoreKind,
    /// Names of the two key parts, e.g. `["layer", "expert"]`.
    pub key_fields: [String; 2],
    /// Element type of the main tensors (scales may differ).
    pub dtype: Dtype,
    /// Layout of one record.
    pub record: RecordLayout,
    /// Key of each record, in record order.
    pub keys: Vec<RecordKey>,
    /// Source checkpoint (expert stores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceCheckpoint>,
    /// Model facts (expert stores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelInfo>,
    /// Extensions by other writers (low-bit companions, KV geometry...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Manifest {
    /// Serialise to compact JSON bytes.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serialising these plain structs cannot fail (string keys only).
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parse JSON bytes and check the manifest's own rules.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, FormatError> {
        let m: Self =
            serde_json::from_slice(bytes).map_err(|source| FormatError::ManifestJson {
                path: path.to_path_buf(),
                source,
            })?;
        m.validate(path)?;
        Ok(m)
    }

    /// A manifest whose records are one raw `U8` tensor named `payload` of
    /// `payload_bytes` bytes, keyed `(layer, item)`: the simplest store, used
    /// by examples, tests and writers that keep their own record layout.
    #[must_use]
    pub fn single_tensor(
        kind: StoreKind,
        dtype: Dtype,
        payload_bytes: u64,
        keys: Vec<RecordKey>,
    ) -> Self {
        let elems = payload_bytes / dtype.size_bytes();
        Self {
            format_version: FORMAT_VERSION,
            kind,
            key_fields: ["layer".into(), "item".into()],
            dtype,
            record: RecordLayout {
                payload_bytes: elems * dtype.size_bytes(),
                tensors: vec![TensorLayout {
                    name: "payload".into(),
                    dtype,
                    shape: vec![elems],
                    offset: 0,
                    len_bytes: elems * dtype.size_bytes(),
                }],
            },
            keys,
            source: None,
            model: None,
            extra: BTreeMap::new(),
        }
    }

    /// Render a key with the field names: `layer=3 expert=7`.
    #[must_use]
    pub fn key_name(&self, key: RecordKey) -> String {
        format!(
            "{}={} {}={}",
            self.key_fields[0], key.layer, self.key_fields[1], key.item
        )
    }

    /// Check the manifest's own rules (see the module docs).
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        let invalid = |field: String, why: String| FormatError::ManifestInvalid {
            path: path.to_path_buf(),
            field,
            why,
        };
        if self.record.tensors.is_empty() {
            return Err(invalid(
                "record.tensors".into(),
                "a record holds at least one tensor".into(),
            ));
        }
        let mut names = HashSet::new();
        let mut end = 0u64;
        for (i, t) in self.record.tensors.iter().enumerate() {
            let field = |f: &str| format!("record.tensors[{i}].{f}");
            if t.name.is_empty() || !names.insert(t.name.as_str()) {
                return Err(invalid(
                    field("name"),
                    if t.name.is_empty() {
                        "the name is empty".to_string()
                    } else {
                        format!("{} is repeated", t.name)
                    },
                ));
            }
            let elems = t.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let want = elems.and_then(|n| n.checked_mul(t.dtype.size_bytes()));
            if want != Some(t.len_bytes) {
                return Err(invalid(
                    field("len_bytes"),
                    format!(
                        "{} bytes, but shape {} of {} needs {}",
                        t.len_bytes,
                        shape(&t.shape),
                        t.dtype,
                        or_overflow(want)
                    ),
                ));
            }
            if t.offset < end {
                return Err(invalid(
                    field("offset"),
                    format!("{} overlaps the previous tensor (ends at {end})", t.offset),
                ));
            }
            end = t
                .offset
                .checked_add(t.len_bytes)
                .ok_or_else(|| invalid(field("offset"), "offset + len_bytes overflows".into()))?;
        }
        if end != self.record.payload_bytes {
            return Err(invalid(
                "record.payload_bytes".into(),
                format!(
                    "{} but the last tensor ends at {end}",
                    self.record.payload_bytes
                ),
            ));
        }
        let mut seen = HashSet::with_capacity(self.keys.len());
        for (i, k) in self.keys.iter().enumerate() {
            if !seen.insert(*k) {
                return Err(invalid(
                    format!("keys[{i}]"),
                    format!("{} repeats an earlier key", self.key_name(*k)),
                ));
            }
        }
        Ok(())
    }

    /// Check the manifest agrees with the header's geometry.
    pub fn check_against(&self, path: &Path, h: &Header) -> Result<(), FormatError> {
        let mismatch = |field, manifest: String, header: String| FormatError::ManifestMismatch {
            path: path.to_path_buf(),
            field,
            manifest,
            header,
        };
        if self.format_version != FORMAT_VERSION {
            return Err(mismatch(
                "format_version",
                self.format_version.to_string(),
                FORMAT_VERSION.to_string(),
            ));
        }
        if self.kind != h.kind {
            return Err(mismatch("kind", self.kind.to_string(), h.kind.to_string()));
        }
        if self.record.payload_bytes != h.payload_bytes {
            return Err(mismatch(
                "record.payload_bytes",
                self.record.payload_bytes.to_string(),
                h.payload_bytes.to_string(),
            ));
        }
        if self.keys.len() as u64 != h.record_count {
            return Err(mismatch(
                "keys",
                format!("{} keys", self.keys.len()),
                format!("record_count {}", h.record_count),
            ));
        }
        Ok(())
    }
}

/// Format a checksum as 16 lower-case hex digits (the manifest's spelling).
#[must_use]
pub fn hex_u64(v: u64) -> String {
    format!("{v:016x}")
}
