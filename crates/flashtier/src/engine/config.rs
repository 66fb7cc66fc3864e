//! `config.json` of a Qwen3-MoE, Qwen2-MoE or Mixtral checkpoint, in the
//! spellings of transformers 4.x and 5.x.
//!
//! Accepted spellings: `num_experts` or `num_local_experts`; `rope_theta` or
//! `rope_parameters.rope_theta`; `head_dim` present, `null` or absent (then
//! `hidden_size / num_attention_heads`); `decoder_sparse_step` and
//! `mlp_only_layers` (Qwen3-MoE, Qwen2-MoE); `tie_word_embeddings`;
//! Qwen2-MoE's `shared_expert_intermediate_size` and `qkv_bias` (absent in
//! 4.x, where the bias is always there). Anything the engine would compute
//! differently from transformers (rope scaling, `attention_bias`, an
//! activation other than SiLU, sliding windows in Qwen, DeepSeek's
//! `n_shared_experts`) is a [`EngineError::Config`] naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use super::error::EngineError;

/// The model families the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Arch {
    /// `model_type: qwen3_moe` (Qwen3-30B-A3B and relatives): qk-norm,
    /// optional dense layers, `norm_topk_prob` from the config.
    Qwen3Moe,
    /// `model_type: mixtral`: every layer sparse, softmax over the top-k logits.
    Mixtral,
    /// `model_type: qwen2_moe` (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v bias, no
    /// qk-norm, and a shared expert beside the routed ones, scaled by
    /// `sigmoid(shared_expert_gate · x)`.
    Qwen2Moe,
}

impl Arch {
    /// Tensor-name stem of the sparse MLP block in hub checkpoints.
    pub fn moe_block_name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe | Arch::Qwen2Moe => "mlp",
            Arch::Mixtral => "block_sparse_moe",
        }
    }
}

/// Everything the forward pass needs from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding and the LM head).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// Key/value heads (GQA: `num_q_heads` is a multiple).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Dense MLP width (Qwen3-MoE dense layers).
    pub dense_intermediate: usize,
    /// One expert's MLP width.
    pub expert_intermediate: usize,
    /// Experts per sparse layer.
    pub num_experts: usize,
    /// Experts each token uses per sparse layer.
    pub top_k: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// Per-layer: does layer `i` use experts (else a dense MLP)?
    pub sparse_layers: Vec<bool>,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Positions the model was built for (context limit).
    pub max_positions: usize,
    /// Mixtral's sliding attention window, if any.
    pub sliding_window: Option<usize>,
    /// Query/key RMSNorm per head (Qwen3).
    pub qk_norm: bool,
    /// Bias on the query, key and value projections (Qwen2-MoE).
    pub qkv_bias: bool,
    /// Width of the shared expert every token also runs (Qwen2-MoE), if any.
    pub shared_expert_intermediate: Option<usize>,
    /// End-of-sequence token ids (`eos_token_id`: a number, a list or null).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Read and check `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| EngineError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&value)
    }

    /// Check a parsed `config.json`.
    pub fn from_json(value: &Value) -> Result<Self, EngineError> {
        let obj = value
            .as_object()
            .ok_or_else(|| EngineError::config("<root>", "config.json is not a JSON object"))?;
        let c = Fields(obj);
        let arch = match c.str("model_type")? {
            "qwen3_moe" => Arch::Qwen3Moe,
            "mixtral" => Arch::Mixtral,
            "qwen2_moe" => Arch::Qwen2Moe,
            other => {
                return Err(EngineError::config(
                    "model_type",
                    format!("`{other}` is not supported (qwen3_moe, qwen2_moe, mixtral)"),
                ));
            }
        };
        let hidden_size = c.positive("hidden_size")?;
        let num_layers = c.positive("num_hidden_layers")?;
        let (num_q_heads, num_kv_heads, head_dim) = attention_heads(&c, hidden_size)?;
        let num_experts = expert_count(&c)?;
        let top_k = c.positive("num_experts_per_tok")?;
        if num_experts > 0 && top_k > num_experts {
            return Err(EngineError::config(
                "num_experts_per_tok",
                format!("{top_k} exceeds the {num_experts} experts"),
            ));
        }
        let intermediate = c.positive("intermediate_size")?;
        let (expert_intermediate, norm_topk_prob) = match arch {
            Arch::Qwen3Moe | Arch::Qwen2Moe => (
                c.positive("moe_intermediate_size")?,
                c.opt_bool("norm_topk_prob")?.unwrap_or(false),
            ),
            Arch::Mixtral => (intermediate, true),
        };
        let sparse_layers = sparse_layers(&c, arch, num_layers, num_experts)?;
        c.check_supported(arch)?;
        let sliding_window = match arch {
            Arch::Mixtral => c.opt_positive("sliding_window")?,
            Arch::Qwen3Moe | Arch::Qwen2Moe => None,
        };
        let (qkv_bias, shared_expert_intermediate) = match arch {
            Arch::Qwen2Moe => (
                c.opt_bool("qkv_bias")?.unwrap_or(true),
                c.opt_usize("shared_expert_intermediate_size")?
                    .filter(|&n| n > 0),
            ),
            Arch::Qwen3Moe | Arch::Mixtral => (false, None),
        };
        Ok(Self {
            arch,
            vocab_size: c.positive("vocab_size")?,
            hidden_size,
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            dense_intermediate: intermediate,
            expert_intermediate,
            num_experts,
            top_k,
            norm_topk_prob,
            rms_norm_eps: c.float("rms_norm_eps")? as f32,
            rope_theta: rope_theta(&c)?,
            sparse_layers,
            tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_positions: c.opt_positive("max_position_embeddings")?.unwrap_or(4096),
            sliding_window,
            qk_norm: arch == Arch::Qwen3Moe,
            qkv_bias,
            shared_expert_intermediate,
            eos_token_ids: eos_ids(&c)?,
        })
    }

    /// Elements of one expert's three matrices.
    pub fn expert_weight_count(&self) -> usize {
        3 * self.hidden_size * self.expert_intermediate
    }

    /// Layers that use experts.
    pub fn num_sparse_layers(&self) -> usize {
        self.sparse_layers.iter().filter(|s| **s).count()
    }
}

