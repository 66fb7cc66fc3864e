//! The error of writing an output through [`super::Output`]: every variant
//! names the output, and the lock, temp file or folder at fault.

use std::path::PathBuf;

/// Why writing an output failed or was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PersistError {
    /// The output is (or resolves to) a file the writer reads.
    #[error("refusing to write {out}: {how} {input}, which this command reads")]
    OutputIsInput {
        /// The output as given.
        out: PathBuf,
        /// The input it would overwrite.
        input: PathBuf,
        /// "it is", "it is a symlink to", "it is a hard link to".
        how: &'static str,
    },
    /// The output exists and is not a file of the writer's kind.
    #[error(
        "refusing to replace {path}: it is not a {expected} ({found}); move it away or choose another output"
    )]
    NotReplaceable {
        /// The existing file.
        path: PathBuf,
        /// The kind the writer makes.
        expected: &'static str,
        /// What is there instead.
        found: String,
    },
    /// Another writer holds the output and the caller asked not to wait.
    #[error("another writer is writing {path} (lock {lock} is held); try again when it is done")]
    Busy {
        /// The output.
        path: PathBuf,
        /// The lock file.
        lock: PathBuf,
    },
    /// The output path names no file, or its folder cannot be resolved.
    #[error("cannot resolve the output path {path}: {source}")]
    Resolve {
        /// The path at fault.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The lock file could not be created or locked.
    #[error("lock {lock} for {path}: {source}")]
    Lock {
        /// The output.
        path: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The existing output could not be inspected.
    #[error("inspect {path}: {source}")]
    Inspect {
        /// The existing file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The temp file could not be created.
    #[error("create a temp file in {dir} for {path}: {source}")]
    Temp {
        /// The output.
        path: PathBuf,
        /// Its folder.
        dir: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Writing the temp file failed.
    #[error("write {path}: {source}")]
    Write {
        /// The temp file (removed since).
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// `fsync` of the temp file or the folder failed.
    #[error("fsync {path}: {source}")]
    Sync {
        /// File or folder.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Renaming the temp file over the output failed.
    #[error("rename {from} to {to}: {source}")]
    Rename {
        /// The temp file (removed since).
        from: PathBuf,
        /// The output.
        to: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// `commit` without `create_temp`.
    #[error("{path}: commit without a temp file")]
    NoTemp {
        /// The output.
        path: PathBuf,
    },
}
