//! [`KvError`]: the KV tier's failures. A restore error means "recompute
//! this KV"; every variant names the store file, block or tile at fault.

use flashtier_format::kv::{BlockId, KvFormatError};
use flashtier_io::{IoError, PersistError};

/// Failures of the KV tier. A restore error means "recompute this KV".
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// The backend failed (names file, offset and length).
    #[error(transparent)]
    Io(#[from] IoError),
    /// Creating the store failed: another file is at its path (which is
    /// left as it is), or the temp file, its fsync or rename failed.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// The store's header or a block address is invalid.
    #[error("KV store {path}: {source}")]
    Format {
        /// Store file.
        path: String,
        /// What is wrong.
        source: KvFormatError,
    },
    /// The store belongs to another model or rank.
    #[error(
        "KV store {path} is for model {found_model:#x} rank {found_rank}, not {model:#x} rank {rank}"
    )]
    WrongOwner {
        /// Store file.
        path: String,
        /// Model hash in the file.
        found_model: u64,
        /// Rank in the file.
        found_rank: u32,
        /// Model hash expected.
        model: u64,
        /// Rank expected.
        rank: u32,
    },
    /// The block holds no completed offload.
    #[error("block (layer {}, block {}) is not resident", .id.layer, .id.block)]
    NotResident {
        /// The block.
        id: BlockId,
    },
    /// The store holds another generation of the block than the caller's.
    #[error("block (layer {}, block {}) is stale: store holds generation {found}, caller expects {expected}", .id.layer, .id.block)]
    Stale {
        /// The block.
        id: BlockId,
        /// Generation the caller offloaded.
        expected: u64,
        /// Generation the store holds.
        found: u64,
    },
    /// The landed bytes fail the block's checksum (torn or misdirected write).
    #[error("block (layer {}, block {}) generation {generation} at offset {offset} of {path} fails its checksum", .id.layer, .id.block)]
    Corrupt {
        /// The block.
        id: BlockId,
        /// Its generation.
        generation: u64,
        /// Store file.
        path: String,
        /// Byte offset of the block.
        offset: u64,
    },
    /// Restoring a tile failed; nothing of it was consumed.
    #[error("restore of tile {tile} failed: {source}")]
    Restore {
        /// Tile index.
        tile: usize,
        /// Why.
        source: Box<KvError>,
    },
    /// The consumer of a tile failed.
    #[error("consumer of tile {tile} failed: {what}")]
    Consumer {
        /// Tile index.
        tile: usize,
        /// The consumer's message.
        what: String,
    },
    /// Invalid arguments (tile larger than the ring slot, wrong sizes...).
    #[error("invalid KV request: {0}")]
    Invalid(String),
}
