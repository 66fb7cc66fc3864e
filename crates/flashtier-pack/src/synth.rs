//! Synthetic MoE checkpoints in the Hugging Face safetensors layout, for the
//! demo, benchmarks and tests: no download, deterministic from a seed.
//!
//! [`SynthSpec`] describes the model (family, layers, experts, dimensions,
//! dtype, shards, seed); [`SynthSpec::scaled_to`] scales a real model's shape
//! to a size (see [`shape`]); [`write_checkpoint`] writes `config.json`, the safetensors files
//! and, when sharded, `model.safetensors.index.json`. Every tensor's bytes
//! depend only on the seed and the tensor's name ([`SynthSpec::tensor_bytes`]
//! regenerates one). Values are small uniform weights (scaled by
//! 1/sqrt(fan-in)), norms near 1; FP8 matrices come with 128x128 block
//! scales (`weight_scale_inv`, F32) as DeepSeek-V3 / Qwen3 FP8 checkpoints
//! ship them. DeepSeek models are DeepSeek-V3-shaped: latent attention
//! (low-rank query, compressed key/value latent), the routing correction
//! bias, a dense first layer and a shared expert, so the engine decodes them.
//!
//! Memory: tensors are generated and written in chunks of at most
//! [`CHUNK_BYTES`], so writing needs a bounded buffer whatever the size.

use std::io::Write;
use std::path::{Path, PathBuf};

use flashtier_format::Dtype;
use serde_json::json;

/// Largest piece of a tensor generated at once.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Model family of a synthetic checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SynthArch {
    /// Qwen3-MoE (`mlp.experts.E.{gate,up,down}_proj`, q/k norms).
    Qwen3Moe,
    /// Qwen2-MoE (same experts, plus one shared expert with a gate).
    Qwen2Moe,
    /// Mixtral (`block_sparse_moe.experts.E.{w1,w2,w3}`).
    Mixtral,
    /// DeepSeek-V3 style (dense first layer, shared experts left dense).
    DeepSeek,
}

impl SynthArch {
    /// Every family.
    pub const ALL: [Self; 4] = [
        Self::Qwen3Moe,
        Self::Qwen2Moe,
        Self::Mixtral,
        Self::DeepSeek,
    ];

    /// `model_type` as config.json spells it.
    #[must_use]
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Mixtral => "mixtral",
            Self::DeepSeek => "deepseek_v3",
        }
    }
}

impl std::str::FromStr for SynthArch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3_moe" | "qwen3" => Ok(Self::Qwen3Moe),
            "qwen2_moe" | "qwen2" => Ok(Self::Qwen2Moe),
            "mixtral" => Ok(Self::Mixtral),
            "deepseek" | "deepseek_v3" => Ok(Self::DeepSeek),
            other => Err(format!(
                "unknown arch `{other}` (qwen3_moe | qwen2_moe | mixtral | deepseek)"
            )),
        }
    }
}

/// A synthetic model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthSpec {
    /// Family (decides tensor names and config fields).
    pub arch: SynthArch,
    /// Decoder layers.
    pub layers: u32,
    /// Routed experts per MoE layer.
    pub experts: u32,
    /// Experts chosen per token.
    pub experts_per_token: u32,
    /// Hidden size.
    pub hidden: u64,
    /// Intermediate size of one routed expert.
    pub intermediate: u64,
    /// Intermediate size of dense layers and shared experts.
    pub dense_intermediate: u64,
    /// Attention heads.
    pub heads: u32,
    /// KV heads (divides `heads`).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Element type of the matrices (BF16, F16, F32 or F8_E4M3 + scales).
    pub dtype: Dtype,
    /// Leading dense layers (DeepSeek's `first_k_dense_replace`; at most
    /// `layers - 1`; ignored by the other families).
    pub dense_layers: u32,
    /// Expert groups and the groups a token may choose from (DeepSeek's
    /// `n_group`, `topk_group`; `[1, 1]` is plain top-k).
    pub expert_groups: [u32; 2],
    /// Number of safetensors files (1 = `model.safetensors`).
    pub shards: u32,
    /// Seed of every tensor's values.
    pub seed: u64,
}

/// Why a synthetic checkpoint could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    /// The spec is not a model.
    #[error("invalid synthetic model: {0}")]
    Invalid(String),
    /// Writing failed.
    #[error("write {path}: {source}")]
    Io {
        /// File written.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The folder holds something that is not a synthetic checkpoint this
    /// project wrote (a real model, say); it is never replaced.
    #[error(
        "{dir} exists and is not a synthetic checkpoint written by flashtier (its config.json has no `flashtier_synthetic` entry); refusing to write over it"
    )]
    NotSynthetic {
        /// The folder.
        dir: PathBuf,
    },
}

