//! The sparse (QSA) layers' cache on the CPU: every position's keys and
//! values (normed and rotated) and raw index keys, grown as positions
//! arrive (up to its capacity), and one key per complete block, made once
//! when the block completes; the indexer's choice of blocks (torch's CPU
//! `topk`, ties included) and the attention over the kept positions.

use super::kernels::{apply_rope, dot, rms_norm, rope_angles};
use super::{HostRope, shape_err};
use crate::device::hybrid::{SparseSpec, SparseState};
use crate::error::EngineError;
use crate::math::softmax;

/// A sparse-attention layer's cache in host memory.
#[derive(Clone, Debug)]
pub struct HostSparse {
    pub(super) spec: SparseSpec,
    /// `len x kv_heads * head_dim`, normed and rotated.
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    /// `len x index_dim`, raw.
    pub(super) index_keys: Vec<f32>,
    /// One key per complete block, `blocks x index_dim`.
    pub(super) block_keys: Vec<f32>,
}

impl SparseState for HostSparse {
    fn len(&self) -> usize {
        self.index_keys.len() / self.spec.index_dim.max(1)
    }
    fn capacity(&self) -> usize {
        self.spec.capacity
    }
}

impl HostSparse {
    /// Keys of the blocks the positions held now complete.
    pub(super) fn complete_blocks(&mut self, k_norm: &[f32], table: &HostRope) {
        let (ratio, di) = (self.spec.ratio, self.spec.index_dim);
        let done = self.block_keys.len() / di;
        for b in done..self.len() / ratio {
            let mut pooled = vec![0f32; di];
            for p in b * ratio..(b + 1) * ratio {
                for (acc, kv) in pooled.iter_mut().zip(&self.index_keys[p * di..][..di]) {
                    *acc += kv;
                }
            }
            pooled.iter_mut().for_each(|v| *v /= ratio as f32);
            let mut key = vec![0f32; di];
            rms_norm(&mut key, &pooled, k_norm, self.spec.eps);
            let (cos, sin) = rope_angles(b * ratio, &table.inv_freq, table.factor);
            let dims = self.spec.rope_dims;
            apply_rope(&mut key[..dims], dims, &cos[..dims / 2], &sin[..dims / 2]);
            self.block_keys.extend(key);
        }
    }

    /// The positions query `t` attends to, ascending.
    pub(super) fn select(&self, iq: &[f32], t: usize) -> Vec<usize> {
        let (r, di) = (self.spec.ratio, self.spec.index_dim);
        let blocks = (t + 1) / r;
        let keep = self.spec.keep.min(blocks);
        let scale = (di as f32).sqrt();
        let scored: Vec<f32> = (0..blocks)
            .map(|b| {
                let key = &self.block_keys[b * di..][..di];
                let s: f32 = iq.chunks_exact(di).map(|qh| dot(qh, key).max(0.0)).sum();
                s / scale
            })
            .collect();
        let kept = crate::topk::kept(&scored, keep);
        let mut positions: Vec<usize> = kept.iter().flat_map(|b| b * r..(b + 1) * r).collect();
        positions.extend(blocks * r..=t);
        positions
    }

    /// Softmax attention of one row's query heads over `positions`.
    pub(super) fn attend(&self, q: &[f32], positions: &[usize], out: &mut [f32]) {
        let s = &self.spec;
        let d = s.head_dim;
        let kvw = s.kv_heads * d;
        let group = s.q_heads / s.kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        for (hq, (qh, oh)) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
            let kvh = hq / group;
            let mut w: Vec<f32> = positions
                .iter()
                .map(|&p| dot(qh, &self.keys[p * kvw + kvh * d..][..d]) * scale)
                .collect();
            softmax(&mut w);
            oh.iter_mut().for_each(|o| *o = 0.0);
            for (&p, wp) in positions.iter().zip(&w) {
                for (o, v) in oh.iter_mut().zip(&self.values[p * kvw + kvh * d..][..d]) {
                    *o += wp * v;
                }
            }
        }
    }
}

pub(super) fn check_sparse(spec: &SparseSpec) -> Result<(), EngineError> {
    let s = spec;
    if s.kv_heads == 0
        || s.q_heads % s.kv_heads != 0
        || s.head_dim == 0
        || s.index_dim == 0
        || s.index_heads == 0
        || s.ratio == 0
        || s.rope_dims % 2 != 0
        || s.rope_dims > s.index_dim
        || s.rope_dims > s.head_dim
    {
        return Err(shape_err(
            "sparse_cache",
            format!(
                "{} query heads over {} key heads of {}, {} index heads of {} ({} rotated), blocks \
                 of {}",
                s.q_heads, s.kv_heads, s.head_dim, s.index_heads, s.index_dim, s.rope_dims, s.ratio
            ),
        ));
    }
    Ok(())
}
