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
//! Writes run on the spill's own thread (the `writer` module); the scheduler
//! thread hands a cache over with the block numbers it reserved for it and
//! returns at once. Until the scheduler thread collects the write's
//! outcome the entry is *writing*: its block numbers are held, never handed
//! to another entry, and its cache stays in memory, so a prompt that takes
//! it is served from memory, never from a block still being written: the
//! cache itself if its write was still queued (taken off the queue; its
//! block numbers are free again at once) or the thread already let go of
//! it, else a copy of the positions the prompt reuses, the write being
//! cancelled before its next block number. Block numbers of a write that
//! failed, or whose entry was taken, return to the free list only when the
//! outcome is collected, after the thread is done with them. A failed
//! write drops its entry ([`SpillStats::spill_failures`]). Restores run on
//! a second thread (the `restorer` module): the scheduler thread hands
//! over the entry's versions and an empty cache and goes on stepping the
//! other sequences; a restore waits for the store while the writer writes
//! at most one block number (`layers` blocks), and the entry's block
//! numbers stay reserved until the restore is collected.
//!
//! Bounds: `--prefix-spill-tokens N` sets `blocks = ceil(N / 16)` block
//! numbers (at most [`MAX_SPILL_TOKENS`] positions). The file is made at its
//! final length, `4096 + round_up(layers x blocks x 16, 4096) + layers x
//! blocks x block_bytes` bytes (sparse until written), with `block_bytes =
//! 2 x kv_heads x round_up(16 x width x 2, 4096)` (`width` the stored head
//! width: twice `head_dim` at the default precision), and never grows:
//! every write is one of its blocks. Writes in flight: at most
//! [`SpillConfig::write_queue`] entries (default [`DEFAULT_WRITE_QUEUE`], at
//! most [`MAX_WRITE_QUEUE`]) are writing at once, queued, being written or
//! written and not yet collected; a cache leaving memory past that is
//! dropped ([`SpillStats::queue_full`]), never waited for. So besides the
//! memory budget the spill holds at most `write_queue` caches, each of at
//! most `blocks x 16` positions (a longer one is never queued): `2 x layers
//! x round_up(len, 16) x kv_heads x width x 2` bytes of K and V each, plus
//! the cache's own attention scratch. Memory of the store: a staging
//! buffer of one tile (at most `layers` blocks) for writes, and the restore
//! ring of [`RING_TILES`] tiles; a tile holds at most [`MAX_RING_BYTES`]
//! `/ 3` (or one block, if a block is larger).
//!
//! Durability (the KV tier's policy, `flashtier::kv`): the store is a cache
//! of state the model recomputes. A block's table entry is sealed (its
//! generation and checksum) only after its write completed; a restore
//! checks every block's generation and checksum before a byte reaches the
//! cache, so a failed, short or corrupt read is a [`SpillError::Restore`]
//! and the prompt is recomputed, never served from wrong bytes. Nothing is
//! fsynced: the file does not outlive the server, which removes it when it
//! stops (dropping the spill stops and joins its thread first, queued
//! writes unwritten); a file a killed server left behind (its pid gone and
//! its lock free) is removed when the next one starts in the same folder.
//!
//! GPU caches are not spilled: the CUDA cache has no path that writes
//! positions back into it from host memory, so a GPU entry that leaves the
//! memory budget is dropped as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use flashtier::kv::swap::BlockVersion;
use flashtier_engine::device::KvState;
use flashtier_engine::device::cpu::kv::{BLOCK_TOKENS, KvCache};
use flashtier_io::PosixBackend;

use super::error::SpillError;
use super::restorer::{Restore, Restorer};
use super::store::{self, Store, StoreIo};
use super::writer::{Job, Outcome, Writer};

mod config;
pub use config::{SpillConfig, SpillStats};

/// Most positions the store may hold (16 Mi).
pub const MAX_SPILL_TOKENS: usize = 1 << 24;

pub use super::store::{MAX_RING_BYTES, RING_TILES};

/// Workers of the default (posix) backend.
const QUEUE_DEPTH: usize = 4;

/// Entries writing at once by default (see the module docs).
pub const DEFAULT_WRITE_QUEUE: usize = 4;

/// Most entries [`SpillConfig::write_queue`] may let write at once.
pub const MAX_WRITE_QUEUE: usize = 64;

static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

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

/// An entry whose write is queued, running, or not yet collected: its
/// cache stays in memory until then (see the module docs).
#[derive(Debug)]
pub(super) struct Writing {
    ticket: u64,
    kv: Arc<KvCache>,
    cancel: Arc<AtomicBool>,
    capacity: usize,
}

impl Writing {
    /// Positions its cache could hold.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Which write it is.
    pub(super) fn ticket(&self) -> u64 {
        self.ticket
    }
}

