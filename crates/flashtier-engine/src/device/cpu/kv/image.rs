//! A cache's stored bytes, out and back in: what a caller that keeps caches
//! elsewhere (the server's prefix cache spilling to the KV tier on a drive)
//! moves.
//!
//! The bytes are the cache's own: per layer a K and a V buffer of whole
//! blocks in the paged layout `[block, token, kv_head, width]` of BF16
//! values (2 bytes each; `width` is [`KvCache::shape`]'s `head_dim`, twice
//! the model's for [`KvPrecision::Bf16x2`]). Positions past the ones held
//! in the last block are zero, in what [`KvCache::layer_bytes`] hands out
//! and in what [`KvCache::fill`] keeps, so a cache filled with another's
//! bytes holds exactly what that one held: the same bits from every step
//! after.

use flashtier_format::kv::KvShape;

use super::{BLOCK_TOKENS, KvCache};
#[cfg(doc)]
use crate::device::KvPrecision;
use crate::device::KvState;
use crate::error::EngineError;

/// Bytes of one stored value (BF16).
pub const VALUE_BYTES: usize = 2;

fn shape_err(op: &'static str, what: String) -> EngineError {
    EngineError::Shape { op, what }
}

impl KvCache {
    /// Layers.
    #[must_use]
    pub fn layers(&self) -> usize {
        self.keys.len()
    }

    /// The stored shape: kv heads, [`BLOCK_TOKENS`] tokens a block, and the
    /// stored head width (`head_dim`, or twice it for `Bf16x2`).
    #[must_use]
    pub fn shape(&self) -> KvShape {
        KvShape {
            num_kv_heads: self.dims.num_kv_heads,
            block_tokens: BLOCK_TOKENS,
            head_dim: self.dims.head_dim,
        }
    }

    /// The K and V bytes of `layer` (whole blocks, paged; see the module
    /// docs). Only between steps: a layer a step is writing is refused.
    pub fn layer_bytes(&self, layer: usize) -> Result<(&[u8], &[u8]), EngineError> {
        let held = self.held.get(layer).copied();
        match (self.keys.get(layer), self.values.get(layer), held) {
            (Some(k), Some(v), Some(h)) if h == self.len => Ok((k, v)),
            _ => Err(shape_err(
                "kv image",
                format!(
                    "layer {layer} of {} layers holding {:?} positions ({} complete)",
                    self.layers(),
                    self.held,
                    self.len
                ),
            )),
        }
    }

    /// Bytes of a layer's K (or V) buffer holding `len` positions: whole
    /// blocks.
    #[must_use]
    pub fn layer_len_bytes(&self, len: usize) -> usize {
        len.div_ceil(BLOCK_TOKENS) * BLOCK_TOKENS * self.position_bytes()
    }

    /// Make this empty cache hold `len` positions whose bytes are `keys`
    /// and `values` (one buffer per layer, [`Self::layer_len_bytes`] each,
    /// paged as [`Self::layer_bytes`] hands them out). The bytes past the
    /// `len`th position are zeroed.
    pub fn fill(
        &mut self,
        len: usize,
        mut keys: Vec<Vec<u8>>,
        mut values: Vec<Vec<u8>>,
    ) -> Result<(), EngineError> {
        let want = self.layer_len_bytes(len);
        let layers = self.layers();
        let sizes_ok = keys.len() == layers
            && values.len() == layers
            && keys.iter().chain(&values).all(|b| b.len() == want);
        if self.len != 0 || self.held.iter().any(|&h| h != 0) || !sizes_ok {
            return Err(shape_err(
                "kv fill",
                format!(
                    "{len} positions ({} and {} buffers, {want} bytes each wanted) into a cache \
                     of {layers} layers holding {}",
                    keys.len(),
                    values.len(),
                    self.len
                ),
            ));
        }
        if len > self.capacity {
            return Err(EngineError::ContextFull {
                len,
                max: self.capacity,
            });
        }
        let end = len * self.position_bytes();
        for buf in keys.iter_mut().chain(values.iter_mut()) {
            if let Some(tail) = buf.get_mut(end..) {
                tail.fill(0);
            }
        }
        self.keys = keys;
        self.values = values;
        self.held.fill(len);
        self.advance(len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{KvPrecision, KvSpec};

    fn cache(capacity: usize) -> KvCache {
        KvCache::new(&KvSpec {
            layers: 2,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            capacity,
            precision: KvPrecision::Bf16x2,
        })
        .expect("cache")
    }

    fn push(c: &mut KvCache, n: usize, seed: f32) {
        for p in 0..n {
            for layer in 0..c.layers() {
                let k: Vec<f32> = (0..16).map(|i| seed + (p * 16 + i) as f32 * 0.37).collect();
                let v: Vec<f32> = k.iter().map(|x| -x * 1.3).collect();
                c.push(layer, &k, &v).expect("push");
            }
            c.advance(1);
        }
    }

    #[test]
    fn a_filled_cache_holds_and_attends_exactly_what_it_was_filled_from() {
        let mut a = cache(64);
        push(&mut a, 21, 0.5);
        let mut b = cache(64);
        let (keys, values): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..a.layers())
            .map(|l| {
                let (k, v) = a.layer_bytes(l).expect("bytes");
                (k.to_vec(), v.to_vec())
            })
            .unzip();
        assert_eq!(keys[0].len(), a.layer_len_bytes(21));
        b.fill(21, keys, values).expect("fill");
        assert_eq!(b.len(), 21);
        for l in 0..2 {
            assert_eq!(a.layer_bytes(l).expect("a"), b.layer_bytes(l).expect("b"));
        }
        // The next position and its attention: the same bits in both.
        push(&mut a, 1, 9.0);
        push(&mut b, 1, 9.0);
        let q: Vec<f32> = (0..32).map(|i| (i as f32 * 0.11).sin()).collect();
        let (mut oa, mut ob) = (vec![0f32; 32], vec![0f32; 32]);
        a.attend(1, &q, &mut oa).expect("attend a");
        b.attend(1, &q, &mut ob).expect("attend b");
        assert_eq!(
            oa.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            ob.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn fill_zeroes_past_its_positions_and_refuses_wrong_shapes() {
        let mut a = cache(64);
        let bytes = a.layer_len_bytes(5);
        assert_eq!(bytes, 16 * 2 * 16 * VALUE_BYTES);
        let err = a.fill(5, vec![vec![1; bytes]], vec![vec![1; bytes]; 2]);
        assert!(matches!(err, Err(EngineError::Shape { .. })), "{err:?}");
        a.fill(5, vec![vec![1; bytes]; 2], vec![vec![1; bytes]; 2])
            .expect("fill");
        let (k, _) = a.layer_bytes(0).expect("bytes");
        let end = 5 * 2 * 16 * VALUE_BYTES;
        assert!(k[..end].iter().all(|&b| b == 1));
        assert!(k[end..].iter().all(|&b| b == 0));
        // Only an empty cache is filled; past the capacity is ContextFull.
        let again = a.fill(5, vec![vec![1; bytes]; 2], vec![vec![1; bytes]; 2]);
        assert!(matches!(again, Err(EngineError::Shape { .. })), "{again:?}");
        let mut small = cache(4);
        let b5 = small.layer_len_bytes(5);
        let full = small.fill(5, vec![vec![0; b5]; 2], vec![vec![0; b5]; 2]);
        assert!(
            matches!(full, Err(EngineError::ContextFull { .. })),
            "{full:?}"
        );
    }
}
