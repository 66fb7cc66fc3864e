//! The engine's error type: every variant names the file, field, tensor or
//! id at fault, so a model the engine cannot run says exactly why.

use std::path::PathBuf;

/// Why a model could not be loaded or a decode step could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// File at fault.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON.
    #[error("{path}: not valid JSON: {source}")]
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
    /// The checkpoint (config.json, index, safetensors headers) could not be read.
    #[error(transparent)]
    Checkpoint(#[from] crate::source::CheckpointError),
    /// A read outside a tensor, or a tensor too large for this machine.
    #[error("{path}: {reason}")]
    Safetensors {
        /// File at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the model needs is in no checkpoint file.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// Tensor name.
        name: String,
    },
    /// A tensor has the wrong shape for the config.
    #[error("tensor `{name}` has shape {got:?}, the config implies {want:?}")]
    TensorShape {
        /// Tensor name.
        name: String,
        /// Shape in the file.
        got: Vec<usize>,
        /// Shape the config implies.
        want: Vec<usize>,
    },
    /// A tensor has a dtype the engine does not compute with.
    #[error("tensor `{name}` has dtype {dtype}; the engine supports BF16, F16 and F32")]
    TensorDtype {
        /// Tensor name.
        name: String,
        /// The dtype string from the safetensors header.
        dtype: String,
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
    /// An expert id or layer is outside the model.
    #[error("expert ({layer}, {expert}) is outside the model ({layers} layers, {experts} experts)")]
    ExpertOutOfRange {
        /// Layer asked for.
        layer: usize,
        /// Expert asked for.
        expert: usize,
        /// Layers in the model.
        layers: usize,
        /// Experts per layer.
        experts: usize,
    },
    /// The expert budget cannot hold the experts one layer of one token needs.
    #[error(
        "expert budget of {budget_bytes} bytes cannot hold the {need_bytes} bytes one token's \
         top-{top_k} experts of one layer need"
    )]
    BudgetTooSmall {
        /// The budget.
        budget_bytes: u64,
        /// Bytes one step needs.
        need_bytes: u64,
        /// Experts per token.
        top_k: usize,
    },
    /// The expert source (store, pool) failed.
    #[error("expert source: {0}")]
    Experts(String),
    /// The attention tier failed.
    #[error("attention: {0}")]
    Attention(String),
    /// The expert pool failed (read, checksum, budget, record lookup).
    #[error(transparent)]
    Pool(#[from] flashtier::experts::ExpertsError),
    /// A demo step (synthetic checkpoint, packing) failed.
    #[error("demo: {0}")]
    Demo(String),
    /// Reading expert bytes failed.
    #[error(transparent)]
    StoreIo(#[from] flashtier_io::IoError),
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
