//! Qwen sparse attention (`qwen_sparse_attention` layers): gated
//! grouped-query attention over the tokens the QSA indexer selects.
//!
//! - Indexer: per token, `indexer_n_heads` query heads (RMSNorm `(1 + w)`
//!   per head, RoPE on the first `rope_dim` dims) and one raw key. For a
//!   query at position `t`, the `(t + 1) / ratio` complete blocks of
//!   `ratio` keys are averaged, normed, and rotated at the block's first
//!   position; a block scores `sum_h relu(q_h . key) / sqrt(index_dim)`,
//!   the `budget / ratio` best blocks are kept (the set torch's CPU
//!   `topk` keeps, ties included: blocks scoring exactly 0 are common,
//!   [`crate::topk`]) and the incomplete tail is always kept.
//! - Attention: per head `[query | gate]` from `q_proj`; q and k RMSNormed
//!   `(1 + w)` per head and rotated on the first `rope_dim` dims; softmax
//!   over the selected positions with scale `1/sqrt(head_dim)`; the output
//!   times `sigmoid(gate)`, then `o_proj`.
//!
//! The cache keeps every position's rotated keys, values and raw index
//! keys in f32, at most `max_position_embeddings` positions.

use crate::checkpoint::Checkpoint;
use crate::config::qwen4::{Qsa, Qwen4Config};
use crate::device::cpu::kernels::{dot, rope_angles, softmax};
use crate::error::EngineError;
use crate::matrix::Matrix;

use super::ops::{host_loader, linear, norm_groups, one_plus, rope_partial, sigmoid};

/// One sparse-attention layer with its cache.
pub struct SparseAttention {
    qsa: Qsa,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    inv_freq: Vec<f32>,
    q_proj: Matrix,
    k_proj: Matrix,
    v_proj: Matrix,
    o_proj: Matrix,
    /// `(1 + w)` per head, repeated over the heads.
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    index_qk: Matrix,
    index_q_norm: Vec<f32>,
    index_k_norm: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    index_keys: Vec<f32>,
    /// Blocks the indexer left out so far (all queries of the sequence).
    pub blocks_dropped: u64,
}

