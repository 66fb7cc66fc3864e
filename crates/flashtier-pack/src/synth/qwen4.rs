//! A synthetic Qwen4-Exp (`qwen4_exp_text`, transformers 5.17) checkpoint in
//! the real model's proportions: GatedDeltaNet and QSA layers (one in
//! four), `hc_count` hyper-connection streams, a 512-expert top-10 MoE with
//! a shared expert, and Per-Layer Embedding (PLE) n-gram tables split in
//! row shards, as transformers saves them.
//!
//! The reference ([`Qwen4Spec::reference`]) is the published config's
//! defaults: 40 layers, hidden 2048, 512 experts of width 512, top-10,
//! vocabulary 248320, 4 streams. The config leaves the PLE layers unset;
//! the full model holds about 45B parameters of tables, so the
//! reference puts two PLE layers (the second decoder layer and the first
//! linear-attention layer past half depth) on a prime base of 10M rows per
//! head: 2 x 16 heads x 10M rows x 128 values = 41B parameters, 0.6 of the
//! expert bytes, as in the full model.
//!
//! [`Qwen4Spec::scaled_to`] scales by one factor `f`: widths, head counts
//! and layers by `f` (as [`super::shape`] does for the other families), the
//! per-head table base, the shard count and the vocabulary by `f^2`, so the
//! tables stay the same share of the expert bytes (table bytes grow as
//! base x row width, experts as layers x width x width) and the LM head the
//! same share of the weight bytes a token reads (vocabulary x hidden
//! against layers x top-k x hidden x width): the full model's LM head is
//! 0.4 of a token's routed expert bytes, and scaling the vocabulary by `f`
//! alone would make it 0.4 / f of them, a CPU-bound step the full model
//! does not have. Expert count, top-k, head widths, stream count and
//! n-gram shape stay as in the reference.
//!
//! Values follow [`SynthSpec::tensors`]'s successor model (LM head row `r`
//! is the embedding of `r + 7919`; every matrix writing into the streams is
//! small), so greedy decoding walks the vocabulary: every step brings new
//! n-grams, new rows and new routing. Norm weights stored as offsets from
//! one (hyper-connection, QSA and PLE norms) are near 0, the others near 1.
//!
//! [`SynthSpec::tensors`]: super::SynthSpec::tensors

use std::path::Path;

use serde_json::json;

use super::shape::largest_fit;
use super::{SynthError, SynthFiles, SynthReport};
use flashtier_engine::family::qwen4::ngram::{NgramSpec, PleNgramHasher};

mod tensors;

/// Scale of matrices that write into the residual streams (relative to
/// 1/sqrt(fan-in)), as for the other families.
const RESIDUAL_WRITE_SCALE: f32 = 0.05;
/// LM head row `r` is embedding row `r + SUCCESSOR_SHIFT`.
const SUCCESSOR_SHIFT: u64 = 7919;
/// One layer in this many is `qwen_sparse_attention`.
const FULL_ATTENTION_INTERVAL: u32 = 4;
/// RoPE covers this share of a head (and fits the indexer's head).
const PARTIAL_ROTARY: f64 = 0.25;
/// Noise of norm weights.
const NORM_NOISE: f32 = 0.05;
/// End-of-sequence token (segments the n-grams).
const EOS: u64 = 2;

/// A synthetic Qwen4-Exp text model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qwen4Spec {
    /// Decoder layers.
    pub layers: u32,
    /// Width of one residual stream.
    pub hidden: u64,
    /// Routed experts per layer.
    pub experts: u32,
    /// Experts per token.
    pub experts_per_token: u32,
    /// One routed expert's width.
    pub intermediate: u64,
    /// The shared expert's width.
    pub shared_intermediate: u64,
    /// Attention query heads (QSA layers).
    pub heads: u32,
    /// Attention key/value heads.
    pub kv_heads: u32,
    /// Attention head width.
    pub head_dim: u64,
    /// GatedDeltaNet key heads.
    pub linear_k_heads: u32,
    /// GatedDeltaNet value heads (a multiple of the key heads).
    pub linear_v_heads: u32,
    /// GatedDeltaNet head width (keys and values).
    pub linear_head_dim: u64,
    /// QSA indexer query heads.
    pub indexer_heads: u32,
    /// QSA indexer head width.
    pub indexer_head_dim: u64,
    /// Tokens the indexer keeps per query.
    pub indexer_budget: u64,
    /// Tokens per indexer block.
    pub indexer_compress: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Hyper-connection streams.
    pub hc_count: u32,
    /// Rank of the hyper-connection mixers.
    pub hc_lowrank: u64,
    /// PLE layers, one-indexed, each a linear-attention layer.
    pub ple_layers: Vec<u32>,
    /// Largest n-gram order.
    pub ngram_size: u32,
    /// Hashed heads per order.
    pub heads_per_ngram: u32,
    /// The per-head primes come after this.
    pub ngram_vocab_base: u64,
    /// Row shards per PLE table.
    pub split_parts: u32,
    /// Number of safetensors files.
    pub shards: u32,
    /// Seed of every tensor's values.
    pub seed: u64,
}