/// Query heads, key/value heads and head width (present or derived).
fn attention_heads(
    c: &Fields<'_>,
    hidden_size: usize,
) -> Result<(usize, usize, usize), EngineError> {
    let num_q_heads = c.positive("num_attention_heads")?;
    let num_kv_heads = c
        .opt_positive("num_key_value_heads")?
        .unwrap_or(num_q_heads);
    if num_q_heads % num_kv_heads != 0 {
        return Err(EngineError::config(
            "num_key_value_heads",
            format!("{num_kv_heads} does not divide num_attention_heads {num_q_heads}"),
        ));
    }
    let head_dim = match c.opt_positive("head_dim")? {
        Some(d) => d,
        None if hidden_size % num_q_heads == 0 => hidden_size / num_q_heads,
        None => {
            return Err(EngineError::config(
                "head_dim",
                "absent, and hidden_size is not a multiple of num_attention_heads",
            ));
        }
    };
    if head_dim % 2 != 0 {
        return Err(EngineError::config(
            "head_dim",
            format!("{head_dim} is odd (RoPE)"),
        ));
    }
    Ok((num_q_heads, num_kv_heads, head_dim))
}

/// `num_experts` (Qwen, transformers 4.x) or `num_local_experts`.
fn expert_count(c: &Fields<'_>) -> Result<usize, EngineError> {
    match (
        c.opt_usize("num_experts")?,
        c.opt_usize("num_local_experts")?,
    ) {
        (Some(a), Some(b)) if a != b => Err(EngineError::config(
            "num_experts",
            format!("{a} disagrees with num_local_experts {b}"),
        )),
        (Some(n), _) | (None, Some(n)) => Ok(n),
        (None, None) => Err(EngineError::config(
            "num_experts",
            "missing (neither num_experts nor num_local_experts)",
        )),
    }
}

/// Which layers are sparse: Qwen's `decoder_sparse_step` and
/// `mlp_only_layers` rule (as transformers applies it), every layer for Mixtral.
fn sparse_layers(
    c: &Fields<'_>,
    arch: Arch,
    num_layers: usize,
    num_experts: usize,
) -> Result<Vec<bool>, EngineError> {
    if arch == Arch::Mixtral {
        if num_experts == 0 {
            return Err(EngineError::config("num_local_experts", "must be positive"));
        }
        return Ok(vec![true; num_layers]);
    }
    let step = c.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(EngineError::config(
            "decoder_sparse_step",
            "must be positive",
        ));
    }
    let mut dense_only = vec![false; num_layers];
    if let Some(v) = c.0.get("mlp_only_layers").filter(|v| !v.is_null()) {
        let list = v
            .as_array()
            .ok_or_else(|| EngineError::config("mlp_only_layers", "not a list of layer indices"))?;
        for item in list {
            let i = item
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .filter(|i| *i < num_layers);
            let i = i.ok_or_else(|| {
                EngineError::config("mlp_only_layers", format!("{item} is not a layer index"))
            })?;
            dense_only[i] = true;
        }
    }
    Ok((0..num_layers)
        .map(|i| !dense_only[i] && num_experts > 0 && (i + 1) % step == 0)
        .collect())
}

