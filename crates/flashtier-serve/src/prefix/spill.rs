//! The prefix cache's second level: kept CPU caches written to a KV store
//! on a drive ([`flashtier::kv::swap::KvSwap`], `docs/kv-format.md`) when
//! they leave the memory budget, and read back for a prompt that shares
//! their first tokens.
//!
//! The store: one file per server, `.flashtier-prefix-<pid>-<n>.ftkv` in the
//! spill folder, created at the first spill from that cache's shape (every
//! CPU cache of one engine has the same) and held under an exclusive lock
//! while the server runs; BF16 values, the block-major order, [`BLOCK_TOKENS`]
//! positions a block. An entry takes `ceil(len / 16)` block numbers, the
//! same ones in every layer; block number `b` of every layer is one
//! contiguous extent, so one block number spills as one write and comes
//! back as one read (or a few, for a model whose layers pass the ring's
//! tile). Block numbers come from a free list: a dropped entry's are reused.
//!
//! Bounds: `--prefix-spill-tokens N` sets `blocks = ceil(N / 16)` block
//! numbers (at most [`MAX_SPILL_TOKENS`] positions). The file is made at its
//! final length, `4096 + round_up(layers x blocks x 16, 4096) + layers x
//! blocks x block_bytes` bytes (sparse until written), with `block_bytes =
//! 2 x kv_heads x round_up(16 x width x 2, 4096)` (`width` the stored head
//! width: twice `head_dim` at the default precision), and never grows:
//! every write is one of its blocks. Memory: a staging buffer of one tile
//! (at most `layers` blocks) for writes, and the restore ring of
//! [`RING_TILES`] tiles; a tile holds at most [`MAX_RING_BYTES`] `/ 3`
//! (or one block, if a block is larger).
//!
//! Durability (the KV tier's policy, `flashtier::kv`): the store is a cache
//! of state the model recomputes. A block's table entry is sealed (its
//! generation and checksum) only after its write completed; a restore
//! checks every block's generation and checksum before a byte reaches the
//! cache, so a failed, short or corrupt read is a [`SpillError::Restore`]
//! and the prompt is recomputed, never served from wrong bytes. Nothing is
//! fsynced: the file does not outlive the server, which removes it when it
//! stops; a file a killed server left behind (its pid gone and its lock
//! free) is removed when the next one starts in the same folder.
//!
//! GPU caches are not spilled: the CUDA cache has no path that writes
//! positions back into it from host memory, so a GPU entry that leaves the
//! memory budget is dropped as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use flashtier::kv::swap::BlockVersion;
use flashtier_engine::device::KvState;
use flashtier_engine::device::cpu::kv::{BLOCK_TOKENS, KvCache};
use flashtier_io::{DirectMode, PosixBackend, StorageBackend};

use super::error::SpillError;
use super::store::{self, Store, StoreIo};

/// Most positions the store may hold (16 Mi).
pub const MAX_SPILL_TOKENS: usize = 1 << 24;

pub use super::store::{MAX_RING_BYTES, RING_TILES};

/// Workers of the default (posix) backend.
const QUEUE_DEPTH: usize = 4;

static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

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
    /// Entries dropped from the drive to make room, or too large for it.
    pub dropped: u64,
    /// Bytes written to the store.
    pub bytes_written: u64,
    /// Bytes read back and verified.
    pub bytes_read: u64,
}

/// An entry on the drive: its block numbers, the versions a restore asks
/// for (block number by block number, every layer's in order), and what it
/// holds.
#[derive(Debug)]
pub(super) struct Spilled {
    blocks: Vec<u32>,
    versions: Vec<BlockVersion>,
    len: usize,
    capacity: usize,
}

impl Spilled {
    /// Positions the cache it came from could hold.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }
}

/// The store and its free block numbers (see the module docs).
pub struct PrefixSpill {
    cfg: SpillConfig,
    backend: Arc<dyn StorageBackend>,
    blocks: u32,
    path: PathBuf,
    store: Option<Store>,
    free: Vec<u32>,
    stats: SpillStats,
}

