//! `config.json` of a Qwen3-MoE, Qwen2-MoE, Mixtral or DeepSeek-V3
//! checkpoint, in the spellings of transformers 4.x and 5.x.
//!
//! Accepted spellings: `num_experts` or `num_local_experts`; `rope_theta` or
//! `rope_parameters.rope_theta`; `head_dim` present, `null` or absent (then
//! `hidden_size / num_attention_heads`); `decoder_sparse_step` and
//! `mlp_only_layers` (Qwen3-MoE, Qwen2-MoE); `tie_word_embeddings`;
//! Qwen2-MoE's `shared_expert_intermediate_size` and `qkv_bias` (absent in
//! 4.x, where the bias is always there); YaRN RoPE scaling (`rope_scaling`
//! or `rope_parameters` with type `yarn`). Anything the engine would compute
//! differently from transformers (other rope scaling, `attention_bias`, an
//! activation other than SiLU, sliding windows in Qwen, a
//! `quantization_config` other than FP8 E4M3 blocks, DeepSeek-V2's routing)
//! is a [`EngineError::Config`] naming the field.
//!
//! DeepSeek-V3 (`deepseek_v3`): multi-head latent attention (`q_lora_rank`
//! or a plain `q_proj`, `kv_lora_rank`, `qk_nope_head_dim`,
//! `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`), YaRN RoPE from
//! `rope_scaling` (4.x) or `rope_parameters` (5.x) with DeepSeek's
//! `mscale_all_dim` softmax correction, sigmoid routing over `n_group`
//! groups (`topk_group`, `e_score_correction_bias`, `routed_scaling_factor`),
//! `n_shared_experts` ungated shared experts, `first_k_dense_replace` dense
//! layers, and the hub's FP8 (`quantization_config` with `quant_method:
//! fp8`, `weight_block_size`).
//!
//! Bounds: every count is at most [`bounds::MAX_CONFIG_COUNT`] (so the
//! parser's own sums and products of two counts cannot overflow) and
//! `num_hidden_layers` at most [`bounds::MAX_LAYERS`] (the parser keeps a
//! flag per layer); a field of the wrong type says so, "missing" means
//! absent or null. [`bounds::check`] then holds every count against the
//! checkpoint's tensors before any weight is read.

use std::path::Path;

use serde_json::Value;

use crate::error::EngineError;
use deepseek::{fp8_block, mla, routing, shared_experts_width};
use fields::Fields;
use rope::{rope, yarn_mscale};

pub mod bounds;
mod deepseek;
mod fields;
mod rope;

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
    /// `model_type: deepseek_v3` (DeepSeek-V3/R1, Kimi K2 and relatives in
    /// BF16): multi-head latent attention, grouped sigmoid routing, shared
    /// experts, leading dense layers.
    DeepseekV3,
}

/// Multi-head latent attention dimensions (DeepSeek-V3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mla {
    /// Rank of the query's low-rank projection (`None`: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Rank of the compressed key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without RoPE.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dims with RoPE (the key's are shared by all heads).
    pub qk_rope_head_dim: usize,
    /// Per-head value dims.
    pub v_head_dim: usize,
    /// RoPE pairs are interleaved `(x0, x1), (x2, x3)...` (DeepSeek's layout).
    pub rope_interleave: bool,
}

impl Mla {
    /// Query/key head width.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How the router turns logits into the chosen experts and their weights.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Softmax over all experts, then the top-k (Qwen, Mixtral).
    Softmax,
    /// DeepSeek-V3: `sigmoid(logits)`; choice by sigmoid plus the
    /// correction bias, only inside the `topk_group` best of `n_group`
    /// groups (a group scores the sum of its two best); weights are the
    /// sigmoids (renormalised with `norm_topk_prob`) times the scaling factor.
    SigmoidGroups {
        /// Expert groups.
        n_group: usize,
        /// Groups a token may choose from.
        topk_group: usize,
        /// Multiplies the routed experts' weights.
        routed_scaling_factor: f32,
    },
}

