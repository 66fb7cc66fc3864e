//! The KV tile layout: where token `t` of block `b`, kv head `h` starts in a
//! K or V buffer, the one definition the CPU reference attention, the GPU
//! kernels and the KV store's landing slots share.
//!
//! A [`KvStrides`] triple (block, token, kv_head), in elements, selects the
//! layout: element `b * block + t * token + h * kv_head` starts the
//! `head_dim` elements of that (block, token, kv head). Two layouts are
//! named:
//! - paged `[block, token, kv_head, dim]` ([`KvStrides::paged`]), K and V in
//!   separate buffers;
//! - the scratch-pool slot `[slot, K|V, kv_head, token, dim]`
//!   ([`KvStrides::slot`] with unpadded groups, or
//!   `GroupLayout::slot_strides` with the store's 4096-byte group pitch), what
//!   a block read from disk lands as: K and V share one buffer, V starting
//!   [`KvStrides::slot_v_offset`] elements after K.
//!
//! Pure arithmetic; every sum that could overflow is checked.

/// Largest head dimension any attention over a KV tile takes (the SPEC's
/// `head_dim <= 256`; the GPU kernel also wants a multiple of 16).
pub const MAX_HEAD_DIM: usize = 256;

/// The shape a layout is built for: the part of the attention dimensions
/// that places KV elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// KV heads.
    pub num_kv_heads: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Element strides of a KV buffer: one block (slot) to the next, one token to
/// the next, one kv head to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct KvStrides {
    /// Elements from one block (slot) to the next.
    pub block: usize,
    /// Elements from one token to the next.
    pub token: usize,
    /// Elements from one kv head to the next.
    pub kv_head: usize,
}

impl KvStrides {
    /// Paged layout `[block, token, kv_head, dim]` (separate K and V buffers).
    #[must_use]
    pub fn paged(shape: impl Into<KvShape>) -> Self {
        let s = shape.into();
        Self {
            block: s.block_tokens * s.num_kv_heads * s.head_dim,
            token: s.num_kv_heads * s.head_dim,
            kv_head: s.head_dim,
        }
    }

    /// Slot layout `[slot, K|V, kv_head, token, dim]` with unpadded groups of
    /// `block_tokens * head_dim` elements; V starts
    /// [`Self::slot_v_offset`] elements after K in the same buffer.
    #[must_use]
    pub fn slot(shape: impl Into<KvShape>) -> Self {
        let s = shape.into();
        let group = s.block_tokens * s.head_dim;
        Self {
            block: 2 * s.num_kv_heads * group,
            token: s.head_dim,
            kv_head: group,
        }
    }

    /// Elements from a slot's K half to its V half, for a slot layout
    /// (`num_kv_heads` groups of K come first): `num_kv_heads * kv_head`.
    #[must_use]
    pub fn slot_v_offset(&self, num_kv_heads: usize) -> usize {
        num_kv_heads.saturating_mul(self.kv_head)
    }

    /// One past the last element a full block `block` touches (so the
    /// elements a buffer must hold for blocks `0..=block`), or `None` on
    /// overflow or an empty shape.
    #[must_use]
    pub fn block_end(&self, shape: impl Into<KvShape>, block: usize) -> Option<usize> {
        let s = shape.into();
        let last_token = s.block_tokens.checked_sub(1)?;
        let last_head = s.num_kv_heads.checked_sub(1)?;
        block
            .checked_mul(self.block)?
            .checked_add(last_token.checked_mul(self.token)?)?
            .checked_add(last_head.checked_mul(self.kv_head)?)?
            .checked_add(s.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape {
        num_kv_heads: 3,
        block_tokens: 4,
        head_dim: 8,
    };

    /// Every (block, token, head, dim) element lands on its own index, in the
    /// order the layout names, and nothing reaches past `block_end`.
    fn covers_exactly(s: KvStrides, order: impl Fn(usize, usize, usize, usize) -> usize) {
        let blocks = 2;
        let end = s.block_end(SHAPE, blocks - 1).expect("fits");
        let mut seen = vec![false; end];
        for b in 0..blocks {
            for t in 0..SHAPE.block_tokens {
                for h in 0..SHAPE.num_kv_heads {
                    for e in 0..SHAPE.head_dim {
                        let at = b * s.block + t * s.token + h * s.kv_head + e;
                        assert_eq!(at, order(b, t, h, e));
                        assert!(!seen[at], "element {at} twice");
                        seen[at] = true;
                    }
                }
            }
        }
        assert!(seen[end - 1], "block_end is one past the last element");
    }

    #[test]
    fn paged_is_block_token_head_dim() {
        let (nkv, bt, hd) = (SHAPE.num_kv_heads, SHAPE.block_tokens, SHAPE.head_dim);
        covers_exactly(KvStrides::paged(SHAPE), |b, t, h, e| {
            ((b * bt + t) * nkv + h) * hd + e
        });
    }

    #[test]
    fn slot_is_slot_kv_head_token_dim_with_v_after_k() {
        let (nkv, bt, hd) = (SHAPE.num_kv_heads, SHAPE.block_tokens, SHAPE.head_dim);
        let s = KvStrides::slot(SHAPE);
        let v = s.slot_v_offset(nkv);
        assert_eq!(v, nkv * bt * hd);
        // K of slot b: [b][0][h][t][e]; V: [b][1][h][t][e].
        let k_at = |b, t, h, e| ((b * 2 * nkv + h) * bt + t) * hd + e;
        covers_exactly(s, k_at);
        assert_eq!(s.block, 2 * v);
        assert_eq!(
            v + k_at(1, 2, 1, 3),
            (((2 + 1) * nkv + 1) * bt + 2) * hd + 3
        );
    }

    #[test]
    fn block_end_checks_overflow_and_empty_shapes() {
        let s = KvStrides::paged(SHAPE);
        assert_eq!(s.block_end(SHAPE, 0), Some(SHAPE.block_tokens * 3 * 8));
        assert_eq!(s.block_end(SHAPE, usize::MAX), None);
        let empty = KvShape {
            block_tokens: 0,
            ..SHAPE
        };
        assert_eq!(s.block_end(empty, 0), None);
        let no_heads = KvShape {
            num_kv_heads: 0,
            ..SHAPE
        };
        assert_eq!(s.block_end(no_heads, 0), None);
    }
}
