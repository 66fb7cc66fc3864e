//! The KV cache: the store's geometry and addressing ([`group`]), its header
//! and block table ([`header`]), and the tile layout the attention kernels
//! read KV elements through ([`tile`]).
//!
//! Pure code: no `unsafe`, no syscalls; every integer on disk is fixed-width
//! little-endian. The byte-level format is documented in `docs/kv-format.md`.

pub mod error;
pub mod group;
pub mod header;
pub mod tile;

pub use group::{
    BlockId, BlockOrder, Extent, GroupKey, GroupLayout, KvGeometry, KvKind, PAGE_BYTES,
    block_checksum,
};
pub use header::{
    BlockEntry, KV_HEADER_BYTES, KV_MAGIC, KV_TABLE_ENTRY_BYTES, KV_VERSION, KvFormatError,
    KvHeader,
};
pub use tile::{KvShape, KvStrides, MAX_HEAD_DIM};