impl SparseAttention {
    /// Load `{prefix}.self_attn.*`.
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &Qwen4Config,
        prefix: &str,
        inv_freq: &[f32],
    ) -> Result<Self, EngineError> {
        let qsa = cfg.qsa.clone().ok_or_else(|| {
            EngineError::config(
                "indexer_n_heads",
                "missing (qwen_sparse_attention needs the indexer)",
            )
        })?;
        let l = host_loader(ckpt);
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qw, kvw) = (cfg.q_heads * d, cfg.kv_heads * d);
        let p = format!("{prefix}.self_attn");
        let di = qsa.head_dim;
        let norm =
            |name: &str, n: usize| l.vector(&format!("{p}.{name}.weight"), &[n]).map(one_plus);
        Ok(Self {
            q_proj: l.host_matrix(&format!("{p}.q_proj.weight"), [2 * qw, h])?,
            k_proj: l.host_matrix(&format!("{p}.k_proj.weight"), [kvw, h])?,
            v_proj: l.host_matrix(&format!("{p}.v_proj.weight"), [kvw, h])?,
            o_proj: l.host_matrix(&format!("{p}.o_proj.weight"), [h, qw])?,
            q_norm: norm("q_norm", d)?.repeat(cfg.q_heads),
            k_norm: norm("k_norm", d)?.repeat(cfg.kv_heads),
            index_qk: l.host_matrix(
                &format!("{p}.indexer.index_qk_proj.weight"),
                [(qsa.heads + 1) * di, h],
            )?,
            index_q_norm: norm("indexer.q_layernorm", di)?.repeat(qsa.heads),
            index_k_norm: norm("indexer.k_layernorm", di)?,
            q_heads: cfg.q_heads,
            kv_heads: cfg.kv_heads,
            head_dim: d,
            eps: cfg.rms_norm_eps,
            inv_freq: inv_freq.to_vec(),
            keys: Vec::new(),
            values: Vec::new(),
            index_keys: Vec::new(),
            blocks_dropped: 0,
            qsa,
        })
    }

    /// Forget the sequence.
    pub fn reset(&mut self) {
        self.keys.clear();
        self.values.clear();
        self.index_keys.clear();
        self.blocks_dropped = 0;
    }

    fn angles(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        rope_angles(pos, &self.inv_freq, 1.0)
    }

    /// Attention of the `rows` rows of `x` at positions `first..`.
    pub fn forward(
        &mut self,
        x: &[f32],
        rows: usize,
        first: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let (d, di) = (self.head_dim, self.qsa.head_dim);
        let (qw, kvw) = (self.q_heads * d, self.kv_heads * d);
        let qg = linear(&self.q_proj, x, rows)?;
        let (mut q, mut gate) = (Vec::with_capacity(rows * qw), Vec::with_capacity(rows * qw));
        for head in qg.chunks_exact(2 * d) {
            q.extend_from_slice(&head[..d]);
            gate.extend_from_slice(&head[d..]);
        }
        let mut q = norm_groups(&q, &self.q_norm, d, self.eps)?;
        let mut k = norm_groups(&linear(&self.k_proj, x, rows)?, &self.k_norm, d, self.eps)?;
        let v = linear(&self.v_proj, x, rows)?;
        let iqk = linear(&self.index_qk, x, rows)?;
        let iw = (self.qsa.heads + 1) * di;
        let mut iq = Vec::with_capacity(rows * self.qsa.heads * di);
        for r in 0..rows {
            let (cos, sin) = self.angles(first + r);
            rope_partial(&mut q[r * qw..(r + 1) * qw], d, &cos, &sin);
            rope_partial(&mut k[r * kvw..(r + 1) * kvw], d, &cos, &sin);
            let row = &iqk[r * iw..(r + 1) * iw];
            let mut qi = norm_groups(
                &row[..self.qsa.heads * di],
                &self.index_q_norm,
                di,
                self.eps,
            )?;
            rope_partial(&mut qi, di, &cos, &sin);
            iq.extend(qi);
            self.index_keys
                .extend_from_slice(&row[self.qsa.heads * di..]);
        }
        self.keys.extend_from_slice(&k);
        self.values.extend_from_slice(&v);
        let mut heads = vec![0f32; rows * qw];
        for r in 0..rows {
            let t = first + r;
            let chosen = self.select(
                &iq[r * self.qsa.heads * di..(r + 1) * self.qsa.heads * di],
                t,
            )?;
            self.attend(
                &q[r * qw..(r + 1) * qw],
                &chosen,
                &mut heads[r * qw..(r + 1) * qw],
            );
        }
        for (hv, g) in heads.iter_mut().zip(&gate) {
            *hv *= sigmoid(*g);
        }
        linear(&self.o_proj, &heads, rows)
    }

    /// The positions query `t` attends to, ascending.
    fn select(&mut self, iq: &[f32], t: usize) -> Result<Vec<usize>, EngineError> {
        let (r, di) = (self.qsa.compress_ratio, self.qsa.head_dim);
        let blocks = (t + 1) / r;
        let keep = self.qsa.blocks_kept().min(blocks);
        let mut scored = Vec::with_capacity(blocks);
        for b in 0..blocks {
            let mut pooled = vec![0f32; di];
            for p in b * r..(b + 1) * r {
                for (acc, kv) in pooled
                    .iter_mut()
                    .zip(&self.index_keys[p * di..(p + 1) * di])
                {
                    *acc += kv;
                }
            }
            pooled.iter_mut().for_each(|v| *v /= r as f32);
            let mut key = norm_groups(&pooled, &self.index_k_norm, di, self.eps)?;
            let (cos, sin) = self.angles(b * r);
            rope_partial(&mut key, di, &cos, &sin);
            let s: f32 = iq.chunks_exact(di).map(|qh| dot(qh, &key).max(0.0)).sum();
            scored.push(s / (di as f32).sqrt());
        }
        let kept = crate::topk::kept(&scored, keep);
        self.blocks_dropped += (blocks - keep) as u64;
        let mut positions: Vec<usize> = kept.iter().flat_map(|b| b * r..(b + 1) * r).collect();
        positions.extend(blocks * r..=t);
        Ok(positions)
    }

    /// Softmax attention of one row's query heads over `positions`.
    fn attend(&self, q: &[f32], positions: &[usize], out: &mut [f32]) {
        let d = self.head_dim;
        let kvw = self.kv_heads * d;
        let group = self.q_heads / self.kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        for (hq, (qh, oh)) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
            let kvh = hq / group;
            let mut w: Vec<f32> = positions
                .iter()
                .map(|&p| dot(qh, &self.keys[p * kvw + kvh * d..][..d]) * scale)
                .collect();
            softmax(&mut w);
            for (&p, wp) in positions.iter().zip(&w) {
                for (o, v) in oh.iter_mut().zip(&self.values[p * kvw + kvh * d..][..d]) {
                    *o += wp * v;
                }
            }
        }
    }
}
