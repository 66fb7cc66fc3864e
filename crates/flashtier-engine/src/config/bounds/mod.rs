//! Every count of `config.json` held against the checkpoint's tensors
//! before anything is allocated: a config whose counts the tensors
//! contradict (ten trillion layers on a three-layer checkpoint, a vocabulary
//! the embedding does not have) is an [`EngineError::ConfigMismatch`] naming
//! the field, its value and what the checkpoint has, never an allocation
//! failure and never a half-loaded model.
//!
//! What [`check`] holds, in this order:
//! - layers: the checkpoint's `model.layers.N.*` tensors name exactly the
//!   layers `0..num_hidden_layers`, no more and no fewer (DeepSeek's
//!   `num_nextn_predict_layers` multi-token-prediction layers may follow);
//! - `vocab_size` and `hidden_size`: the embedding's `[rows, columns]`, and
//!   the LM head's unless tied;
//! - attention (layer 0): the query and key/value projections have the rows
//!   `num_attention_heads`, `num_key_value_heads` and the head widths imply
//!   (with MLA: `q_lora_rank`, `kv_lora_rank`, the per-head dims);
//! - feed-forward: every layer the config makes sparse has a router and no
//!   other layer has one; the first dense layer's `gate_proj` has
//!   `intermediate_size` rows; the first sparse layer's router has one row
//!   per expert, its expert tensors hold experts `0..num_experts` of the
//!   expert width, its shared expert the shared width.
//!
//! Bounds (each a typed error before any allocation of that size):
//! - a count in `config.json`: at most [`MAX_CONFIG_COUNT`]; layers: at most
//!   [`MAX_LAYERS`] (checked by the parser, which keeps a flag per layer);
//! - one forward step's widest activation (`PREFILL_CHUNK` rows of the widest
//!   of hidden, vocabulary, attention, MLP, shared and router widths, f32):
//!   at most [`MAX_ACTIVATION_BYTES`];
//! - the KV cache: see [`crate::device::cpu::kv`].
//!
//! Files: `attention.rs` (the attention projections), `ffn.rs` (routers,
//! dense and expert widths, experts per layer, shared experts).

mod attention;
mod ffn;

use std::collections::{BTreeMap, BTreeSet};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::files::{CheckpointFiles as Source, TensorInfo};
use crate::config::ModelConfig;
use crate::error::{EngineError, dims};

/// Prompt tokens in one forward step on the CPU and in a batched step
/// (the activation bound below is checked for this many rows); a device
/// may take more at once ([`step_rows`]).
pub const PREFILL_CHUNK: usize = 256;

/// Largest count a `config.json` field may hold (`u32::MAX`): far above any
/// model's, small enough that a sum or product of two counts fits in u64.
pub const MAX_CONFIG_COUNT: u64 = u32::MAX as u64;

/// Most decoder layers a config may declare.
pub const MAX_LAYERS: usize = 1 << 16;

/// Most bytes of one activation of one forward step (`PREFILL_CHUNK` rows
/// of f32).
pub const MAX_ACTIVATION_BYTES: u64 = 1 << 30;

/// Check `cfg` against the tensors of `ckpt` (see the module docs).
pub fn check(cfg: &ModelConfig, ckpt: &Checkpoint) -> Result<(), EngineError> {
    check_source(cfg, ckpt.source())
}

/// [`check`] on a parsed checkpoint (before a backend opens its files).
pub fn check_source(cfg: &ModelConfig, src: &Source) -> Result<(), EngineError> {
    let mtp = src
        .config()
        .get("num_nextn_predict_layers")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    let layers = checkpoint_layers(src.tensors().keys().map(String::as_str));
    if let Some(found) = layer_mismatch(cfg.num_layers as u64, mtp, &layers) {
        return Err(mismatch("num_hidden_layers", cfg.num_layers, found));
    }
    let t = Tensors(src.tensors());
    check_embedding(cfg, &t)?;
    match &cfg.mla {
        Some(m) => attention::check_mla(cfg, m, &t)?,
        None => attention::check_gqa(cfg, &t)?,
    }
    ffn::check_ffn(cfg, &t, src.config())?;
    check_activations(cfg)
}

/// The decoder layers `model.layers.N.*` tensor names, ascending.
pub fn checkpoint_layers<'a>(names: impl Iterator<Item = &'a str>) -> BTreeSet<u64> {
    names
        .filter_map(|n| n.strip_prefix("model.layers.")?.split_once('.'))
        .filter_map(|(layer, _)| layer.parse().ok())
        .collect()
}

/// What the checkpoint has, when its `layers` are not exactly `0..n`
/// followed by at most `extra` more (multi-token-prediction layers); `None`
/// when they are.
pub fn layer_mismatch(n: u64, extra: u64, layers: &BTreeSet<u64>) -> Option<String> {
    let count = layers.len() as u64;
    let Some(&last) = layers.last() else {
        return Some("the checkpoint has no model.layers.N tensors".into());
    };
    let contiguous = last + 1 == count;
    if contiguous && count >= n && count - n <= extra {
        return None;
    }
    if contiguous {
        return Some(format!(
            "the checkpoint has {count} layers (model.layers.0 to model.layers.{last})"
        ));
    }
    let gap = (0..=last).find(|i| !layers.contains(i)).unwrap_or(last);
    Some(format!(
        "the checkpoint's layers run to model.layers.{last} without model.layers.{gap}"
    ))
}

fn mismatch(field: &str, value: impl ToString, found: String) -> EngineError {
    EngineError::ConfigMismatch {
        field: field.to_string(),
        value: value.to_string(),
        found,
    }
}

