//! The KV cache of one sequence, and decode attention over it through the KV
//! tier's tiled decode attention ([`flashtier::kv::attention`]).
//!
//! Keys and values are kept as BF16 in the KV tier's paged layout
//! `[block, token, kv_head, dim]`, `BLOCK_TOKENS` tokens a block; the last
//! block may be partly filled. Attention folds the blocks into an
//! [`AttnState`] tile by tile (`begin_step`, `step_tile` per `TILE_BLOCKS`
//! blocks, `finalize_f32`), exactly the path restored KV tiles take.
//!
//! Two precisions ([`KvPrecision`]):
//! - `Bf16`: one BF16 per value, as deployments keep KV (half the memory;
//!   logits then differ from an f32 reference by about 1e-2).
//! - `Bf16x2` (default): each f32 value `x` is stored as two BF16s, `hi =
//!   bf16(x)` and `lo = bf16(x - hi)`, side by side in a head twice as wide.
//!   The query is duplicated (`[q, q]`, scaled by sqrt 2 to undo the tier's
//!   `1/sqrt(2 d)`), so `q' . k' = q . (k_hi + k_lo)`, and the output's two
//!   halves add to `sum p (v_hi + v_lo)`: the tier's BF16 kernel computes
//!   attention on values accurate to about 2^-17 relative, which keeps the
//!   logits within 1e-3 of transformers' f32 computation. Needs
//!   `head_dim <= 128` (the tier's limit is 256).
//!
//! Bound: at most `capacity` positions per layer (`capacity x num_kv_heads x
//! head_dim x 2` BF16 values per layer, growing with the positions held); a
//! push past it is [`EngineError::ContextFull`]. With a sliding window
//! (Mixtral) the capacity is the window, so no position ever falls out of it.
//!
//! Limits on what a config sets, checked by [`KvCache::new`] before anything
//! is allocated ([`EngineError::TooLarge`]): `capacity` (from
//! `max_position_embeddings` or `sliding_window`) at most [`MAX_POSITIONS`];
//! layers at most [`MAX_LAYERS`];
//! the cache at full capacity (K and V of every layer) within u64 bytes;
//! the widened query and output scratch (`q_heads x` stored head width f32)
//! at most [`MAX_SCRATCH_VALUES`] values each.

use half::bf16;

use crate::config::bounds::MAX_LAYERS;
use crate::device::{KvPrecision, KvSpec, KvState};
use crate::error::EngineError;
use flashtier::kv::attention::{AttentionDims, AttnState, KvTile, TileSeq};
use flashtier_format::kv::KvStrides;

/// Tokens per KV block.
pub const BLOCK_TOKENS: usize = 16;

/// Blocks folded per `step_tile` call.
pub const TILE_BLOCKS: usize = 32;

/// Most positions one cache holds (16 Mi: above any supported model's
/// context).
pub const MAX_POSITIONS: usize = 1 << 24;

/// Most f32 values of the query and output scratch (64 MiB each).
pub const MAX_SCRATCH_VALUES: usize = 1 << 24;

