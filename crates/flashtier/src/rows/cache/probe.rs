//! The lock-free read side of [`RowCache`]: the seqlock copy of one row
//! ([`RowCache::get`]) and the batched probe ([`RowCache::get_many`]), over a
//! set shape that is either read from the cache at run time ([`Dims`]) or
//! fixed at compile time for Engram's rows ([`Fixed`]).
//!
//! This is the hit path (about 10 ns a row): every helper is
//! `#[inline(always)]` so that a `Fixed` probe folds its slicing into one
//! length check and its row copy into a fixed sequence of moves.

use std::sync::atomic::{AtomicU64, Ordering, fence};

use flashtier_io::seqcopy::{copy_words, prefetch_word};

use super::{HEADER_WORDS, PROBE_GROUP, READ_TRIES, RowCache, words};

/// The way holding `key`, scanning every way without an early exit: the
/// matching way varies from row to row, and a mispredicted exit would stall
/// the next rows' loads behind this row's cache miss.
#[inline(always)]
fn find_way(keys: &[AtomicU64], key: u64) -> Option<usize> {
    let mut found = usize::MAX;
    for (i, k) in keys.iter().enumerate() {
        found = if k.load(Ordering::Relaxed) == key {
            i
        } else {
            found
        };
    }
    (found != usize::MAX).then_some(found)
}

/// A set's dimensions as the probe sees them. [`Dims`] reads them from the
/// cache at run time; [`Fixed`] makes them compile-time constants, so the
/// probe's slicing folds into one length check and the row copy into a
/// fixed sequence of moves (about a third faster for Engram's rows).
pub(super) trait Shape: Copy {
    fn ways(self) -> usize;
    fn weight_bytes(self) -> usize;
    fn scale_bytes(self) -> usize;
    #[inline(always)]
    fn weight_words(self) -> usize {
        words(self.weight_bytes())
    }
    #[inline(always)]
    fn row_words(self) -> usize {
        self.weight_words() + words(self.scale_bytes())
    }
}

/// Dimensions read from the cache.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    ways: usize,
    weight_bytes: usize,
    scale_bytes: usize,
}

impl Shape for Dims {
    #[inline(always)]
    fn ways(self) -> usize {
        self.ways
    }
    #[inline(always)]
    fn weight_bytes(self) -> usize {
        self.weight_bytes
    }
    #[inline(always)]
    fn scale_bytes(self) -> usize {
        self.scale_bytes
    }
}

/// Dimensions fixed at compile time: `WAYS` ways of `WB` + `SB`-byte rows.
#[derive(Clone, Copy)]
struct Fixed<const WAYS: usize, const WB: usize, const SB: usize>;

impl<const WAYS: usize, const WB: usize, const SB: usize> Shape for Fixed<WAYS, WB, SB> {
    #[inline(always)]
    fn ways(self) -> usize {
        WAYS
    }
    #[inline(always)]
    fn weight_bytes(self) -> usize {
        WB
    }
    #[inline(always)]
    fn scale_bytes(self) -> usize {
        SB
    }
}
impl RowCache {
    /// Split a set's words into (seq, refs, keys, rows) for a set of
    /// `shape` (the cache's own dimensions, or the same as constants).
    #[inline(always)]
    pub(super) fn parts<S: Shape>(
        shape: S,
        w: &[AtomicU64],
    ) -> Option<(&AtomicU64, &AtomicU64, &[AtomicU64], &[AtomicU64])> {
        let ways = shape.ways();
        let set = w.get(..HEADER_WORDS + ways + ways * shape.row_words())?;
        let (header, rows) = set.split_at(HEADER_WORDS + ways);
        let [seq, refs, keys @ ..] = header else {
            return None;
        };
        Some((seq, refs, keys, rows))
    }

    /// Copy row `id` into `weight_out` / `scale_out` if cached. Never returns
    /// a torn row; gives up (a miss) after [`READ_TRIES`] racing writes.
    pub fn get(&self, id: u64, weight_out: &mut [u8], scale_out: &mut [u8]) -> bool {
        self.get_in(
            self.dims(),
            self.set_words_of(self.set_of(id)),
            id,
            weight_out,
            scale_out,
        )
    }

    pub(super) fn dims(&self) -> Dims {
        Dims {
            ways: self.ways,
            weight_bytes: self.geometry.w(),
            scale_bytes: self.geometry.s(),
        }
    }

