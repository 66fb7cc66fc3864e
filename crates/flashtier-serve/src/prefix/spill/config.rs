//! What the spill is told ([`SpillConfig`]) and what it counts
//! ([`SpillStats`]).

use std::path::PathBuf;
use std::sync::Arc;

use flashtier_io::{DirectMode, StorageBackend};

use super::DEFAULT_WRITE_QUEUE;

/// Where and how much the prefix cache spills.
#[derive(Clone)]
pub struct SpillConfig {
    /// Folder of the store file (made if missing).
    pub dir: PathBuf,
    /// Positions the store holds at most (rounded up to whole blocks).
    pub tokens: usize,
    /// O_DIRECT policy of the store.
    pub direct: DirectMode,
    /// Backend of the store (default: posix, 4 workers).
    pub backend: Option<Arc<dyn StorageBackend>>,
    /// Entries writing at once at most (1..=[`MAX_WRITE_QUEUE`](super::MAX_WRITE_QUEUE)): queued,
    /// being written, or written and not yet collected.
    pub write_queue: usize,
}

impl SpillConfig {
    /// Spill to `dir`, at most `tokens` positions, posix reads, O_DIRECT
    /// where the file system allows it.
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>, tokens: usize) -> Self {
        Self {
            dir: dir.into(),
            tokens,
            direct: DirectMode::Prefer,
            backend: None,
            write_queue: DEFAULT_WRITE_QUEUE,
        }
    }
}

impl std::fmt::Debug for SpillConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillConfig")
            .field("dir", &self.dir)
            .field("tokens", &self.tokens)
            .field("direct", &self.direct)
            .field("backend", &self.backend.as_ref().map(|b| b.name()))
            .field("write_queue", &self.write_queue)
            .finish()
    }
}

/// What the spill did, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpillStats {
    /// Entries written to the drive.
    pub spilled: u64,
    /// Entries whose write failed (dropped).
    pub spill_failures: u64,
    /// Entries read back for a prompt.
    pub restored: u64,
    /// Restores that failed (the prompt was recomputed).
    pub restore_failures: u64,
    /// Entries dropped from the drive to make room, too large for it, or
    /// finding too few block numbers free (the rest held by writes).
    pub dropped: u64,
    /// Entries dropped because [`SpillConfig::write_queue`] entries were
    /// writing already.
    pub queue_full: u64,
    /// Entries a prompt took, from memory, while they were writing.
    pub taken_writing: u64,
    /// Bytes written to the store (cancelled and failed writes' included).
    pub bytes_written: u64,
    /// Bytes read back and verified.
    pub bytes_read: u64,
}
