//! The one error type of the I/O layer. Every variant names the file, offset
//! and length at fault, so a failed read is never anonymous.

use std::path::PathBuf;

use flashtier_format::OpenError;

/// An I/O failure, always naming what was being read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The file could not be opened.
    #[error("open {path}: {source}")]
    Open {
        /// File that failed to open.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The path names a FIFO, device, socket or directory: refused before
    /// it was opened, so the caller never blocks on a pipe.
    #[error("{path} is {what}, not a regular file")]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is instead (`a FIFO (named pipe)`, `a character device`...).
        what: &'static str,
    },
    /// Another holder (this process or another) has the file locked for
    /// its exclusive use (see [`crate::StoreFile::lock_exclusive`]).
    #[error("{path} is in use by another flashtier process (or another handle in this one)")]
    InUse {
        /// The file.
        path: PathBuf,
    },
    /// The lock call itself failed.
    #[error("lock {path}: {source}")]
    Lock {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The file system refused O_DIRECT and the caller required it.
    #[error(
        "{path}: the file system refuses O_DIRECT and direct I/O was required (--direct=require)"
    )]
    DirectRefused {
        /// File that refused direct I/O.
        path: PathBuf,
    },
    /// A read failed in the kernel.
    #[error("read {path} at offset {offset} length {len}: {source}")]
    Read {
        /// File read.
        path: PathBuf,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: usize,
        /// OS error.
        source: std::io::Error,
    },
    /// The file ended before the request was satisfied.
    #[error("read {path} at offset {offset} length {len}: file ended after {got} bytes")]
    ShortRead {
        /// File read.
        path: PathBuf,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: usize,
        /// Bytes actually available.
        got: usize,
    },
    /// A mapped file no longer covers an extent: it was truncated while
    /// mapped (touching the extent would raise SIGBUS).
    #[error(
        "{path}: extent at offset {offset} length {len} lies past the end of the file, now {file_bytes} bytes (truncated while mapped)"
    )]
    Truncated {
        /// File mapped.
        path: PathBuf,
        /// Byte offset of the extent.
        offset: u64,
        /// Length of the extent in bytes.
        len: usize,
        /// The file's length now.
        file_bytes: u64,
    },
    /// A write failed in the kernel.
    #[error("write {path} at offset {offset} length {len}: {source}")]
    Write {
        /// File written.
        path: PathBuf,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: usize,
        /// OS error.
        source: std::io::Error,
    },
    /// A direct-I/O request whose offset, length or memory is not aligned.
    #[error(
        "{path}: request at offset {offset} length {len} is not aligned to {align} bytes for direct I/O"
    )]
    Misaligned {
        /// File of the request.
        path: PathBuf,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: usize,
        /// Required alignment.
        align: usize,
    },
    /// A landing (host buffer or region slice) too small or out of bounds.
    #[error("{path}: request at offset {offset} length {len} does not fit its landing ({what})")]
    Landing {
        /// File of the request.
        path: PathBuf,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: usize,
        /// What was wrong with the landing.
        what: String,
    },
    /// The device sink failed to take the landed bytes.
    #[error("{path}: device landing of offset {offset} length {len} failed: {what}")]
    Device {
        /// File of the request.
        path: PathBuf,
        /// Byte offset of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: usize,
        /// The device layer's message.
        what: String,
    },
    /// The backend could not be set up or has shut down.
    #[error("backend {backend}: {what}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What failed.
        what: String,
    },
    /// A caller passed an invalid argument (queue depth, geometry...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A `FLASHTIER_*` variable held a value its reader cannot take
    /// ([`crate::settings`]).
    #[error(transparent)]
    Setting(#[from] crate::settings::SettingError),
}

impl From<OpenError> for IoError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::NotRegular { path, what } => Self::NotRegular { path, what },
            OpenError::Os { path, source } => Self::Open { path, source },
            other => Self::Open {
                path: other.path().to_path_buf(),
                source: std::io::Error::other(other.to_string()),
            },
        }
    }
}

impl IoError {
    /// Whether this error is an injected or real failure of the medium (as
    /// opposed to a caller mistake).
    #[must_use]
    pub fn is_media(&self) -> bool {
        matches!(
            self,
            Self::Read { .. } | Self::ShortRead { .. } | Self::Write { .. }
        )
    }
}
