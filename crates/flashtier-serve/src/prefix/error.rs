//! [`SpillError`]: why a kept cache did not go to the drive or did not come
//! back. Either way the scheduler goes on without it: an entry whose
//! write failed on the writer thread is dropped when the scheduler thread
//! collects the outcome (nobody waits for it), and a prompt whose entry
//! could not be restored is computed from its first token. Never wrong
//! data.

use std::path::PathBuf;

use flashtier::kv::KvError;
use flashtier_engine::error::EngineError;

/// Failures of the prefix spill (see the module docs).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpillError {
    /// The spill folder could not be made or listed.
    #[error("prefix spill folder {path}: {source}")]
    Dir {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Creating the store file failed.
    #[error("creating the prefix spill store {path}: {source}")]
    Create {
        /// The store file.
        path: PathBuf,
        /// Why.
        source: KvError,
    },
    /// Writing an entry's blocks failed; the entry was dropped. `offset`
    /// and `len_bytes` name the extent of the write.
    #[error(
        "writing {len_bytes} bytes at offset {offset} of the prefix spill store {path}: {source}"
    )]
    Write {
        /// The store file.
        path: PathBuf,
        /// Byte offset of the write.
        offset: u64,
        /// Bytes written.
        len_bytes: u64,
        /// Why (the backend's error names its own extent too).
        source: KvError,
    },
    /// Restoring an entry failed: a read failed, came back short, or its
    /// bytes failed their block's checksum. The prompt is recomputed.
    #[error(
        "restoring {blocks} blocks of a kept cache from the prefix spill store {path}: {source}"
    )]
    Restore {
        /// The store file.
        path: PathBuf,
        /// Blocks the restore asked for.
        blocks: usize,
        /// Why (names the tile, block and offset at fault).
        source: KvError,
    },
    /// The writer thread could not be started.
    #[error("starting the prefix spill's writer thread: {0}")]
    Writer(std::io::Error),
    /// The cache could not be read out or filled back (its shape is not
    /// the store's, or the engine refused it).
    #[error("prefix spill: {0}")]
    Engine(#[from] EngineError),
    /// The entry needs more blocks than the store holds, or its shape does
    /// not match the store's.
    #[error("prefix spill: {0}")]
    Shape(String),
    /// The spill's restore thread died (a panic) with this restore queued
    /// or running; the prompt is computed whole.
    #[error("the prefix spill's restore thread stopped")]
    RestoreThreadStopped,
}
