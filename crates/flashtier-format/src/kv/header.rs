//! The KV store header and its per-block table entries (byte offsets in
//! `docs/kv-format.md`). Fixed-width little-endian; every derived field is
//! re-derived from the geometry on decode and must agree.

use crate::checksum::xxh3_64;
use crate::le::{get_u32, get_u64, put_u32, put_u64};

pub use super::error::KvFormatError;
use super::group::{BlockOrder, GroupLayout, KvGeometry};
pub use super::group::{KV_HEADER_BYTES, KV_TABLE_ENTRY_BYTES};

/// Magic at byte 0 of every KV store.
pub const KV_MAGIC: [u8; 8] = *b"FTKVSTOR";
/// The version this build writes and reads.
pub const KV_VERSION: u32 = 1;
/// Bytes covered by the header checksum (the checksum sits right after).
const CHECKED_BYTES: usize = 104;

/// The header of a KV store file: one per (model, rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvHeader {
    /// Geometry, order and placement of everything in the file.
    pub layout: GroupLayout,
    /// Identity of the model (a hash the caller chooses, e.g. of its config).
    pub model_hash: u64,
    /// Tensor-parallel rank the store belongs to.
    pub rank: u32,
}

impl KvHeader {
    /// Encode into a full header page of [`KV_HEADER_BYTES`] bytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; KV_HEADER_BYTES];
        let l = &self.layout;
        let g = l.geometry();
        if let Some(m) = b.get_mut(0..8) {
            m.copy_from_slice(&KV_MAGIC);
        }
        put_u32(&mut b, 8, KV_VERSION);
        put_u32(&mut b, 12, l.order().code());
        put_u32(&mut b, 16, g.num_layers);
        put_u32(&mut b, 20, g.num_blocks);
        put_u32(&mut b, 24, g.num_kv_heads);
        put_u32(&mut b, 28, g.block_tokens);
        put_u32(&mut b, 32, g.head_dim);
        put_u32(&mut b, 36, g.dtype_bytes);
        put_u64(&mut b, 40, l.group_stride());
        put_u64(&mut b, 48, l.block_bytes());
        put_u64(&mut b, 56, l.table_extent().offset);
        put_u64(&mut b, 64, l.table_extent().len_bytes);
        put_u64(&mut b, 72, l.data_extent().offset);
        put_u64(&mut b, 80, l.data_extent().len_bytes);
        put_u64(&mut b, 88, self.model_hash);
        put_u32(&mut b, 96, self.rank);
        put_u32(&mut b, 100, 0);
        let sum = xxh3_64(b.get(..CHECKED_BYTES).unwrap_or_default());
        put_u64(&mut b, CHECKED_BYTES, sum);
        b
    }

    /// Decode and validate a header (at least the first 112 bytes of the file).
    pub fn decode(bytes: &[u8]) -> Result<Self, KvFormatError> {
        let need = CHECKED_BYTES + 8;
        let Some(head) = bytes.get(..need) else {
            return Err(KvFormatError::Truncated {
                got: bytes.len(),
                need,
            });
        };
        let mut magic = [0u8; 8];
        magic.copy_from_slice(head.get(..8).unwrap_or(&[0; 8]));
        if magic != KV_MAGIC {
            return Err(KvFormatError::BadMagic { found: magic });
        }
        let version = get_u32(head, 8);
        if version != KV_VERSION {
            return Err(KvFormatError::BadVersion {
                found: version,
                supported: KV_VERSION,
            });
        }
        let stored = get_u64(head, CHECKED_BYTES);
        let computed = xxh3_64(head.get(..CHECKED_BYTES).unwrap_or_default());
        if stored != computed {
            return Err(KvFormatError::HeaderChecksum { stored, computed });
        }
        let geometry = KvGeometry {
            num_layers: get_u32(head, 16),
            num_blocks: get_u32(head, 20),
            num_kv_heads: get_u32(head, 24),
            block_tokens: get_u32(head, 28),
            head_dim: get_u32(head, 32),
            dtype_bytes: get_u32(head, 36),
        };
        let layout = GroupLayout::new(geometry, BlockOrder::from_code(get_u32(head, 12))?)?;
        let derived = [
            ("group_stride", 40, layout.group_stride()),
            ("block_bytes", 48, layout.block_bytes()),
            ("table_offset", 56, layout.table_extent().offset),
            ("table_len_bytes", 64, layout.table_extent().len_bytes),
            ("data_offset", 72, layout.data_extent().offset),
            ("data_len_bytes", 80, layout.data_extent().len_bytes),
        ];
        for (field, at, expected) in derived {
            let found = get_u64(head, at);
            if found != expected {
                return Err(KvFormatError::Inconsistent {
                    field,
                    found,
                    expected,
                });
            }
        }
        Ok(Self {
            layout,
            model_hash: get_u64(head, 88),
            rank: get_u32(head, 96),
        })
    }
}

/// One entry of the per-block table: which generation of the block the data
/// area holds and the checksum that seals it. Generation 0 means empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockEntry {
    /// Generation of the block's last completed write (0: never written).
    pub generation: u64,
    /// `block_checksum(id, generation, bytes)` of that write.
    pub checksum: u64,
}

impl BlockEntry {
    /// Encode as 16 little-endian bytes.
    #[must_use]
    pub fn encode(&self) -> [u8; KV_TABLE_ENTRY_BYTES] {
        let mut b = [0u8; KV_TABLE_ENTRY_BYTES];
        put_u64(&mut b, 0, self.generation);
        put_u64(&mut b, 8, self.checksum);
        b
    }

    /// Decode 16 bytes (shorter input decodes as empty bytes, i.e. zeros).
    #[must_use]
    pub fn decode(bytes: &[u8]) -> Self {
        Self {
            generation: get_u64(bytes, 0),
            checksum: get_u64(bytes, 8),
        }
    }
}
