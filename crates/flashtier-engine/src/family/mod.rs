//! Model families, each describing its forward pass once over any
//! [`Device`]:
//!
//! - Qwen3-MoE, Qwen2-MoE and Mixtral: grouped-query attention ([`gqa`])
//!   and softmax-routed experts; Qwen3 adds per-head qk-norm, Qwen2-MoE
//!   q/k/v biases and a gated shared expert, Mixtral a sliding window.
//! - DeepSeek-V3: multi-head latent attention ([`mla`]), grouped sigmoid
//!   routing, ungated shared experts and leading dense layers.
//! - Qwen4-Exp ([`qwen4`], CPU only, its own decoder): GatedDeltaNet and
//!   QSA sparse attention on hyper-connection streams, PLE n-gram rows, a
//!   gated shared expert; its routed experts go through the same tier.
//!
//! The first four are pre-norm decoders: per layer `x += attn(rms_norm(x))`, then
//! `x += ffn(rms_norm(x))` ([`ffn`]); then the final norm and the LM head.
//! [`route`] holds the host reference of both routing rules.

pub mod ffn;
pub mod gqa;
pub mod mla;
pub mod qwen4;
pub mod route;

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::device::{AddNormTo, Device};
use crate::error::EngineError;
use crate::loader::Loader;
use ffn::{Ffn, SparseMlp};
use gqa::GqaWeights;
use mla::MlaWeights;
use route::RouteRule;

/// The attention half of a layer.
pub enum Attention<D: Device> {
    /// Grouped-query attention.
    Gqa(GqaWeights<D>),
    /// Multi-head latent attention.
    Mla(MlaWeights<D>),
}

/// One decoder layer's resident weights.
pub struct Layer<D: Device> {
    /// RMSNorm before attention.
    pub input_norm: D::Vector,
    /// RMSNorm before the feed-forward half.
    pub post_attention_norm: D::Vector,
    /// Attention.
    pub attn: Attention<D>,
    /// Feed-forward.
    pub ffn: Ffn<D>,
}

/// Every resident weight of a model (the experts live in the tier).
pub struct Weights<D: Device> {
    /// `[vocab, hidden]`.
    pub embed: D::Mat,
    /// Decoder layers.
    pub layers: Vec<Layer<D>>,
    /// Final RMSNorm.
    pub norm: D::Vector,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<D::Mat>,
}

impl<D: Device> Weights<D> {
    /// Load every non-expert tensor, named as in HF checkpoints, onto `dev`.
    pub fn load(dev: &D, ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Self, EngineError> {
        let l = Loader {
            ckpt,
            dev,
            fp8_block: cfg.fp8_block,
        };
        let h = cfg.hidden_size;
        let embed = l.matrix("model.embed_tokens.weight", [cfg.vocab_size, h])?;
        let layers = (0..cfg.num_layers)
            .map(|i| load_layer(&l, cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = l.vector("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(l.matrix("lm_head.weight", [cfg.vocab_size, h])?)
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The LM head matrix (the embedding when tied).
    pub fn lm_head(&self) -> &D::Mat {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

fn load_layer<D: Device>(
    l: &Loader<'_, D>,
    cfg: &ModelConfig,
    i: usize,
) -> Result<Layer<D>, EngineError> {
    let h = cfg.hidden_size;
    let p = format!("model.layers.{i}");
    let attn = match &cfg.mla {
        Some(m) => Attention::Mla(MlaWeights::load(l, cfg, m, &p)?),
        None => Attention::Gqa(GqaWeights::load(l, cfg, &p)?),
    };
    Ok(Layer {
        input_norm: l.vector(&format!("{p}.input_layernorm.weight"), &[h])?,
        post_attention_norm: l.vector(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        attn,
        ffn: Ffn::load(l, cfg, i, &p)?,
    })
}

/// What one forward step of `rows` tokens shares across layers.
pub struct Step<'a, D: Device> {
    /// The device.
    pub dev: &'a D,
    /// The model's config.
    pub cfg: &'a ModelConfig,
    /// The routing rule.
    pub rule: &'a RouteRule,
    /// RoPE's table.
    pub rope: &'a D::Rope,
    /// The sequence's KV cache.
    pub kv: &'a mut D::Kv,
    /// The expert tier.
    pub experts: &'a mut D::Experts,
    /// Tokens in this step.
    pub rows: usize,
    /// Position of the step's first token.
    pub first: usize,
}

/// The decoder layers over the step's embedded rows `x` (the residual
/// stream, updated in place), then the final norm: returns the normed
/// rows the LM head reads. Each half's output is added to the stream
/// together with the norm that follows (the post-attention norm, the next
/// layer's input norm, or the final norm), which devices may fold into
/// the half's last product ([`Device::linear_add_norm`],
/// [`Device::moe_add_norm`]); the normed rows alternate between two
/// buffers, a half's input and its output.
pub fn decoder_layers<D: Device>(
    w: &Weights<D>,
    st: &mut Step<'_, D>,
    x: &mut D::Act,
) -> Result<D::Act, EngineError> {
    let (dev, c) = (st.dev, st.cfg);
    let eps = c.rms_norm_eps;
    let mut normed = dev.zeros(st.rows, c.hidden_size)?;
    let mut mid = dev.zeros(st.rows, c.hidden_size)?;
    let first = w.layers.first().map_or(&w.norm, |l| &l.input_norm);
    dev.rms_norm(&mut normed, x, first, eps)?;
    for (i, layer) in w.layers.iter().enumerate() {
        let to = AddNormTo {
            resid: &mut *x,
            norm: &layer.post_attention_norm,
            eps,
            out: &mut mid,
        };
        match &layer.attn {
            Attention::Gqa(g) => g.forward(st, i, &normed, to)?,
            Attention::Mla(m) => m.forward(st, i, &normed, to)?,
        }
        let to = AddNormTo {
            resid: &mut *x,
            norm: w.layers.get(i + 1).map_or(&w.norm, |l| &l.input_norm),
            eps,
            out: &mut normed,
        };
        // The next layer's q/k/v weights may come in while this layer's
        // routed experts run (a hint; see `Device::prefetch_after_experts`).
        if let (Ffn::Sparse(_), Some(Attention::Gqa(g))) =
            (&layer.ffn, w.layers.get(i + 1).map(|l| &l.attn))
        {
            dev.prefetch_after_experts(&[&g.q_proj, &g.k_proj, &g.v_proj])?;
        }
        match &layer.ffn {
            Ffn::Dense(d) => d.forward_into(dev, &mid, to)?,
            Ffn::Sparse(s) => s.forward(st, i, &mid, next_sparse(w, i), to)?,
        }
    }
    Ok(normed)
}

/// The next sparse layer after `i` and its block (for pre-gating).
fn next_sparse<D: Device>(w: &Weights<D>, i: usize) -> Option<(usize, &SparseMlp<D>)> {
    w.layers
        .iter()
        .enumerate()
        .skip(i + 1)
        .find_map(|(j, l)| match &l.ffn {
            Ffn::Sparse(s) => Some((j, s)),
            Ffn::Dense(_) => None,
        })
}