    /// [`Self::get`] on the words of `id`'s set, with the set's dimensions
    /// given by `shape` (which must match the cache's).
    #[inline(always)]
    fn get_in<S: Shape>(
        &self,
        shape: S,
        set: &[AtomicU64],
        id: u64,
        weight_out: &mut [u8],
        scale_out: &mut [u8],
    ) -> bool {
        let key = id.wrapping_add(1);
        let row_words = shape.row_words();
        if weight_out.len() != shape.weight_bytes() || scale_out.len() != shape.scale_bytes() {
            return false;
        }
        let Some((seq, refs, keys, rows)) = Self::parts(shape, set) else {
            return false;
        };
        for _ in 0..READ_TRIES {
            let before = seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let Some(way) = find_way(keys, key) else {
                return false;
            };
            let Some(row) = rows.get(way * row_words..(way + 1) * row_words) else {
                return false;
            };
            let (w, s) = row.split_at(shape.weight_words());
            copy_words(w, weight_out);
            copy_words(s, scale_out);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == before {
                let bit = 1u64 << way;
                if refs.load(Ordering::Relaxed) & bit == 0 {
                    refs.fetch_or(bit, Ordering::Relaxed);
                }
                return true;
            }
        }
        false
    }

    /// Copy every cached row of `ids` into its place in `weights_out` /
    /// `scales_out` (row `i` at `i * w` / `i * s`) and push the index of
    /// every id not cached onto `missed`; returns the hits. The batched form
    /// of [`Self::get`]: ids go in groups of [`PROBE_GROUP`], whose set
    /// headers are all requested from memory before the first is probed, so
    /// the probes' loads overlap instead of queueing one behind another.
    /// Output slices shorter than `ids` stop the batch early (the caller
    /// checks lengths).
    pub fn get_many(
        &self,
        ids: &[u64],
        weights_out: &mut [u8],
        scales_out: &mut [u8],
        missed: &mut Vec<usize>,
    ) -> u64 {
        let (w, s) = (self.geometry.w(), self.geometry.s());
        // Engram's rows at every way count get a probe built for them.
        match (self.ways, w, s) {
            (1, 256, 8) => self.probe_all(Fixed::<1, 256, 8>, ids, weights_out, scales_out, missed),
            (2, 256, 8) => self.probe_all(Fixed::<2, 256, 8>, ids, weights_out, scales_out, missed),
            (4, 256, 8) => self.probe_all(Fixed::<4, 256, 8>, ids, weights_out, scales_out, missed),
            (8, 256, 8) => self.probe_all(Fixed::<8, 256, 8>, ids, weights_out, scales_out, missed),
            (16, 256, 8) => {
                self.probe_all(Fixed::<16, 256, 8>, ids, weights_out, scales_out, missed)
            }
            _ => self.probe_all(self.dims(), ids, weights_out, scales_out, missed),
        }
    }

    /// [`Self::get_many`] with the set dimensions of `shape`.
    #[inline(always)]
    fn probe_all<S: Shape>(
        &self,
        shape: S,
        ids: &[u64],
        weights_out: &mut [u8],
        scales_out: &mut [u8],
        missed: &mut Vec<usize>,
    ) -> u64 {
        let (w, s) = (shape.weight_bytes(), shape.scale_bytes());
        let mut hits = 0;
        let mut sets: [&[AtomicU64]; PROBE_GROUP] = [&[]; PROBE_GROUP];
        // Rows are addressed by index, not by chunking the outputs: a
        // geometry without scale bytes has an empty `scales_out`, which
        // chunks into nothing.
        for (g, ids) in ids.chunks(PROBE_GROUP).enumerate() {
            for (set, &id) in sets.iter_mut().zip(ids) {
                *set = self.set_words_of(self.set_of(id));
                if let Some(word) = set.first() {
                    prefetch_word(word);
                }
            }
            for (k, (&id, &set)) in ids.iter().zip(sets.iter()).enumerate() {
                let i = g * PROBE_GROUP + k;
                let (Some(wo), Some(so)) = (
                    weights_out.get_mut(i * w..(i + 1) * w),
                    scales_out.get_mut(i * s..(i + 1) * s),
                ) else {
                    return hits;
                };
                if self.get_in(shape, set, id, wo, so) {
                    hits += 1;
                } else {
                    missed.push(i);
                }
            }
        }
        hits
    }

    /// Pull the header lines of `id`'s set (sequence, reference bits, keys)
    /// towards the core: a hint a batched lookup issues a few rows ahead.
    #[inline]
    pub fn prefetch_set(&self, id: u64) {
        let set = self.set_words_of(self.set_of(id));
        let header = set.get(..HEADER_WORDS + self.ways).unwrap_or(&[]);
        for w in header.iter().step_by(8) {
            prefetch_word(w);
        }
    }
}
