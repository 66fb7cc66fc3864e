//! The packed row shard: one rank's owned rows `[lo, hi)` of an embedding /
//! Engram table, weight and scale side by side, so that a cache miss is one
//! aligned read. The byte-level layout is in `docs/rows-format.md`.
//!
//! ```text
//! [0, 4096)                      header (fixed-width little-endian, see below)
//! [4096, 4096 + blocks * 4096)   row blocks: rows_per_block rows of row_stride
//!                                bytes each, zero padding to the block end
//! [checksum_offset, ...)         one xxh3-64 per row block (u64 LE), zero
//!                                padded to a multiple of 4096
//! ```
//!
//! Invariants checked by [`RowShardHeader::decode`]: magic, version, header
//! checksum, `lo <= hi <= rows`, `row_stride == row_weight_bytes +
//! scale_bytes`, `rows_per_block == block_bytes / row_stride >= 1`,
//! `block_count == ceil((hi - lo) / rows_per_block)`, and offsets that follow
//! from those. A row never straddles a block, so one block read serves it,
//! and every block read is checked against its checksum before a byte of it
//! is served.

use std::path::Path;

use crate::checksum::xxh3_64;
use crate::le::{get_u32, get_u64};

mod checksums;
mod error;

pub use checksums::{block_checksum, checksums_digest, encode_checksums};
pub use error::RowShardError;

/// Magic at byte 0 of every packed row shard.
pub const ROW_SHARD_MAGIC: [u8; 8] = *b"FTROWSH1";
/// The only version this code reads and writes.
pub const ROW_SHARD_VERSION: u32 = 1;
/// Bytes of the header region (keeps row block 0 page-aligned).
pub const ROW_SHARD_HEADER_BYTES: u32 = 4096;
/// Bytes of one row block (one direct read).
pub const ROW_SHARD_BLOCK_BYTES: u32 = 4096;
/// Bytes of the header covered by the header checksum (`[0, 104)`).
const HEADER_CHECKED_BYTES: usize = 104;

/// The decoded header of a packed row shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowShardHeader {
    /// Layer (or table) id this shard belongs to.
    pub layer: u64,
    /// First owned row (inclusive).
    pub lo: u64,
    /// End of the owned rows (exclusive).
    pub hi: u64,
    /// Rows of the whole table.
    pub rows: u64,
    /// Weight bytes per row (256 for Engram FP8 rows).
    pub row_weight_bytes: u32,
    /// Scale bytes per row (8 for Engram).
    pub scale_bytes: u32,
    /// Rows per 4096-byte block.
    pub rows_per_block: u32,
    /// Checksum (xxh3-64) of the row-block checksum table.
    pub checksums_xxh3: u64,
}

/// Where one row sits in a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLocation {
    /// Block index.
    pub block: u64,
    /// File offset of the block.
    pub block_offset: u64,
    /// Offset of the row inside the block.
    pub in_block: usize,
}

fn put(b: &mut [u8], at: usize, bytes: &[u8]) {
    if let Some(d) = b.get_mut(at..at + bytes.len()) {
        d.copy_from_slice(bytes);
    }
}

impl RowShardHeader {
    /// A header for rows `[lo, hi)` of a `rows`-row table; `rows_per_block`
    /// follows from the geometry. `checksums_xxh3` starts at 0 and is set by
    /// the writer once the blocks are written.
    pub fn new(
        layer: u64,
        lo: u64,
        hi: u64,
        rows: u64,
        row_weight_bytes: u32,
        scale_bytes: u32,
    ) -> Result<Self, RowShardError> {
        let stride = row_weight_bytes.saturating_add(scale_bytes);
        let h = Self {
            layer,
            lo,
            hi,
            rows,
            row_weight_bytes,
            scale_bytes,
            rows_per_block: ROW_SHARD_BLOCK_BYTES.checked_div(stride).unwrap_or(0),
            checksums_xxh3: 0,
        };
        h.check(Path::new("<new shard>"))?;
        Ok(h)
    }

    /// Bytes of one row (weight then scale).
    #[must_use]
    pub fn row_stride(&self) -> u32 {
        self.row_weight_bytes + self.scale_bytes
    }

    /// Rows held by this shard.
    #[must_use]
    pub fn owned_rows(&self) -> u64 {
        self.hi - self.lo
    }

    /// Row blocks in the shard.
    #[must_use]
    pub fn block_count(&self) -> u64 {
        self.owned_rows().div_ceil(u64::from(self.rows_per_block))
    }

