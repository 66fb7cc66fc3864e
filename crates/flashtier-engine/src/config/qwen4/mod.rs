//! `config.json` of a Qwen4-Exp checkpoint (transformers 5.17's
//! `qwen4_exp_text`, or the multimodal `qwen4_exp` whose `text_config` is
//! read and whose vision tower is not run).
//!
//! Checked as transformers' `validate_architecture` checks it, plus the
//! engine's own bounds: every count is at most
//! [`super::bounds::MAX_CONFIG_COUNT`]; layers at most
//! [`super::bounds::MAX_LAYERS`]; `hc_count` in `2..=`[`MAX_HC_COUNT`];
//! `ngram_size` in `2..=`[`MAX_NGRAM_SIZE`]; at most [`MAX_NGRAM_HEADS`]
//! hashed heads over all PLE layers; every heads-times-width product a
//! count too; `ngram_vocab_size_base` at most
//! [`MAX_NGRAM_VOCAB_BASE`] (the per-head primes are found by trial
//! division); every head, key and value width even where RoPE or a split
//! needs it. A value transformers would refuse, or one the engine would
//! compute differently (RoPE other than `default`, `attention_bias`, an
//! activation other than SiLU, a QSA indexer with several key heads), is an
//! [`EngineError::Config`] naming the field (`text_config.` prefixed inside
//! the wrapper).

mod parse;

use serde_json::Value;

use super::fields::Fields;
use super::{Arch, ModelConfig, Routing};
use crate::checkpoint::files::WRAPPER_TEXT_SCOPE;
use crate::error::EngineError;
use parse::parse_text;

/// Most hyper-connection streams.
pub const MAX_HC_COUNT: usize = 64;
/// Largest n-gram order.
pub const MAX_NGRAM_SIZE: usize = 8;
/// Most hashed n-gram heads over all PLE layers (each needs its own prime).
pub const MAX_NGRAM_HEADS: usize = 1 << 12;
/// Largest `ngram_vocab_size_base` (primes above it are found by trial
/// division: about 2^18 divisions per candidate at most).
pub const MAX_NGRAM_VOCAB_BASE: u64 = 1 << 36;

/// `err` with the config field it names (a [`EngineError::Config`] or
/// [`EngineError::ConfigMismatch`]) prefixed by `scope`
/// ([`Qwen4Config::field_scope`]); any other error as it is.
pub fn in_scope(err: EngineError, scope: &str) -> EngineError {
    match err {
        _ if scope.is_empty() => err,
        EngineError::Config { field, reason } => EngineError::Config {
            field: format!("{scope}{field}"),
            reason,
        },
        EngineError::ConfigMismatch {
            field,
            value,
            found,
        } => EngineError::ConfigMismatch {
            field: format!("{scope}{field}"),
            value,
            found,
        },
        other => other,
    }
}

/// What a decoder layer mixes tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// GatedDeltaNet (`linear_attention`).
    Linear,
    /// Full attention with RoPE and, when configured, the QSA indexer
    /// (`qwen_sparse_attention`, or `full_attention` in real checkpoints).
    Sparse,
}

/// The GatedDeltaNet shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearAttn {
    /// Causal conv kernel width.
    pub conv_kernel: usize,
    /// Key (and query) heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`).
    pub v_heads: usize,
    /// Key head width.
    pub k_dim: usize,
    /// Value head width.
    pub v_dim: usize,
    /// The output gate is a sigmoid (else SiLU).
    pub sigmoid_gate: bool,
}

/// The QSA token indexer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qsa {
    /// Indexer query heads (one key head).
    pub heads: usize,
    /// Indexer head width (at least the RoPE width).
    pub head_dim: usize,
    /// Tokens chosen from complete blocks per query.
    pub budget: usize,
    /// Tokens per block (divides `budget`).
    pub compress_ratio: usize,
}

impl Qsa {
    /// Blocks kept per query.
    pub fn blocks_kept(&self) -> usize {
        self.budget / self.compress_ratio
    }
}

/// The Per-Layer Embedding (PLE) and n-gram hashing settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ple {
    /// Zero-based decoder layers with PLE, ascending (all `linear_attention`).
    pub layers: Vec<usize>,
    /// Width of the concatenated n-gram embedding.
    pub embed_dim: usize,
    /// Dilated short-conv kernel width (dilation `ngram_size`).
    pub conv_kernel: usize,
    /// Largest n-gram order (>= 2).
    pub ngram_size: usize,
    /// Hashed heads per order.
    pub heads_per_ngram: usize,
    /// The primes of the head vocabularies come after this.
    pub vocab_base: u64,
    /// Each layer's table is padded to a multiple of this.
    pub vocab_divisor: u64,
    /// Seed of the layer multipliers.
    pub seed: u64,
    /// Row shards of each table in the checkpoint.
    pub split_parts: usize,
    /// The token that starts a segment (the first `eos_token_id`).
    pub eos: u64,
}

