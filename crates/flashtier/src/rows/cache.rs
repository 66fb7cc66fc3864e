//! A bounded set-associative row cache, safe under concurrent lookups.
//!
//! Layout: one slab of u64 words, one stretch per set, so a hit touches one
//! small contiguous region (the set's header line and the row's lines):
//!
//! ```text
//! set s: [seq][refs][key 0 .. key W-1][row 0 words][row 1 words]...[pad to 64 B]
//! ```
//!
//! `seq` is the set's sequence counter (odd while a writer is inside),
//! `refs` holds one CLOCK reference bit per way, a key is `id + 1` (0 =
//! empty), and a row is its weight words then its scale words
//! (little-endian). Each set also has a CLOCK hand byte outside the slab.
//! The byte budget covers all of it:
//! `sets = budget / (set_words * 8 + 1)`, ways 1..=16.
//!
//! Concurrency: writers (inserting a row read from disk) serialise per set
//! on one of at most [`MAX_STRIPES`] striped locks and bump the set's
//! sequence counter around the write. Readers take no lock: they read the
//! counter, find the key, copy the words, and re-read the counter; a change
//! means a concurrent write and the copy is retried, at most [`READ_TRIES`]
//! times before the lookup is treated as a miss. So a reader never returns
//! a torn row, and the hit path never waits on a writer. Every word is an
//! atomic; a reader copies a row with [`flashtier_io::seqcopy::copy_words`]
//! (16-byte vector moves, race-free against the atomic writers; the
//! `unsafe` lives in flashtier-io), so this module needs no `unsafe`.
//!
//! Replacement is per set: CLOCK (second chance). A hit sets the slot's
//! reference bit (an atomic OR, only when it is clear); the hand evicts the
//! first slot whose bit is clear, clearing bits as it passes, so a row seen
//! twice outlives one seen once.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};
use std::sync::{Mutex, PoisonError};

use flashtier_io::seqcopy::{copy_words, prefetch_word};

use crate::rows::{RowError, RowGeometry};

/// Most ways per set.
pub const MAX_WAYS: usize = 16;
/// Most writer locks.
pub const MAX_STRIPES: usize = 256;
/// Bounded retries of a lock-free read that raced a writer.
pub const READ_TRIES: usize = 8;

/// Ids whose set headers [`RowCache::get_many`] requests before probing.
pub const PROBE_GROUP: usize = 16;

/// Words before the keys in a set's stretch (seq, refs).
const HEADER_WORDS: usize = 2;

/// The cache. See the module docs.
pub struct RowCache {
    sets: usize,
    ways: usize,
    weight_words: usize,
    row_words: usize,
    set_words: usize,
    /// Index of set 0's first word (aligns sets to 64 bytes).
    base_word: usize,
    geometry: RowGeometry,
    slab: Vec<AtomicU64>,
    hands: Vec<AtomicU8>,
    stripes: Vec<Mutex<()>>,
}

fn words(bytes: usize) -> usize {
    bytes.div_ceil(8)
}

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

fn copy_in(words: &[AtomicU64], src: &[u8]) {
    let mut chunks = src.chunks_exact(8);
    let mut words = words.iter();
    for (chunk, w) in (&mut chunks).zip(&mut words) {
        let mut v = [0u8; 8];
        v.copy_from_slice(chunk);
        w.store(u64::from_le_bytes(v), Ordering::Relaxed);
    }
    let tail = chunks.remainder();
    if let (false, Some(w)) = (tail.is_empty(), words.next()) {
        let mut v = [0u8; 8];
        v[..tail.len()].copy_from_slice(tail);
        w.store(u64::from_le_bytes(v), Ordering::Relaxed);
    }
}