impl std::fmt::Debug for PrefixSpill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixSpill")
            .field("path", &self.path)
            .field("blocks", &self.blocks)
            .field("free", &self.free.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Block numbers for `len` positions.
pub(super) fn blocks_for(len: usize) -> usize {
    len.div_ceil(BLOCK_TOKENS)
}

impl PrefixSpill {
    /// A spill into `cfg.dir` (made if missing; stale stores of killed
    /// servers there are removed). The store file is created at the first
    /// spill.
    pub fn new(cfg: SpillConfig) -> Result<Self, SpillError> {
        if cfg.tokens == 0 || cfg.tokens > MAX_SPILL_TOKENS {
            return Err(SpillError::Shape(format!(
                "prefix spill of {} positions: 1..={MAX_SPILL_TOKENS}",
                cfg.tokens
            )));
        }
        let dir_err = |source| SpillError::Dir {
            path: cfg.dir.clone(),
            source,
        };
        std::fs::create_dir_all(&cfg.dir).map_err(dir_err)?;
        store::sweep_stale(&cfg.dir).map_err(dir_err)?;
        let backend = match &cfg.backend {
            Some(b) => b.clone(),
            None => Arc::new(
                PosixBackend::new(QUEUE_DEPTH).map_err(|e| SpillError::Create {
                    path: cfg.dir.clone(),
                    source: e.into(),
                })?,
            ),
        };
        let blocks = u32::try_from(blocks_for(cfg.tokens))
            .map_err(|_| SpillError::Shape("too many spill blocks".into()))?;
        let n = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let path = cfg
            .dir
            .join(format!(".flashtier-prefix-{}-{n}.ftkv", std::process::id()));
        Ok(Self {
            cfg,
            backend,
            blocks,
            path,
            store: None,
            free: (0..blocks).rev().collect(),
            stats: SpillStats::default(),
        })
    }

    /// The store file (there once something was spilled).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Block numbers the store holds (each `BLOCK_TOKENS` positions).
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.blocks as usize
    }

    /// Block numbers free now.
    #[must_use]
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// The store's length in bytes, once it exists (fixed at creation).
    #[must_use]
    pub fn file_len_bytes(&self) -> Option<u64> {
        self.store.as_ref().map(Store::file_len_bytes)
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> SpillStats {
        self.stats
    }

    /// An entry left the drive without being restored.
    pub(super) fn drop_entry(&mut self, s: Spilled) {
        self.stats.dropped += 1;
        self.release(s);
    }

    /// Count an entry that could not go to the drive at all.
    pub(super) fn note_dropped(&mut self) {
        self.stats.dropped += 1;
    }

    /// Its block numbers are free again (nothing reads them afterwards: the
    /// next write of a block seals a new generation).
    pub(super) fn release(&mut self, s: Spilled) {
        self.free.extend(s.blocks.iter().rev());
    }

    /// Write `kv` (a cache of `capacity` positions) to the drive. The
    /// caller made room ([`Self::free_blocks`]); on failure nothing of it
    /// is kept.
    pub(super) fn write(&mut self, kv: &KvCache, capacity: usize) -> Result<Spilled, SpillError> {
        let result = self.try_write(kv, capacity);
        match &result {
            Ok(_) => self.stats.spilled += 1,
            Err(e) => {
                self.stats.spill_failures += 1;
                tracing::warn!("a kept cache was dropped instead of spilled: {e}");
            }
        }
        result
    }

    fn try_write(&mut self, kv: &KvCache, capacity: usize) -> Result<Spilled, SpillError> {
        let need = blocks_for(kv.len());
        if need == 0 || need > self.free.len() {
            return Err(SpillError::Shape(format!(
                "{} positions need {need} blocks; {} of {} are free",
                kv.len(),
                self.free.len(),
                self.blocks
            )));
        }
        let store = match &mut self.store {
            Some(s) => s,
            empty => {
                let io = StoreIo {
                    path: &self.path,
                    backend: self.backend.clone(),
                    direct: self.cfg.direct,
                    blocks: self.blocks,
                };
                empty.insert(Store::create(io, kv)?)
            }
        };
        let free = &mut self.free;
        let mut blocks = free.split_off(free.len() - need);
        blocks.reverse();
        match store.write(kv, &blocks) {
            Ok(versions) => {
                self.stats.bytes_written += versions.len() as u64 * store.block_bytes();
                Ok(Spilled {
                    blocks,
                    versions,
                    len: kv.len(),
                    capacity,
                })
            }
            Err(e) => {
                free.extend(blocks.iter().rev());
                Err(e)
            }
        }
    }

    /// Read the first `positions` positions of `s` (whole blocks of them)
    /// back into `into`, an empty cache of the engine's; the caller cuts it
    /// back to `positions` and releases `s`.
    pub(super) fn restore(
        &mut self,
        s: &Spilled,
        positions: usize,
        into: &mut KvCache,
    ) -> Result<(), SpillError> {
        let result = self.try_restore(s, positions, into);
        match &result {
            Ok(bytes) => {
                self.stats.restored += 1;
                self.stats.bytes_read += bytes;
            }
            Err(_) => self.stats.restore_failures += 1,
        }
        result.map(|_| ())
    }

    fn try_restore(
        &mut self,
        s: &Spilled,
        positions: usize,
        into: &mut KvCache,
    ) -> Result<u64, SpillError> {
        let store = self
            .store
            .as_mut()
            .ok_or_else(|| SpillError::Shape("no spill store".into()))?;
        let need = blocks_for(positions.min(s.len)).max(1);
        let versions = s.versions.get(..need * store.layers()).ok_or_else(|| {
            SpillError::Shape(format!("{need} blocks of an entry of {}", s.blocks.len()))
        })?;
        store.read(versions, (need * BLOCK_TOKENS).min(s.len), into)
    }
}

impl Drop for PrefixSpill {
    fn drop(&mut self) {
        // The store is the server's scratch: its lock ends with the swap,
        // then the file goes.
        if self.store.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
