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
//!   [`crate::topk`]) and the incomplete tail is always kept
//!   ([`HybridOps::sparse_attend`]).
//! - Attention: per head `[query | gate]` from `q_proj`; q and k RMSNormed
//!   `(1 + w)` per head and rotated on the first `rope_dim` dims; softmax
//!   over the selected positions with scale `1/sqrt(head_dim)`; the output
//!   times `sigmoid(gate)`, then `o_proj`.
//!
//! The cache keeps every position's rotated keys, values and raw index
//! keys in f32 on the device, at most `max_position_embeddings` positions.

use crate::config::qwen4::{Qsa, Qwen4Config};
use crate::device::hybrid::{HybridOps, SparseSpec, SparseState};
use crate::device::{Activation, HeadCopy, RopeSpec};
use crate::error::EngineError;
use crate::load::weights::Loader;

use super::ops::one_plus;

/// One sparse-attention layer with its cache.
pub struct SparseAttention<D: HybridOps> {
    qsa: Qsa,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    hidden: usize,
    eps: f32,
    q_proj: D::Mat,
    k_proj: D::Mat,
    v_proj: D::Mat,
    o_proj: D::Mat,
    /// `(1 + w)`, one head wide.
    q_norm: D::Vector,
    k_norm: D::Vector,
    index_qk: D::Mat,
    index_q_norm: D::Vector,
    index_k_norm: D::Vector,
    cache: D::Sparse,
    /// Blocks the indexer left out so far (all queries of the sequence).
    pub blocks_dropped: u64,
}

