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
//!
//! Files: this one holds the layout, the writers and replacement; the
//! lock-free read side (the hit path, one probe per way count and row shape
//! Engram uses) is in `probe.rs`.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};
use std::sync::{Mutex, PoisonError};

use crate::rows::{RowError, RowGeometry};

mod probe;

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

/// Words of 8 bytes holding `bytes` (inlined into the probe's shapes, so
/// a compile-time shape folds it).
#[inline(always)]
fn words(bytes: usize) -> usize {
    bytes.div_ceil(8)
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

    /// The set of row `id` (inlined into the probe).
    #[inline]
    fn set_of(&self, id: u64) -> usize {
        let h = (id ^ (id >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((u128::from(h) * self.sets as u128) >> 64) as usize
    }

    /// The words of set `set`.
    #[inline]
    fn set_words_of(&self, set: usize) -> &[AtomicU64] {
        let at = self.base_word + set * self.set_words;
        self.slab.get(at..at + self.set_words).unwrap_or(&[])
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
mod tests;