/// A set's dimensions as the probe sees them. [`Dims`] reads them from the
/// cache at run time; [`Fixed`] makes them compile-time constants, so the
/// probe's slicing folds into one length check and the row copy into a
/// fixed sequence of moves (about a third faster for Engram's rows).
trait Shape: Copy {
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
struct Dims {
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
    /// A cache within `budget_bytes` for rows of `geometry`; `None` when the
    /// budget holds less than one set.
    pub fn new(
        budget_bytes: u64,
        ways: usize,
        geometry: RowGeometry,
    ) -> Result<Option<Self>, RowError> {
        if !(1..=MAX_WAYS).contains(&ways) {
            return Err(RowError::Config(format!(
                "{ways} cache ways: need 1..={MAX_WAYS}"
            )));
        }
        geometry.validate()?;
        let weight_words = words(geometry.w());
        let row_words = weight_words + words(geometry.s());
        let set_words = (HEADER_WORDS + ways + ways * row_words).div_ceil(8) * 8;
        let set_bytes = (set_words * 8 + 1) as u64;
        let sets = usize::try_from(budget_bytes / set_bytes).map_err(|_| {
            RowError::Config(format!("cache budget {budget_bytes} bytes too large"))
        })?;
        // Keep 64 bytes of the budget for aligning the slab.
        let sets = if sets > 0 && (sets as u64) * set_bytes + 64 > budget_bytes {
            sets - 1
        } else {
            sets
        };
        if sets == 0 {
            return Ok(None);
        }
        let slab: Vec<AtomicU64> = (0..sets * set_words + 8)
            .map(|_| AtomicU64::new(0))
            .collect();
        let misalign = (slab.as_ptr() as usize % 64) / 8;
        Ok(Some(Self {
            sets,
            ways,
            weight_words,
            row_words,
            set_words,
            base_word: (8 - misalign) % 8,
            geometry,
            slab,
            hands: (0..sets).map(|_| AtomicU8::new(0)).collect(),
            stripes: (0..sets.min(MAX_STRIPES)).map(|_| Mutex::new(())).collect(),
        }))
    }

    /// Sets.
    #[must_use]
    pub fn sets(&self) -> usize {
        self.sets
    }

    /// Ways per set.
    #[must_use]
    pub fn ways(&self) -> usize {
        self.ways
    }

    /// Slots (rows the cache can hold).
    #[must_use]
    pub fn slots(&self) -> usize {
        self.sets * self.ways
    }

    /// Bytes the cache occupies (within its budget).
    #[must_use]
    pub fn bytes(&self) -> u64 {
        (self.slab.len() * 8 + self.hands.len()) as u64
    }

