//! The seal of a shard's row blocks: one xxh3-64 per 4096-byte block in a
//! table after the blocks, the table itself checked by the header's
//! `checksums_xxh3`. A block is verified before any byte of it is served.
//! The table is the store's checksum table ([`crate::checksum::encode_table`]),
//! zero-padded to a whole block.

use std::path::Path;

use super::{ROW_SHARD_BLOCK_BYTES, RowShardError, RowShardHeader};
use crate::checksum::{decode_table, encode_table, xxh3_64};

/// xxh3-64 of one row block, as stored in the checksum table.
#[must_use]
pub fn block_checksum(block: &[u8]) -> u64 {
    xxh3_64(block)
}

impl RowShardHeader {
    /// Decode the checksum table region (`bytes` starts at `checksum_offset`)
    /// and check it against `checksums_xxh3`.
    pub fn decode_checksums(&self, path: &Path, bytes: &[u8]) -> Result<Vec<u64>, RowShardError> {
        let need = usize::try_from(self.block_count() * 8).unwrap_or(usize::MAX);
        let Some(table) = bytes.get(..need) else {
            return Err(RowShardError::Truncated {
                path: path.to_path_buf(),
                expected_bytes: self.file_bytes(),
                actual_bytes: self.checksum_offset() + bytes.len() as u64,
            });
        };
        let computed = xxh3_64(table);
        if computed != self.checksums_xxh3 {
            return Err(RowShardError::ChecksumTable {
                path: path.to_path_buf(),
                stored: self.checksums_xxh3,
                computed,
            });
        }
        Ok(decode_table(table))
    }

    /// Check one block read from the file against its stored checksum.
    pub fn verify_block(
        &self,
        path: &Path,
        block: u64,
        bytes: &[u8],
        stored: u64,
    ) -> Result<(), RowShardError> {
        let computed = block_checksum(bytes);
        if computed != stored {
            return Err(RowShardError::BlockChecksum {
                path: path.to_path_buf(),
                block,
                offset: self.data_offset() + block * u64::from(ROW_SHARD_BLOCK_BYTES),
                len_bytes: bytes.len() as u64,
                stored,
                computed,
            });
        }
        Ok(())
    }
}

/// Encode a checksum table (one u64 LE per block), zero-padded to a whole
/// number of blocks.
#[must_use]
pub fn encode_checksums(sums: &[u64]) -> Vec<u8> {
    let mut b = encode_table(sums);
    let block = ROW_SHARD_BLOCK_BYTES as usize;
    b.resize(b.len().div_ceil(block) * block, 0);
    b
}

/// xxh3-64 of the unpadded checksum table, for `checksums_xxh3`.
#[must_use]
pub fn checksums_digest(sums: &[u64]) -> u64 {
    xxh3_64(&encode_table(sums))
}
