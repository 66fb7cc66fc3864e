//! Prompt reuse: the KV caches of finished sequences, kept so that a later
//! prompt sharing their first tokens skips computing them.
//!
//! An entry is one finished sequence's cache and the tokens it holds. A new
//! prompt takes the entry with the longest common prefix (exact token
//! comparison: no hash can alias two prompts), the cache is cut back to
//! that prefix ([`SeqKv::truncate`]), and only the rest of the prompt is
//! computed. At least the prompt's last token is always computed, since
//! its logits pick the first output token. An entry is taken, not copied:
//! two prompts running at once that share a prefix reuse it once.
//!
//! Two levels. In memory the entries hold at most `budget` positions in all
//! (the KV bytes are `budget x` the model's bytes per position); the least
//! recently used leave first. With a [`PrefixSpill`], a CPU cache that
//! leaves memory (or that is longer than the memory budget) is handed to
//! the spill's writer thread instead of dropped, up to the spill's own
//! bound, where the least recently used leave first too; `put` does not
//! wait for the write. Until its outcome is collected ([`PrefixCache::settle`],
//! which `put` and `take` call first) the entry is *writing*: its
//! positions count as on the drive, its cache (outside the memory budget,
//! at most the spill's write queue of them) serves a prompt from memory,
//! and a failed write drops it. A prompt whose longest match is on the
//! drive gets a fresh cache filled from it, block by block, every block's
//! checksum verified, on the spill's restore thread ([`spill`]): `take`
//! answers [`Taken::Restoring`] at once and the caller collects the cache
//! with [`PrefixCache::restores`] between its steps. A restore that fails
//! is an error the caller answers by computing the prompt from its first
//! token; the entry is gone either way. At equal reuse an entry served
//! from memory wins.
//!
//! A cache that cannot be cut back (one with chunks offloaded to a drive)
//! is reused only whole; a GPU cache is never spilled (see [`spill`]);
//! Qwen4-Exp's, whose state the model holds for one sequence at a time, is
//! never kept.

mod error;
mod image;
mod restorer;
pub mod spill;
mod store;
mod writer;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use flashtier_engine::device::KvState;
use flashtier_engine::device::cpu::kv::KvCache;
use flashtier_engine::engine::SeqKv;
use flashtier_engine::error::EngineError;

pub use error::SpillError;
pub use spill::{DEFAULT_WRITE_QUEUE, MAX_WRITE_QUEUE, PrefixSpill, SpillConfig, SpillStats};
use spill::{Settled, Spilled, Writing, blocks_for};

/// Kept caches of finished sequences.
#[derive(Debug)]
pub struct PrefixCache {
    entries: Vec<Entry>,
    budget: usize,
    /// Positions of the `Memory` entries.
    held: usize,
    spill: Option<PrefixSpill>,
    /// Positions of the `Drive` and `Writing` entries.
    spilled: usize,
    clock: u64,
    /// Restores started by `take`, not yet collected: (ticket, positions
    /// reused).
    pending: Vec<(u64, usize)>,
}

#[derive(Debug)]
enum Kept {
    Memory(SeqKv),
    Drive(Spilled),
    Writing(Writing),
}

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    kept: Kept,
    used: u64,
}

impl Entry {
    fn capacity(&self) -> usize {
        match &self.kept {
            Kept::Memory(kv) => kv.capacity(),
            Kept::Drive(s) => s.capacity(),
            Kept::Writing(w) => w.capacity(),
        }
    }

    /// Whether a prefix of it can be reused (a spilled entry restores any
    /// prefix of whole blocks, then is cut back; a writing one is a CPU
    /// cache).
    fn rewinds(&self) -> bool {
        match &self.kept {
            Kept::Memory(kv) => kv.rewinds(),
            Kept::Drive(_) | Kept::Writing(_) => true,
        }
    }

    /// Whether a prompt taking it is served from memory.
    fn served_from_memory(&self) -> bool {
        !matches!(self.kept, Kept::Drive(_))
    }
}

