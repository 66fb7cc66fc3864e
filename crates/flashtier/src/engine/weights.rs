//! The non-expert weights (embeddings, attention, norms, routers, dense
//! MLPs, LM head), shape-checked against the config and widened to f32.
//! Expert matrices are not loaded here: they come from an
//! [`super::ExpertSource`] one step at a time.

use super::checkpoint::{Checkpoint, DType};
use super::config::{Mla, ModelConfig, Routing};
use super::error::EngineError;

/// A dense SwiGLU MLP.
#[derive(Debug)]
pub struct DenseMlp {
    /// `[intermediate, hidden]`.
    pub gate: Vec<f32>,
    /// `[intermediate, hidden]`.
    pub up: Vec<f32>,
    /// `[hidden, intermediate]`.
    pub down: Vec<f32>,
}

/// A shared expert: a dense SwiGLU every token runs beside the routed
/// experts, scaled by `sigmoid(gate · x)` (Qwen2-MoE) or not (DeepSeek-V3).
#[derive(Debug)]
pub struct SharedExpert {
    /// The expert's matrices.
    pub mlp: DenseMlp,
    /// Qwen2-MoE's `shared_expert_gate`: `[1, hidden]`, stored as `[hidden]`.
    pub gate: Option<Vec<f32>>,
}

/// The feed-forward half of a layer.
#[derive(Debug)]
pub enum Mlp {
    /// Dense SwiGLU (Qwen `mlp_only_layers`, `decoder_sparse_step`).
    Dense(DenseMlp),
    /// Sparse: the router `[num_experts, hidden]`; experts come from the source.
    Sparse {
        /// Router weight.
        router: Vec<f32>,
        /// DeepSeek-V3's `e_score_correction_bias` `[num_experts]`.
        score_bias: Option<Vec<f32>>,
        /// The shared expert (Qwen2-MoE, DeepSeek-V3), resident.
        shared: Option<SharedExpert>,
    },
}

/// Grouped-query attention (Qwen, Mixtral).
#[derive(Debug)]
pub struct GqaWeights {
    /// `[q_heads * head_dim, hidden]`.
    pub q_proj: Vec<f32>,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: Vec<f32>,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: Vec<f32>,
    /// `[hidden, q_heads * head_dim]`.
    pub o_proj: Vec<f32>,
    /// Qwen3 per-head query norm `[head_dim]`.
    pub q_norm: Option<Vec<f32>>,
    /// Qwen3 per-head key norm `[head_dim]`.
    pub k_norm: Option<Vec<f32>>,
    /// Qwen2-MoE projection biases: query `[q_heads * head_dim]`, key and
    /// value `[kv_heads * head_dim]`.
    pub qkv_bias: Option<[Vec<f32>; 3]>,
}

/// The query projection of latent attention.
#[derive(Debug)]
pub enum QueryProj {
    /// `q_proj` `[heads * qk_head_dim, hidden]`.
    Plain(Vec<f32>),
    /// `q_b(rms_norm(q_a x))`: `q_a_proj` `[q_lora_rank, hidden]`,
    /// `q_a_layernorm` `[q_lora_rank]`, `q_b_proj` `[heads * qk_head_dim, q_lora_rank]`.
    LowRank {
        /// `q_a_proj`.
        a: Vec<f32>,
        /// `q_a_layernorm`.
        norm: Vec<f32>,
        /// `q_b_proj`.
        b: Vec<f32>,
    },
}

/// Multi-head latent attention (DeepSeek-V3).
#[derive(Debug)]
pub struct MlaWeights {
    /// The query projection.
    pub q: QueryProj,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a: Vec<f32>,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
    pub kv_b: Vec<f32>,
    /// `o_proj` `[hidden, heads * v_head_dim]`.
    pub o_proj: Vec<f32>,
}

/// The attention half of a layer.
#[derive(Debug)]
pub enum AttnWeights {
    /// Grouped-query attention.
    Gqa(GqaWeights),
    /// Multi-head latent attention.
    Mla(MlaWeights),
}

impl AttnWeights {
    fn len(&self) -> usize {
        match self {
            Self::Gqa(g) => {
                let norms =
                    g.q_norm.as_ref().map_or(0, Vec::len) + g.k_norm.as_ref().map_or(0, Vec::len);
                let bias = g
                    .qkv_bias
                    .as_ref()
                    .map_or(0, |b| b.iter().map(Vec::len).sum());
                g.q_proj.len() + g.k_proj.len() + g.v_proj.len() + g.o_proj.len() + norms + bias
            }
            Self::Mla(m) => {
                let q = match &m.q {
                    QueryProj::Plain(q) => q.len(),
                    QueryProj::LowRank { a, norm, b } => a.len() + norm.len() + b.len(),
                };
                q + m.kv_a.len() + m.kv_a_norm.len() + m.kv_b.len() + m.o_proj.len()
            }
        }
    }
}