impl Qwen4Spec {
    /// The full-size model (see the module docs).
    #[must_use]
    pub fn reference(seed: u64) -> Self {
        let mut s = Self {
            layers: 40,
            hidden: 2048,
            experts: 512,
            experts_per_token: 10,
            intermediate: 512,
            shared_intermediate: 512,
            heads: 16,
            kv_heads: 2,
            head_dim: 256,
            linear_k_heads: 16,
            linear_v_heads: 32,
            linear_head_dim: 128,
            indexer_heads: 16,
            indexer_head_dim: 128,
            indexer_budget: 2048,
            indexer_compress: 4,
            vocab: 248_320,
            hc_count: 4,
            hc_lowrank: 320,
            ple_layers: Vec::new(),
            ngram_size: 3,
            heads_per_ngram: 8,
            ngram_vocab_base: 10_000_000,
            split_parts: 512,
            shards: 1,
            seed,
        };
        s.ple_layers = s.default_ple_layers();
        s.shards = s.total_bytes().div_ceil(4 << 30).clamp(1, 4096) as u32;
        s
    }

    /// The reference scaled by one factor to about `target_bytes` (at most;
    /// never below the smallest widths), see the module docs.
    #[must_use]
    pub fn scaled_to(target_bytes: u64, seed: u64) -> Self {
        let full = Self::reference(seed);
        if full.total_bytes() <= target_bytes {
            return full;
        }
        let mut s = full.scaled(largest_fit(target_bytes, |f| full.scaled(f).total_bytes()));
        s.shards = s.total_bytes().div_ceil(400 << 20).clamp(1, 64) as u32;
        s
    }

    fn scaled(&self, f: f64) -> Self {
        let width = |v: u64, step: u64, min: u64| {
            (((v as f64 * f) / step as f64).round() as u64 * step).max(min)
        };
        let count = |v: u32, min: u32| ((f64::from(v) * f).round() as u32).max(min);
        let mut s = self.clone();
        s.layers = count(self.layers, FULL_ATTENTION_INTERVAL);
        s.hidden = width(self.hidden, 64, 64);
        s.intermediate = width(self.intermediate, 32, 32);
        s.shared_intermediate = width(self.shared_intermediate, 32, 32);
        s.kv_heads = count(self.kv_heads, 1);
        s.heads = count(self.heads, 1)
            .max(s.kv_heads)
            .next_multiple_of(s.kv_heads);
        s.linear_k_heads = count(self.linear_k_heads, 1);
        s.linear_v_heads = s.linear_k_heads * (self.linear_v_heads / self.linear_k_heads.max(1));
        s.indexer_heads = count(self.indexer_heads, 1);
        // The vocabulary by f^2: the LM head (vocabulary x hidden) then
        // keeps its share of the weight bytes a token reads (routed experts:
        // layers x hidden x width), as the tables keep theirs.
        s.vocab = ((((self.vocab as f64 * f * f) / 256.0).round() as u64) * 256).max(256);
        s.hc_lowrank = width(self.hc_lowrank, 16, 16);
        s.ngram_vocab_base = ((self.ngram_vocab_base as f64 * f * f) as u64).max(1024);
        s.split_parts = ((f64::from(self.split_parts) * f * f).round() as u32).max(2);
        s.ple_layers = s.default_ple_layers();
        s
    }

    /// The second layer and the first linear-attention layer past half
    /// depth (one-indexed).
    fn default_ple_layers(&self) -> Vec<u32> {
        let second = (self.layers / 2 + 1..=self.layers)
            .find(|&l| self.is_linear(l))
            .filter(|&l| l > 2);
        std::iter::once(2).chain(second).collect()
    }

    /// Whether one-indexed layer `l` is a GatedDeltaNet layer.
    fn is_linear(&self, l: u32) -> bool {
        l % FULL_ATTENTION_INTERVAL != 0
    }

    /// Hashed heads per PLE layer.
    #[must_use]
    pub fn ngram_heads(&self) -> u64 {
        u64::from((self.ngram_size - 1) * self.heads_per_ngram)
    }

    /// Values per table row (`ple_embed_dim`, the hidden size, over the heads).
    #[must_use]
    pub fn row_dim(&self) -> u64 {
        self.hidden / self.ngram_heads().max(1)
    }

