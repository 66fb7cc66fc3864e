//! KV-cache geometry on disk: groups, blocks, the two block orders, and where
//! every group and block of a KV store lives ([`GroupLayout`]).
//!
//! A *group* is the K or the V of one kv head of one block of one layer:
//! `block_tokens * head_dim * dtype_bytes` bytes, padded to `group_stride` (a
//! multiple of 4096, so every group and every block is an O_DIRECT extent).
//! A *block* is `2 * num_kv_heads` groups laid out
//! `[K0, K1, .., K(nkv-1), V0, .., V(nkv-1)]` at `group_stride` pitch: exactly
//! the scratch-pool slot layout `[K|V, kv_head, token, dim]`
//! ([`GroupLayout::slot_strides`]), so a block read from disk lands in a slot
//! with no reshuffle.
//!
//! Blocks sit in the data area in one of two orders ([`BlockOrder`]):
//! per-layer (`[layer][block]`, a run of consecutive blocks of one layer is one
//! extent) or block-major (`[block][layer]`, one block of every layer is one
//! extent). The byte-level format is documented in `docs/kv-format.md`.

use crate::checksum::xxh3_64_with_seed;

use super::error::KvFormatError;
use super::tile::KvStrides;

/// Bytes the header occupies (one page; the table starts after it).
pub const KV_HEADER_BYTES: usize = 4096;
/// Bytes of one block-table entry (generation u64, checksum u64).
pub const KV_TABLE_ENTRY_BYTES: usize = 16;

/// Page size every extent is aligned to.
pub const PAGE_BYTES: u64 = 4096;

/// Which half of attention's cache a group holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvKind {
    /// Keys.
    K,
    /// Values.
    V,
}

impl KvKind {
    /// 0 for K, 1 for V (the group's half inside a block).
    #[must_use]
    pub fn index(self) -> u64 {
        match self {
            Self::K => 0,
            Self::V => 1,
        }
    }
}

/// One block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    /// Layer index.
    pub layer: u32,
    /// Block index within the layer (0..num_blocks).
    pub block: u32,
}

impl BlockId {
    /// A block id.
    #[must_use]
    pub fn new(layer: u32, block: u32) -> Self {
        Self { layer, block }
    }
}

/// One group: (layer, block, kv_head, K|V).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKey {
    /// Layer index.
    pub layer: u32,
    /// Block index within the layer.
    pub block: u32,
    /// KV head.
    pub kv_head: u32,
    /// K or V.
    pub kind: KvKind,
}

impl GroupKey {
    /// A group key.
    #[must_use]
    pub fn new(layer: u32, block: u32, kv_head: u32, kind: KvKind) -> Self {
        Self {
            layer,
            block,
            kv_head,
            kind,
        }
    }

    /// The block this group belongs to.
    #[must_use]
    pub fn block_id(&self) -> BlockId {
        BlockId::new(self.layer, self.block)
    }
}

/// The order of blocks in the data area.
///
/// The default, block-major, was chosen by measurement (`flashtier bench kv`,
/// `docs/benchmarks.md` `## KV tier`): restoring a tile of blocks of every
/// layer is one 4 MiB read instead of 32 reads of 128 KiB, and it restored
/// faster than per-layer in every one of six 2 GiB runs (median 1.0-1.1 GB/s
/// against 0.45-0.94 GB/s on the shared virtio disk).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BlockOrder {
    /// `[layer][block]`: consecutive blocks of one layer are contiguous.
    PerLayer,
    /// `[block][layer]`: one block of every layer is one contiguous extent.
    #[default]
    BlockMajor,
}

impl BlockOrder {
    /// On-disk code (0 per-layer, 1 block-major).
    #[must_use]
    pub fn code(self) -> u32 {
        match self {
            Self::PerLayer => 0,
            Self::BlockMajor => 1,
        }
    }

    /// Decode an on-disk code.
    pub fn from_code(code: u32) -> Result<Self, KvFormatError> {
        match code {
            0 => Ok(Self::PerLayer),
            1 => Ok(Self::BlockMajor),
            other => Err(KvFormatError::BadField {
                field: "block_order",
                value: u64::from(other),
            }),
        }
    }
}

impl std::str::FromStr for BlockOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "per-layer" | "layer" => Ok(Self::PerLayer),
            "block-major" | "block" => Ok(Self::BlockMajor),
            other => Err(format!(
                "unknown block order {other} (per-layer | block-major)"
            )),
        }
    }
}

impl std::fmt::Display for BlockOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::PerLayer => "per-layer",
            Self::BlockMajor => "block-major",
        })
    }
}

/// The model geometry a KV store is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    /// Transformer layers.
    pub num_layers: u32,
    /// Blocks per layer the store holds.
    pub num_blocks: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (1, 2 or 4).
    pub dtype_bytes: u32,
}

/// A byte extent in the store file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len_bytes: u64,
}