/// One decoder layer's resident weights.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub input_norm: Vec<f32>,
    /// RMSNorm before the MLP.
    pub post_attention_norm: Vec<f32>,
    /// Attention weights.
    pub attn: AttnWeights,
    /// Feed-forward weights.
    pub mlp: Mlp,
}

/// Every resident weight of the model.
#[derive(Debug)]
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl ModelWeights {
    /// Load and check every non-expert tensor named as in HF checkpoints.
    pub fn load(checkpoint: &Checkpoint, cfg: &ModelConfig) -> Result<Self, EngineError> {
        let ckpt = &Loader {
            ckpt: checkpoint,
            fp8_block: cfg.fp8_block,
        };
        let h = cfg.hidden_size;
        let embed = ckpt.load_f32("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let layers = (0..cfg.num_layers)
            .map(|i| load_layer(ckpt, cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = ckpt.load_f32("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(ckpt.load_f32("lm_head.weight", &[cfg.vocab_size, h])?)
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The LM head matrix (the embedding when tied).
    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// Bytes held.
    pub fn resident_bytes(&self) -> usize {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let dense = |d: &DenseMlp| d.gate.len() + d.up.len() + d.down.len();
                let mlp = match &l.mlp {
                    Mlp::Dense(d) => dense(d),
                    Mlp::Sparse {
                        router,
                        score_bias,
                        shared,
                    } => {
                        router.len()
                            + score_bias.as_ref().map_or(0, Vec::len)
                            + shared
                                .as_ref()
                                .map_or(0, |s| dense(&s.mlp) + s.gate.as_ref().map_or(0, Vec::len))
                    }
                };
                l.attn.len() + mlp
            })
            .sum();
        4 * (self.embed.len() + layer + self.lm_head.as_ref().map_or(0, Vec::len))
    }
}

/// Reads weights as f32: BF16/F16/F32 tensors widened, FP8 E4M3 matrices
/// dequantized exactly with their `{name}_scale_inv` block scales
/// (`code * scale`, as transformers dequantizes).
struct Loader<'a> {
    ckpt: &'a Checkpoint,
    fp8_block: Option<[usize; 2]>,
}

impl Loader<'_> {
    fn load_f32(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, EngineError> {
        let (_, dtype) = self.ckpt.info(name)?;
        if dtype != DType::F8E4M3 {
            return self.ckpt.load_f32(name, want);
        }
        self.ckpt.expect_shape(name, want)?;
        let (&[rows, cols], Some([br, bc])) = (want, self.fp8_block) else {
            return Err(EngineError::config(
                "quantization_config",
                format!(
                    "tensor `{name}` is F8_E4M3 {want:?}: FP8 needs a matrix and \
                     quantization_config.weight_block_size"
                ),
            ));
        };
        let codes = self.ckpt.read_range(name, 0, rows * cols)?;
        let (srows, scols) = (rows.div_ceil(br), cols.div_ceil(bc));
        let scales = self
            .ckpt
            .load_f32(&format!("{name}_scale_inv"), &[srows, scols])?;
        Ok(codes
            .iter()
            .enumerate()
            .map(|(k, &code)| {
                let (r, c) = (k / cols, k % cols);
                crate::rows::fp8::e4m3_to_f32(code) * scales[(r / br) * scols + c / bc]
            })
            .collect())
    }
}

fn load_layer(ckpt: &Loader<'_>, cfg: &ModelConfig, i: usize) -> Result<LayerWeights, EngineError> {
    let h = cfg.hidden_size;
    let p = format!("model.layers.{i}");
    let mlp = if cfg.sparse_layers[i] {
        let router = ckpt
            .load_f32(
                &format!("{p}.{}.gate.weight", cfg.arch.moe_block_name()),
                &[cfg.num_experts, h],
            )
            .or_else(|e| match e {
                // transformers-5 fused checkpoints keep the router under `mlp`.
                EngineError::MissingTensor { .. } => {
                    ckpt.load_f32(&format!("{p}.mlp.gate.weight"), &[cfg.num_experts, h])
                }
                other => Err(other),
            })?;
        let score_bias = match cfg.routing {
            Routing::SigmoidGroups { .. } => Some(ckpt.load_f32(
                &format!("{p}.mlp.gate.e_score_correction_bias"),
                &[cfg.num_experts],
            )?),
            Routing::Softmax => None,
        };
        let shared = match cfg.shared_expert_intermediate {
            Some(inter) if cfg.shared_expert_gated => Some(SharedExpert {
                mlp: load_dense(ckpt, &format!("{p}.mlp.shared_expert"), inter, h)?,
                gate: Some(ckpt.load_f32(&format!("{p}.mlp.shared_expert_gate.weight"), &[1, h])?),
            }),
            Some(inter) => Some(SharedExpert {
                mlp: load_dense(ckpt, &format!("{p}.mlp.shared_experts"), inter, h)?,
                gate: None,
            }),
            None => None,
        };
        Mlp::Sparse {
            router,
            score_bias,
            shared,
        }
    } else {
        Mlp::Dense(load_dense(
            ckpt,
            &format!("{p}.mlp"),
            cfg.dense_intermediate,
            h,
        )?)
    };
    let attn = match &cfg.mla {
        Some(m) => AttnWeights::Mla(load_mla(ckpt, cfg, m, &p)?),
        None => AttnWeights::Gqa(load_gqa(ckpt, cfg, &p)?),
    };
    Ok(LayerWeights {
        input_norm: ckpt.load_f32(&format!("{p}.input_layernorm.weight"), &[h])?,
        post_attention_norm: ckpt
            .load_f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        attn,
        mlp,
    })
}

fn load_gqa(ckpt: &Loader<'_>, cfg: &ModelConfig, p: &str) -> Result<GqaWeights, EngineError> {
    let h = cfg.hidden_size;
    let d = cfg.head_dim;
    let q_width = cfg.num_q_heads * d;
    let kv_width = cfg.num_kv_heads * d;
    let (q_norm, k_norm) = if cfg.qk_norm {
        (
            Some(ckpt.load_f32(&format!("{p}.self_attn.q_norm.weight"), &[d])?),
            Some(ckpt.load_f32(&format!("{p}.self_attn.k_norm.weight"), &[d])?),
        )
    } else {
        (None, None)
    };
    let qkv_bias = if cfg.qkv_bias {
        Some([
            ckpt.load_f32(&format!("{p}.self_attn.q_proj.bias"), &[q_width])?,
            ckpt.load_f32(&format!("{p}.self_attn.k_proj.bias"), &[kv_width])?,
            ckpt.load_f32(&format!("{p}.self_attn.v_proj.bias"), &[kv_width])?,
        ])
    } else {
        None
    };
    Ok(GqaWeights {
        q_proj: ckpt.load_f32(&format!("{p}.self_attn.q_proj.weight"), &[q_width, h])?,
        k_proj: ckpt.load_f32(&format!("{p}.self_attn.k_proj.weight"), &[kv_width, h])?,
        v_proj: ckpt.load_f32(&format!("{p}.self_attn.v_proj.weight"), &[kv_width, h])?,
        o_proj: ckpt.load_f32(&format!("{p}.self_attn.o_proj.weight"), &[h, q_width])?,
        q_norm,
        k_norm,
        qkv_bias,
    })
}

fn load_mla(
    ckpt: &Loader<'_>,
    cfg: &ModelConfig,
    m: &Mla,
    p: &str,
) -> Result<MlaWeights, EngineError> {
    let h = cfg.hidden_size;
    let heads = cfg.num_q_heads;
    let a = format!("{p}.self_attn");
    let q = match m.q_lora_rank {
        Some(r) => QueryProj::LowRank {
            a: ckpt.load_f32(&format!("{a}.q_a_proj.weight"), &[r, h])?,
            norm: ckpt.load_f32(&format!("{a}.q_a_layernorm.weight"), &[r])?,
            b: ckpt.load_f32(
                &format!("{a}.q_b_proj.weight"),
                &[heads * m.qk_head_dim(), r],
            )?,
        },
        None => QueryProj::Plain(
            ckpt.load_f32(&format!("{a}.q_proj.weight"), &[heads * m.qk_head_dim(), h])?,
        ),
    };
    Ok(MlaWeights {
        q,
        kv_a: ckpt.load_f32(
            &format!("{a}.kv_a_proj_with_mqa.weight"),
            &[m.kv_lora_rank + m.qk_rope_head_dim, h],
        )?,
        kv_a_norm: ckpt.load_f32(&format!("{a}.kv_a_layernorm.weight"), &[m.kv_lora_rank])?,
        kv_b: ckpt.load_f32(
            &format!("{a}.kv_b_proj.weight"),
            &[heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
        )?,
        o_proj: ckpt.load_f32(&format!("{a}.o_proj.weight"), &[h, heads * m.v_head_dim])?,
    })
}

/// The SwiGLU under `prefix` (`{prefix}.gate_proj.weight`...).
fn load_dense(
    ckpt: &Loader<'_>,
    prefix: &str,
    inter: usize,
    h: usize,
) -> Result<DenseMlp, EngineError> {
    Ok(DenseMlp {
        gate: ckpt.load_f32(&format!("{prefix}.gate_proj.weight"), &[inter, h])?,
        up: ckpt.load_f32(&format!("{prefix}.up_proj.weight"), &[inter, h])?,
        down: ckpt.load_f32(&format!("{prefix}.down_proj.weight"), &[h, inter])?,
    })
}
