//! One KV block between a CPU cache's paged buffers and a KV store block.
//!
//! The cache keeps each layer's K and V in separate buffers, paged
//! `[block, token, kv_head, width]` ([`KvStrides::paged`]); a KV store block
//! is the scratch-pool slot layout `[K|V, kv_head, token, width]` with each
//! (K or V, kv head) group at the store's padded pitch
//! ([`GroupLayout::slot_strides`], `docs/kv-format.md`). A block moves one
//! run of `width` values per (token, kv head) each way; the padding between
//! groups is never written, so a block image that started zeroed keeps it
//! zero, as the format asks.

use flashtier_format::kv::{GroupLayout, KvShape, KvStrides};

use super::error::SpillError;
use flashtier_engine::device::cpu::kv::image::VALUE_BYTES;

/// Where one block's values sit in both layouts, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BlockImage {
    shape: KvShape,
    paged: KvStrides,
    slot: KvStrides,
    v_offset_bytes: usize,
    block_bytes: usize,
}

/// The K / V byte ranges one (token, kv head) run takes: in the paged
/// buffers, and in the slot image.
struct Run {
    paged: std::ops::Range<usize>,
    slot_k: std::ops::Range<usize>,
    slot_v: std::ops::Range<usize>,
}

impl BlockImage {
    /// A cache of `shape` (BF16 values) against a store of `layout`; the
    /// shapes must agree (checked: [`SpillError::Shape`]).
    pub(super) fn new(shape: KvShape, layout: &GroupLayout) -> Result<Self, SpillError> {
        let g = layout.geometry();
        let agree = [
            (g.num_kv_heads as usize, shape.num_kv_heads),
            (g.block_tokens as usize, shape.block_tokens),
            (g.head_dim as usize, shape.head_dim),
            (g.dtype_bytes as usize, VALUE_BYTES),
        ];
        if agree.iter().any(|(a, b)| a != b) {
            return Err(SpillError::Shape(format!(
                "a cache of {shape:?} ({VALUE_BYTES}-byte values) against a store of {g:?}"
            )));
        }
        Ok(Self {
            shape,
            paged: KvStrides::paged(shape),
            slot: layout.slot_strides(),
            v_offset_bytes: layout.slot_v_offset_bytes(),
            block_bytes: usize::try_from(layout.block_bytes())
                .map_err(|_| SpillError::Shape("a block larger than memory".into()))?,
        })
    }

    /// Bytes of one block image.
    pub(super) fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn runs(&self, block: usize) -> impl Iterator<Item = Run> + '_ {
        let width = self.shape.head_dim * VALUE_BYTES;
        let (p, s) = (self.paged, self.slot);
        (0..self.shape.block_tokens).flat_map(move |t| {
            (0..self.shape.num_kv_heads).map(move |h| {
                let at = (block * p.block + t * p.token + h * p.kv_head) * VALUE_BYTES;
                let k = (t * s.token + h * s.kv_head) * VALUE_BYTES;
                let v = self.v_offset_bytes + k;
                Run {
                    paged: at..at + width,
                    slot_k: k..k + width,
                    slot_v: v..v + width,
                }
            })
        })
    }

    fn out_of_range(&self, block: usize, what: &str) -> SpillError {
        SpillError::Shape(format!(
            "block {block} does not fit {what} ({:?}, {} bytes a block image)",
            self.shape, self.block_bytes
        ))
    }

    /// Write block `block` of the paged buffers `k` and `v` into `dst` (one
    /// block image; its padding is left as it is).
    pub(super) fn pack(
        &self,
        k: &[u8],
        v: &[u8],
        block: usize,
        dst: &mut [u8],
    ) -> Result<(), SpillError> {
        for r in self.runs(block) {
            for (src, to) in [(k, r.slot_k), (v, r.slot_v)] {
                let from = src.get(r.paged.clone());
                match (from, dst.get_mut(to)) {
                    (Some(a), Some(b)) => b.copy_from_slice(a),
                    _ => return Err(self.out_of_range(block, "the cache or the image")),
                }
            }
        }
        Ok(())
    }

    /// Write the block image `src` into block `block` of the paged buffers
    /// `k` and `v`.
    pub(super) fn unpack(
        &self,
        src: &[u8],
        block: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), SpillError> {
        for r in self.runs(block) {
            for (dst, from) in [(&mut *k, r.slot_k), (&mut *v, r.slot_v)] {
                match (src.get(from), dst.get_mut(r.paged.clone())) {
                    (Some(a), Some(b)) => b.copy_from_slice(a),
                    _ => return Err(self.out_of_range(block, "the image or the cache")),
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use flashtier_format::kv::{BlockOrder, KvGeometry};

    use super::*;

    fn layout(head_dim: u32) -> GroupLayout {
        let g = KvGeometry {
            num_layers: 2,
            num_blocks: 3,
            num_kv_heads: 2,
            block_tokens: 4,
            head_dim,
            dtype_bytes: 2,
        };
        GroupLayout::new(g, BlockOrder::BlockMajor).expect("layout")
    }

    const SHAPE: KvShape = KvShape {
        num_kv_heads: 2,
        block_tokens: 4,
        head_dim: 8,
    };

    #[test]
    fn a_block_goes_to_the_slot_layout_and_back_byte_for_byte() {
        let img = BlockImage::new(SHAPE, &layout(8)).expect("image");
        let per_block = 4 * 2 * 8 * VALUE_BYTES;
        let k: Vec<u8> = (0..3 * per_block).map(|i| (i % 251) as u8).collect();
        let v: Vec<u8> = (0..3 * per_block).map(|i| (i % 241 + 7) as u8).collect();
        let mut dst = vec![0u8; img.block_bytes()];
        img.pack(&k, &v, 1, &mut dst).expect("pack");
        // Token 2, kv head 1, value 3 of block 1: K in group 1, V in group 3
        // (V after both K groups), each group at the 4096-byte pitch.
        let paged = ((4 + 2) * 2 + 1) * 8 + 3;
        let slot = 2048 + 2 * 8 + 3;
        assert_eq!(dst[slot * 2], k[paged * 2]);
        assert_eq!(dst[2 * 4096 + slot * 2], v[paged * 2]);
        // The padding past each group's 64 bytes stays zero.
        for g in 0..4 {
            assert!(dst[g * 4096 + 64..(g + 1) * 4096].iter().all(|&b| b == 0));
        }
        let (mut k2, mut v2) = (vec![0u8; k.len()], vec![0u8; v.len()]);
        img.unpack(&dst, 1, &mut k2, &mut v2).expect("unpack");
        let b1 = per_block..2 * per_block;
        assert_eq!(k2[b1.clone()], k[b1.clone()]);
        assert_eq!(v2[b1.clone()], v[b1]);
        assert!(k2[..per_block].iter().all(|&b| b == 0), "only block 1");
    }

    #[test]
    fn shapes_that_disagree_and_blocks_past_the_buffers_are_errors() {
        assert!(matches!(
            BlockImage::new(SHAPE, &layout(16)),
            Err(SpillError::Shape(_))
        ));
        let img = BlockImage::new(SHAPE, &layout(8)).expect("image");
        let mut dst = vec![0u8; img.block_bytes()];
        let short = vec![0u8; 10];
        assert!(matches!(
            img.pack(&short, &short, 0, &mut dst),
            Err(SpillError::Shape(_))
        ));
    }
}