    /// File offset of the first row block.
    #[must_use]
    pub fn data_offset(&self) -> u64 {
        u64::from(ROW_SHARD_HEADER_BYTES)
    }

    /// File offset of the checksum table.
    #[must_use]
    pub fn checksum_offset(&self) -> u64 {
        self.data_offset() + self.block_count() * u64::from(ROW_SHARD_BLOCK_BYTES)
    }

    /// Bytes of the checksum table region (padded to 4096).
    #[must_use]
    pub fn checksum_region_bytes(&self) -> u64 {
        (self.block_count() * 8).div_ceil(4096) * 4096
    }

    /// Exact length of a complete shard file.
    #[must_use]
    pub fn file_bytes(&self) -> u64 {
        self.checksum_offset() + self.checksum_region_bytes()
    }

    /// Where owned row `id` sits, or `None` when `id` is outside `[lo, hi)`.
    #[must_use]
    pub fn locate(&self, id: u64) -> Option<RowLocation> {
        if id < self.lo || id >= self.hi {
            return None;
        }
        let local = id - self.lo;
        let rpb = u64::from(self.rows_per_block);
        let block = local / rpb;
        let in_block = usize::try_from((local % rpb) * u64::from(self.row_stride())).ok()?;
        Some(RowLocation {
            block,
            block_offset: self.data_offset() + block * u64::from(ROW_SHARD_BLOCK_BYTES),
            in_block,
        })
    }

