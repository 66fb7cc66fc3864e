//! A bounded set-associative row cache, safe under concurrent lookups.
//!
//! Geometry: `sets * ways` slots (ways 1..=16). A slot holds one row as
//! little-endian u64 words (weight words, then scale words), its key
//! (`id + 1`, 0 = empty) and a CLOCK reference bit; a set has a sequence
//! counter and a CLOCK hand. The byte budget covers all of it:
//! `sets = budget / (ways * (row_words * 8 + 9) + 9)`.
//!
//! Concurrency: writers (inserting a row read from disk) serialise per set
//! on one of at most [`MAX_STRIPES`] striped locks and bump the set's
//! sequence counter around the write (odd while writing). Readers take no
//! lock: they read the counter, find the key, copy the words, and re-read
//! the counter; a change means a concurrent write and the copy is retried,
//! at most [`READ_TRIES`] times before the lookup is treated as a miss. So a
//! reader never returns a torn row, and the hit path never waits on a
//! writer. Every word is an atomic, so this needs no `unsafe`.
//!
//! Replacement is per set: CLOCK (second chance). A hit sets the slot's
//! reference bit; the hand evicts the first slot whose bit is clear,
//! clearing bits as it passes, so a row seen twice outlives one seen once.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};
use std::sync::{Mutex, PoisonError};

use crate::rows::{RowError, RowGeometry};

/// Most ways per set.
pub const MAX_WAYS: usize = 16;
/// Most writer locks.
pub const MAX_STRIPES: usize = 256;
/// Bounded retries of a lock-free read that raced a writer.
pub const READ_TRIES: usize = 8;

/// The cache. See the module docs.
pub struct RowCache {
    sets: usize,
    ways: usize,
    weight_words: usize,
    row_words: usize,
    geometry: RowGeometry,
    keys: Vec<AtomicU64>,
    refs: Vec<AtomicU8>,
    seq: Vec<AtomicU64>,
    hands: Vec<AtomicU8>,
    data: Vec<AtomicU64>,
    stripes: Vec<Mutex<()>>,
}

fn words(bytes: usize) -> usize {
    bytes.div_ceil(8)
}

fn copy_out(words: &[AtomicU64], out: &mut [u8]) {
    for (chunk, w) in out.chunks_mut(8).zip(words) {
        let v = w.load(Ordering::Relaxed).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn copy_in(words: &[AtomicU64], src: &[u8]) {
    for (chunk, w) in src.chunks(8).zip(words) {
        let mut v = [0u8; 8];
        v[..chunk.len()].copy_from_slice(chunk);
        w.store(u64::from_le_bytes(v), Ordering::Relaxed);
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
        let set_bytes = (ways * (row_words * 8 + 9) + 9) as u64;
        let sets = usize::try_from(budget_bytes / set_bytes).map_err(|_| {
            RowError::Config(format!("cache budget {budget_bytes} bytes too large"))
        })?;
        if sets == 0 {
            return Ok(None);
        }
        let slots = sets * ways;
        let atomics = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Ok(Some(Self {
            sets,
            ways,
            weight_words,
            row_words,
            geometry,
            keys: atomics(slots),
            refs: (0..slots).map(|_| AtomicU8::new(0)).collect(),
            seq: atomics(sets),
            hands: (0..sets).map(|_| AtomicU8::new(0)).collect(),
            data: atomics(slots * row_words),
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
        (self.slots() * (self.row_words * 8 + 9) + self.sets * 9) as u64
    }

    fn set_of(&self, id: u64) -> usize {
        let h = (id ^ (id >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((u128::from(h) * self.sets as u128) >> 64) as usize
    }

    fn row_words_of(&self, slot: usize) -> &[AtomicU64] {
        let at = slot * self.row_words;
        self.data.get(at..at + self.row_words).unwrap_or(&[])
    }

    /// Copy row `id` into `weight_out` / `scale_out` if cached. Never returns
    /// a torn row; gives up (a miss) after [`READ_TRIES`] racing writes.
    pub fn get(&self, id: u64, weight_out: &mut [u8], scale_out: &mut [u8]) -> bool {
        let key = id.wrapping_add(1);
        let set = self.set_of(id);
        let base = set * self.ways;
        let Some(seq) = self.seq.get(set) else {
            return false;
        };
        for _ in 0..READ_TRIES {
            let before = seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let keys = self.keys.get(base..base + self.ways).unwrap_or(&[]);
            let Some(way) = keys.iter().position(|k| k.load(Ordering::Relaxed) == key) else {
                return false;
            };
            let slot = base + way;
            let row = self.row_words_of(slot);
            let (w, s) = row.split_at(self.weight_words.min(row.len()));
            copy_out(w, weight_out);
            copy_out(s, scale_out);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == before {
                if let Some(r) = self.refs.get(slot) {
                    if r.load(Ordering::Relaxed) == 0 {
                        r.store(1, Ordering::Relaxed);
                    }
                }
                return true;
            }
        }
        false
    }

    /// Whether `id` is cached (a racing write may make this stale at once).
    #[must_use]
    pub fn contains(&self, id: u64) -> bool {
        let key = id.wrapping_add(1);
        let base = self.set_of(id) * self.ways;
        self.keys
            .get(base..base + self.ways)
            .is_some_and(|k| k.iter().any(|k| k.load(Ordering::Relaxed) == key))
    }

    /// Insert row `id` (`row` = weight bytes then scale bytes), evicting by
    /// CLOCK when the set is full. A row already present is left as is.
    pub fn insert(&self, id: u64, row: &[u8]) {
        let key = id.wrapping_add(1);
        let set = self.set_of(id);
        let base = set * self.ways;
        let Some(stripe) = self.stripes.get(set % self.stripes.len().max(1)) else {
            return;
        };
        let _guard = stripe.lock().unwrap_or_else(PoisonError::into_inner);
        let keys = self.keys.get(base..base + self.ways).unwrap_or(&[]);
        if keys.iter().any(|k| k.load(Ordering::Relaxed) == key) {
            return;
        }
        let way = self.victim(set, base);
        let slot = base + way;
        let (Some(seq), Some(k)) = (self.seq.get(set), self.keys.get(slot)) else {
            return;
        };
        let v = seq.load(Ordering::Relaxed);
        seq.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        k.store(key, Ordering::Relaxed);
        let words = self.row_words_of(slot);
        let (w, s) = words.split_at(self.weight_words.min(words.len()));
        let (rw, rs) = row.split_at(self.geometry.w().min(row.len()));
        copy_in(w, rw);
        copy_in(s, rs);
        if let Some(r) = self.refs.get(slot) {
            r.store(0, Ordering::Relaxed);
        }
        seq.store(v.wrapping_add(2), Ordering::Release);
    }

    /// The way to fill in `set` (caller holds the set's stripe lock).
    fn victim(&self, set: usize, base: usize) -> usize {
        let Some(hand) = self.hands.get(set) else {
            return 0;
        };
        let mut h = usize::from(hand.load(Ordering::Relaxed)) % self.ways;
        // Bounded: after one sweep every bit is clear, so two sweeps suffice.
        for _ in 0..2 * self.ways {
            let slot = base + h;
            let empty = self
                .keys
                .get(slot)
                .is_some_and(|k| k.load(Ordering::Relaxed) == 0);
            let referenced = self
                .refs
                .get(slot)
                .is_some_and(|r| r.load(Ordering::Relaxed) != 0);
            if empty || !referenced {
                break;
            }
            if let Some(r) = self.refs.get(slot) {
                r.store(0, Ordering::Relaxed);
            }
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
}