/// Where every group and block of a KV store lives. Validated on
/// construction, so the accessors cannot overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupLayout {
    geometry: KvGeometry,
    order: BlockOrder,
    group_bytes: u64,
    group_stride: u64,
    block_bytes: u64,
    table_offset: u64,
    table_len_bytes: u64,
    data_offset: u64,
    data_len_bytes: u64,
}

fn round_page(x: u64) -> Option<u64> {
    x.checked_add(PAGE_BYTES - 1)
        .map(|v| v / PAGE_BYTES * PAGE_BYTES)
}

impl GroupLayout {
    /// Validate `geometry` and place the header, the block table and the
    /// data area.
    pub fn new(geometry: KvGeometry, order: BlockOrder) -> Result<Self, KvFormatError> {
        let g = geometry;
        let fields = [
            ("num_layers", g.num_layers),
            ("num_blocks", g.num_blocks),
            ("num_kv_heads", g.num_kv_heads),
            ("block_tokens", g.block_tokens),
            ("head_dim", g.head_dim),
        ];
        for (field, value) in fields {
            if value == 0 {
                return Err(KvFormatError::BadField { field, value: 0 });
            }
        }
        if !matches!(g.dtype_bytes, 1 | 2 | 4) {
            return Err(KvFormatError::BadField {
                field: "dtype_bytes",
                value: u64::from(g.dtype_bytes),
            });
        }
        let ovf = || KvFormatError::Overflow;
        let group_bytes = u64::from(g.block_tokens)
            .checked_mul(u64::from(g.head_dim))
            .and_then(|x| x.checked_mul(u64::from(g.dtype_bytes)))
            .ok_or_else(ovf)?;
        let group_stride = round_page(group_bytes).ok_or_else(ovf)?;
        let block_bytes = group_stride
            .checked_mul(2 * u64::from(g.num_kv_heads))
            .ok_or_else(ovf)?;
        let blocks_total = u64::from(g.num_layers) * u64::from(g.num_blocks);
        let table_len_bytes = blocks_total
            .checked_mul(KV_TABLE_ENTRY_BYTES as u64)
            .and_then(round_page)
            .ok_or_else(ovf)?;
        let table_offset = KV_HEADER_BYTES as u64;
        let data_offset = table_offset.checked_add(table_len_bytes).ok_or_else(ovf)?;
        let data_len_bytes = blocks_total.checked_mul(block_bytes).ok_or_else(ovf)?;
        data_offset.checked_add(data_len_bytes).ok_or_else(ovf)?;
        // Slot strides are usize element counts; keep them representable.
        usize::try_from(block_bytes).map_err(|_| ovf())?;
        Ok(Self {
            geometry,
            order,
            group_bytes,
            group_stride,
            block_bytes,
            table_offset,
            table_len_bytes,
            data_offset,
            data_len_bytes,
        })
    }

