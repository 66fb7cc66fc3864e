//! Multi-head latent attention, as DeepSeek-V3 runs it: the query through
//! its low-rank pair (or a plain `q_proj`), the key/value latent through
//! `kv_a` and its norm, RoPE on the rope parts (interleaved pairs by
//! default), the latent expanded per head by `kv_b`. The KV cache holds the
//! expanded keys and values, the narrower of the two zero-padded to the
//! cache's head width, and the query is pre-scaled so the cache's
//! `1/sqrt(head_dim)` becomes DeepSeek's softmax scale.

use crate::config::{Mla, ModelConfig};
use crate::device::{AddNormTo, Device, HeadCopy, RopeSpec, VectorLen};
use crate::error::EngineError;
use crate::family::{RowUse, Step, per_sequence_arity};
use crate::load::weights::Loader;

/// The query projection of latent attention.
pub enum QueryProj<D: Device> {
    /// `q_proj` `[heads * qk_head_dim, hidden]`.
    Plain(D::Mat),
    /// `q_b(rms_norm(q_a x))`.
    LowRank {
        /// `q_a_proj` `[q_lora_rank, hidden]`.
        a: D::Mat,
        /// `q_a_layernorm` `[q_lora_rank]`.
        norm: D::Vector,
        /// `q_b_proj` `[heads * qk_head_dim, q_lora_rank]`.
        b: D::Mat,
    },
}

/// One layer's latent-attention weights.
pub struct MlaWeights<D: Device> {
    /// The latent dimensions.
    pub dims: Mla,
    /// The query projection.
    pub q: QueryProj<D>,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a: D::Mat,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    pub kv_a_norm: D::Vector,
    /// `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
    pub kv_b: D::Mat,
    /// `o_proj` `[hidden, heads * v_head_dim]`.
    pub o_proj: D::Mat,
}