/// YaRN RoPE scaling (`rope_type: yarn`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor.
    pub factor: f64,
    /// Context length of pretraining.
    pub original_max_positions: f64,
    /// Ramp boundaries (rotations).
    pub beta_fast: f64,
    /// Ramp boundaries (rotations).
    pub beta_slow: f64,
    /// Round the ramp's boundaries outwards (transformers' `truncate`).
    pub truncate: bool,
    /// Scale of cos and sin.
    pub attention_factor: f64,
    /// DeepSeek's softmax correction: `mscale_all_dim` (0 = none).
    pub mscale_all_dim: f64,
}

impl Arch {
    /// Tensor-name stem of the sparse MLP block in hub checkpoints.
    pub fn moe_block_name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::DeepseekV3 => "mlp",
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
    /// Key/value heads (GQA: `num_q_heads` is a multiple; with MLA, one per
    /// query head).
    pub num_kv_heads: usize,
    /// Width of one head in the KV cache (with MLA, the wider of the
    /// query/key and value heads; the narrower is zero-padded).
    pub head_dim: usize,
    /// Dims of a head that RoPE rotates (`head_dim`, or MLA's rope part).
    pub rope_dim: usize,
    /// YaRN scaling of RoPE, if any.
    pub yarn: Option<Yarn>,
    /// Multi-head latent attention (DeepSeek-V3).
    pub mla: Option<Mla>,
    /// How experts are chosen.
    pub routing: Routing,
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
    /// Width of the shared expert every token also runs (Qwen2-MoE,
    /// DeepSeek-V3: `n_shared_experts * moe_intermediate_size`), if any.
    pub shared_expert_intermediate: Option<usize>,
    /// Whether the shared expert is scaled by `sigmoid(shared_expert_gate · x)`
    /// (Qwen2-MoE) or added as is (DeepSeek-V3).
    pub shared_expert_gated: bool,
    /// FP8 block quantization (`quantization_config.weight_block_size`):
    /// matrices stored as E4M3 codes with a float32 `weight_scale_inv` per
    /// block are dequantized exactly; activations stay f32.
    pub fp8_block: Option<[usize; 2]>,
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
            "deepseek_v3" => Arch::DeepseekV3,
            other => {
                return Err(EngineError::config(
                    "model_type",
                    format!(
                        "`{other}` is not supported (qwen3_moe, qwen2_moe, mixtral, deepseek_v3)"
                    ),
                ));
            }
        };
        let hidden_size = c.positive("hidden_size")?;
        let num_layers = c.positive("num_hidden_layers")?;
        if num_layers > bounds::MAX_LAYERS {
            return Err(EngineError::config(
                "num_hidden_layers",
                format!(
                    "{num_layers} is over the limit of {} layers",
                    bounds::MAX_LAYERS
                ),
            ));
        }
        let mla = match arch {
            Arch::DeepseekV3 => Some(mla(&c)?),
            _ => None,
        };
        let (num_q_heads, num_kv_heads, head_dim, rope_dim) = match &mla {
            Some(m) => {
                let heads = c.positive("num_attention_heads")?;
                if let Some(kv) = c.opt_positive("num_key_value_heads")? {
                    if kv != heads {
                        return Err(EngineError::config(
                            "num_key_value_heads",
                            format!(
                                "{kv}: latent attention expands one key/value head per query head ({heads})"
                            ),
                        ));
                    }
                }
                let d = m.qk_head_dim().max(m.v_head_dim);
                (heads, heads, d, m.qk_rope_head_dim)
            }
            None => {
                let (q, kv, d) = attention_heads(&c, hidden_size)?;
                (q, kv, d, d)
            }
        };
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
            Arch::DeepseekV3 => (
                c.positive("moe_intermediate_size")?,
                c.opt_bool("norm_topk_prob")?.unwrap_or(true),
            ),
            Arch::Mixtral => (intermediate, true),
        };
        let routing = match arch {
            Arch::DeepseekV3 => routing(&c, num_experts, top_k)?,
            _ => Routing::Softmax,
        };
        let sparse_layers = sparse_layers(&c, arch, num_layers, num_experts)?;
        c.check_supported(arch)?;
        let sliding_window = match arch {
            Arch::Mixtral => c.opt_positive("sliding_window")?,
            Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::DeepseekV3 => None,
        };
        let (qkv_bias, shared_expert_intermediate) = match arch {
            Arch::Qwen2Moe => (
                c.opt_bool("qkv_bias")?.unwrap_or(true),
                c.opt_usize("shared_expert_intermediate_size")?
                    .filter(|&n| n > 0),
            ),
            Arch::DeepseekV3 => (false, shared_experts_width(&c, expert_intermediate)?),
            Arch::Qwen3Moe | Arch::Mixtral => (false, None),
        };
        let (rope_theta, yarn) = rope(&c)?;
        Ok(Self {
            arch,
            vocab_size: c.positive("vocab_size")?,
            hidden_size,
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            yarn,
            mla,
            routing,
            dense_intermediate: intermediate,
            expert_intermediate,
            num_experts,
            top_k,
            norm_topk_prob,
            rms_norm_eps: c.float("rms_norm_eps")? as f32,
            rope_theta,
            sparse_layers,
            tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_positions: c.opt_positive("max_position_embeddings")?.unwrap_or(4096),
            sliding_window,
            qk_norm: arch == Arch::Qwen3Moe,
            qkv_bias,
            shared_expert_intermediate,
            shared_expert_gated: arch == Arch::Qwen2Moe,
            fp8_block: fp8_block(&c)?,
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

    /// RoPE's inverse frequencies over `rope_dim`, in f32 as transformers
    /// computes them (plain, or YaRN's blend of interpolated and
    /// extrapolated frequencies).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.rope_dim;
        let base = self.rope_theta as f32;
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(y) = &self.yarn else {
            return pos_freqs.iter().map(|p| 1.0 / p).collect();
        };
        let correction_dim = |rotations: f64| {
            (dim as f64
                * (y.original_max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln())
                / (2.0 * self.rope_theta.ln())
        };
        let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
        if y.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        pos_freqs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let inter = 1.0 / (y.factor as f32 * p);
                let extra = 1.0 / p;
                inter * (1.0 - extrapolation) + extra * extrapolation
            })
            .collect()
    }

    /// Scale of RoPE's cos and sin (YaRN's attention factor, else 1).
    pub fn rope_attention_factor(&self) -> f32 {
        self.yarn
            .as_ref()
            .map_or(1.0, |y| y.attention_factor as f32)
    }

    /// The softmax scale of attention: `1 / sqrt(query/key head width)`,
    /// times DeepSeek's YaRN correction `mscale(factor, mscale_all_dim)^2`.
    pub fn attention_scale(&self) -> f64 {
        let qk = self.mla.as_ref().map_or(self.head_dim, Mla::qk_head_dim);
        let base = (qk as f64).powf(-0.5);
        match (&self.mla, &self.yarn) {
            (Some(_), Some(y)) if y.mscale_all_dim != 0.0 => {
                let m = yarn_mscale(y.factor, y.mscale_all_dim);
                base * m * m
            }
            _ => base,
        }
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

/// `num_experts` (Qwen, transformers 4.x), `num_local_experts` or
/// `n_routed_experts` (DeepSeek).
fn expert_count(c: &Fields<'_>) -> Result<usize, EngineError> {
    match (
        c.opt_usize("num_experts")?,
        c.opt_usize("num_local_experts")?
            .or(c.opt_usize("n_routed_experts")?),
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
    if arch == Arch::DeepseekV3 {
        if num_experts == 0 {
            return Err(EngineError::config("n_routed_experts", "must be positive"));
        }
        let dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
        return Ok((0..num_layers).map(|i| i >= dense).collect());
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

#[cfg(test)]
mod tests;