impl<D: HybridOps> SparseAttention<D> {
    /// Load `{prefix}.self_attn.*`.
    pub fn load(l: &Loader<'_, D>, cfg: &Qwen4Config, prefix: &str) -> Result<Self, EngineError> {
        let qsa = cfg.qsa.clone().ok_or_else(|| {
            EngineError::config(
                "indexer_n_heads",
                "missing (qwen_sparse_attention needs the indexer)",
            )
        })?;
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qw, kvw) = (cfg.q_heads * d, cfg.kv_heads * d);
        let p = format!("{prefix}.self_attn");
        let di = qsa.head_dim;
        let norm = |name: &str, n: usize| -> Result<D::Vector, EngineError> {
            let w = l.ckpt.load_f32(&format!("{p}.{name}.weight"), &[n])?;
            l.dev.vector(one_plus(w))
        };
        let spec = SparseSpec {
            capacity: cfg.max_positions,
            q_heads: cfg.q_heads,
            kv_heads: cfg.kv_heads,
            head_dim: d,
            index_heads: qsa.heads,
            index_dim: di,
            ratio: qsa.compress_ratio,
            keep: qsa.blocks_kept(),
            rope_dims: cfg.rope_dim,
            eps: cfg.rms_norm_eps,
        };
        Ok(Self {
            q_proj: l.matrix(&format!("{p}.q_proj.weight"), [2 * qw, h])?,
            k_proj: l.matrix(&format!("{p}.k_proj.weight"), [kvw, h])?,
            v_proj: l.matrix(&format!("{p}.v_proj.weight"), [kvw, h])?,
            o_proj: l.matrix(&format!("{p}.o_proj.weight"), [h, qw])?,
            q_norm: norm("q_norm", d)?,
            k_norm: norm("k_norm", d)?,
            index_qk: l.matrix(
                &format!("{p}.indexer.index_qk_proj.weight"),
                [(qsa.heads + 1) * di, h],
            )?,
            index_q_norm: norm("indexer.q_layernorm", di)?,
            index_k_norm: norm("indexer.k_layernorm", di)?,
            cache: l.dev.sparse_cache(&spec)?,
            q_heads: cfg.q_heads,
            kv_heads: cfg.kv_heads,
            head_dim: d,
            rope_dim: cfg.rope_dim,
            hidden: h,
            eps: cfg.rms_norm_eps,
            blocks_dropped: 0,
            qsa,
        })
    }

    /// Forget the sequence.
    pub fn reset(&mut self, dev: &D) -> Result<(), EngineError> {
        dev.sparse_clear(&mut self.cache)?;
        self.blocks_dropped = 0;
        Ok(())
    }

    /// Attention of the rows of `x` at the next positions (`table`: RoPE
    /// over the rotated dims).
    pub fn forward(&mut self, dev: &D, x: &D::Act, table: &D::Rope) -> Result<D::Act, EngineError> {
        let rows = x.rows();
        let first = self.cache.len();
        let (d, di, ih) = (self.head_dim, self.qsa.head_dim, self.qsa.heads);
        let (qw, kvw) = (self.q_heads * d, self.kv_heads * d);
        let mut qg = dev.zeros(rows, 2 * qw)?;
        let mut k = dev.zeros(rows, kvw)?;
        let mut v = dev.zeros(rows, kvw)?;
        let mut iqk = dev.zeros(rows, (ih + 1) * di)?;
        dev.linear_many(
            &mut [&mut qg, &mut k, &mut v, &mut iqk],
            &[&self.q_proj, &self.k_proj, &self.v_proj, &self.index_qk],
            x,
        )?;
        let split = |src_offset: usize| HeadCopy {
            heads: self.q_heads,
            len: d,
            src_stride: 2 * d,
            src_offset,
            dst_stride: d,
            dst_offset: 0,
            scale: 1.0,
        };
        let mut q_raw = dev.zeros(rows, qw)?;
        let mut gate = dev.zeros(rows, qw)?;
        dev.copy_heads(&mut q_raw, &qg, split(0))?;
        dev.copy_heads(&mut gate, &qg, split(d))?;
        let mut q = dev.zeros(rows, qw)?;
        dev.rms_norm(&mut q, &q_raw, &self.q_norm, self.eps)?;
        let mut kn = dev.zeros(rows, kvw)?;
        dev.rms_norm(&mut kn, &k, &self.k_norm, self.eps)?;
        let rope = |heads: usize, head_stride: usize| RopeSpec {
            heads,
            head_stride,
            offset: 0,
            dims: self.rope_dim,
            interleaved: false,
        };
        dev.rope(&mut q, table, rope(self.q_heads, d), first)?;
        dev.rope(&mut kn, table, rope(self.kv_heads, d), first)?;
        let mut iq_raw = dev.zeros(rows, ih * di)?;
        let mut ik = dev.zeros(rows, di)?;
        let part = |heads: usize, src_offset: usize| HeadCopy {
            heads,
            len: di,
            src_stride: di,
            src_offset,
            dst_stride: di,
            dst_offset: 0,
            scale: 1.0,
        };
        dev.copy_heads(&mut iq_raw, &iqk, part(ih, 0))?;
        dev.copy_heads(&mut ik, &iqk, part(1, ih * di))?;
        let mut iq = dev.zeros(rows, ih * di)?;
        dev.rms_norm(&mut iq, &iq_raw, &self.index_q_norm, self.eps)?;
        dev.rope(&mut iq, table, rope(ih, di), first)?;
        let mut heads = dev.zeros(rows, qw)?;
        dev.sparse_attend(
            &mut self.cache,
            (&q, &kn, &v),
            (&iq, &ik),
            &self.index_k_norm,
            table,
            &mut heads,
        )?;
        let (ratio, keep) = (self.qsa.compress_ratio, self.qsa.blocks_kept());
        self.blocks_dropped += (first..first + rows)
            .map(|t| {
                let blocks = (t + 1) / ratio;
                (blocks - keep.min(blocks)) as u64
            })
            .sum::<u64>();
        dev.mul_sigmoid(&mut heads, &gate)?;
        let mut y = dev.zeros(rows, self.hidden)?;
        dev.linear(&mut y, &self.o_proj, &heads)?;
        Ok(y)
    }
}