impl<D: Device> MlaWeights<D> {
    /// Load `{prefix}.self_attn.*` as `cfg` shapes it.
    pub fn load(
        l: &Loader<'_, D>,
        cfg: &ModelConfig,
        m: &Mla,
        prefix: &str,
    ) -> Result<Self, EngineError> {
        let (h, heads) = (cfg.hidden_size, cfg.num_q_heads);
        let a = format!("{prefix}.self_attn");
        let q = match m.q_lora_rank {
            Some(r) => QueryProj::LowRank {
                a: l.matrix(&format!("{a}.q_a_proj.weight"), [r, h])?,
                norm: l.vector(&format!("{a}.q_a_layernorm.weight"), &[r])?,
                b: l.matrix(
                    &format!("{a}.q_b_proj.weight"),
                    [heads * m.qk_head_dim(), r],
                )?,
            },
            None => QueryProj::Plain(
                l.matrix(&format!("{a}.q_proj.weight"), [heads * m.qk_head_dim(), h])?,
            ),
        };
        Ok(Self {
            dims: m.clone(),
            q,
            kv_a: l.matrix(
                &format!("{a}.kv_a_proj_with_mqa.weight"),
                [m.kv_lora_rank + m.qk_rope_head_dim, h],
            )?,
            kv_a_norm: l.vector(&format!("{a}.kv_a_layernorm.weight"), &[m.kv_lora_rank])?,
            kv_b: l.matrix(
                &format!("{a}.kv_b_proj.weight"),
                [heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            )?,
            o_proj: l.matrix(&format!("{a}.o_proj.weight"), [h, heads * m.v_head_dim])?,
        })
    }

    /// Attention of the step's rows at `layer` (`rows x hidden`), added
    /// into `to`'s residual stream and normed.
    pub fn forward(
        &self,
        st: &mut Step<'_, D>,
        layer: usize,
        x: &D::Act,
        to: AddNormTo<'_, D>,
    ) -> Result<(), EngineError> {
        let (dev, c, m) = (st.dev, st.cfg, &self.dims);
        let (n, heads, d) = (st.rows, c.num_q_heads, c.head_dim);
        let (nope, rope, vd, rank) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        let qk = nope + rope;
        let mut q = dev.zeros(n, heads * qk)?;
        match &self.q {
            QueryProj::Plain(p) => dev.linear(&mut q, p, x)?,
            QueryProj::LowRank { a, norm, b } => {
                let mut low = dev.zeros(n, norm.len())?;
                dev.linear(&mut low, a, x)?;
                let mut normed = dev.zeros(n, norm.len())?;
                dev.rms_norm(&mut normed, &low, norm, c.rms_norm_eps)?;
                dev.linear(&mut q, b, &normed)?;
            }
        }
        let mut latent = dev.zeros(n, rank + rope)?;
        dev.linear(&mut latent, &self.kv_a, x)?;
        let mut kv_nope = dev.zeros(n, rank)?;
        dev.copy_heads(&mut kv_nope, &latent, slice(1, rank, 0, 0, 0, 0, 1.0))?;
        let mut kv_normed = dev.zeros(n, rank)?;
        dev.rms_norm(&mut kv_normed, &kv_nope, &self.kv_a_norm, c.rms_norm_eps)?;
        let mut kv = dev.zeros(n, heads * (nope + vd))?;
        dev.linear(&mut kv, &self.kv_b, &kv_normed)?;
        let rotate = |heads, head_stride, offset| RopeSpec {
            heads,
            head_stride,
            offset,
            dims: rope,
            interleaved: m.rope_interleave,
        };
        let table = st.rope;
        st.per_sequence(
            &mut [&mut latent, &mut q],
            &[RowUse::InOut, RowUse::InOut],
            |dev, _, first, a| match a {
                [latent, q] => {
                    dev.rope(latent, table, rotate(1, rank + rope, rank), first)?;
                    dev.rope(q, table, rotate(heads, qk, nope), first)
                }
                _ => Err(per_sequence_arity()),
            },
        )?;
        // Query heads `[nope | rope]` padded to `d` and pre-scaled; keys
        // `[k_nope | k_rot]` (k_rot shared by every head); values padded.
        let q_scale = (c.attention_scale() * (d as f64).sqrt()) as f32;
        let mut qs = dev.zeros(n, heads * d)?;
        dev.copy_heads(&mut qs, &q, slice(heads, qk, qk, 0, d, 0, q_scale))?;
        let mut ks = dev.zeros(n, heads * d)?;
        dev.copy_heads(&mut ks, &kv, slice(heads, nope, nope + vd, 0, d, 0, 1.0))?;
        dev.copy_heads(&mut ks, &latent, slice(heads, rope, 0, rank, d, nope, 1.0))?;
        let mut vs = dev.zeros(n, heads * d)?;
        dev.copy_heads(&mut vs, &kv, slice(heads, vd, nope + vd, nope, d, 0, 1.0))?;
        let mut attended = dev.zeros(n, heads * d)?;
        st.per_sequence(
            &mut [&mut attended, &mut qs, &mut ks, &mut vs],
            &[RowUse::Out, RowUse::In, RowUse::In, RowUse::In],
            |dev, kv, _, a| match a {
                [attended, qs, ks, vs] => dev.attend(kv, layer, qs, ks, vs, attended),
                _ => Err(per_sequence_arity()),
            },
        )?;
        let mut values = dev.zeros(n, heads * vd)?;
        dev.copy_heads(&mut values, &attended, slice(heads, vd, d, 0, vd, 0, 1.0))?;
        to.linear(dev, &self.o_proj, &values)
    }
}

/// A [`HeadCopy`] in argument order: heads, len, source stride and offset,
/// destination stride and offset, scale.
fn slice(
    heads: usize,
    len: usize,
    src_stride: usize,
    src_offset: usize,
    dst_stride: usize,
    dst_offset: usize,
    scale: f32,
) -> HeadCopy {
    HeadCopy {
        heads,
        len,
        src_stride,
        src_offset,
        dst_stride,
        dst_offset,
        scale,
    }
}