/// What [`PrefixCache::take`] found for a prompt.
#[derive(Debug)]
pub enum Taken {
    /// A cache, ready now.
    Ready(Reused),
    /// An entry on the drive, being read back: [`PrefixCache::restores`]
    /// gives its cache (or why not) under `ticket`, reusing `cached`
    /// positions.
    Restoring {
        /// Which restore.
        ticket: u64,
        /// Positions of the prompt it will hold.
        cached: usize,
    },
}

/// A cache taken for a prompt, with how many of its positions it reuses.
#[derive(Debug)]
pub struct Reused {
    /// The cache, cut back to `cached` positions.
    pub kv: SeqKv,
    /// Positions of the prompt it already holds.
    pub cached: usize,
    /// Whether it came back from the drive.
    pub restored: bool,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// An empty cache holding at most `budget` positions in memory (0: no
    /// reuse), and nothing on a drive.
    #[must_use]
    pub fn new(budget: usize) -> Self {
        Self::with_spill(budget, None)
    }

    /// An empty cache of `budget` positions in memory that spills to
    /// `spill` past it.
    #[must_use]
    pub fn with_spill(budget: usize, spill: Option<PrefixSpill>) -> Self {
        Self {
            entries: Vec::new(),
            budget,
            held: 0,
            spill,
            spilled: 0,
            clock: 0,
            pending: Vec::new(),
        }
    }

    /// Positions held in memory now.
    #[must_use]
    pub fn held(&self) -> usize {
        self.held
    }

    /// Positions held on the drive now, or being written there.
    #[must_use]
    pub fn spilled(&self) -> usize {
        self.spilled
    }

    /// Entries held now (both levels).
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The spill, if any.
    #[must_use]
    pub fn spill(&self) -> Option<&PrefixSpill> {
        self.spill.as_ref()
    }