/// Whether `dir` is missing, empty, or a synthetic checkpoint (its
/// `config.json` carries the `flashtier_synthetic` entry); anything else is
/// refused with [`SynthError::NotSynthetic`].
fn check_replaceable(dir: &Path) -> Result<(), SynthError> {
    let io = |source| SynthError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    if entries.next().is_none() {
        return Ok(());
    }
    // A FIFO or device as config.json is refused unopened: no synthetic
    // checkpoint, and no wait for a writer.
    let mut config = Vec::new();
    let synthetic = flashtier_format::open_regular_read(&dir.join("config.json"))
        .ok()
        .and_then(|mut f| std::io::Read::read_to_end(&mut f, &mut config).ok())
        .and_then(|_| serde_json::from_slice::<serde_json::Value>(&config).ok())
        .is_some_and(|v| v.get("flashtier_synthetic").is_some());
    if synthetic {
        Ok(())
    } else {
        Err(SynthError::NotSynthetic {
            dir: dir.to_path_buf(),
        })
    }
}

/// Remove the synthetic checkpoint in `dir` (nothing when it is missing);
/// a folder that is not one is left alone and refused.
pub fn remove_synthetic(dir: &Path) -> Result<(), SynthError> {
    check_replaceable(dir)?;
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(SynthError::Io {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in (-scale, scale).
    Uniform(f32),
    /// 1 + uniform noise of this size (norm weights).
    NearOne(f32),
    /// Positive FP8 block scales around this value.
    Scale(f32),
    /// Row `r` holds the values row `(r + shift) % rows` of the tensor whose
    /// name hashes to `of` would hold with `Uniform(scale)` (the LM head
    /// made of shifted embedding rows).
    ShiftedRows {
        /// Uniform scale of the source tensor.
        scale: f32,
        /// xxh3 of the source tensor's name.
        of: u64,
        /// Rows to shift by.
        shift: u64,
        /// Rows of both tensors.
        rows: u64,
        /// Columns of both tensors.
        cols: u64,
    },
}

/// One tensor of a synthetic checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Value distribution.
    pub init: Init,
}

impl SynthTensor {
    /// Length in bytes.
    #[must_use]
    pub fn len_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size_bytes()
    }
}

impl SynthSpec {
    /// A tiny model for tests (a few hundred KB).
    #[must_use]
    pub fn tiny(arch: SynthArch, dtype: Dtype, seed: u64) -> Self {
        Self {
            arch,
            layers: 2,
            experts: 4,
            experts_per_token: 2,
            hidden: 64,
            intermediate: 32,
            dense_intermediate: 64,
            heads: 2,
            kv_heads: 1,
            head_dim: 32,
            vocab: 128,
            dtype,
            dense_layers: 1,
            expert_groups: [1, 1],
            shards: 2,
            seed,
        }
    }

    /// DeepSeek's leading dense layers as written (none with one layer).
    pub(crate) fn leading_dense(&self) -> u32 {
        if self.arch == SynthArch::DeepSeek {
            self.dense_layers.min(self.layers.saturating_sub(1))
        } else {
            0
        }
    }

    /// The first layer with experts.
    pub(crate) fn first_sparse_layer(&self) -> u32 {
        self.leading_dense()
    }

    /// Bytes of one expert record's tensors (before 4096 alignment).
    #[must_use]
    pub fn expert_bytes(&self) -> u64 {
        let layer = self.first_sparse_layer();
        let marker = match self.arch {
            SynthArch::Mixtral => ".block_sparse_moe.experts.0.",
            _ => ".mlp.experts.0.",
        };
        self.layer_tensors(layer)
            .iter()
            .filter(|t| t.name.contains(marker))
            .map(SynthTensor::len_bytes)
            .sum()
    }

    /// Bytes of every tensor.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.tensors().iter().map(SynthTensor::len_bytes).sum()
    }

    fn check(&self) -> Result<(), SynthError> {
        let dims = [
            self.hidden,
            self.intermediate,
            self.dense_intermediate,
            self.head_dim,
            self.vocab,
        ];
        let counts = [
            self.layers,
            self.experts,
            self.heads,
            self.kv_heads,
            self.shards,
            self.experts_per_token,
        ];
        if dims.contains(&0) || counts.contains(&0) {
            return Err(SynthError::Invalid(format!(
                "a zero dimension or count: hidden, intermediate, dense intermediate, head_dim, \
                 vocab {}; layers, experts, heads, kv heads, shards, experts per token {}",
                flashtier_format::text::list(&dims),
                flashtier_format::text::list(&counts)
            )));
        }
        if self.heads % self.kv_heads != 0 || self.experts_per_token > self.experts {
            return Err(SynthError::Invalid(
                "kv_heads must divide heads, experts_per_token <= experts".into(),
            ));
        }
        let [groups, chosen] = self.expert_groups;
        let per_group = self.experts / groups.max(1);
        if groups == 0
            || chosen == 0
            || chosen > groups
            || self.experts % groups != 0
            || (groups > 1 && (per_group < 2 || chosen * per_group < self.experts_per_token))
        {
            return Err(SynthError::Invalid(format!(
                "expert groups {groups} (choose {chosen}) do not fit {} experts, top-{}",
                self.experts, self.experts_per_token
            )));
        }
        if !matches!(
            self.dtype,
            Dtype::Bf16 | Dtype::F16 | Dtype::F32 | Dtype::F8E4M3
        ) {
            return Err(SynthError::Invalid(format!(
                "dtype {} (use BF16, F16, F32, F8_E4M3)",
                self.dtype
            )));
        }
        Ok(())
    }
}

