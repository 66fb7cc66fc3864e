//! The error of reading a checkpoint: every variant names the file, and the
//! tensor, offset or range at fault.

use std::path::PathBuf;

/// Why a checkpoint could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// `config.json` or the index could not be read.
    #[error("read {path} at offset {offset} length {len}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// `config.json` or the index could not be opened, or is no regular
    /// file (a FIFO, a device).
    #[error(transparent)]
    Open(#[from] flashtier_format::OpenError),
    /// A safetensors file could not be opened or read through
    /// `flashtier-io` (names the file, offset and length; a FIFO or device
    /// is refused before it is opened).
    #[error(transparent)]
    Storage(#[from] flashtier_io::IoError),
    /// Neither `model.safetensors` nor `model.safetensors.index.json` exists.
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoWeights {
        /// Checkpoint folder.
        dir: PathBuf,
    },
    /// A JSON file (config, index, safetensors header) is malformed.
    #[error("{path}: {what}")]
    Json {
        /// File.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A safetensors header breaks the format.
    #[error("{path}: tensor {tensor}: {why}")]
    BadTensor {
        /// File.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        why: String,
    },
    /// Two tensors of one file claim the same bytes (ranges are
    /// `data_offsets`, relative to the start of the data section).
    #[error(
        "{path}: tensors {first} (data_offsets [{first_begin}, {first_end})) and {second} \
         (data_offsets [{second_begin}, {second_end})) overlap"
    )]
    OverlappingTensors {
        /// File.
        path: PathBuf,
        /// The tensor that starts first.
        first: String,
        /// Its first byte.
        first_begin: u64,
        /// One past its last byte.
        first_end: u64,
        /// The tensor that starts inside it.
        second: String,
        /// Its first byte.
        second_begin: u64,
        /// One past its last byte.
        second_end: u64,
    },
    /// Bytes of the data section that no tensor covers, between two tensors
    /// (or before the first). safetensors writers pack tensors back to back.
    #[error(
        "{path}: data bytes [{begin}, {end}) between {before} and tensor {after} belong to no \
         tensor (safetensors packs tensors back to back)"
    )]
    DataGap {
        /// File.
        path: PathBuf,
        /// The tensor that ends at `begin` (or "the start of the data section").
        before: String,
        /// The tensor that starts at `end`.
        after: String,
        /// First uncovered byte (relative to the data section).
        begin: u64,
        /// One past the last uncovered byte.
        end: u64,
    },
    /// The data section runs past the end of its last tensor.
    #[error(
        "{path}: the data section is {data_len} bytes but its tensors end at byte {covered} \
         (trailing bytes after the last tensor)"
    )]
    TrailingData {
        /// File.
        path: PathBuf,
        /// Where the last tensor ends (relative to the data section).
        covered: u64,
        /// Length of the data section.
        data_len: u64,
    },
    /// A tensor the index lists (or the caller asks for) is not there.
    #[error("tensor {tensor} not found in the checkpoint ({where_})")]
    MissingTensor {
        /// Tensor name.
        tensor: String,
        /// Where it was expected.
        where_: String,
    },
    /// A destination buffer of the wrong size for a tensor.
    #[error("tensor {tensor}: buffer of {got} bytes for {len_bytes} bytes")]
    BufferSize {
        /// Tensor name.
        tensor: String,
        /// Tensor length.
        len_bytes: u64,
        /// Buffer length.
        got: u64,
    },
    /// A byte range past the end of a tensor.
    #[error("tensor {tensor}: {len} bytes at byte {at} run past its {len_bytes} bytes")]
    PartOutOfRange {
        /// Tensor name.
        tensor: String,
        /// Start of the range within the tensor.
        at: u64,
        /// Length of the range.
        len: u64,
        /// Tensor length.
        len_bytes: u64,
    },
}

/// A header the shared parser refuses: malformed JSON as [`CheckpointError::Json`],
/// anything else as [`CheckpointError::BadTensor`] (`<header>` for the
/// length word or the JSON as a whole).
impl From<flashtier_format::safetensors::SafetensorsError> for CheckpointError {
    fn from(e: flashtier_format::safetensors::SafetensorsError) -> Self {
        use flashtier_format::safetensors::HeaderFault;
        match e.fault {
            HeaderFault::Json(_) => Self::Json {
                path: e.path,
                what: e.fault.to_string(),
            },
            _ => Self::BadTensor {
                path: e.path,
                tensor: e.tensor.unwrap_or_else(|| "<header>".into()),
                why: e.fault.to_string(),
            },
        }
    }
}
