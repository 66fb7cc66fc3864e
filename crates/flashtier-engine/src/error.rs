//! The engine's error type: every variant names the file, field, tensor,
//! record or id at fault, so a model the engine cannot run says exactly why.

use std::path::PathBuf;

use flashtier::experts::Precision;

/// `2x3x4` for a shape in an error message.
pub(crate) fn dims(shape: &[u64]) -> String {
    flashtier_format::text::shape(shape)
}

/// A size for an error message; `None` is a product past u64.
fn over_u64(value: Option<u64>) -> String {
    flashtier_format::text::or_overflow(value)
}

/// Why a model could not be loaded or a decode step could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The KV tier failed: a block that does not restore exactly (named
    /// with its tile), the store file's I/O (path, offset, length).
    #[error(transparent)]
    Kv(#[from] flashtier::kv::KvError),
    /// A KV budget on a device that keeps every position in RAM (the CPU
    /// engine has no KV tier path).
    #[error(
        "a KV budget (--kv-budget-hbm) needs the CUDA device; the CPU engine keeps every KV position in RAM{}",
        why.as_ref().map(|w| format!(" (no GPU: {w})")).unwrap_or_default()
    )]
    KvBudgetNeedsGpu {
        /// Why `auto` stayed on the CPU, when it did.
        why: Option<String>,
    },
    /// A KV budget too small for the resident window and the restore ring.
    #[error(
        "a KV budget of {budget} bytes of HBM is too small: the cache needs at least {needed} bytes (two resident chunks of {chunk_bytes} bytes in each of {layers} layers, plus a restore ring of {ring_bytes} bytes)"
    )]
    KvBudgetTooSmall {
        /// The budget asked for.
        budget: u64,
        /// The smallest budget that works.
        needed: u64,
        /// Bytes of one chunk of one layer.
        chunk_bytes: u64,
        /// Layers.
        layers: usize,
        /// Bytes of the restore ring.
        ring_bytes: u64,
    },
    /// A file could not be opened or read.
    #[error("{path}: {source}", path = path.display())]
    Io {
        /// File at fault.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON.
    #[error("{path}: not valid JSON: {source}", path = path.display())]
    Json {
        /// File at fault.
        path: PathBuf,
        /// Parser error.
        source: serde_json::Error,
    },
    /// A config field is missing, has the wrong type or an unsupported value.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The JSON field (dotted path for nested fields).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A config count the checkpoint's tensors contradict
    /// ([`crate::config::bounds`]).
    #[error("config field `{field}` is {value}, but {found}")]
    ConfigMismatch {
        /// The JSON field.
        field: String,
        /// Its value in config.json.
        value: String,
        /// What the checkpoint has instead.
        found: String,
    },
    /// A size a file or flag sets is over the engine's limit for it; refused
    /// before anything of that size is allocated.
    #[error("{what}: {value} {unit} is over the limit of {limit} {unit}", value = over_u64(*value))]
    TooLarge {
        /// What would have been allocated, and which field or flag sets it.
        what: String,
        /// The size asked for (`None`: more than 2^64).
        value: Option<u64>,
        /// The limit.
        limit: u64,
        /// Unit of both (`bytes`, `positions`, `values`).
        unit: &'static str,
    },
    /// The checkpoint (config.json, index, safetensors headers) could not be read.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::files::CheckpointError),
    /// A read outside a tensor, or a tensor too large for this machine.
    #[error("tensor `{name}`: bytes {start}+{len} are outside its {tensor_bytes} bytes")]
    TensorRange {
        /// Tensor name.
        name: String,
        /// First byte asked for, from the tensor's start.
        start: u64,
        /// Bytes asked for.
        len: u64,
        /// The tensor's length.
        tensor_bytes: u64,
    },
    /// A tensor the model needs is in no checkpoint file.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// Tensor name.
        name: String,
    },
    /// A tensor has the wrong shape for the config.
    #[error("tensor `{name}` has shape {got}, the config implies {want}", got = dims(got), want = dims(want))]
    TensorShape {
        /// Tensor name.
        name: String,
        /// Shape in the file.
        got: Vec<u64>,
        /// Shape the config implies.
        want: Vec<u64>,
    },
    /// A tensor has a dtype the engine does not compute with.
    #[error(
        "tensor `{name}` has dtype {dtype}; the engine computes with BF16, F16, F32 and F8_E4M3 blocks"
    )]
    TensorDtype {
        /// Tensor name.
        name: String,
        /// The dtype string from the safetensors header.
        dtype: String,
    },
    /// A matrix or record whose bytes do not fit its shape.
    #[error("{what}: {reason}")]
    Layout {
        /// What was being built.
        what: String,
        /// Why it does not fit.
        reason: String,
    },
    /// An expert store whose record layout does not match the model.
    #[error("expert store {store}: {reason}", store = store.display())]
    ExpertLayout {
        /// The store file.
        store: PathBuf,
        /// What does not match.
        reason: String,
    },
    /// A low-bit copy reached the exact-record kernels.
    #[error("record {record} is a {precision} copy; the engine computes with exact records only")]
    LowBitRecord {
        /// Record index.
        record: usize,
        /// The copy it holds.
        precision: Precision,
    },
    /// A device operation got operands of the wrong shape (a bug in the
    /// caller: shapes are checked when the weights load).
    #[error("{op}: operands do not fit: {what}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// The shapes involved.
        what: String,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        /// Offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The sequence would grow past the KV cache's capacity.
    #[error("sequence of {len} tokens exceeds the context limit of {max} tokens")]
    ContextFull {
        /// Tokens requested.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An expert id or layer no store record can have.
    #[error("expert ({layer}, {expert}) is outside any store")]
    ExpertOutOfRange {
        /// Layer asked for.
        layer: usize,
        /// Expert asked for.
        expert: usize,
    },
    /// The attention tier failed.
    #[error("attention: {0}")]
    Attention(String),
    /// The expert pool failed (read, checksum, budget, record lookup).
    #[error(transparent)]
    Pool(#[from] flashtier::experts::ExpertsError),
    /// A packed store does not pair with its checkpoint, or packing one
    /// (`flashtier-pack`) failed.
    #[error(transparent)]
    Pack(#[from] crate::store::PackError),
    /// Reading bytes failed.
    #[error(transparent)]
    StoreIo(#[from] flashtier_io::IoError),
    /// The model does not fit in the GPU's free memory.
    #[error(
        "the GPU has {free_bytes} of {total_bytes} bytes free; the model needs {need_bytes} \
         ({weights_bytes} of resident weights, {experts_bytes} of HBM expert slots): give a \
         smaller --budget-hbm, or run on the CPU"
    )]
    DeviceMemory {
        /// Bytes needed.
        need_bytes: u64,
        /// Of which resident weights.
        weights_bytes: u64,
        /// Of which expert slots.
        experts_bytes: u64,
        /// Free device memory.
        free_bytes: u64,
        /// Device memory.
        total_bytes: u64,
    },
    /// The GPU failed, or there is none.
    #[error(transparent)]
    Cuda(#[from] flashtier_cuda::CudaError),
    /// A `FLASHTIER_*` variable held a value its reader cannot take
    /// ([`crate::settings`]).
    #[error(transparent)]
    Setting(#[from] flashtier_io::settings::SettingError),
    /// An expert store file is not usable.
    #[error(transparent)]
    Format(#[from] flashtier_format::FormatError),
    /// A row store (Qwen4-Exp's PLE tables) failed.
    #[error(transparent)]
    Rows(#[from] flashtier::rows::RowError),
}

impl EngineError {
    /// A config error naming `field`.
    pub(crate) fn config(field: &str, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}