    fn check(&self, path: &Path) -> Result<(), RowShardError> {
        let bad = |field: &'static str, value: u64, why: &str| RowShardError::BadField {
            path: path.to_path_buf(),
            field,
            value,
            why: why.to_string(),
        };
        if self.row_weight_bytes == 0 {
            return Err(bad("row_weight_bytes", 0, "must be non-zero"));
        }
        let stride = u64::from(self.row_weight_bytes) + u64::from(self.scale_bytes);
        if stride > u64::from(ROW_SHARD_BLOCK_BYTES) {
            return Err(bad(
                "row_stride",
                stride,
                "a row must fit in one 4096-byte block",
            ));
        }
        let rpb = u64::from(ROW_SHARD_BLOCK_BYTES) / stride;
        if u64::from(self.rows_per_block) != rpb {
            return Err(bad(
                "rows_per_block",
                u64::from(self.rows_per_block),
                &format!("must be 4096 / row_stride = {rpb}"),
            ));
        }
        if self.hi > self.rows {
            return Err(bad(
                "hi",
                self.hi,
                &format!("beyond the table's {} rows", self.rows),
            ));
        }
        if self.lo > self.hi {
            return Err(bad(
                "lo",
                self.lo,
                &format!("greater than hi = {}", self.hi),
            ));
        }
        // Offsets must fit in u64 for any lo/hi that passed the checks above;
        // a block count whose byte size overflows is rejected here.
        let limit = u64::MAX / 8192;
        if self.block_count() > limit {
            return Err(bad("block_count", self.block_count(), "too large"));
        }
        Ok(())
    }

    /// Encode into the 4096-byte header region (checksum included).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; ROW_SHARD_HEADER_BYTES as usize];
        put(&mut b, 0, &ROW_SHARD_MAGIC);
        put(&mut b, 8, &ROW_SHARD_VERSION.to_le_bytes());
        put(&mut b, 12, &ROW_SHARD_HEADER_BYTES.to_le_bytes());
        put(&mut b, 16, &self.layer.to_le_bytes());
        put(&mut b, 24, &self.lo.to_le_bytes());
        put(&mut b, 32, &self.hi.to_le_bytes());
        put(&mut b, 40, &self.rows.to_le_bytes());
        put(&mut b, 48, &self.row_weight_bytes.to_le_bytes());
        put(&mut b, 52, &self.scale_bytes.to_le_bytes());
        put(&mut b, 56, &self.row_stride().to_le_bytes());
        put(&mut b, 60, &ROW_SHARD_BLOCK_BYTES.to_le_bytes());
        put(&mut b, 64, &self.rows_per_block.to_le_bytes());
        put(&mut b, 72, &self.data_offset().to_le_bytes());
        put(&mut b, 80, &self.block_count().to_le_bytes());
        put(&mut b, 88, &self.checksum_offset().to_le_bytes());
        put(&mut b, 96, &self.checksums_xxh3.to_le_bytes());
        let sum = xxh3_64(b.get(..HEADER_CHECKED_BYTES).unwrap_or(&[]));
        put(&mut b, 104, &sum.to_le_bytes());
        b
    }

    /// Decode and validate the header region of the file at `path`
    /// (`bytes` holds at least its first 4096 bytes).
    pub fn decode(path: &Path, bytes: &[u8]) -> Result<Self, RowShardError> {
        let p = || path.to_path_buf();
        if bytes.len() < ROW_SHARD_HEADER_BYTES as usize {
            return Err(RowShardError::TooShort {
                path: p(),
                len_bytes: bytes.len() as u64,
            });
        }
        let mut magic = [0u8; 8];
        magic.copy_from_slice(bytes.get(..8).unwrap_or(&[0; 8]));
        if magic != ROW_SHARD_MAGIC {
            return Err(RowShardError::BadMagic {
                path: p(),
                found: magic,
            });
        }
        let version = get_u32(bytes, 8);
        if version != ROW_SHARD_VERSION {
            return Err(RowShardError::UnsupportedVersion {
                path: p(),
                found: version,
            });
        }
        let stored = get_u64(bytes, 104);
        let computed = xxh3_64(bytes.get(..HEADER_CHECKED_BYTES).unwrap_or(&[]));
        if stored != computed {
            return Err(RowShardError::HeaderChecksum {
                path: p(),
                stored,
                computed,
            });
        }
        let h = Self {
            layer: get_u64(bytes, 16),
            lo: get_u64(bytes, 24),
            hi: get_u64(bytes, 32),
            rows: get_u64(bytes, 40),
            row_weight_bytes: get_u32(bytes, 48),
            scale_bytes: get_u32(bytes, 52),
            rows_per_block: get_u32(bytes, 64),
            checksums_xxh3: get_u64(bytes, 96),
        };
        h.check(path)?;
        h.check_derived(path, bytes)?;
        Ok(h)
    }

    fn check_derived(&self, path: &Path, bytes: &[u8]) -> Result<(), RowShardError> {
        let fields: [(&'static str, u64, u64); 6] = [
            (
                "header_bytes",
                u64::from(get_u32(bytes, 12)),
                u64::from(ROW_SHARD_HEADER_BYTES),
            ),
            (
                "row_stride",
                u64::from(get_u32(bytes, 56)),
                u64::from(self.row_stride()),
            ),
            (
                "block_bytes",
                u64::from(get_u32(bytes, 60)),
                u64::from(ROW_SHARD_BLOCK_BYTES),
            ),
            ("data_offset", get_u64(bytes, 72), self.data_offset()),
            ("block_count", get_u64(bytes, 80), self.block_count()),
            (
                "checksum_offset",
                get_u64(bytes, 88),
                self.checksum_offset(),
            ),
        ];
        for (field, value, want) in fields {
            if value != want {
                return Err(RowShardError::BadField {
                    path: path.to_path_buf(),
                    field,
                    value,
                    why: format!("must be {want}"),
                });
            }
        }
        Ok(())
    }

    /// Check that this shard is the one a store expects: same layer, same
    /// owned range, same table, same geometry. The first difference is the
    /// error.
    pub fn expect(&self, path: &Path, expected: &RowShardHeader) -> Result<(), RowShardError> {
        let pairs: [(&'static str, u64, u64); 6] = [
            ("layer", expected.layer, self.layer),
            ("lo", expected.lo, self.lo),
            ("hi", expected.hi, self.hi),
            ("rows", expected.rows, self.rows),
            (
                "row_weight_bytes",
                u64::from(expected.row_weight_bytes),
                u64::from(self.row_weight_bytes),
            ),
            (
                "scale_bytes",
                u64::from(expected.scale_bytes),
                u64::from(self.scale_bytes),
            ),
        ];
        for (field, expected, found) in pairs {
            if expected != found {
                return Err(RowShardError::Mismatch {
                    path: path.to_path_buf(),
                    field,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }

    /// Check the file length against the header: shorter is truncated.
    pub fn check_len(&self, path: &Path, actual_bytes: u64) -> Result<(), RowShardError> {
        if actual_bytes < self.file_bytes() {
            return Err(RowShardError::Truncated {
                path: path.to_path_buf(),
                expected_bytes: self.file_bytes(),
                actual_bytes,
            });
        }
        Ok(())
    }
}
