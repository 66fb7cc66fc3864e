//! Taking a kept cache for a prompt: from memory at once, from an entry
//! still being written by a copy, or from the drive on the spill's restore
//! thread (see the parent module).

use std::sync::Arc;

use flashtier_engine::device::KvState;
use flashtier_engine::device::cpu::kv::KvCache;
use flashtier_engine::engine::SeqKv;
use flashtier_engine::error::EngineError;

use super::spill::{Spilled, Writing};
use super::{Kept, PrefixCache, PrefixSpill, SpillError};

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
                spill.release(s);
                return Err(SpillError::Shape(format!(
                    "{other:?} cannot take a CPU cache's positions"
                )));
            }
            Err(e) => {
                spill.release(s);
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
        let cut = |c: Box<KvCache>, reuse: usize| -> Result<Reused, SpillError> {
            let mut kv = SeqKv::Cpu(c);
            kv.truncate(reuse)?;
            Ok(Reused {
                kv,
                cached: reuse,
                restored: true,
            })
        };
        spill
            .collect_restores()
            .into_iter()
            .map(|(ticket, reuse, got)| (ticket, got.and_then(|c| cut(c, reuse))))
            .collect()
    }

    /// Restores started and not yet collected.
    #[must_use]
    pub fn restoring(&self) -> usize {
        self.spill.as_ref().map_or(0, PrefixSpill::restoring)
    }

    /// Block until a restore is ready to collect, at most `timeout` (at
    /// once when none is running).
    pub fn wait_restores(&self, timeout: std::time::Duration) {
        if let Some(spill) = &self.spill {
            spill.wait_restores(timeout);
        }
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