/// `eos_token_id`: absent, null, one id or a list of ids.
fn eos_ids(c: &Fields<'_>) -> Result<Vec<u32>, EngineError> {
    let bad = || EngineError::config("eos_token_id", "not a token id or a list of ids");
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)
    };
    match c.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

/// `rope_theta` (4.x) or `rope_parameters.rope_theta` (5.x); only the plain
/// ("default") RoPE is supported.
fn rope_theta(c: &Fields<'_>) -> Result<f64, EngineError> {
    if let Some(scaling) = c.0.get("rope_scaling").filter(|v| !v.is_null()) {
        let kind = scaling.get("rope_type").or_else(|| scaling.get("type"));
        if kind.and_then(Value::as_str) != Some("default") {
            return Err(EngineError::config(
                "rope_scaling",
                format!("{scaling} is not supported"),
            ));
        }
    }
    if let Some(params) = c.0.get("rope_parameters").filter(|v| !v.is_null()) {
        let p = params
            .as_object()
            .ok_or_else(|| EngineError::config("rope_parameters", "not an object"))?;
        if let Some(kind) = p.get("rope_type").and_then(Value::as_str) {
            if kind != "default" {
                return Err(EngineError::config(
                    "rope_parameters.rope_type",
                    format!("`{kind}` is not supported (default)"),
                ));
            }
        }
        if let Some(f) = p.get("partial_rotary_factor").and_then(Value::as_f64) {
            if f != 1.0 {
                return Err(EngineError::config(
                    "rope_parameters.partial_rotary_factor",
                    format!("{f} is not supported (1.0)"),
                ));
            }
        }
        if let Some(t) = p.get("rope_theta") {
            return t.as_f64().filter(|t| *t > 0.0).ok_or_else(|| {
                EngineError::config("rope_parameters.rope_theta", "not a positive number")
            });
        }
    }
    c.0.get("rope_theta")
        .and_then(Value::as_f64)
        .filter(|t| *t > 0.0)
        .ok_or_else(|| {
            EngineError::config(
                "rope_theta",
                "missing (neither rope_theta nor rope_parameters.rope_theta)",
            )
        })
}

/// Typed access to the fields of one JSON object.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, field: &str) -> Option<&Value> {
        self.0.get(field).filter(|v| !v.is_null())
    }

    fn str(&self, field: &str) -> Result<&str, EngineError> {
        self.get(field)
            .ok_or_else(|| EngineError::config(field, "missing"))?
            .as_str()
            .ok_or_else(|| EngineError::config(field, "not a string"))
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>, EngineError> {
        self.get(field)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| EngineError::config(field, format!("{v} is not a count")))
            })
            .transpose()
    }

    fn opt_positive(&self, field: &str) -> Result<Option<usize>, EngineError> {
        match self.opt_usize(field)? {
            Some(0) => Err(EngineError::config(field, "must be positive")),
            other => Ok(other),
        }
    }

    fn positive(&self, field: &str) -> Result<usize, EngineError> {
        self.opt_positive(field)?
            .ok_or_else(|| EngineError::config(field, "missing"))
    }

    fn opt_bool(&self, field: &str) -> Result<Option<bool>, EngineError> {
        self.get(field)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| EngineError::config(field, "not a boolean"))
            })
            .transpose()
    }

    fn float(&self, field: &str) -> Result<f64, EngineError> {
        self.get(field)
            .ok_or_else(|| EngineError::config(field, "missing"))?
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| EngineError::config(field, "not a positive number"))
    }

    /// Fields whose presence would change the computation in ways the engine
    /// does not implement.
    fn check_supported(&self, arch: Arch) -> Result<(), EngineError> {
        if let Some(act) = self.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(EngineError::config(
                    "hidden_act",
                    format!("{act} is not supported (silu)"),
                ));
            }
        }
        if self.opt_bool("attention_bias")? == Some(true) {
            return Err(EngineError::config(
                "attention_bias",
                "true is not supported",
            ));
        }
        if arch != Arch::Mixtral && self.opt_bool("use_sliding_window")? == Some(true) {
            return Err(EngineError::config(
                "use_sliding_window",
                "true is not supported",
            ));
        }
        for field in ["n_shared_experts", "shared_expert_intermediate_size"] {
            if field == "shared_expert_intermediate_size" && arch == Arch::Qwen2Moe {
                continue;
            }
            if self.opt_usize(field)?.is_some_and(|n| n > 0) {
                return Err(EngineError::config(
                    field,
                    "shared experts are not supported",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
