//! The non-expert weights (embeddings, attention, norms, routers, dense
//! MLPs, LM head), shape-checked against the config and widened to f32.
//! Expert matrices are not loaded here: they come from an
//! [`super::ExpertSource`] one step at a time.

use super::checkpoint::Checkpoint;
use super::config::ModelConfig;
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

/// Qwen2-MoE's shared expert: a dense SwiGLU every token runs, scaled by
/// `sigmoid(gate · x)`.
#[derive(Debug)]
pub struct SharedExpert {
    /// The expert's matrices.
    pub mlp: DenseMlp,
    /// `shared_expert_gate`: `[1, hidden]`, stored as `[hidden]`.
    pub gate: Vec<f32>,
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
        /// The shared expert (Qwen2-MoE), resident.
        shared: Option<SharedExpert>,
    },
}

/// One decoder layer's resident weights.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub input_norm: Vec<f32>,
    /// RMSNorm before the MLP.
    pub post_attention_norm: Vec<f32>,
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
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Self, EngineError> {
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
                    Mlp::Sparse { router, shared } => {
                        router.len() + shared.as_ref().map_or(0, |s| dense(&s.mlp) + s.gate.len())
                    }
                };
                let bias = l
                    .qkv_bias
                    .as_ref()
                    .map_or(0, |b| b.iter().map(Vec::len).sum());
                l.q_proj.len() + l.k_proj.len() + l.v_proj.len() + l.o_proj.len() + mlp + bias
            })
            .sum();
        4 * (self.embed.len() + layer + self.lm_head.as_ref().map_or(0, Vec::len))
    }
}

fn load_layer(ckpt: &Checkpoint, cfg: &ModelConfig, i: usize) -> Result<LayerWeights, EngineError> {
    let h = cfg.hidden_size;
    let d = cfg.head_dim;
    let p = format!("model.layers.{i}");
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
        let shared = match cfg.shared_expert_intermediate {
            Some(inter) => Some(SharedExpert {
                mlp: load_dense(ckpt, &format!("{p}.mlp.shared_expert"), inter, h)?,
                gate: ckpt.load_f32(&format!("{p}.mlp.shared_expert_gate.weight"), &[1, h])?,
            }),
            None => None,
        };
        Mlp::Sparse { router, shared }
    } else {
        Mlp::Dense(load_dense(
            ckpt,
            &format!("{p}.mlp"),
            cfg.dense_intermediate,
            h,
        )?)
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
    Ok(LayerWeights {
        input_norm: ckpt.load_f32(&format!("{p}.input_layernorm.weight"), &[h])?,
        post_attention_norm: ckpt
            .load_f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        q_proj: ckpt.load_f32(&format!("{p}.self_attn.q_proj.weight"), &[q_width, h])?,
        k_proj: ckpt.load_f32(&format!("{p}.self_attn.k_proj.weight"), &[kv_width, h])?,
        v_proj: ckpt.load_f32(&format!("{p}.self_attn.v_proj.weight"), &[kv_width, h])?,
        o_proj: ckpt.load_f32(&format!("{p}.self_attn.o_proj.weight"), &[h, q_width])?,
        q_norm,
        k_norm,
        qkv_bias,
        mlp,
    })
}

/// The SwiGLU under `prefix` (`{prefix}.gate_proj.weight`...).
fn load_dense(
    ckpt: &Checkpoint,
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