    /// Rows of PLE layer `rank`'s table, as transformers sizes it.
    #[must_use]
    pub fn table_rows(&self, rank: usize) -> u64 {
        let spec = NgramSpec {
            vocab: self.vocab,
            ngram_size: self.ngram_size as usize,
            heads_per_ngram: self.heads_per_ngram as usize,
            vocab_base: self.ngram_vocab_base,
            divisor: 128,
            seed: 1234,
            eos: EOS,
        };
        PleNgramHasher::new(spec, rank).rows()
    }

    /// Bytes of every PLE table.
    #[must_use]
    pub fn table_bytes(&self) -> u64 {
        (0..self.ple_layers.len())
            .map(|r| self.table_rows(r) * self.row_dim() * 2)
            .sum()
    }

    /// Bytes of one expert record's tensors (gate, up, down).
    #[must_use]
    pub fn expert_bytes(&self) -> u64 {
        3 * self.hidden * self.intermediate * 2
    }

    /// Bytes of all routed experts.
    #[must_use]
    pub fn all_expert_bytes(&self) -> u64 {
        self.expert_bytes() * u64::from(self.experts) * u64::from(self.layers)
    }

    /// Bytes of every tensor (the small attention and PLE projections
    /// left out; exact from [`Self::tensors`]).
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        let per_layer = self.layer_bytes_without_experts();
        let l = u64::from(self.layers);
        self.all_expert_bytes()
            + per_layer * l
            + self.table_bytes()
            + 2 * self.vocab * self.hidden * 2
    }

    fn layer_bytes_without_experts(&self) -> u64 {
        let (h, wide) = (self.hidden, self.hidden * u64::from(self.hc_count));
        let hyper = 2 * (2 * wide * self.hc_lowrank + u64::from(self.hc_count) * wide + wide);
        let kd = u64::from(self.linear_k_heads) * self.linear_head_dim;
        let vd = u64::from(self.linear_v_heads) * self.linear_head_dim;
        let gdn = (2 * kd + vd) * h + vd * h + vd * h;
        let shared = 3 * h * self.shared_intermediate;
        2 * (hyper + gdn + shared + u64::from(self.experts) * h)
    }

    fn check(&self) -> Result<(), SynthError> {
        let bad = |why: String| Err(SynthError::Invalid(why));
        if self.layers < FULL_ATTENTION_INTERVAL || self.hidden == 0 || self.vocab < 256 {
            return bad(format!(
                "{} layers (at least {FULL_ATTENTION_INTERVAL}), hidden {}, vocab {} (at least 256)",
                self.layers, self.hidden, self.vocab
            ));
        }
        if self.experts_per_token == 0 || self.experts_per_token > self.experts {
            return bad(format!(
                "top-{} of {} experts",
                self.experts_per_token, self.experts
            ));
        }
        if self.heads % self.kv_heads.max(1) != 0 || self.kv_heads == 0 {
            return bad(format!(
                "{} kv heads for {} heads",
                self.kv_heads, self.heads
            ));
        }
        if self.linear_k_heads == 0 || self.linear_v_heads % self.linear_k_heads != 0 {
            return bad("linear value heads must be a multiple of the key heads".into());
        }
        if self.ngram_size < 2 || self.hidden % self.ngram_heads().max(1) != 0 {
            return bad(format!(
                "hidden {} must split over {} n-gram heads",
                self.hidden,
                self.ngram_heads()
            ));
        }
        if let Some(&l) = self
            .ple_layers
            .iter()
            .find(|&&l| l == 0 || l > self.layers || !self.is_linear(l))
        {
            return bad(format!(
                "PLE layer {l} is not a linear-attention layer of the {}",
                self.layers
            ));
        }
        let parts = u64::from(self.split_parts.max(1));
        if (0..self.ple_layers.len()).any(|r| self.table_rows(r) < parts * parts) {
            return bad(format!(
                "tables too small for {parts} row shards (base {})",
                self.ngram_vocab_base
            ));
        }
        if self.indexer_budget % self.indexer_compress.max(1) != 0 {
            return bad("indexer budget must be a multiple of its block".into());
        }
        Ok(())
    }

    /// The `config.json` transformers 5.17 reads as `qwen4_exp_text`.
    #[must_use]
    pub fn config_json(&self) -> serde_json::Value {
        let layer_types: Vec<&str> = (1..=self.layers)
            .map(|l| {
                if self.is_linear(l) {
                    "linear_attention"
                } else {
                    "qwen_sparse_attention"
                }
            })
            .collect();
        let mut c = json!({
            "architectures": ["Qwen4ExpForCausalLM"],
            "model_type": "qwen4_exp_text",
            "vocab_size": self.vocab, "hidden_size": self.hidden, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "output_gate_type": null, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "attention_bias": false,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": true, "dtype": "bfloat16",
            "rope_parameters": { "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": PARTIAL_ROTARY },
            "layer_types": layer_types,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": self.linear_head_dim,
            "linear_value_head_dim": self.linear_head_dim, "linear_num_key_heads": self.linear_k_heads,
            "linear_num_value_heads": self.linear_v_heads,
            "num_experts": self.experts, "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.intermediate, "shared_expert_intermediate_size": self.shared_intermediate,
            "norm_topk_prob": true, "output_router_logits": false, "router_aux_loss_coef": 0.001,
        });
        let more = json!({
            "hc_count": self.hc_count, "hc_lowrank": self.hc_lowrank,
            "ple_layer_ids": self.ple_layers, "ple_embed_dim": self.hidden, "ple_conv_kernel_size": 4,
            "ngram_size": self.ngram_size, "heads_per_ngram": self.heads_per_ngram,
            "ngram_vocab_size_base": self.ngram_vocab_base, "make_ngram_vocab_size_divisible_by": 128,
            "seed": 1234, "split_ngram_parts": self.split_parts, "number_of_conv_states": 3,
            "indexer_n_heads": self.indexer_heads, "indexer_kv_heads": 1,
            "indexer_head_dim": self.indexer_head_dim, "indexer_budget": self.indexer_budget,
            "indexer_compress_ratio": self.indexer_compress,
            "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": null,
            "flashtier_synthetic": { "seed": self.seed, "note": "synthetic weights generated by flashtier; not a trained model" },
        });
        if let (Some(c), Some(m)) = (c.as_object_mut(), more.as_object()) {
            c.extend(m.clone());
        }
        c
    }
}

