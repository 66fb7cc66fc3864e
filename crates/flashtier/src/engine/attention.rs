//! The KV cache of one sequence and decode attention over it.
//!
//! Bound: the cache holds at most `capacity` positions per layer
//! (`capacity x num_kv_heads x head_dim x 2` f32 per layer); a push past it
//! is [`EngineError::ContextFull`].

use super::error::EngineError;
use super::kernels::{dot_f32, softmax};

/// Keys and values of every layer, f32, `[position, kv_head, dim]`.
#[derive(Debug)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    num_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    /// An empty cache for `num_layers` layers of up to `capacity` positions.
    pub fn new(num_layers: usize, num_kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self {
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
            num_kv_heads,
            head_dim,
            capacity,
            len: 0,
        }
    }

    /// Positions held (complete over all layers).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Is the cache empty?
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Append one position's keys and values to `layer`; the position counts
    /// once every layer has it (see [`KvCache::advance`]).
    pub fn push(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), EngineError> {
        let width = self.num_kv_heads * self.head_dim;
        if self.len >= self.capacity {
            return Err(EngineError::ContextFull {
                len: self.len + 1,
                max: self.capacity,
            });
        }
        let ok = k.len() == width && v.len() == width && layer < self.keys.len();
        if !ok || self.keys[layer].len() != self.len * width {
            return Err(EngineError::Attention(format!(
                "layer {layer}: push of {} keys at position {} does not fit the cache",
                k.len(),
                self.len
            )));
        }
        self.keys[layer].extend_from_slice(k);
        self.values[layer].extend_from_slice(v);
        Ok(())
    }

    /// Mark the position every layer pushed as complete.
    pub fn advance(&mut self) {
        self.len += 1;
    }

    /// Keys of `layer` for positions `[0, len]` (the position being decoded included).
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// Softmax attention of every query head of `q` (`[num_q_heads, head_dim]`)
/// over the last `window` (or all) positions of `layer` in `cache`, GQA
/// grouping query heads onto key/value heads; writes `out` like `q`.
pub fn attend(
    out: &mut [f32],
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    window: Option<usize>,
) -> Result<(), EngineError> {
    let d = cache.head_dim;
    let kvh = cache.num_kv_heads;
    let (keys, values) = cache.layer(layer);
    let positions = keys.len() / (kvh * d);
    let q_heads = q.len() / d;
    if q_heads % kvh != 0 || out.len() != q.len() || positions == 0 {
        return Err(EngineError::Attention(format!(
            "{q_heads} query heads over {kvh} kv heads and {positions} positions"
        )));
    }
    let group = q_heads / kvh;
    let first = window.map_or(0, |w| positions.saturating_sub(w));
    let scale = 1.0 / (d as f32).sqrt();
    let mut scores = vec![0f32; positions - first];
    for h in 0..q_heads {
        let kv = h / group;
        let qh = &q[h * d..(h + 1) * d];
        for (s, p) in scores.iter_mut().zip(first..positions) {
            let base = (p * kvh + kv) * d;
            *s = dot_f32(qh, &keys[base..base + d]) * scale;
        }
        softmax(&mut scores);
        let oh = &mut out[h * d..(h + 1) * d];
        oh.fill(0.0);
        for (s, p) in scores.iter().zip(first..positions) {
            let base = (p * kvh + kv) * d;
            for (o, v) in oh.iter_mut().zip(&values[base..base + d]) {
                *o += s * v;
            }
        }
    }
    Ok(())
}
