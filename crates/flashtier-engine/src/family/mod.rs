//! Model families, each describing its forward pass once over any
//! [`Device`]:
//!
//! - Qwen3-MoE, Qwen2-MoE and Mixtral: grouped-query attention ([`gqa`])
//!   and softmax-routed experts; Qwen3 adds per-head qk-norm, Qwen2-MoE
//!   q/k/v biases and a gated shared expert, Mixtral a sliding window.
//! - DeepSeek-V3: multi-head latent attention ([`mla`]), grouped sigmoid
//!   routing, ungated shared experts and leading dense layers.
//! - Qwen4-Exp ([`qwen4`], its own decoder over the hybrid operations of
//!   [`crate::device::hybrid`]): GatedDeltaNet and QSA sparse attention on
//!   hyper-connection streams, PLE n-gram rows, a gated shared expert; its
//!   routed experts go through the same tier.
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
use crate::device::{Activation, AddNormTo, Device};
use crate::error::EngineError;
use crate::load::weights::Loader;
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

/// The rows of one sequence in a step: `rows` consecutive rows from
/// `start`, at positions `first..first + rows` of its KV cache.
pub struct SeqRows<'a, D: Device> {
    /// The sequence's KV cache.
    pub kv: &'a mut D::Kv,
    /// Position of the sequence's first row (the cache's length).
    pub first: usize,
    /// The sequence's first row in the step.
    pub start: usize,
    /// Rows of the sequence.
    pub rows: usize,
}

/// How [`Step::per_sequence`] treats an activation of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowUse {
    /// Read by the sequence's operations.
    In,
    /// Written by them (every column of the sequence's rows).
    Out,
    /// Read and updated in place.
    InOut,
}

/// What one forward step of `rows` tokens shares across layers. The rows
/// belong to one sequence (a prompt chunk, a decode token) or to several
/// (a batch: each sequence's rows consecutive, in `seqs` order); only the
/// position-dependent operations (RoPE, attention) look at `seqs`.
pub struct Step<'a, D: Device> {
    /// The device.
    pub dev: &'a D,
    /// The model's config.
    pub cfg: &'a ModelConfig,
    /// The routing rule.
    pub rule: &'a RouteRule,
    /// RoPE's table.
    pub rope: &'a D::Rope,
    /// The sequences whose rows the step holds.
    pub seqs: Vec<SeqRows<'a, D>>,
    /// The expert tier.
    pub experts: &'a mut D::Experts,
    /// Tokens in this step.
    pub rows: usize,
}

impl<D: Device> Step<'_, D> {
    /// The caches of a step of two or more sequences that each decode one
    /// row (row `r` is sequence `r`'s), for [`Device::attend_rows`];
    /// `None` for any other step.
    pub fn decode_rows(&mut self) -> Option<Vec<&mut D::Kv>> {
        let one_each = self.seqs.len() >= 2
            && self
                .seqs
                .iter()
                .enumerate()
                .all(|(i, s)| s.rows == 1 && s.start == i);
        one_each.then(|| self.seqs.iter_mut().map(|s| &mut *s.kv).collect())
    }

    /// Run `f` once per sequence with its KV cache, its first position and
    /// its rows of `acts` (`uses` says how each is used): a step of one
    /// sequence hands `f` the activations themselves; otherwise `f` gets
    /// copies of the sequence's rows, and the rows of the `Out` and `InOut`
    /// activations are copied back after it. Every operation the engine
    /// runs computes each row on its own, so the copies change no bit.
    pub fn per_sequence(
        &mut self,
        acts: &mut [&mut D::Act],
        uses: &[RowUse],
        mut f: impl FnMut(&D, &mut D::Kv, usize, &mut [&mut D::Act]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let (dev, rows) = (self.dev, self.rows);
        if acts.len() != uses.len() {
            return Err(EngineError::Shape {
                op: "per_sequence",
                what: format!("{} activations, {} uses", acts.len(), uses.len()),
            });
        }
        if let [seq] = self.seqs.as_mut_slice()
            && seq.start == 0
            && seq.rows == rows
        {
            return f(dev, seq.kv, seq.first, acts);
        }
        for seq in &mut self.seqs {
            let mut parts = Vec::with_capacity(acts.len());
            for (a, &u) in acts.iter().zip(uses) {
                let mut part = dev.zeros(seq.rows, a.cols())?;
                if u != RowUse::Out {
                    dev.copy_rows(&mut part, 0, a, seq.start, seq.rows)?;
                }
                parts.push(part);
            }
            let mut refs: Vec<&mut D::Act> = parts.iter_mut().collect();
            f(dev, seq.kv, seq.first, &mut refs)?;
            for ((a, part), &u) in acts.iter_mut().zip(&parts).zip(uses) {
                if u != RowUse::In {
                    dev.copy_rows(a, seq.start, part, 0, seq.rows)?;
                }
            }
        }
        Ok(())
    }
}

/// [`Step::per_sequence`] handed `f` another number of activations than
/// it was given (a bug in the caller's pattern).
pub(crate) fn per_sequence_arity() -> EngineError {
    EngineError::Shape {
        op: "per_sequence",
        what: "the activations handed back do not match the pattern".to_string(),
    }
}

/// The decoder layers over the step's embedded rows `x` (the residual
/// stream, updated in place), then the final norm: returns the normed
/// rows the LM head reads. Each half's output is added to the stream
/// together with the norm that follows (the post-attention norm, the next
/// layer's input norm, or the final norm: [`AddNormTo`]); the normed rows
/// alternate between two buffers, a half's input and its output.
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
