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
mod reuse;
pub mod spill;
mod store;
mod writer;

#[cfg(test)]
mod tests;

use flashtier_engine::device::KvState;
use flashtier_engine::engine::SeqKv;

pub use error::SpillError;
pub use reuse::{Reused, Taken};
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
