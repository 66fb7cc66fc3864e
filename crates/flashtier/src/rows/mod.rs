//! The row store: exact retrieval of immutable table rows (Engram n-gram
//! embeddings, any large embedding table) by id, from NVMe or RAM.
//!
//! A row is `weight_bytes` of payload (256 FP8 E4M3 codes for Engram) and
//! `scale_bytes` of scale (8). [`RowStore::lookup`] fills a weights array and
//! a scales array for a batch of ids:
//!
//! - ids outside the table are an error naming the id and its position; the
//!   rank's owned range `[lo, hi)` is served, every other row comes back as
//!   zeros (another rank adds it in);
//! - hits come from a bounded set-associative cache ([`cache`]); misses are
//!   deduplicated, grouped by read window, and served by a shared bounded
//!   worker pool in which the caller takes part ([`pool`]), or submitted in
//!   bounded windows to a backend with its own queue (io_uring);
//! - a miss is one read: from a packed shard ([`pack`], weight and scale side
//!   by side, every block checked against its xxh3) or from the table source
//!   with the owned scales resident in RAM;
//! - RAM mode maps and locks the whole table instead.
//!
//! [`ngram`] turns token ids into Engram row ids; [`fp8`] dequantises rows.
//!
//! ```
//! use flashtier::rows::{RowGeometry, RowStore, RowStoreConfig, pack};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let g = RowGeometry::ENGRAM;
//! let table = pack::write_synthetic_table(&dir.path().join("t.bin"), 100, g, 7)?;
//! let store = RowStore::open(table, RowStoreConfig { cache_bytes: 1 << 16, ..Default::default() })?;
//! store.set_range(0, 50)?;
//! let ids = [3u64, 60, 3];
//! let mut w = vec![0u8; ids.len() * 256];
//! let mut s = vec![0u8; ids.len() * 8];
//! store.lookup(&ids, &mut w, &mut s)?;
//! let mut row = vec![0u8; 264];
//! pack::synthetic_row(7, 3, g, &mut row);
//! assert_eq!(&w[..256], &row[..256]);
//! assert!(w[256..512].iter().all(|&b| b == 0)); // row 60 is not owned
//! assert_eq!(&w[512..], &row[..256]);
//! # Ok(()) }
//! ```

pub mod cache;
pub mod config;
pub mod error;
pub mod fp8;
pub mod ngram;
pub mod pack;
pub mod pool;
pub mod source;
pub mod stats;
pub mod store;
pub mod verify;

mod backing;
mod fetch;
mod shard;
mod state;

pub use cache::RowCache;
pub use config::RowStoreConfig;
pub use error::RowError;
pub use fp8::ScaleFormat;
pub use ngram::{EngramHashConfig, EngramHasher};
pub use pool::{InlineBackend, RowPool};
pub use source::TableSource;
pub use store::{RowPrefetch, RowStats, RowStore};

/// Bytes of one row: weight payload then scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowGeometry {
    /// Weight bytes per row (256 FP8 codes for Engram).
    pub weight_bytes: u32,
    /// Scale bytes per row (8 for Engram).
    pub scale_bytes: u32,
}

impl RowGeometry {
    /// Engram: 256 FP8 E4M3 codes and 8 scale bytes.
    pub const ENGRAM: Self = Self {
        weight_bytes: 256,
        scale_bytes: 8,
    };

    /// Weight plus scale bytes.
    #[must_use]
    pub fn stride(self) -> usize {
        self.weight_bytes as usize + self.scale_bytes as usize
    }

    /// Weight bytes as `usize`.
    #[must_use]
    pub fn w(self) -> usize {
        self.weight_bytes as usize
    }

    /// Scale bytes as `usize`.
    #[must_use]
    pub fn s(self) -> usize {
        self.scale_bytes as usize
    }

    /// Check the geometry: a non-empty weight, and a row that fits one
    /// 4096-byte block (the packed shard's unit of reading).
    pub fn validate(self) -> Result<(), RowError> {
        if self.weight_bytes == 0 || self.stride() > 4096 {
            return Err(RowError::Config(format!(
                "row geometry {} + {} bytes: the weight must be non-empty and a row at most 4096 bytes",
                self.weight_bytes, self.scale_bytes
            )));
        }
        Ok(())
    }
}

impl Default for RowGeometry {
    fn default() -> Self {
        Self::ENGRAM
    }
}

/// The contiguous range rank `rank` of `ranks` owns in a `rows`-row table:
/// `[rows * rank / ranks, rows * (rank + 1) / ranks)`. The ranges of all ranks
/// partition the table.
pub fn owned_range(rows: u64, rank: u64, ranks: u64) -> Result<(u64, u64), RowError> {
    if ranks == 0 || rank >= ranks {
        return Err(RowError::Config(format!(
            "rank {rank} of {ranks}: need 0 <= rank < ranks"
        )));
    }
    let at = |r: u64| (u128::from(rows) * u128::from(r) / u128::from(ranks)) as u64;
    Ok((at(rank), at(rank + 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_partition_the_table() {
        for rows in [0u64, 1, 7, 1000, 1 << 40] {
            for ranks in 1..9 {
                let mut next = 0;
                for r in 0..ranks {
                    let (lo, hi) = owned_range(rows, r, ranks).expect("valid");
                    assert_eq!(lo, next);
                    next = hi;
                }
                assert_eq!(next, rows);
            }
        }
        assert!(owned_range(10, 2, 2).is_err());
        assert!(owned_range(10, 0, 0).is_err());
    }
}