/// A write the scheduler thread collected.
#[derive(Debug)]
pub(super) enum Settled {
    /// Entry `ticket` is on the drive.
    Written(u64, Spilled),
    /// Entry `ticket`'s write failed: the entry is gone.
    Failed(u64),
}

/// The store, its free block numbers and its writer (see the module docs).
pub struct PrefixSpill {
    blocks: u32,
    path: PathBuf,
    free: Vec<u32>,
    stats: SpillStats,
    write_queue: usize,
    /// Entries writing now (at most `write_queue`).
    writing: usize,
    next_ticket: u64,
    writer: Writer,
    restorer: Restorer,
    /// Entries being read back, by ticket: their block numbers stay
    /// reserved until the restore is collected.
    /// (ticket, positions the prompt reuses, the entry).
    restoring: Vec<(u64, usize, Spilled)>,
}

impl std::fmt::Debug for PrefixSpill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixSpill")
            .field("path", &self.path)
            .field("blocks", &self.blocks)
            .field("free", &self.free.len())
            .field("writing", &self.writing)
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
    /// servers there are removed), with its writer thread started. The
    /// store file is created at the first spill.
    pub fn new(cfg: SpillConfig) -> Result<Self, SpillError> {
        if cfg.tokens == 0 || cfg.tokens > MAX_SPILL_TOKENS {
            return Err(SpillError::Shape(format!(
                "prefix spill of {} positions: 1..={MAX_SPILL_TOKENS}",
                cfg.tokens
            )));
        }
        if cfg.write_queue == 0 || cfg.write_queue > MAX_WRITE_QUEUE {
            return Err(SpillError::Shape(format!(
                "prefix spill write queue of {} entries: 1..={MAX_WRITE_QUEUE}",
                cfg.write_queue
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
        let writer = Writer::spawn(StoreIo {
            path: path.clone(),
            backend,
            direct: cfg.direct,
            blocks,
        })?;
        let restorer = Restorer::spawn(writer.store_slot())?;
        Ok(Self {
            blocks,
            path,
            free: (0..blocks).rev().collect(),
            stats: SpillStats::default(),
            write_queue: cfg.write_queue,
            writing: 0,
            next_ticket: 0,
            writer,
            restorer,
            restoring: Vec::new(),
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

    /// Block numbers free now (those of writing entries are not).
    #[must_use]
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Entries writing now: queued, being written, or not yet collected.
    #[must_use]
    pub fn writing(&self) -> usize {
        self.writing
    }

    /// The store's length in bytes, once it exists (fixed at creation).
    #[must_use]
    pub fn file_len_bytes(&self) -> Option<u64> {
        self.writer.store().as_ref().map(Store::file_len_bytes)
    }

    /// Counters so far (writes count once collected).
    #[must_use]
    pub fn stats(&self) -> SpillStats {
        self.stats
    }

    /// An entry left the drive without being restored.
    pub(super) fn drop_entry(&mut self, s: Spilled) {
        self.stats.dropped += 1;
        self.release(s);
    }

    /// Whether an entry of `need` block numbers may be handed over: not
    /// while `write_queue` entries are writing, nor when it is longer than
    /// the store (each counted).
    pub(super) fn admits(&mut self, need: usize) -> bool {
        if self.writing >= self.write_queue {
            self.stats.queue_full += 1;
            return false;
        }
        if need > self.blocks() {
            self.stats.dropped += 1;
            return false;
        }
        true
    }

    /// Its block numbers are free again (nothing reads them afterwards: the
    /// next write of a block seals a new generation).
    pub(super) fn release(&mut self, s: Spilled) {
        self.free.extend(s.blocks.iter().rev());
    }

    /// Hand `kv` (a cache of `capacity` positions) to the writer, with the
    /// block numbers it needs taken off the free list; returns at once.
    /// `None` (counted) when `write_queue` entries are writing already or
    /// too few block numbers are free (the caller made what room it could).
    pub(super) fn submit(&mut self, kv: Box<KvCache>, capacity: usize) -> Option<Writing> {
        let need = blocks_for(kv.len());
        if self.writing >= self.write_queue {
            self.stats.queue_full += 1;
            return None;
        }
        if need == 0 || need > self.free.len() {
            self.stats.dropped += 1;
            return None;
        }
        let mut blocks = self.free.split_off(self.free.len() - need);
        blocks.reverse();
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let kv: Arc<KvCache> = Arc::from(kv);
        let cancel = Arc::new(AtomicBool::new(false));
        self.writer.push(Job {
            ticket,
            kv: kv.clone(),
            blocks,
            cancel: cancel.clone(),
            capacity,
        });
        self.writing += 1;
        Some(Writing {
            ticket,
            kv,
            cancel,
            capacity,
        })
    }

    /// The cache of a writing entry a prompt takes. Its write is cancelled:
    /// taken off the queue if it has not started (its block numbers are
    /// free again now), else stopped before its next block number (its
    /// block numbers are freed when it is collected). The cache comes back
    /// still shared only while the thread is writing from it.
    pub(super) fn reclaim(&mut self, w: Writing) -> Arc<KvCache> {
        self.stats.taken_writing += 1;
        w.cancel.store(true, Ordering::Release);
        if let Some(job) = self.writer.unqueue(w.ticket) {
            self.writing -= 1;
            self.free.extend(job.blocks.iter().rev());
        }
        w.kv
    }

    /// Take in the writes finished since the last call: count them, free
    /// the block numbers of those that failed or whose entry was taken,
    /// and return the outcome of each one whose entry still waits for it.
    pub(super) fn collect(&mut self) -> Vec<Settled> {
        let mut settled = Vec::new();
        for d in self.writer.collect() {
            self.writing -= 1;
            self.stats.bytes_written += d.bytes;
            if d.cancel.load(Ordering::Acquire) {
                self.free.extend(d.blocks.iter().rev());
                continue;
            }
            match d.outcome {
                Outcome::Written(versions) => {
                    self.stats.spilled += 1;
                    let s = Spilled {
                        blocks: d.blocks,
                        versions,
                        len: d.len,
                        capacity: d.capacity,
                    };
                    settled.push(Settled::Written(d.ticket, s));
                }
                Outcome::Failed(e) => {
                    self.stats.spill_failures += 1;
                    tracing::warn!("a kept cache was dropped instead of spilled: {e}");
                    self.free.extend(d.blocks.iter().rev());
                    settled.push(Settled::Failed(d.ticket));
                }
                // Only a stopping writer stops a write nobody cancelled.
                Outcome::Stopped => {
                    self.free.extend(d.blocks.iter().rev());
                    settled.push(Settled::Failed(d.ticket));
                }
            }
        }
        settled
    }

    /// Block until every queued write is finished (their outcomes are
    /// collected by the next [`Self::collect`]).
    pub(super) fn flush(&self) {
        self.writer.flush();
    }

    /// Start reading the first `positions` positions of `s` (whole blocks
    /// of them) back into `into`, an empty cache of the engine's, on the
    /// restorer thread; returns the ticket [`Self::collect_restores`]
    /// answers with. `s`'s block numbers are released when it is
    /// collected. An entry that cannot be read (no store, too few
    /// versions) is an error now, its block numbers released.
    pub(super) fn start_restore(
        &mut self,
        s: Spilled,
        positions: usize,
        into: Box<KvCache>,
    ) -> Result<u64, SpillError> {
        // Every block number of the entry has one version a layer (the
        // store's lock is not taken here: a restore running on the
        // restorer thread holds it for its whole read).
        let layers = s.versions.len() / s.blocks.len().max(1);
        let need = blocks_for(positions.min(s.len)).max(1);
        let versions = s.versions.get(..need * layers);
        let Some(versions) = versions.map(<[BlockVersion]>::to_vec) else {
            self.stats.restore_failures += 1;
            let why = format!("{need} blocks of an entry of {}", s.blocks.len());
            self.release(s);
            return Err(SpillError::Shape(why));
        };
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.restorer.push(Restore {
            ticket,
            versions,
            fill: (need * BLOCK_TOKENS).min(s.len),
            into,
        });
        self.restoring.push((ticket, positions, s));
        Ok(ticket)
    }

    /// Restores in flight (started, not collected).
    #[must_use]
    pub fn restoring(&self) -> usize {
        self.restoring.len()
    }

    /// The restores finished since the last call, counted, their entries'
    /// block numbers released: each ticket with the positions its prompt
    /// reuses and its filled cache (not yet cut back to them), or the error.
    pub(super) fn collect_restores(
        &mut self,
    ) -> Vec<(u64, usize, Result<Box<KvCache>, SpillError>)> {
        let mut out = Vec::new();
        for r in self.restorer.collect() {
            let Some(at) = self.restoring.iter().position(|(t, _, _)| *t == r.ticket) else {
                continue;
            };
            let (ticket, positions, s) = self.restoring.swap_remove(at);
            self.release(s);
            match r.result {
                Ok((kv, bytes)) => {
                    self.stats.restored += 1;
                    self.stats.bytes_read += bytes;
                    out.push((ticket, positions, Ok(kv)));
                }
                Err(e) => {
                    self.stats.restore_failures += 1;
                    out.push((ticket, positions, Err(e)));
                }
            }
        }
        out
    }

    /// Block until a restore waits to be collected, at most `timeout`.
    pub(super) fn wait_restores(&self, timeout: std::time::Duration) {
        if !self.restoring.is_empty() {
            self.restorer.wait(timeout);
        }
    }
}

impl Drop for PrefixSpill {
    fn drop(&mut self) {
        // The threads go first (queued writes unwritten, queued restores
        // dropped), then the store: its lock ends with the swap, then the
        // file goes.
        self.restorer.stop();
        self.writer.stop();
        let store = self.writer.store().take();
        if store.is_some() {
            drop(store);
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