    /// Take the entry sharing the longest prefix with `prompt` whose cache
    /// can hold `capacity` positions, cut back to the reused prefix (at
    /// most `prompt.len() - 1` positions). `Ok(None)` when no entry shares
    /// a first token. A spilled entry starts being restored into
    /// `fresh()`, an empty cache of the engine's ([`Taken::Restoring`]); a
    /// copy of a writing entry whose write is running is made into one
    /// now. An error means the entry is lost and the prompt must be
    /// computed whole.
    pub fn take(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        fresh: impl FnOnce() -> Result<SeqKv, EngineError>,
    ) -> Result<Option<Taken>, SpillError> {
        self.settle();
        let limit = prompt.len().saturating_sub(1);
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.capacity() >= capacity)
            .map(|(i, e)| {
                let n = common_prefix(&e.tokens, prompt).min(limit);
                // A cache that cannot be cut back is reused only whole.
                let n = if e.rewinds() || n == e.tokens.len() {
                    n
                } else {
                    0
                };
                (i, n)
            })
            .max_by_key(|&(i, n)| {
                (
                    n,
                    self.entries[i].served_from_memory(),
                    self.entries[i].used,
                )
            });
        let Some((best, reuse)) = best.filter(|&(_, n)| n > 0) else {
            return Ok(None);
        };
        let e = self.entries.swap_remove(best);
        match e.kept {
            Kept::Memory(mut kv) => {
                self.held -= e.tokens.len();
                if kv.truncate(reuse).is_err() {
                    return Ok(None);
                }
                Ok(Some(Taken::Ready(Reused {
                    kv,
                    cached: reuse,
                    restored: false,
                })))
            }
            Kept::Drive(s) => {
                self.spilled -= e.tokens.len();
                let ticket = self.restore(s, reuse, fresh)?;
                self.pending.push((ticket, reuse));
                Ok(Some(Taken::Restoring {
                    ticket,
                    cached: reuse,
                }))
            }
            Kept::Writing(w) => {
                self.spilled -= e.tokens.len();
                let kv = self.reclaim(w, reuse, fresh)?;
                Ok(Some(Taken::Ready(Reused {
                    kv,
                    cached: reuse,
                    restored: false,
                })))
            }
        }
    }

    /// The first `reuse` positions of a writing entry, from memory: its
    /// own cache once the writer let go of it, else a copy into `fresh()`.
    fn reclaim(
        &mut self,
        w: Writing,
        reuse: usize,
        fresh: impl FnOnce() -> Result<SeqKv, EngineError>,
    ) -> Result<SeqKv, SpillError> {
        let Some(spill) = self.spill.as_mut() else {
            return Err(SpillError::Shape("a writing entry without a spill".into()));
        };
        match Arc::try_unwrap(spill.reclaim(w)) {
            Ok(own) => {
                let mut kv = SeqKv::Cpu(Box::new(own));
                kv.truncate(reuse)?;
                Ok(kv)
            }
            Err(shared) => filled(fresh, reuse, |c| copy_prefix(&shared, reuse, c)),
        }
    }

    /// Start restoring the first `reuse` positions of `s` into `fresh()`
    /// on the spill's thread; `s`'s blocks are free once it is collected
    /// (or now, on an error).
    fn restore(
        &mut self,
        s: Spilled,
        reuse: usize,
        fresh: impl FnOnce() -> Result<SeqKv, EngineError>,
    ) -> Result<u64, SpillError> {
        let Some(spill) = self.spill.as_mut() else {
            return Err(SpillError::Shape("a spilled entry without a spill".into()));
        };
        let into = match fresh() {
            Ok(SeqKv::Cpu(c)) => c,
            Ok(other) => {
                spill.drop_entry(s);
                return Err(SpillError::Shape(format!(
                    "{other:?} cannot take a CPU cache's positions"
                )));
            }
            Err(e) => {
                spill.drop_entry(s);
                return Err(e.into());
            }
        };
        spill.start_restore(s, reuse, into)
    }

    /// The restores started by [`Self::take`] that finished since the last
    /// call: each ticket with its cache cut back to the reused positions,
    /// or the error (the prompt is then computed whole).
    pub fn restores(&mut self) -> Vec<(u64, Result<Reused, SpillError>)> {
        let Some(spill) = self.spill.as_mut() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (ticket, got) in spill.collect_restores() {
            let Some(at) = self.pending.iter().position(|(t, _)| *t == ticket) else {
                continue;
            };
            let (_, reuse) = self.pending.swap_remove(at);
            let reused = got.and_then(|c| {
                let mut kv = SeqKv::Cpu(c);
                kv.truncate(reuse)?;
                Ok(Reused {
                    kv,
                    cached: reuse,
                    restored: true,
                })
            });
            out.push((ticket, reused));
        }
        out
    }

    /// Restores started and not yet collected.
    #[must_use]
    pub fn restoring(&self) -> usize {
        self.pending.len()
    }

    /// Block until a restore is ready to collect, at most `timeout` (at
    /// once when none is running).
    pub fn wait_restores(&self, timeout: std::time::Duration) {
        if let Some(spill) = &self.spill {
            spill.wait_restores(timeout);
        }
    }

    /// Keep a finished sequence's cache, which holds `tokens`; the least
    /// recently used entries make room, going to the drive when there is a
    /// spill. A sequence longer than the memory budget goes straight to the
    /// drive, or is dropped.
    pub fn put(&mut self, tokens: Vec<u32>, kv: SeqKv) {
        debug_assert_eq!(tokens.len(), kv.len());
        self.settle();
        // Qwen4-Exp's state lives in the model, which the next sequence
        // takes over: nothing of it can be kept.
        let state_in_model = matches!(kv, SeqKv::Qwen4 { .. });
        if state_in_model || tokens.is_empty() || tokens.len() != kv.len() || self.budget == 0 {
            return;
        }
        self.clock += 1;
        let used = self.clock;
        if tokens.len() > self.budget {
            self.demote(tokens, kv, used);
            return;
        }
        while self.held + tokens.len() > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| matches!(e.kept, Kept::Memory(_)))
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i);
            let Some(oldest) = oldest else {
                break;
            };
            let e = self.entries.swap_remove(oldest);
            self.held -= e.tokens.len();
            if let Kept::Memory(old) = e.kept {
                self.demote(e.tokens, old, e.used);
            }
        }
        self.held += tokens.len();
        self.entries.push(Entry {
            tokens,
            kept: Kept::Memory(kv),
            used,
        });
    }

    /// A cache leaving memory: handed to the spill's writer (the least
    /// recently used on the drive making room) when it is a CPU cache that
    /// fits the spill and its write queue has room, else dropped.
    fn demote(&mut self, tokens: Vec<u32>, kv: SeqKv, used: u64) {
        let Some(spill) = self.spill.as_mut() else {
            return;
        };
        let SeqKv::Cpu(cache) = kv else {
            return;
        };
        let need = blocks_for(tokens.len());
        if !spill.admits(need) {
            return;
        }
        while spill.free_blocks() < need {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| matches!(e.kept, Kept::Drive(_)))
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i);
            let Some(oldest) = oldest else {
                break;
            };
            let e = self.entries.swap_remove(oldest);
            self.spilled -= e.tokens.len();
            if let Kept::Drive(s) = e.kept {
                spill.drop_entry(s);
            }
        }
        let capacity = cache.capacity();
        if let Some(w) = spill.submit(cache, capacity) {
            self.spilled += tokens.len();
            self.entries.push(Entry {
                tokens,
                kept: Kept::Writing(w),
                used,
            });
        }
    }

    /// Take in the spill's finished writes: a written entry is on the drive
    /// now (its cache's memory goes), one whose write failed is gone.
    /// Cheap when none finished; `put` and `take` call it first, and the
    /// scheduler between steps.
    pub fn settle(&mut self) {
        let Some(spill) = self.spill.as_mut() else {
            return;
        };
        for s in spill.collect() {
            let (Settled::Written(ticket, _) | Settled::Failed(ticket)) = &s;
            let ticket = *ticket;
            let at = self
                .entries
                .iter()
                .position(|e| matches!(&e.kept, Kept::Writing(w) if w.ticket() == ticket));
            match (at, s) {
                (Some(i), Settled::Written(_, d)) => {
                    if let Some(e) = self.entries.get_mut(i) {
                        e.kept = Kept::Drive(d);
                    }
                }
                (Some(i), Settled::Failed(_)) => {
                    let e = self.entries.swap_remove(i);
                    self.spilled -= e.tokens.len();
                }
                // A taken entry's write is cancelled, and the spill frees
                // its blocks itself; kept here for any other path.
                (None, Settled::Written(_, d)) => spill.release(d),
                (None, Settled::Failed(_)) => {}
            }
        }
    }

    /// Block until the spill's queued writes are finished, then
    /// [`Self::settle`]: every entry is in memory or on the drive after.
    /// The scheduler never calls it; tests and callers that want the
    /// counters final do.
    pub fn flush(&mut self) {
        if let Some(spill) = &self.spill {
            spill.flush();
        }
        self.settle();
    }
}