    /// The geometry.
    #[must_use]
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    /// The block order.
    #[must_use]
    pub fn order(&self) -> BlockOrder {
        self.order
    }
    /// Payload bytes of one group (`block_tokens * head_dim * dtype_bytes`).
    #[must_use]
    pub fn group_bytes(&self) -> u64 {
        self.group_bytes
    }
    /// Pitch of groups inside a block (group bytes rounded up to 4096).
    #[must_use]
    pub fn group_stride(&self) -> u64 {
        self.group_stride
    }
    /// Bytes of one block (`2 * num_kv_heads * group_stride`).
    #[must_use]
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }
    /// Groups per block (`2 * num_kv_heads`).
    #[must_use]
    pub fn groups_per_block(&self) -> u32 {
        2 * self.geometry.num_kv_heads
    }
    /// Blocks in the store (`num_layers * num_blocks`).
    #[must_use]
    pub fn blocks_total(&self) -> u64 {
        u64::from(self.geometry.num_layers) * u64::from(self.geometry.num_blocks)
    }
    /// Extent of the per-block checksum/generation table.
    #[must_use]
    pub fn table_extent(&self) -> Extent {
        Extent {
            offset: self.table_offset,
            len_bytes: self.table_len_bytes,
        }
    }
    /// Extent of the data area.
    #[must_use]
    pub fn data_extent(&self) -> Extent {
        Extent {
            offset: self.data_offset,
            len_bytes: self.data_len_bytes,
        }
    }
    /// Size of the whole store file.
    #[must_use]
    pub fn file_len_bytes(&self) -> u64 {
        self.data_offset + self.data_len_bytes
    }

    /// Check that `id` is inside the store.
    pub fn check_block(&self, id: BlockId) -> Result<(), KvFormatError> {
        let g = &self.geometry;
        if id.layer >= g.num_layers || id.block >= g.num_blocks {
            return Err(KvFormatError::BlockOutOfRange {
                layer: id.layer,
                block: id.block,
                num_layers: g.num_layers,
                num_blocks: g.num_blocks,
            });
        }
        Ok(())
    }

    /// Position of `id` in file order (0..blocks_total): also its index in
    /// the block table.
    pub fn file_index(&self, id: BlockId) -> Result<u64, KvFormatError> {
        self.check_block(id)?;
        let g = &self.geometry;
        Ok(match self.order {
            BlockOrder::PerLayer => {
                u64::from(id.layer) * u64::from(g.num_blocks) + u64::from(id.block)
            }
            BlockOrder::BlockMajor => {
                u64::from(id.block) * u64::from(g.num_layers) + u64::from(id.layer)
            }
        })
    }

    /// The block at file position `index`, the inverse of [`Self::file_index`].
    pub fn block_at(&self, index: u64) -> Result<BlockId, KvFormatError> {
        let g = &self.geometry;
        let (major, minor) = match self.order {
            BlockOrder::PerLayer => (u64::from(g.num_blocks), true),
            BlockOrder::BlockMajor => (u64::from(g.num_layers), false),
        };
        let (hi, lo) = (index / major, index % major);
        let hi = u32::try_from(hi).unwrap_or(u32::MAX);
        let lo = u32::try_from(lo).unwrap_or(u32::MAX);
        let id = if minor {
            BlockId::new(hi, lo)
        } else {
            BlockId::new(lo, hi)
        };
        self.check_block(id)?;
        Ok(id)
    }

    /// Extent of one block.
    pub fn block_extent(&self, id: BlockId) -> Result<Extent, KvFormatError> {
        let index = self.file_index(id)?;
        Ok(Extent {
            offset: self.data_offset + index * self.block_bytes,
            len_bytes: self.block_bytes,
        })
    }

    /// Index of a group inside its block (`kind * num_kv_heads + kv_head`).
    pub fn group_index(&self, kv_head: u32, kind: KvKind) -> Result<u32, KvFormatError> {
        let nkv = self.geometry.num_kv_heads;
        if kv_head >= nkv {
            return Err(KvFormatError::HeadOutOfRange {
                kv_head,
                num_kv_heads: nkv,
            });
        }
        Ok(u32::from(kind == KvKind::V) * nkv + kv_head)
    }

    /// Extent of one group (`group_stride` bytes, padding included).
    pub fn group_extent(&self, key: GroupKey) -> Result<Extent, KvFormatError> {
        let block = self.block_extent(key.block_id())?;
        let idx = u64::from(self.group_index(key.kv_head, key.kind)?);
        Ok(Extent {
            offset: block.offset + idx * self.group_stride,
            len_bytes: self.group_stride,
        })
    }

    /// The single extent of `run_len` consecutive blocks of one layer
    /// starting at `first`, or `None` when the order does not make them
    /// contiguous (block-major with several layers). Errors when any block
    /// of the run is outside the store.
    pub fn run_extent(
        &self,
        first: BlockId,
        run_len: u32,
    ) -> Result<Option<Extent>, KvFormatError> {
        if run_len == 0 {
            return Err(KvFormatError::BadField {
                field: "run_len",
                value: 0,
            });
        }
        let last_block = first.block.saturating_add(run_len - 1);
        self.check_block(BlockId::new(first.layer, last_block))?;
        let start = self.block_extent(first)?;
        let contiguous =
            run_len == 1 || self.order == BlockOrder::PerLayer || self.geometry.num_layers == 1;
        Ok(contiguous.then(|| Extent {
            offset: start.offset,
            len_bytes: u64::from(run_len) * self.block_bytes,
        }))
    }

    /// Strides of the scratch-pool slot layout `[slot, K|V, kv_head, token,
    /// dim]` in elements of `dtype_bytes`, groups at the store's padded
    /// `group_stride` pitch: what a block read from disk lands as.
    #[must_use]
    pub fn slot_strides(&self) -> KvStrides {
        let d = u64::from(self.geometry.dtype_bytes);
        // Values fit in usize: `new` checked block_bytes does.
        let el = |x: u64| usize::try_from(x / d).unwrap_or(usize::MAX);
        KvStrides {
            block: el(self.block_bytes),
            token: usize::try_from(self.geometry.head_dim).unwrap_or(usize::MAX),
            kv_head: el(self.group_stride),
        }
    }

    /// Bytes from a slot's K half to its V half (`num_kv_heads *
    /// group_stride`).
    #[must_use]
    pub fn slot_v_offset_bytes(&self) -> usize {
        let nkv = u64::from(self.geometry.num_kv_heads);
        usize::try_from(nkv * self.group_stride).unwrap_or(usize::MAX)
    }
}

/// The checksum that seals one block: xxh3-64 of the block's bytes, seeded by
/// its identity and generation so that bytes of another block, or of an older
/// generation of this one, never verify.
#[must_use]
pub fn block_checksum(id: BlockId, generation: u64, bytes: &[u8]) -> u64 {
    let seed = (u64::from(id.layer) << 32 | u64::from(id.block))
        .rotate_left(17)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ generation;
    xxh3_64_with_seed(bytes, seed)
}

#[cfg(test)]
#[path = "group_tests.rs"]
mod tests;