impl Ple {
    /// Hashed heads per PLE layer: `(ngram_size - 1) * heads_per_ngram`.
    pub fn heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }

    /// Width of one table row: `embed_dim / heads`.
    pub fn row_dim(&self) -> usize {
        self.embed_dim / self.heads()
    }
}

/// Everything the Qwen4-Exp forward pass needs from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen4Config {
    /// Prefix of the text model's tensors (`model`, or
    /// `model.language_model` in the multimodal wrapper).
    pub prefix: String,
    /// The wrapper's vision tower is present and not run.
    pub vision_skipped: bool,
    /// Vocabulary.
    pub vocab_size: usize,
    /// Width of one residual stream.
    pub hidden_size: usize,
    /// Per layer, its token mixer.
    pub layers: Vec<LayerKind>,
    /// Attention query heads.
    pub q_heads: usize,
    /// Attention key/value heads.
    pub kv_heads: usize,
    /// Attention head width.
    pub head_dim: usize,
    /// Dims of a head RoPE rotates (`head_dim * partial_rotary_factor`).
    pub rope_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// GatedDeltaNet shape.
    pub linear: LinearAttn,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// One routed expert's width.
    pub expert_intermediate: usize,
    /// The shared expert's width.
    pub shared_intermediate: usize,
    /// Renormalise the top-k weights.
    pub norm_topk_prob: bool,
    /// Hyper-connection streams.
    pub hc_count: usize,
    /// Rank of the hyper-connection input mixer.
    pub hc_lowrank: usize,
    /// PLE, when any layer has it.
    pub ple: Option<Ple>,
    /// The QSA indexer, when configured.
    pub qsa: Option<Qsa>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Context limit.
    pub max_positions: usize,
    /// LM head tied to the embedding.
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
}

impl Qwen4Config {
    /// The routed experts as the expert tier and the packer see them: a
    /// Qwen3-MoE-shaped [`ModelConfig`] with every layer sparse, softmax
    /// top-k routing and no FP8 (its attention fields are the QSA layers'
    /// and are not used by the tier).
    pub fn expert_view(&self) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen3Moe,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.layers.len(),
            num_q_heads: self.q_heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            rope_dim: self.rope_dim,
            yarn: None,
            mla: None,
            routing: Routing::Softmax,
            dense_intermediate: self.shared_intermediate,
            expert_intermediate: self.expert_intermediate,
            num_experts: self.num_experts,
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            sparse_layers: vec![true; self.layers.len()],
            tie_word_embeddings: self.tie_word_embeddings,
            max_positions: self.max_positions,
            sliding_window: None,
            qk_norm: true,
            qkv_bias: false,
            shared_expert_intermediate: Some(self.shared_intermediate),
            shared_expert_gated: true,
            fp8_block: None,
            eos_token_ids: self.eos_token_ids.clone(),
        }
    }

    /// Where the text model's fields sit in `config.json`: `text_config.`
    /// inside the multimodal wrapper, else at the top (`""`).
    pub fn field_scope(&self) -> &'static str {
        if self.vision_skipped {
            WRAPPER_TEXT_SCOPE
        } else {
            ""
        }
    }

    /// Whether `value` is a Qwen4-Exp config (text or wrapper).
    pub fn is_qwen4(value: &Value) -> bool {
        matches!(
            value.get("model_type").and_then(Value::as_str),
            Some("qwen4_exp" | "qwen4_exp_text")
        )
    }

    /// Check a parsed `config.json`.
    pub fn from_json(value: &Value) -> Result<Self, EngineError> {
        let obj = value
            .as_object()
            .ok_or_else(|| EngineError::config("<root>", "config.json is not a JSON object"))?;
        match Fields(obj).str("model_type")? {
            "qwen4_exp_text" => parse_text(obj, "", "model"),
            "qwen4_exp" => {
                let text = obj
                    .get("text_config")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        EngineError::config("text_config", "missing or not an object")
                    })?;
                let mut cfg = parse_text(text, WRAPPER_TEXT_SCOPE, "model.language_model")?;
                cfg.vision_skipped = true;
                Ok(cfg)
            }
            other => Err(EngineError::config(
                "model_type",
                format!("`{other}` is not Qwen4-Exp (qwen4_exp, qwen4_exp_text)"),
            )),
        }
    }
}

#[cfg(test)]
mod tests;
