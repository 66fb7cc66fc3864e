//! [`RowShardError`]: every way a packed row shard fails validation, each
//! naming the file (and the block, offset or field at fault).

use std::path::PathBuf;

use super::ROW_SHARD_VERSION;
use crate::text::hex_bytes;

/// A packed row shard failed validation. Every variant names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RowShardError {
    /// Fewer bytes than a header.
    #[error("{path}: packed row shard is {len_bytes} bytes, shorter than its 4096-byte header")]
    TooShort {
        /// Shard file.
        path: PathBuf,
        /// Bytes available.
        len_bytes: u64,
    },
    /// The magic is not `FTROWSH1`.
    #[error(
        "{path}: not a packed row shard (magic {}, expected FTROWSH1)",
        hex_bytes(found)
    )]
    BadMagic {
        /// Shard file.
        path: PathBuf,
        /// The bytes found.
        found: [u8; 8],
    },
    /// A version this code does not read.
    #[error(
        "{path}: packed row shard version {found} (this build reads version {ROW_SHARD_VERSION})"
    )]
    UnsupportedVersion {
        /// Shard file.
        path: PathBuf,
        /// Version found.
        found: u32,
    },
    /// The header checksum does not match its bytes.
    #[error(
        "{path}: header checksum {stored:#018x} does not match the header bytes ({computed:#018x})"
    )]
    HeaderChecksum {
        /// Shard file.
        path: PathBuf,
        /// Stored checksum.
        stored: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// A header field is inconsistent with itself or the other fields.
    #[error("{path}: header field `{field}` = {value} is invalid: {why}")]
    BadField {
        /// Shard file.
        path: PathBuf,
        /// Field name as in docs/rows-format.md.
        field: &'static str,
        /// Value found.
        value: u64,
        /// What is wrong with it.
        why: String,
    },
    /// The shard is valid but was packed for another layer, range or table.
    #[error(
        "{path}: header field `{field}` is {found} but this store expects {expected}; re-run `flashtier pack rows`"
    )]
    Mismatch {
        /// Shard file.
        path: PathBuf,
        /// Field name as in docs/rows-format.md.
        field: &'static str,
        /// What the store expects.
        expected: u64,
        /// What the shard says.
        found: u64,
    },
    /// The file is shorter than its header says.
    #[error(
        "{path}: packed row shard is truncated: {actual_bytes} bytes, header needs {expected_bytes}"
    )]
    Truncated {
        /// Shard file.
        path: PathBuf,
        /// Length the header implies.
        expected_bytes: u64,
        /// Length of the file.
        actual_bytes: u64,
    },
    /// The checksum table does not match its checksum in the header.
    #[error(
        "{path}: row-block checksum table is corrupt (stored {stored:#018x}, computed {computed:#018x})"
    )]
    ChecksumTable {
        /// Shard file.
        path: PathBuf,
        /// Stored checksum.
        stored: u64,
        /// Checksum of the table read.
        computed: u64,
    },
    /// A row block does not match its checksum: never served.
    #[error(
        "{path}: row block {block} at offset {offset} length {len_bytes} is corrupt (checksum {computed:#018x}, expected {stored:#018x})"
    )]
    BlockChecksum {
        /// Shard file.
        path: PathBuf,
        /// Block index.
        block: u64,
        /// Byte offset of the block in the file.
        offset: u64,
        /// Block length in bytes.
        len_bytes: u64,
        /// Stored checksum.
        stored: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
}
