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
//! is a [`crate::EngineError::Config`] naming the field.
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

pub mod bounds;
mod deepseek;
mod fields;
mod parse;
pub mod qwen4;
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
    /// Elements of one expert's three matrices.
    pub fn expert_weight_count(&self) -> usize {
        3 * self.hidden_size * self.expert_intermediate
    }

    /// Layers that use experts.
    pub fn num_sparse_layers(&self) -> usize {
        self.sparse_layers.iter().filter(|s| **s).count()
    }
}

#[cfg(test)]
mod mutation_tests;
#[cfg(test)]
mod tests;