/// Keys and values of every layer, BF16 bytes, paged layout.
#[derive(Debug)]
pub struct KvCache {
    keys: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
    precision: KvPrecision,
    head_dim: usize,
    /// Scratch for the widened query and output (`Bf16x2`).
    q_wide: Vec<f32>,
    out_wide: Vec<f32>,
    dims: AttentionDims,
    state: AttnState,
    capacity: usize,
    len: usize,
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

/// The limits of the module docs for a cache of `spec` storing heads
/// `width` wide; returns the scratch length (`q_heads x width`).
fn check_limits(spec: &KvSpec, width: usize) -> Result<usize, EngineError> {
    let too_large = |what: &str, value: Option<usize>, limit: usize, unit| EngineError::TooLarge {
        what: what.to_string(),
        value: value.map(|v| v as u64),
        limit: limit as u64,
        unit,
    };
    let at_most = |what: &str, value: usize, limit: usize, unit| {
        if value > limit {
            return Err(too_large(what, Some(value), limit, unit));
        }
        Ok(())
    };
    at_most("KV cache layers", spec.layers, MAX_LAYERS, "layers")?;
    at_most(
        "KV cache capacity (max_position_embeddings or sliding_window)",
        spec.capacity,
        MAX_POSITIONS,
        "positions",
    )?;
    let full = [spec.layers, spec.kv_heads, width, 2 * 2]
        .iter()
        .try_fold(spec.capacity as u64, |n, &x| n.checked_mul(x as u64));
    if full.is_none() {
        return Err(EngineError::TooLarge {
            what:
                "KV cache at full capacity (positions x layers x kv heads x head width x K and V)"
                    .into(),
            value: None,
            limit: u64::MAX,
            unit: "bytes",
        });
    }
    match spec.q_heads.checked_mul(width) {
        Some(n) if n <= MAX_SCRATCH_VALUES => Ok(n),
        n => Err(too_large(
            "attention query scratch (query heads x stored head width)",
            n,
            MAX_SCRATCH_VALUES,
            "values",
        )),
    }
}

impl KvCache {
    /// An empty cache of `spec`'s shape.
    pub fn new(spec: &KvSpec) -> Result<Self, EngineError> {
        let KvSpec {
            layers: num_layers,
            q_heads: num_q_heads,
            kv_heads: num_kv_heads,
            head_dim,
            capacity,
            precision,
        } = *spec;
        let width = match precision {
            KvPrecision::Bf16 => head_dim,
            KvPrecision::Bf16x2 => head_dim.saturating_mul(2),
        };
        if width > flashtier::kv::attention::MAX_HEAD_DIM {
            return Err(EngineError::Attention(format!(
                "head_dim {head_dim} stored as {precision} is {width} wide, over the KV tier's \
                 limit of {}; use KvPrecision::Bf16",
                flashtier::kv::attention::MAX_HEAD_DIM
            )));
        }
        let scratch = check_limits(spec, width)?;
        let dims = AttentionDims::new(1, num_q_heads, num_kv_heads, width, BLOCK_TOKENS);
        let state = AttnState::new(dims).map_err(|e| EngineError::Attention(e.to_string()))?;
        Ok(Self {
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
            precision,
            head_dim,
            q_wide: vec![0.0; scratch],
            out_wide: vec![0.0; scratch],
            dims,
            state,
            capacity,
            len: 0,
        })
    }

    /// Bytes of one position of one layer (K or V).
    fn position_bytes(&self) -> usize {
        self.dims.num_kv_heads * self.dims.head_dim * 2
    }

    /// How values are stored.
    pub fn precision(&self) -> KvPrecision {
        self.precision
    }

    /// Append one position's keys and values (`[kv_head, head_dim]` f32) to
    /// `layer`, after the positions it holds; the position counts once every
    /// layer has it (see [`KvState::advance`]). A layer may run up to one
    /// step of rows ahead of the others while a step is in flight.
    pub fn push(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), EngineError> {
        let width = self.dims.num_kv_heads * self.head_dim;
        let held = self
            .keys
            .get(layer)
            .map_or(0, |b| b.len() / self.position_bytes());
        if held >= self.capacity {
            return Err(EngineError::ContextFull {
                len: held + 1,
                max: self.capacity,
            });
        }
        if k.len() != width || v.len() != width || layer >= self.keys.len() || held < self.len {
            return Err(EngineError::Attention(format!(
                "layer {layer}: push of {} keys at position {held} does not fit a cache of \
                 {} layers, {width} values per position and {} complete positions",
                k.len(),
                self.keys.len(),
                self.len
            )));
        }
        let (d, precision) = (self.head_dim, self.precision);
        for (dst, src) in [(&mut self.keys[layer], k), (&mut self.values[layer], v)] {
            for head in src.chunks_exact(d) {
                let hi = head.iter().map(|x| bf16::from_f32(*x));
                dst.extend(hi.clone().flat_map(bf16::to_le_bytes));
                if precision == KvPrecision::Bf16x2 {
                    let lo = head
                        .iter()
                        .zip(hi)
                        .map(|(x, h)| bf16::from_f32(x - h.to_f32()));
                    dst.extend(lo.flat_map(bf16::to_le_bytes));
                }
            }
        }
        Ok(())
    }