    fn set_of(&self, id: u64) -> usize {
        let h = (id ^ (id >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((u128::from(h) * self.sets as u128) >> 64) as usize
    }

    /// The words of set `set`.
    fn set_words_of(&self, set: usize) -> &[AtomicU64] {
        let at = self.base_word + set * self.set_words;
        self.slab.get(at..at + self.set_words).unwrap_or(&[])
    }

    /// Split a set's words into (seq, refs, keys, rows) for a set of
    /// `shape` (the cache's own dimensions, or the same as constants).
    #[inline(always)]
    fn parts<S: Shape>(
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

    fn dims(&self) -> Dims {
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

    /// Whether `id` is cached (a racing write may make this stale at once).
    #[must_use]
    pub fn contains(&self, id: u64) -> bool {
        let key = id.wrapping_add(1);
        Self::parts(self.dims(), self.set_words_of(self.set_of(id)))
            .is_some_and(|(_, _, keys, _)| keys.iter().any(|k| k.load(Ordering::Relaxed) == key))
    }

    /// Insert row `id` (`row` = weight bytes then scale bytes), evicting by
    /// CLOCK when the set is full. A row already present is left as is.
    pub fn insert(&self, id: u64, row: &[u8]) {
        let key = id.wrapping_add(1);
        let set = self.set_of(id);
        let Some(stripe) = self.stripes.get(set % self.stripes.len().max(1)) else {
            return;
        };
        let Some((seq, refs, keys, rows)) = Self::parts(self.dims(), self.set_words_of(set)) else {
            return;
        };
        let _guard = stripe.lock().unwrap_or_else(PoisonError::into_inner);
        if keys.iter().any(|k| k.load(Ordering::Relaxed) == key) {
            return;
        }
        let way = self.victim(set, refs, keys);
        let Some(k) = keys.get(way) else {
            return;
        };
        let v = seq.load(Ordering::Relaxed);
        seq.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        k.store(key, Ordering::Relaxed);
        let words = rows
            .get(way * self.row_words..(way + 1) * self.row_words)
            .unwrap_or(&[]);
        let (w, s) = words.split_at(self.weight_words.min(words.len()));
        let (rw, rs) = row.split_at(self.geometry.w().min(row.len()));
        copy_in(w, rw);
        copy_in(s, rs);
        refs.fetch_and(!(1u64 << way), Ordering::Relaxed);
        seq.store(v.wrapping_add(2), Ordering::Release);
    }

    /// The way to fill in `set` (caller holds the set's stripe lock).
    fn victim(&self, set: usize, refs: &AtomicU64, keys: &[AtomicU64]) -> usize {
        let Some(hand) = self.hands.get(set) else {
            return 0;
        };
        let mut h = usize::from(hand.load(Ordering::Relaxed)) % self.ways;
        // Bounded: after one sweep every bit is clear, so two sweeps suffice.
        for _ in 0..2 * self.ways {
            let empty = keys.get(h).is_some_and(|k| k.load(Ordering::Relaxed) == 0);
            let bit = 1u64 << h;
            if empty || refs.load(Ordering::Relaxed) & bit == 0 {
                break;
            }
            refs.fetch_and(!bit, Ordering::Relaxed);
            h = (h + 1) % self.ways;
        }
        hand.store(((h + 1) % self.ways) as u8, Ordering::Relaxed);
        h
    }
}

impl std::fmt::Debug for RowCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowCache")
            .field("sets", &self.sets)
            .field("ways", &self.ways)
            .field("bytes", &self.bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: u64) -> Vec<u8> {
        (0..264u64)
            .map(|i| (id.wrapping_mul(31) ^ i) as u8)
            .collect()
    }

    /// `get_many` agrees with `get` and with the inserted bytes for the
    /// compiled-in Engram shapes, a way count without one (3), and
    /// geometries with odd byte counts or no scale at all.
    #[test]
    fn get_many_matches_get_for_every_shape() {
        let shapes = [
            (RowGeometry::ENGRAM, 1),
            (RowGeometry::ENGRAM, 3),
            (RowGeometry::ENGRAM, 4),
            (RowGeometry::ENGRAM, 16),
            (
                RowGeometry {
                    weight_bytes: 100,
                    scale_bytes: 0,
                },
                4,
            ),
            (
                RowGeometry {
                    weight_bytes: 37,
                    scale_bytes: 5,
                },
                2,
            ),
        ];
        for (g, ways) in shapes {
            let (w, s) = (g.w(), g.s());
            let c = RowCache::new(1 << 16, ways, g)
                .expect("valid")
                .expect("fits");
            let bytes = |id: u64| -> Vec<u8> {
                (0..g.stride() as u64)
                    .map(|i| (id.wrapping_mul(77) ^ i) as u8)
                    .collect()
            };
            for id in (0..400u64).step_by(2) {
                c.insert(id, &bytes(id));
            }
            let ids: Vec<u64> = (0..150u64).map(|i| (i * 37) % 400).collect();
            let (mut wo, mut so) = (vec![0xAAu8; ids.len() * w], vec![0xAAu8; ids.len() * s]);
            let mut missed = Vec::new();
            let hits = c.get_many(&ids, &mut wo, &mut so, &mut missed);
            assert_eq!(hits as usize + missed.len(), ids.len(), "{g:?} x {ways}");
            for (i, &id) in ids.iter().enumerate() {
                let (mut w1, mut s1) = (vec![0u8; w], vec![0u8; s]);
                let hit = c.get(id, &mut w1, &mut s1);
                assert_eq!(hit, !missed.contains(&i), "{g:?} x {ways}: id {id}");
                if hit {
                    let want = bytes(id);
                    assert_eq!(
                        &wo[i * w..(i + 1) * w],
                        &want[..w],
                        "{g:?} x {ways}: id {id}"
                    );
                    assert_eq!(
                        &so[i * s..(i + 1) * s],
                        &want[w..],
                        "{g:?} x {ways}: id {id}"
                    );
                    assert_eq!((w1.as_slice(), s1.as_slice()), want.split_at(w));
                }
            }
            assert!(hits > 0, "{g:?} x {ways}: nothing cached");
        }
    }

    #[test]
    fn budget_and_ways_bounds() {
        let g = RowGeometry::ENGRAM;
        assert!(RowCache::new(1 << 20, 0, g).is_err());
        assert!(RowCache::new(1 << 20, 17, g).is_err());
        assert!(RowCache::new(10, 4, g).expect("valid").is_none());
        for ways in [1, 4, 16] {
            let c = RowCache::new(1 << 20, ways, g)
                .expect("valid")
                .expect("fits");
            assert!(c.bytes() <= 1 << 20);
            assert_eq!(c.slots(), c.sets() * ways);
        }
    }

    #[test]
    fn hit_returns_exact_row_and_miss_returns_false() {
        let c = RowCache::new(1 << 16, 4, RowGeometry::ENGRAM)
            .expect("valid")
            .expect("fits");
        let mut w = vec![0u8; 256];
        let mut s = vec![0u8; 8];
        assert!(!c.get(5, &mut w, &mut s));
        c.insert(5, &row(5));
        assert!(c.get(5, &mut w, &mut s));
        assert_eq!(w, row(5)[..256]);
        assert_eq!(s, row(5)[256..]);
    }

    #[test]
    fn get_many_matches_get_row_by_row() {
        let c = RowCache::new(1 << 20, 4, RowGeometry::ENGRAM)
            .expect("valid")
            .expect("fits");
        // Every third id cached, over more than three probe groups.
        let ids: Vec<u64> = (0..3 * PROBE_GROUP as u64 + 5).map(|i| i * 7 + 1).collect();
        for &id in ids.iter().step_by(3) {
            c.insert(id, &row(id));
        }
        let (mut w, mut s) = (vec![0xAAu8; ids.len() * 256], vec![0xAAu8; ids.len() * 8]);
        let mut missed = Vec::new();
        let hits = c.get_many(&ids, &mut w, &mut s, &mut missed);
        let want_missed: Vec<usize> = (0..ids.len()).filter(|i| i % 3 != 0).collect();
        assert_eq!(missed, want_missed);
        assert_eq!(hits as usize, ids.len() - want_missed.len());
        for (i, &id) in ids.iter().enumerate().step_by(3) {
            assert_eq!(w[i * 256..(i + 1) * 256], row(id)[..256], "weights of {id}");
            assert_eq!(s[i * 8..(i + 1) * 8], row(id)[256..], "scales of {id}");
        }
        for &i in &missed {
            assert!(
                w[i * 256..(i + 1) * 256].iter().all(|&b| b == 0xAA),
                "a miss is left untouched"
            );
        }
    }

    #[test]
    fn odd_geometry_round_trips() {
        let g = RowGeometry {
            weight_bytes: 13,
            scale_bytes: 3,
        };
        let c = RowCache::new(1 << 12, 2, g).expect("valid").expect("fits");
        let r: Vec<u8> = (1..=16).collect();
        c.insert(9, &r);
        let (mut w, mut s) = (vec![0u8; 13], vec![0u8; 3]);
        assert!(c.get(9, &mut w, &mut s));
        assert_eq!(w, r[..13]);
        assert_eq!(s, r[13..]);
    }

    #[test]
    fn a_set_never_holds_more_than_its_ways_and_keeps_referenced_rows() {
        let c = RowCache::new(1 << 14, 4, RowGeometry::ENGRAM)
            .expect("valid")
            .expect("fits");
        let (mut w, mut s) = (vec![0u8; 256], vec![0u8; 8]);
        c.insert(0, &row(0));
        assert!(c.get(0, &mut w, &mut s)); // referenced
        let same_set: Vec<u64> = (1..100_000u64)
            .filter(|&i| c.set_of(i) == c.set_of(0))
            .take(12)
            .collect();
        for &id in &same_set {
            c.insert(id, &row(id));
            assert!(
                c.get(0, &mut w, &mut s),
                "the referenced row survives one sweep"
            );
        }
        let resident =
            same_set.iter().filter(|&&i| c.contains(i)).count() + usize::from(c.contains(0));
        assert!(resident <= 4);
        for id in same_set.iter().filter(|&&i| c.contains(i)) {
            assert!(c.get(*id, &mut w, &mut s));
            assert_eq!(w, row(*id)[..256]);
        }
    }

    /// The vectorised seqlock copy under churn: writers keep evicting and
    /// refilling one set's ways with other rows while readers copy from it;
    /// every row a reader accepts must be exactly the row of its id.
    #[test]
    fn readers_racing_evictions_in_one_set_never_see_a_torn_row() {
        let c = RowCache::new(1 << 14, 2, RowGeometry::ENGRAM)
            .expect("valid")
            .expect("fits");
        let ids: Vec<u64> = (0..1_000_000u64)
            .filter(|&i| c.set_of(i) == c.set_of(0))
            .take(6)
            .collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for t in 0..2usize {
                let (c, ids, stop) = (&c, &ids, &stop);
                s.spawn(move || {
                    for round in 0..20_000usize {
                        let id = ids[(round * 5 + t) % ids.len()];
                        c.insert(id, &row(id));
                    }
                    stop.store(true, Ordering::Relaxed);
                });
            }
            for t in 0..3usize {
                let (c, ids, stop) = (&c, &ids, &stop);
                s.spawn(move || {
                    let (mut w, mut sc) = (vec![0u8; 256], vec![0u8; 8]);
                    let mut k = t;
                    while !stop.load(Ordering::Relaxed) {
                        let id = ids[k % ids.len()];
                        k += 1;
                        if c.get(id, &mut w, &mut sc) {
                            let want = row(id);
                            assert_eq!(w, want[..256], "torn weights of row {id}");
                            assert_eq!(sc, want[256..], "torn scales of row {id}");
                        }
                    }
                });
            }
        });
    }
}
