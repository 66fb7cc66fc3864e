//! The error of packing a checkpoint into a store.

use std::path::PathBuf;

use crate::checkpoint::files::CheckpointError;

/// Why packing (or pairing a store with its checkpoint) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PackError {
    /// Reading the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Writing the store failed.
    #[error(transparent)]
    Io(#[from] flashtier_io::IoError),
    /// The output was refused (an input of the pack, or a file of another
    /// kind), is locked by another writer, or could not be persisted.
    #[error(transparent)]
    Persist(#[from] flashtier_io::PersistError),
    /// The store format refused the plan (or the store, when pairing).
    #[error(transparent)]
    Format(#[from] flashtier_format::FormatError),
    /// `config.json` lacks a field or disagrees with the tensors.
    #[error("{path}: field {scope}{field}: {why}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// Where the field sits: `""`, or `text_config.` in a multimodal
        /// wrapper ([`crate::checkpoint::files::CheckpointFiles::config_scope`]).
        scope: &'static str,
        /// Field name.
        field: &'static str,
        /// What is wrong.
        why: String,
    },
    /// No tensor matches a known expert layout.
    #[error(
        "{dir}: no expert tensors found (expected model.layers.L.mlp.experts.E.* or model.layers.L.block_sparse_moe.experts.E.*)"
    )]
    NoExperts {
        /// Checkpoint folder.
        dir: PathBuf,
    },
    /// Expert tensors of two layouts in one checkpoint.
    #[error("expert tensors of two layouts in one checkpoint: {first} and {second}")]
    MixedLayouts {
        /// A tensor of the first layout.
        first: String,
        /// A tensor of the other layout.
        second: String,
    },
    /// An expert tensor of a dtype the store does not hold.
    #[error(
        "tensor {tensor}: dtype {dtype} is not supported for expert {role}s (supported: {supported})"
    )]
    UnsupportedDtype {
        /// Tensor name.
        tensor: String,
        /// Its dtype.
        dtype: String,
        /// `matrix` or `scale`.
        role: &'static str,
        /// The dtypes that are.
        supported: &'static str,
    },
    /// An FP8 matrix without its scales.
    #[error(
        "tensor {tensor}: F8_E4M3 weights need a scale tensor ({tensor}_scale_inv or {tensor}_scale)"
    )]
    MissingScale {
        /// The FP8 matrix.
        tensor: String,
    },
    /// Experts whose tensors differ in name, dtype or shape.
    #[error("tensor {tensor}: {why}")]
    Inconsistent {
        /// The tensor at fault (or the one missing).
        tensor: String,
        /// What differs.
        why: String,
    },
    /// A store paired with a checkpoint it was not packed from.
    #[error("store {store} does not belong to checkpoint {dir}: {why}")]
    SourceMismatch {
        /// The store file.
        store: PathBuf,
        /// The checkpoint folder.
        dir: PathBuf,
        /// What differs.
        why: String,
    },
    /// A store whose manifest disagrees with its checkpoint's headers about
    /// one record (boxed: it names six things).
    #[error(transparent)]
    RecordMismatch(Box<RecordMismatch>),
    /// A packing thread failed outside I/O (it panicked).
    #[error("packing thread failed: {0}")]
    Thread(String),
}

/// A store whose manifest disagrees with its checkpoint's headers about one
/// record: its key, or a tensor's name, dtype, shape or place.
#[derive(Debug, thiserror::Error)]
#[error(
    "store {store} does not match checkpoint {dir}: record {record} ({key}), tensor {tensor} \
     (checkpoint tensor {source_tensor}): {why}"
)]
#[non_exhaustive]
pub struct RecordMismatch {
    /// The store file.
    pub store: PathBuf,
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Record index.
    pub record: u64,
    /// Its key in the manifest, e.g. `layer=3 expert=7`.
    pub key: String,
    /// The record tensor at fault (as the manifest names it).
    pub tensor: String,
    /// The checkpoint tensor it comes from.
    pub source_tensor: String,
    /// What differs.
    pub why: String,
}