/// Write the checkpoint of `spec` into `dir` (created if missing; an older
/// synthetic checkpoint there is replaced, anything else refused).
/// `progress` gets the tensor bytes written since the last call.
pub fn write_qwen4_checkpoint(
    spec: &Qwen4Spec,
    dir: &Path,
    progress: &mut (dyn FnMut(u64) + Send),
) -> Result<SynthReport, SynthError> {
    spec.check()?;
    SynthFiles {
        config: spec.config_json(),
        tensors: spec.tensors(),
        shards: spec.shards,
        seed: spec.seed,
    }
    .write(dir, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::SynthTensor;

    #[test]
    fn the_reference_has_the_full_models_sizes() {
        let r = Qwen4Spec::reference(1);
        // 512 experts x 40 layers x 3 x 2048 x 512: 64.4B parameters.
        assert_eq!(r.all_expert_bytes() / 2, 64_424_509_440);
        // About 45B parameters of tables (two layers, 16 heads, 10M rows).
        let table = r.table_bytes() / 2;
        assert!((40_000_000_000..46_000_000_000).contains(&table), "{table}");
        assert_eq!(r.ple_layers, vec![2, 21]);
        r.check().expect("a valid model");
    }

    #[test]
    fn a_scaled_model_keeps_the_proportions() {
        let full = Qwen4Spec::reference(1);
        let s = Qwen4Spec::scaled_to(1 << 30, 1);
        let exact: u64 = s.tensors().iter().map(SynthTensor::len_bytes).sum();
        assert!(exact <= (1 << 30) + (1 << 26), "{exact}");
        assert!(exact > 1 << 29, "{exact}");
        assert_eq!((s.experts, s.experts_per_token), (512, 10));
        let share = |m: &Qwen4Spec| m.table_bytes() as f64 / m.all_expert_bytes() as f64;
        assert!(
            (share(&s) / share(&full) - 1.0).abs() < 0.35,
            "{} vs {}",
            share(&s),
            share(&full)
        );
        assert_eq!(s.ple_layers.len(), 2);
        // The LM head's share of the weight bytes a token reads.
        let head = |m: &Qwen4Spec| {
            (m.vocab * m.hidden) as f64
                / (u64::from(m.layers * m.experts_per_token) * 3 * m.hidden * m.intermediate) as f64
        };
        assert!(
            (head(&s) / head(&full) - 1.0).abs() < 0.35,
            "{} vs {}",
            head(&s),
            head(&full)
        );
        s.check().expect("a valid model");
    }

    #[test]
    fn a_bad_spec_is_refused() {
        let mut s = Qwen4Spec::scaled_to(64 << 20, 1);
        s.ple_layers = vec![s.layers];
        assert!(matches!(s.check(), Err(SynthError::Invalid(_))));
    }
}