    /// Attention of `q` (`[num_q_heads, head_dim]` f32) over every position
    /// `layer` holds (the one being decoded included); writes `out` like `q`.
    pub fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        let positions = self
            .keys
            .get(layer)
            .map_or(0, |k| k.len() / self.position_bytes());
        if positions == 0 {
            return Err(EngineError::Attention(format!(
                "layer {layer} holds no position"
            )));
        }
        let blocks = positions.div_ceil(BLOCK_TOKENS);
        // Pad the last block to a whole block so every block index is in bounds.
        let block_bytes = BLOCK_TOKENS * self.position_bytes();
        for buf in [&mut self.keys[layer], &mut self.values[layer]] {
            buf.resize(blocks * block_bytes, 0);
        }
        let result = match self.precision {
            KvPrecision::Bf16 => self.fold_tiles(layer, positions, q, out),
            KvPrecision::Bf16x2 => self.attend_wide(layer, positions, q, out),
        };
        let used = positions * self.position_bytes();
        self.keys[layer].truncate(used);
        self.values[layer].truncate(used);
        result
    }

    /// `Bf16x2`: `[q, q] * sqrt 2` against `[hi, lo]` heads; the output
    /// halves add up.
    fn attend_wide(
        &mut self,
        layer: usize,
        positions: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let d = self.head_dim;
        if q.len() != self.q_wide.len() / 2 || out.len() != q.len() {
            return Err(EngineError::Attention(format!(
                "query of {} values for {} heads of {d}",
                q.len(),
                self.dims.num_q_heads
            )));
        }
        let mut q_wide = std::mem::take(&mut self.q_wide);
        let mut out_wide = std::mem::take(&mut self.out_wide);
        for (wide, head) in q_wide.chunks_exact_mut(2 * d).zip(q.chunks_exact(d)) {
            for (i, x) in head.iter().enumerate() {
                wide[i] = x * std::f32::consts::SQRT_2;
                wide[d + i] = x * std::f32::consts::SQRT_2;
            }
        }
        let result = self.fold_tiles(layer, positions, &q_wide, &mut out_wide);
        for (o, wide) in out.chunks_exact_mut(d).zip(out_wide.chunks_exact(2 * d)) {
            for i in 0..d {
                o[i] = wide[i] + wide[d + i];
            }
        }
        self.q_wide = q_wide;
        self.out_wide = out_wide;
        result
    }

    fn fold_tiles(
        &mut self,
        layer: usize,
        positions: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let err =
            |e: flashtier::kv::attention::AttentionError| EngineError::Attention(e.to_string());
        let blocks = positions.div_ceil(BLOCK_TOKENS) as u32;
        let last_tokens = positions - (blocks as usize - 1) * BLOCK_TOKENS;
        let strides = KvStrides::paged(&self.dims);
        let ids: Vec<u32> = (0..blocks).collect();
        self.state.begin_step(1).map_err(err)?;
        for chunk in ids.chunks(TILE_BLOCKS) {
            let is_last = chunk.last() == ids.last();
            let seqs = [TileSeq {
                blocks: chunk,
                last_block_tokens: if is_last { last_tokens } else { BLOCK_TOKENS },
            }];
            let tile = KvTile {
                k: &self.keys[layer],
                v: &self.values[layer],
                strides,
                seqs: &seqs,
            };
            self.state.step_tile(q, &tile).map_err(err)?;
        }
        self.state.finalize_f32(out).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        layers: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        precision: KvPrecision,
    ) -> KvSpec {
        KvSpec {
            layers,
            q_heads,
            kv_heads,
            head_dim,
            capacity,
            precision,
        }
    }