/// The first `positions` positions of `src` in `into`, an empty cache of
/// the same shape: the bytes `src` cut back to `positions` would hold.
/// A fresh cache of the engine's, its first positions written by `fill`
/// (a CPU cache only), cut back to `reuse` positions.
fn filled(
    fresh: impl FnOnce() -> Result<SeqKv, EngineError>,
    reuse: usize,
    fill: impl FnOnce(&mut KvCache) -> Result<(), SpillError>,
) -> Result<SeqKv, SpillError> {
    let mut kv = fresh()?;
    match &mut kv {
        SeqKv::Cpu(c) => fill(c)?,
        other => {
            return Err(SpillError::Shape(format!(
                "{other:?} cannot take a CPU cache's positions"
            )));
        }
    }
    kv.truncate(reuse)?;
    Ok(kv)
}

fn copy_prefix(src: &KvCache, positions: usize, into: &mut KvCache) -> Result<(), SpillError> {
    let bytes = src.layer_len_bytes(positions);
    let mut keys = Vec::with_capacity(src.layers());
    let mut values = Vec::with_capacity(src.layers());
    for layer in 0..src.layers() {
        let (k, v) = src.layer_bytes(layer)?;
        match (k.get(..bytes), v.get(..bytes)) {
            (Some(k), Some(v)) => {
                keys.push(k.to_vec());
                values.push(v.to_vec());
            }
            _ => {
                return Err(SpillError::Shape(format!(
                    "{positions} positions of a cache holding {}",
                    src.len()
                )));
            }
        }
    }
    into.fill(positions, keys, values)?;
    Ok(())
}
