//! The tensor list and config.json of a synthetic model, per family.

use flashtier_format::Dtype;
use serde_json::json;

use super::{Init, SynthArch, SynthSpec, SynthTensor};

/// Block size of FP8 weight scales (rows and columns).
const FP8_BLOCK: u64 = 128;

/// Scale of the matrices that write into the residual stream (`o_proj`,
/// `down_proj`) relative to 1/sqrt(fan-in): small, so the residual stays
/// dominated by the token's embedding (see [`SynthSpec::tensors`]).
const RESIDUAL_WRITE_SCALE: f32 = 0.05;

/// Successor shift of the LM head: row `r` is the embedding of token
/// `r + shift` (an odd prime, coprime to every vocabulary size used).
const SUCCESSOR_SHIFT: u64 = 7919;

impl SynthSpec {
    fn matrix(&self, out: &mut Vec<SynthTensor>, name: String, rows: u64, cols: u64) {
        self.scaled_matrix(out, name, rows, cols, 1.0);
    }

    /// A matrix whose output is added to the residual stream.
    fn out_matrix(&self, out: &mut Vec<SynthTensor>, name: String, rows: u64, cols: u64) {
        self.scaled_matrix(out, name, rows, cols, RESIDUAL_WRITE_SCALE);
    }

    fn scaled_matrix(
        &self,
        out: &mut Vec<SynthTensor>,
        name: String,
        rows: u64,
        cols: u64,
        k: f32,
    ) {
        let scale = k / (cols as f32).sqrt();
        out.push(SynthTensor {
            name: name.clone(),
            dtype: self.dtype,
            shape: vec![rows, cols],
            init: Init::Uniform(scale),
        });
        if self.dtype == Dtype::F8E4M3 {
            out.push(SynthTensor {
                name: format!("{name}_scale_inv"),
                dtype: Dtype::F32,
                shape: vec![rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
                init: Init::Scale(scale),
            });
        }
    }

    /// Norms, embeddings and routers: the matrix dtype, or BF16 under FP8.
    fn plain_dtype(&self) -> Dtype {
        if self.dtype == Dtype::F8E4M3 {
            Dtype::Bf16
        } else {
            self.dtype
        }
    }

    fn vector(&self, out: &mut Vec<SynthTensor>, name: String, len: u64, init: Init) {
        out.push(SynthTensor {
            name,
            dtype: self.plain_dtype(),
            shape: vec![len],
            init,
        });
    }

    fn mlp(&self, out: &mut Vec<SynthTensor>, prefix: &str, inter: u64, mixtral: bool) {
        let (g, u, d) = if mixtral {
            ("w1", "w3", "w2")
        } else {
            ("gate_proj", "up_proj", "down_proj")
        };
        self.matrix(out, format!("{prefix}{g}.weight"), inter, self.hidden);
        self.matrix(out, format!("{prefix}{u}.weight"), inter, self.hidden);
        self.out_matrix(out, format!("{prefix}{d}.weight"), self.hidden, inter);
    }

    /// DeepSeek-V3's latent attention dimensions for this spec:
    /// `(q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v)`.
    pub(crate) fn mla_dims(&self) -> (u64, u64, u64, u64, u64) {
        let d = self.head_dim;
        let rope = (d / 2).max(2) & !1;
        // DeepSeek-V3's ratio: q_lora_rank 1536 of hidden 7168.
        let q_lora = (self.hidden * 3 / 14).div_ceil(16).max(1) * 16;
        let kv_lora = (4 * d).min(self.hidden / 2).max(8);
        (q_lora, kv_lora, d, rope, d)
    }

    fn mla(&self, out: &mut Vec<SynthTensor>, p: &str) {
        let (q_lora, kv_lora, nope, rope, v) = self.mla_dims();
        let heads = u64::from(self.heads);
        let a = format!("{p}self_attn.");
        self.matrix(out, format!("{a}q_a_proj.weight"), q_lora, self.hidden);
        self.vector(
            out,
            format!("{a}q_a_layernorm.weight"),
            q_lora,
            Init::NearOne(0.05),
        );
        self.matrix(
            out,
            format!("{a}q_b_proj.weight"),
            heads * (nope + rope),
            q_lora,
        );
        self.matrix(
            out,
            format!("{a}kv_a_proj_with_mqa.weight"),
            kv_lora + rope,
            self.hidden,
        );
        self.vector(
            out,
            format!("{a}kv_a_layernorm.weight"),
            kv_lora,
            Init::NearOne(0.05),
        );
        self.matrix(
            out,
            format!("{a}kv_b_proj.weight"),
            heads * (nope + v),
            kv_lora,
        );
        self.out_matrix(out, format!("{a}o_proj.weight"), self.hidden, heads * v);
    }

    fn attention(&self, out: &mut Vec<SynthTensor>, p: &str) {
        if self.arch == SynthArch::DeepSeek {
            return self.mla(out, p);
        }
        let q = u64::from(self.heads) * self.head_dim;
        let kv = u64::from(self.kv_heads) * self.head_dim;
        self.matrix(out, format!("{p}self_attn.q_proj.weight"), q, self.hidden);
        self.matrix(out, format!("{p}self_attn.k_proj.weight"), kv, self.hidden);
        self.matrix(out, format!("{p}self_attn.v_proj.weight"), kv, self.hidden);
        self.out_matrix(out, format!("{p}self_attn.o_proj.weight"), self.hidden, q);
        match self.arch {
            SynthArch::Qwen3Moe => {
                self.vector(
                    out,
                    format!("{p}self_attn.q_norm.weight"),
                    self.head_dim,
                    Init::NearOne(0.05),
                );
                self.vector(
                    out,
                    format!("{p}self_attn.k_norm.weight"),
                    self.head_dim,
                    Init::NearOne(0.05),
                );
            }
            SynthArch::Qwen2Moe => {
                for (n, len) in [("q", q), ("k", kv), ("v", kv)] {
                    self.vector(
                        out,
                        format!("{p}self_attn.{n}_proj.bias"),
                        len,
                        Init::Uniform(0.02),
                    );
                }
            }
            SynthArch::Mixtral | SynthArch::DeepSeek => {}
        }
    }

    fn router(&self, out: &mut Vec<SynthTensor>, name: String, rows: u64) {
        let scale = 1.0 / (self.hidden as f32).sqrt();
        out.push(SynthTensor {
            name,
            dtype: self.plain_dtype(),
            shape: vec![rows, self.hidden],
            init: Init::Uniform(scale),
        });
    }

    /// The tensors of decoder layer `layer`, in file order.
    pub(super) fn layer_tensors(&self, layer: u32) -> Vec<SynthTensor> {
        let p = format!("model.layers.{layer}.");
        let mut out = Vec::new();
        self.vector(
            &mut out,
            format!("{p}input_layernorm.weight"),
            self.hidden,
            Init::NearOne(0.05),
        );
        self.attention(&mut out, &p);
        self.vector(
            &mut out,
            format!("{p}post_attention_layernorm.weight"),
            self.hidden,
            Init::NearOne(0.05),
        );
        let experts = u64::from(self.experts);
        match self.arch {
            SynthArch::Mixtral => {
                self.router(
                    &mut out,
                    format!("{p}block_sparse_moe.gate.weight"),
                    experts,
                );
                for e in 0..self.experts {
                    self.mlp(
                        &mut out,
                        &format!("{p}block_sparse_moe.experts.{e}."),
                        self.intermediate,
                        true,
                    );
                }
            }
            SynthArch::DeepSeek if layer < self.leading_dense() => {
                self.mlp(
                    &mut out,
                    &format!("{p}mlp."),
                    self.dense_intermediate,
                    false,
                );
            }
            _ => {
                self.router(&mut out, format!("{p}mlp.gate.weight"), experts);
                if self.arch == SynthArch::DeepSeek {
                    let name = format!("{p}mlp.gate.e_score_correction_bias");
                    out.push(SynthTensor {
                        name,
                        dtype: Dtype::F32,
                        shape: vec![experts],
                        init: Init::Uniform(0.01),
                    });
                }
                for e in 0..self.experts {
                    self.mlp(
                        &mut out,
                        &format!("{p}mlp.experts.{e}."),
                        self.intermediate,
                        false,
                    );
                }
                if self.arch == SynthArch::Qwen2Moe {
                    self.mlp(
                        &mut out,
                        &format!("{p}mlp.shared_expert."),
                        self.dense_intermediate,
                        false,
                    );
                    self.router(&mut out, format!("{p}mlp.shared_expert_gate.weight"), 1);
                }
                if self.arch == SynthArch::DeepSeek {
                    self.mlp(
                        &mut out,
                        &format!("{p}mlp.shared_experts."),
                        self.intermediate,
                        false,
                    );
                }
            }
        }
        out
    }

    /// Every tensor of the model, in file order.
    ///
    /// Random weights make greedy decoding collapse into a repeated token,
    /// and a repeated token routes to the same experts every step, which no
    /// real text does. So the synthetic model is a "successor" model: the
    /// residual stream stays dominated by the token's embedding (the
    /// matrices writing into it are small), and LM head row `r` is the
    /// embedding of token `r + SUCCESSOR_SHIFT`, so the greedy next token of
    /// `t` is `t - SUCCESSOR_SHIFT` (mod vocab): tokens never repeat within a
    /// vocabulary's worth of steps and routing follows the token, as it does
    /// for real text. The layers still compute everything a real one does.
    #[must_use]
    pub fn tensors(&self) -> Vec<SynthTensor> {
        let mut out = Vec::new();
        let embed = "model.embed_tokens.weight";
        let embed_init = Init::Uniform(1.0);
        out.push(SynthTensor {
            name: embed.into(),
            dtype: self.plain_dtype(),
            shape: vec![self.vocab, self.hidden],
            init: embed_init,
        });
        for l in 0..self.layers {
            out.extend(self.layer_tensors(l));
        }
        self.vector(
            &mut out,
            "model.norm.weight".into(),
            self.hidden,
            Init::NearOne(0.05),
        );
        out.push(SynthTensor {
            name: "lm_head.weight".into(),
            dtype: self.plain_dtype(),
            shape: vec![self.vocab, self.hidden],
            init: Init::ShiftedRows {
                scale: 1.0,
                of: flashtier_format::xxh3_64(embed.as_bytes()),
                shift: SUCCESSOR_SHIFT % self.vocab.max(1),
                rows: self.vocab,
                cols: self.hidden,
            },
        });
        out
    }
}

/// The config.json of `spec`, with the fields the family's HF config reads.
#[must_use]
pub fn config_json(spec: &SynthSpec) -> serde_json::Value {
    let torch_dtype = match spec.dtype {
        Dtype::F16 => "float16",
        Dtype::F32 => "float32",
        _ => "bfloat16",
    };
    let mut c = json!({
        "model_type": spec.arch.model_type(),
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "num_experts_per_tok": spec.experts_per_token,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "torch_dtype": torch_dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "flashtier_synthetic": { "seed": spec.seed, "note": "synthetic weights generated by flashtier; not a trained model" },
    });
    let mla = spec.mla_dims();
    let extra = match spec.arch {
        SynthArch::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "num_experts": spec.experts,
            "moe_intermediate_size": spec.intermediate, "intermediate_size": spec.dense_intermediate,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
            "attention_bias": false, "use_sliding_window": false, "sliding_window": null,
            "max_window_layers": spec.layers, "router_aux_loss_coef": 0.001, "output_router_logits": false,
        }),
        SynthArch::Qwen2Moe => json!({
            "architectures": ["Qwen2MoeForCausalLM"], "num_experts": spec.experts,
            "moe_intermediate_size": spec.intermediate, "intermediate_size": spec.dense_intermediate,
            "shared_expert_intermediate_size": spec.dense_intermediate, "norm_topk_prob": false,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "use_sliding_window": false,
            "sliding_window": null, "max_window_layers": spec.layers, "router_aux_loss_coef": 0.001,
        }),
        SynthArch::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"], "num_local_experts": spec.experts,
            "intermediate_size": spec.intermediate, "rms_norm_eps": 1e-5, "sliding_window": null,
            "router_aux_loss_coef": 0.02, "output_router_logits": false,
        }),
        SynthArch::DeepSeek => json!({
            "architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": spec.experts, "n_shared_experts": 1,
            "num_key_value_heads": spec.heads, "q_lora_rank": mla.0, "kv_lora_rank": mla.1,
            "qk_nope_head_dim": mla.2, "qk_rope_head_dim": mla.3, "v_head_dim": mla.4,
            "rope_interleave": true, "attention_bias": false,
            "moe_intermediate_size": spec.intermediate, "intermediate_size": spec.dense_intermediate,
            "first_k_dense_replace": spec.leading_dense(), "moe_layer_freq": 1,
            "n_group": spec.expert_groups[0], "topk_group": spec.expert_groups[1],
            "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "norm_topk_prob": true, "rms_norm_eps": 1e-6,
        }),
    };
    if let (Some(c), Some(e)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
        if spec.dtype == Dtype::F8E4M3 {
            c.insert(
                "quantization_config".into(),
                json!({ "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK] }),
            );
        }
    }
    c
}

/// Split `tensors` (in order) into at most `shards` runs of about equal bytes.
pub(super) fn split_shards(tensors: &[SynthTensor], shards: u32) -> Vec<Vec<SynthTensor>> {
    let total: u64 = tensors.iter().map(SynthTensor::len_bytes).sum();
    let per = total.div_ceil(u64::from(shards.max(1))).max(1);
    let mut out: Vec<Vec<SynthTensor>> = vec![Vec::new()];
    let mut in_shard = 0u64;
    for t in tensors {
        let full = in_shard >= per && out.len() < shards as usize;
        if full {
            out.push(Vec::new());
            in_shard = 0;
        }
        in_shard += t.len_bytes();
        if let Some(last) = out.last_mut() {
            last.push(t.clone());
        }
    }
    out
}
