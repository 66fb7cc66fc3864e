//! Grouped-query attention, as Qwen3-MoE (per-head qk RMSNorm), Qwen2-MoE
//! (q/k/v bias) and Mixtral (neither) run it: q/k/v projections, the
//! optional bias and qk-norm, RoPE on whole heads (`rotate_half`), the KV
//! cache's causal attention, and `o_proj`.

use crate::config::ModelConfig;
use crate::device::{AddNormTo, Device};
use crate::error::EngineError;
use crate::family::{RowUse, Step, per_sequence_arity};
use crate::load::weights::Loader;

/// One layer's attention weights.
pub struct GqaWeights<D: Device> {
    /// `[q_heads * head_dim, hidden]`.
    pub q_proj: D::Mat,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: D::Mat,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: D::Mat,
    /// `[hidden, q_heads * head_dim]`.
    pub o_proj: D::Mat,
    /// Qwen3's per-head query and key norms `[head_dim]`.
    pub qk_norm: Option<[D::Vector; 2]>,
    /// Qwen2-MoE's query, key and value biases.
    pub qkv_bias: Option<[D::Vector; 3]>,
}

impl<D: Device> GqaWeights<D> {
    /// Load `{prefix}.self_attn.*` as `cfg` shapes it.
    pub fn load(l: &Loader<'_, D>, cfg: &ModelConfig, prefix: &str) -> Result<Self, EngineError> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (q_width, kv_width) = (cfg.num_q_heads * d, cfg.num_kv_heads * d);
        let a = format!("{prefix}.self_attn");
        let qk_norm = if cfg.qk_norm {
            Some([
                l.vector(&format!("{a}.q_norm.weight"), &[d])?,
                l.vector(&format!("{a}.k_norm.weight"), &[d])?,
            ])
        } else {
            None
        };
        let qkv_bias = if cfg.qkv_bias {
            Some([
                l.vector(&format!("{a}.q_proj.bias"), &[q_width])?,
                l.vector(&format!("{a}.k_proj.bias"), &[kv_width])?,
                l.vector(&format!("{a}.v_proj.bias"), &[kv_width])?,
            ])
        } else {
            None
        };
        Ok(Self {
            q_proj: l.matrix(&format!("{a}.q_proj.weight"), [q_width, h])?,
            k_proj: l.matrix(&format!("{a}.k_proj.weight"), [kv_width, h])?,
            v_proj: l.matrix(&format!("{a}.v_proj.weight"), [kv_width, h])?,
            o_proj: l.matrix(&format!("{a}.o_proj.weight"), [h, q_width])?,
            qk_norm,
            qkv_bias,
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
        let (dev, c) = (st.dev, st.cfg);
        let (n, d) = (st.rows, c.head_dim);
        let mut q = dev.zeros(n, c.num_q_heads * d)?;
        let mut k = dev.zeros(n, c.num_kv_heads * d)?;
        let mut v = dev.zeros(n, c.num_kv_heads * d)?;
        dev.linear_many(
            &mut [&mut q, &mut k, &mut v],
            &[&self.q_proj, &self.k_proj, &self.v_proj],
            x,
        )?;
        if let Some([qb, kb, vb]) = &self.qkv_bias {
            dev.add_bias(&mut q, qb)?;
            dev.add_bias(&mut k, kb)?;
            dev.add_bias(&mut v, vb)?;
        }
        let norms = self.qk_norm.as_ref().map(|[qn, kn]| [qn, kn]);
        // The output product's weights come in while the attention runs.
        dev.prefetch(&[&self.o_proj])?;
        let mut heads = dev.zeros(n, c.num_q_heads * d)?;
        let (eps, rope) = (c.rms_norm_eps, st.rope);
        // Sequences decoding one row each attend together where the device
        // can (the same bits as one by one).
        if let Some(mut kvs) = st.decode_rows()
            && dev.attend_rows(
                &mut kvs,
                layer,
                (&mut q, &mut k),
                &v,
                (norms, eps, rope, d),
                &mut heads,
            )?
        {
            return to.linear(dev, &self.o_proj, &heads);
        }
        st.per_sequence(
            &mut [&mut heads, &mut q, &mut k, &mut v],
            &[RowUse::Out, RowUse::In, RowUse::In, RowUse::In],
            |dev, kv, first, a| match a {
                [heads, q, k, v] => {
                    dev.qk_norm_rope(q, k, norms, eps, rope, d, first)?;
                    dev.attend(kv, layer, q, k, v, heads)
                }
                _ => Err(per_sequence_arity()),
            },
        )?;
        to.linear(dev, &self.o_proj, &heads)
    }
}
