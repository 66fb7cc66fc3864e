//! The row store's error type: every variant names the id, file, range or
//! buffer at fault. A lookup that fails fills nothing the caller may use.

use std::path::PathBuf;

use flashtier_format::row_shard::RowShardError;
use flashtier_io::{IoError, LockError};

/// A row-store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RowError {
    /// A read failed (file, offset and length inside).
    #[error(transparent)]
    Io(#[from] IoError),
    /// A shard's output was refused, locked by another writer, or not
    /// persisted.
    #[error(transparent)]
    Persist(#[from] flashtier_io::PersistError),
    /// A packed shard is invalid, mismatched, truncated or corrupt.
    #[error(transparent)]
    Shard(#[from] RowShardError),
    /// RAM mode could not map or lock the table.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// A row id outside the table.
    #[error("row id {id} (batch position {index}) is out of range: the table has {rows} rows")]
    IdOutOfRange {
        /// The id.
        id: u64,
        /// Its position in the batch.
        index: usize,
        /// Rows in the table.
        rows: u64,
    },
    /// A negative row id (C ABI).
    #[error("row id {id} (batch position {index}) is negative")]
    NegativeId {
        /// The id.
        id: i64,
        /// Its position in the batch.
        index: usize,
    },
    /// An output buffer of the wrong size.
    #[error("{what} buffer holds {got_bytes} bytes, {expected_bytes} needed for the batch")]
    BufferSize {
        /// Which buffer.
        what: &'static str,
        /// Bytes needed.
        expected_bytes: usize,
        /// Bytes given.
        got_bytes: usize,
    },
    /// An ownership range outside the table or reversed.
    #[error("ownership range [{lo}, {hi}) is invalid for a table of {rows} rows")]
    InvalidRange {
        /// Start.
        lo: u64,
        /// End.
        hi: u64,
        /// Rows in the table.
        rows: u64,
    },
    /// The range may not change once scales are pinned or a shard attached.
    #[error("ownership range is fixed at [{lo}, {hi}) ({why}); refusing [{new_lo}, {new_hi})")]
    RangeFixed {
        /// Current start.
        lo: u64,
        /// Current end.
        hi: u64,
        /// Requested start.
        new_lo: u64,
        /// Requested end.
        new_hi: u64,
        /// What fixed it.
        why: &'static str,
    },
    /// A table source (safetensors or raw) is malformed or does not fit.
    #[error("table source {path}: {what}")]
    Source {
        /// File at fault.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// An invalid configuration (ways, geometry, hash moduli, threads...).
    #[error("invalid row store configuration: {0}")]
    Config(String),
    /// A `FLASHTIER_*` variable held a value its reader cannot take
    /// ([`crate::settings`]).
    #[error(transparent)]
    Setting(#[from] flashtier_io::settings::SettingError),
    /// A pool worker panicked while serving a read (a bug; never served).
    #[error("row read of {path} at offset {offset} was lost: a worker panicked")]
    WorkerLost {
        /// File being read.
        path: PathBuf,
        /// Offset of the read.
        offset: u64,
    },
}