mod plan;
pub mod qwen4;
pub use plan::config_json;
pub use qwen4::{Qwen4Spec, write_qwen4_checkpoint};
pub mod shape;
mod values;
pub use values::fill_tensor;

impl SynthSpec {
    /// Regenerate the bytes of tensor `name` (`None` if the model has none).
    #[must_use]
    pub fn tensor_bytes(&self, name: &str) -> Option<Vec<u8>> {
        let t = self.tensors().into_iter().find(|t| t.name == name)?;
        let mut out = vec![0u8; usize::try_from(t.len_bytes()).ok()?];
        fill_tensor(self.seed, &t, 0, &mut out);
        Some(out)
    }
}

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// The safetensors files.
    pub files: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Tensor bytes written.
    pub bytes: u64,
}

/// Write the checkpoint of `spec` into `dir` (created if missing).
/// `progress` is called with the tensor bytes written since the last call.
pub fn write_checkpoint(
    spec: &SynthSpec,
    dir: &Path,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<SynthReport, SynthError> {
    spec.check()?;
    let files = SynthFiles {
        config: config_json(spec),
        tensors: spec.tensors(),
        shards: spec.shards,
        seed: spec.seed,
    };
    files.write(dir, progress)
}

/// A synthetic checkpoint as files: its config.json, its tensors in file
/// order, how many safetensors files they are split over, and the seed of
/// their values.
pub(crate) struct SynthFiles {
    pub(crate) config: serde_json::Value,
    pub(crate) tensors: Vec<SynthTensor>,
    pub(crate) shards: u32,
    pub(crate) seed: u64,
}

impl SynthFiles {
    /// Write `config.json`, the safetensors files and, when sharded, the
    /// index into `dir` (created; an older synthetic checkpoint there is
    /// replaced, anything else refused).
    pub(crate) fn write(
        &self,
        dir: &Path,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<SynthReport, SynthError> {
        check_replaceable(dir)?;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| SynthError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let config_path = dir.join("config.json");
        let config = serde_json::to_vec_pretty(&self.config).unwrap_or_default();
        std::fs::write(&config_path, config).map_err(io(&config_path))?;
        let shards = plan::split_shards(&self.tensors, self.shards);
        let n = shards.len();
        let mut files = Vec::with_capacity(n);
        let mut weight_map = serde_json::Map::new();
        let mut bytes = 0u64;
        let names: Vec<String> = (0..n)
            .map(|i| {
                if n == 1 {
                    "model.safetensors".to_string()
                } else {
                    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                }
            })
            .collect();
        // Shards are independent files: written in parallel (a reference-sized
        // model is tens of GB), progress reported under one lock.
        let progress = std::sync::Mutex::new(progress);
        let seed = self.seed;
        let written: Vec<Result<u64, SynthError>> = {
            use rayon::prelude::*;
            shards
                .par_iter()
                .zip(names.par_iter())
                .map(|(shard, name)| {
                    let path = dir.join(name);
                    let mut report = |b: u64| {
                        if let Ok(mut p) = progress.lock() {
                            (*p)(b);
                        }
                    };
                    values::write_safetensors(seed, shard, &path, &mut report).map_err(io(&path))
                })
                .collect()
        };
        for ((shard, name), w) in shards.iter().zip(&names).zip(written) {
            bytes += w?;
            for t in shard {
                weight_map.insert(t.name.clone(), json!(name));
            }
            files.push(dir.join(name));
        }
        if n > 1 {
            let index = json!({ "metadata": { "total_size": bytes }, "weight_map": weight_map });
            let path = dir.join("model.safetensors.index.json");
            let mut f = std::fs::File::create(&path).map_err(io(&path))?;
            f.write_all(&serde_json::to_vec_pretty(&index).unwrap_or_default())
                .map_err(io(&path))?;
        }
        Ok(SynthReport {
            dir: dir.to_path_buf(),
            files,
            tensors: self.tensors.len(),
            bytes,
        })
    }
}