    /// Plain softmax attention in f64 over exact f32 keys and values.
    fn naive(
        q: &[f32],
        ks: &[Vec<f32>],
        vs: &[Vec<f32>],
        qh: usize,
        kvh: usize,
        d: usize,
    ) -> Vec<f64> {
        let mut out = vec![0f64; qh * d];
        for h in 0..qh {
            let kv = h / (qh / kvh);
            let scores: Vec<f64> = ks
                .iter()
                .map(|k| {
                    let dot: f64 = (0..d)
                        .map(|i| f64::from(q[h * d + i]) * f64::from(k[kv * d + i]))
                        .sum();
                    dot / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (p, v) in w.iter().zip(vs) {
                for i in 0..d {
                    out[h * d + i] += p / sum * f64::from(v[kv * d + i]);
                }
            }
        }
        out
    }

    fn value(i: usize, salt: f32) -> f32 {
        ((i as f32 * 0.618 + salt).sin() * 1.7)
            .tan()
            .clamp(-3.0, 3.0)
    }

    #[test]
    fn tiled_attention_matches_f64_in_both_precisions() {
        let (qh, kvh, d) = (4, 2, 8);
        // 37 positions: several blocks, the last one partial, more than one tile of 2 blocks.
        let positions = 37;
        for (precision, tol) in [(KvPrecision::Bf16x2, 2e-5), (KvPrecision::Bf16, 3e-2)] {
            let mut cache = KvCache::new(&spec(2, qh, kvh, d, 64, precision)).unwrap();
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for p in 0..positions {
                let k: Vec<f32> = (0..kvh * d).map(|i| value(i + 97 * p, 0.3)).collect();
                let v: Vec<f32> = (0..kvh * d).map(|i| value(i + 89 * p, 1.1)).collect();
                for layer in 0..2 {
                    cache.push(layer, &k, &v).unwrap();
                }
                cache.advance(1);
                ks.push(k);
                vs.push(v);
            }
            let q: Vec<f32> = (0..qh * d).map(|i| value(i, 2.0)).collect();
            let mut out = vec![0f32; qh * d];
            cache.attend(1, &q, &mut out).unwrap();
            let want = naive(&q, &ks, &vs, qh, kvh, d);
            let worst = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (f64::from(*a) - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < tol, "{precision:?}: max error {worst}");
        }
    }

    #[test]
    fn capacity_and_width_limits_are_errors() {
        let mut cache = KvCache::new(&spec(1, 2, 1, 4, 1, KvPrecision::Bf16x2)).unwrap();
        cache.push(0, &[0.0; 4], &[0.0; 4]).unwrap();
        cache.advance(1);
        assert!(matches!(
            cache.push(0, &[0.0; 4], &[0.0; 4]),
            Err(EngineError::ContextFull { len: 2, max: 1 })
        ));
        assert!(matches!(
            cache.attend(0, &[0.0; 3], &mut [0.0; 3]),
            Err(EngineError::Attention(_))
        ));
        assert!(KvCache::new(&spec(1, 2, 1, 256, 8, KvPrecision::Bf16x2)).is_err());
        assert!(KvCache::new(&spec(1, 2, 1, 256, 8, KvPrecision::Bf16)).is_ok());
    }

    #[test]
    fn sizes_a_config_sets_are_capped_before_allocating() {
        let e = KvCache::new(&spec(2, 2, 1, 8, 1_000_000_000_000, KvPrecision::Bf16)).unwrap_err();
        assert!(
            matches!(
                e,
                EngineError::TooLarge {
                    unit: "positions",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("max_position_embeddings"), "{e}");
        let e = KvCache::new(&spec(2, 1 << 40, 1, 8, 16, KvPrecision::Bf16)).unwrap_err();
        assert!(
            matches!(e, EngineError::TooLarge { unit: "values", .. }),
            "{e}"
        );
        let e = KvCache::new(&spec(1 << 40, 2, 1, 8, 16, KvPrecision::Bf16)).unwrap_err();
        assert!(
            matches!(e, EngineError::TooLarge { unit: "layers", .. }),
            "{e}"
        );
        let e =
            KvCache::new(&spec(2, 2, usize::MAX / 4, 8, 1 << 20, KvPrecision::Bf16)).unwrap_err();
        assert!(e.to_string().contains("more than 2^64"), "{e}");
        assert!(KvCache::new(&spec(2, 2, 1, 8, MAX_POSITIONS, KvPrecision::Bf16)).is_ok());
    }
}
