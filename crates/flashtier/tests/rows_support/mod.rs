//! Shared fixtures of the row-store tests: synthetic tables and the naive
//! reference every lookup is compared with.
#![allow(dead_code)]

use std::path::Path;

use flashtier::rows::pack::{synthetic_row, write_synthetic_table};
use flashtier::rows::{RowGeometry, RowStore, TableSource};

pub const SEED: u64 = 0x5EED;
pub const G: RowGeometry = RowGeometry::ENGRAM;

/// The naive reference: row `id` of the synthetic table, or zeros when the
/// rank does not own it.
pub fn reference(id: u64, lo: u64, hi: u64) -> Vec<u8> {
    let mut row = vec![0u8; G.stride()];
    if id >= lo && id < hi {
        synthetic_row(SEED, id, G, &mut row);
    }
    row
}

pub fn table(dir: &Path, rows: u64) -> TableSource {
    write_synthetic_table(&dir.join("table.bin"), rows, G, SEED).expect("synthetic table")
}

/// Look `ids` up and compare every row with the reference.
pub fn check(store: &RowStore, ids: &[u64]) {
    let (lo, hi) = store.range();
    let mut w = vec![0xAAu8; ids.len() * G.w()];
    let mut s = vec![0xAAu8; ids.len() * G.s()];
    store.lookup(ids, &mut w, &mut s).expect("lookup");
    for (i, &id) in ids.iter().enumerate() {
        let want = reference(id, lo, hi);
        assert_eq!(
            &w[i * G.w()..(i + 1) * G.w()],
            &want[..G.w()],
            "weights of id {id} at {i}"
        );
        assert_eq!(
            &s[i * G.s()..(i + 1) * G.s()],
            &want[G.w()..],
            "scales of id {id} at {i}"
        );
    }
}

/// A small deterministic generator (xorshift) for test batches.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A batch with duplicates: ids from a small hot pool half the time.
    pub fn batch(&mut self, len: usize, rows: u64) -> Vec<u64> {
        let hot: Vec<u64> = (0..8).map(|_| self.below(rows)).collect();
        (0..len)
            .map(|_| {
                if self.next() % 2 == 0 {
                    hot[self.below(8) as usize]
                } else {
                    self.below(rows)
                }
            })
            .collect()
    }
}