/// The tensors of a checkpoint, by name.
struct Tensors<'a>(&'a BTreeMap<String, TensorInfo>);

impl Tensors<'_> {
    fn shape(&self, name: &str) -> Result<&[u64], EngineError> {
        self.0
            .get(name)
            .map(|t| t.shape.as_slice())
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
            })
    }

    fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// Dimension `axis` of tensor `name` is `want`, which the config's
    /// `field` (= `value`) implies by `rule`; `want` is `None` when the
    /// config's product overflows.
    fn dim(
        &self,
        name: &str,
        axis: usize,
        want: Option<usize>,
        rule: Rule<'_>,
    ) -> Result<(), EngineError> {
        let shape = self.shape(name)?;
        let got = shape.get(axis).copied();
        if got.is_some() && got == want.map(|w| w as u64) {
            return Ok(());
        }
        let which = ["rows", "columns", "dimension 2"]
            .get(axis)
            .unwrap_or(&"a dimension");
        Err(mismatch(
            rule.field,
            rule.value,
            format!("`{name}` has shape {} ({which}: {})", dims(shape), rule.how),
        ))
    }
}

/// Which config field a dimension checks, its value, and how it sets the
/// dimension.
#[derive(Clone, Copy)]
struct Rule<'a> {
    field: &'a str,
    value: usize,
    how: &'a str,
}

fn rule<'a>(field: &'a str, value: usize, how: &'a str) -> Rule<'a> {
    Rule { field, value, how }
}

fn check_embedding(cfg: &ModelConfig, t: &Tensors<'_>) -> Result<(), EngineError> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut names = vec!["model.embed_tokens.weight"];
    if !cfg.tie_word_embeddings {
        names.push("lm_head.weight");
    }
    for name in names {
        t.dim(name, 0, Some(v), rule("vocab_size", v, "vocab_size"))?;
        t.dim(name, 1, Some(h), rule("hidden_size", h, "hidden_size"))?;
    }
    Ok(())
}

/// Most rows one forward step of `cfg` may take, a multiple of
/// [`PREFILL_CHUNK`] and at least that many (what [`check`] holds): the
/// rows whose widest activation stays within [`MAX_ACTIVATION_BYTES`], at
/// most `most` (a device's own limit, rounded down to the chunk).
#[must_use]
pub fn step_rows(cfg: &ModelConfig, most: usize) -> usize {
    let fits = widest_activation(cfg)
        .filter(|&w| w > 0)
        .map_or(PREFILL_CHUNK, |w| {
            usize::try_from(MAX_ACTIVATION_BYTES / (w as u64 * 4)).unwrap_or(usize::MAX)
        });
    (fits.min(most) / PREFILL_CHUNK * PREFILL_CHUNK).max(PREFILL_CHUNK)
}

/// The widest activation of one step's row, in f32 values (`None` when
/// it overflows).
fn widest_activation(cfg: &ModelConfig) -> Option<usize> {
    let attention = match &cfg.mla {
        Some(m) => {
            let widest_head = m
                .qk_head_dim()
                .max(m.qk_nope_head_dim + m.v_head_dim)
                .max(cfg.head_dim);
            cfg.num_q_heads.checked_mul(widest_head)
        }
        None => cfg.num_q_heads.checked_mul(cfg.head_dim),
    };
    let widths = [
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.dense_intermediate,
        cfg.expert_intermediate,
        cfg.num_experts,
        cfg.shared_expert_intermediate.unwrap_or(0),
    ];
    attention.map(|a| widths.iter().fold(a, |w, &x| w.max(x)))
}

/// One step's widest activation is at most [`MAX_ACTIVATION_BYTES`].
fn check_activations(cfg: &ModelConfig) -> Result<(), EngineError> {
    let widest = widest_activation(cfg);
    let bytes = widest.and_then(|w| (w as u64).checked_mul(PREFILL_CHUNK as u64 * 4));
    match bytes {
        Some(b) if b <= MAX_ACTIVATION_BYTES => Ok(()),
        value => Err(EngineError::TooLarge {
            what: format!(
                "one forward step's widest activation ({PREFILL_CHUNK} rows of f32; hidden_size, \
                 vocab_size, the attention and MLP widths)"
            ),
            value,
            limit: MAX_ACTIVATION_BYTES,
            unit: "bytes",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_sets_are_described() {
        let set = |v: &[u64]| v.iter().copied().collect::<BTreeSet<u64>>();
        assert_eq!(layer_mismatch(3, 0, &set(&[0, 1, 2])), None);
        assert_eq!(
            layer_mismatch(61, 1, &set(&(0..62).collect::<Vec<_>>())),
            None
        );
        assert_eq!(
            layer_mismatch(61, 1, &set(&(0..61).collect::<Vec<_>>())),
            None
        );
        let four = layer_mismatch(4, 0, &set(&[0, 1, 2])).unwrap_or_default();
        assert!(four.contains("3 layers"), "{four}");
        assert!(layer_mismatch(2, 0, &set(&[0, 1, 2])).is_some());
        let gap = layer_mismatch(3, 0, &set(&[0, 2])).unwrap_or_default();
        assert!(gap.contains("without model.layers.1"), "{gap}");
        assert!(layer_mismatch(1, 0, &set(&[])).is_some());
        assert_eq!(
            checkpoint_layers(
                [
                    "model.layers.10.x",
                    "model.layers.2.y",
                    "model.norm.weight",
                    "model.layers.z.w"
                ]
                .into_iter()
            ),
            set(&[2, 10])
        );
    }
}
