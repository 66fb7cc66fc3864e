//! The non-expert weights (embeddings, attention, norms, routers, dense
//! MLPs, LM head), shape-checked against the config. Matrices stay in their
//! stored form ([`Matrix`]); norms and biases are widened to f32.
//! Expert matrices are not loaded here: they come from an
//! [`crate::ExpertSource`] one step at a time.

use crate::checkpoint::{Checkpoint, DType, to_f32};
use crate::config::{Mla, ModelConfig, Routing};
use crate::error::EngineError;
use crate::kernels::{MatRef, block_scale, f8_scale_grid};

/// A weight matrix as the checkpoint stores it: BF16/F16/F32 bytes, or FP8
/// E4M3 codes with their F32 block scales. Kept in that form (not widened
/// to f32), so the resident weights take the checkpoint's bytes: half of
/// f32 for BF16, a quarter for FP8. [`Matrix::mat`] hands it to `matvec`.
#[derive(Debug)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: MatrixData,
}

#[derive(Debug)]
enum MatrixData {
    Raw {
        bytes: Vec<u8>,
        dtype: DType,
    },
    F8 {
        codes: Vec<u8>,
        scales: Vec<u8>,
        block: [usize; 2],
    },
}

impl Matrix {
    /// An f32 matrix of `rows x cols` from row-major `values`.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self, EngineError> {
        if values.len() != rows * cols {
            return Err(EngineError::Experts(format!(
                "{} values for a {rows}x{cols} matrix",
                values.len()
            )));
        }
        Ok(Self {
            rows,
            cols,
            data: MatrixData::Raw {
                bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                dtype: DType::F32,
            },
        })
    }

    /// For `matvec`.
    pub fn mat(&self) -> MatRef<'_> {
        match &self.data {
            MatrixData::Raw { bytes, dtype } => MatRef::Raw(bytes, *dtype),
            MatrixData::F8 {
                codes,
                scales,
                block,
            } => MatRef::F8Block {
                codes,
                scales,
                block: *block,
                cols: self.cols,
            },
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `r` widened to f32 (an embedding lookup); `None` past the end.
    pub fn row_f32(&self, r: usize) -> Option<Vec<f32>> {
        if r >= self.rows {
            return None;
        }
        let c = self.cols;
        match &self.data {
            MatrixData::Raw { bytes, dtype } => {
                let w = dtype.size_bytes();
                bytes
                    .get(r * c * w..(r + 1) * c * w)
                    .map(|b| to_f32(b, *dtype))
            }
            MatrixData::F8 {
                codes,
                scales,
                block: [br, bc],
            } => {
                let per_row = c.div_ceil(*bc);
                let row = codes.get(r * c..(r + 1) * c)?;
                Some(
                    row.iter()
                        .enumerate()
                        .map(|(j, &code)| {
                            flashtier::rows::fp8::e4m3_to_f32(code)
                                * block_scale(scales, r / br, j / bc, per_row)
                        })
                        .collect(),
                )
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.data {
            MatrixData::Raw { bytes, .. } => bytes.len(),
            MatrixData::F8 { codes, scales, .. } => codes.len() + scales.len(),
        }
    }
}

/// A dense SwiGLU MLP.
#[derive(Debug)]
pub struct DenseMlp {
    /// `[intermediate, hidden]`.
    pub gate: Matrix,
    /// `[intermediate, hidden]`.
    pub up: Matrix,
    /// `[hidden, intermediate]`.
    pub down: Matrix,
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
        router: Matrix,
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
    pub q_proj: Matrix,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: Matrix,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: Matrix,
    /// `[hidden, q_heads * head_dim]`.
    pub o_proj: Matrix,
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
    Plain(Matrix),
    /// `q_b(rms_norm(q_a x))`: `q_a_proj` `[q_lora_rank, hidden]`,
    /// `q_a_layernorm` `[q_lora_rank]`, `q_b_proj` `[heads * qk_head_dim, q_lora_rank]`.
    LowRank {
        /// `q_a_proj`.
        a: Matrix,
        /// `q_a_layernorm`.
        norm: Vec<f32>,
        /// `q_b_proj`.
        b: Matrix,
    },
}

/// Multi-head latent attention (DeepSeek-V3).
#[derive(Debug)]
pub struct MlaWeights {
    /// The query projection.
    pub q: QueryProj,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a: Matrix,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
    pub kv_b: Matrix,
    /// `o_proj` `[hidden, heads * v_head_dim]`.
    pub o_proj: Matrix,
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
    fn bytes(&self) -> usize {
        match self {
            Self::Gqa(g) => {
                let norms =
                    g.q_norm.as_ref().map_or(0, Vec::len) + g.k_norm.as_ref().map_or(0, Vec::len);
                let bias: usize = g
                    .qkv_bias
                    .as_ref()
                    .map_or(0, |b| b.iter().map(Vec::len).sum());
                g.q_proj.bytes()
                    + g.k_proj.bytes()
                    + g.v_proj.bytes()
                    + g.o_proj.bytes()
                    + 4 * (norms + bias)
            }
            Self::Mla(m) => {
                let q = match &m.q {
                    QueryProj::Plain(q) => q.bytes(),
                    QueryProj::LowRank { a, norm, b } => a.bytes() + 4 * norm.len() + b.bytes(),
                };
                q + m.kv_a.bytes() + 4 * m.kv_a_norm.len() + m.kv_b.bytes() + m.o_proj.bytes()
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
    pub embed: Matrix,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
}

impl ModelWeights {
    /// Load and check every non-expert tensor named as in HF checkpoints.
    pub fn load(checkpoint: &Checkpoint, cfg: &ModelConfig) -> Result<Self, EngineError> {
        let ckpt = &Loader {
            ckpt: checkpoint,
            fp8_block: cfg.fp8_block,
        };
        let h = cfg.hidden_size;
        let embed = ckpt.load_matrix("model.embed_tokens.weight", [cfg.vocab_size, h])?;
        let layers = (0..cfg.num_layers)
            .map(|i| load_layer(ckpt, cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = ckpt.load_f32("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(ckpt.load_matrix("lm_head.weight", [cfg.vocab_size, h])?)
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The LM head matrix (the embedding when tied).
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes held.
    pub fn resident_bytes(&self) -> usize {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let dense = |d: &DenseMlp| d.gate.bytes() + d.up.bytes() + d.down.bytes();
                let mlp = match &l.mlp {
                    Mlp::Dense(d) => dense(d),
                    Mlp::Sparse {
                        router,
                        score_bias,
                        shared,
                    } => {
                        router.bytes()
                            + 4 * score_bias.as_ref().map_or(0, Vec::len)
                            + shared.as_ref().map_or(0, |s| {
                                dense(&s.mlp) + 4 * s.gate.as_ref().map_or(0, Vec::len)
                            })
                    }
                };
                l.attn.bytes() + mlp + 4 * (l.input_norm.len() + l.post_attention_norm.len())
            })
            .sum();
        self.embed.bytes()
            + layer
            + 4 * self.norm.len()
            + self.lm_head.as_ref().map_or(0, Matrix::bytes)
    }
}

/// Reads weights: matrices as stored ([`Matrix`]: BF16/F16/F32 bytes, or
/// FP8 E4M3 codes with their `{name}_scale_inv` F32 block scales), vectors
/// widened to f32.
struct Loader<'a> {
    ckpt: &'a Checkpoint,
    fp8_block: Option<[usize; 2]>,
}

impl Loader<'_> {
    /// Matrix `name` of shape `[rows, cols]`, kept in its stored form
    /// (BF16/F16/F32 bytes, or FP8 codes with their F32 block scales).
    fn load_matrix(&self, name: &str, [rows, cols]: [usize; 2]) -> Result<Matrix, EngineError> {
        let dtype = self.ckpt.expect_shape(name, &[rows, cols])?;
        let data = if dtype == DType::F8E4M3 {
            let Some(block) = self.fp8_block else {
                return Err(EngineError::config(
                    "quantization_config",
                    format!(
                        "tensor `{name}` is F8_E4M3: FP8 needs quantization_config.weight_block_size"
                    ),
                ));
            };
            let scale_name = format!("{name}_scale_inv");
            let sdt = self
                .ckpt
                .expect_shape(&scale_name, &f8_scale_grid(rows, cols, block))?;
            if sdt != DType::F32 {
                return Err(EngineError::TensorDtype {
                    name: scale_name,
                    dtype: format!("{} (FP8 block scales must be F32)", sdt.name()),
                });
            }
            let [sr, sc] = f8_scale_grid(rows, cols, block);
            let scales_len = sr * sc * 4;
            MatrixData::F8 {
                codes: self.ckpt.read_range(name, 0, rows * cols)?,
                scales: self.ckpt.read_range(&scale_name, 0, scales_len)?,
                block,
            }
        } else {
            MatrixData::Raw {
                bytes: self
                    .ckpt
                    .read_range(name, 0, rows * cols * dtype.size_bytes())?,
                dtype,
            }
        };
        Ok(Matrix { rows, cols, data })
    }

    /// Vector (or tiny matrix) `name` widened to f32: norms, biases, the
    /// routing bias. FP8 is refused here; FP8 matrices load as [`Matrix`].
    fn load_f32(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, EngineError> {
        self.ckpt.load_f32(name, want)
    }
}

fn load_layer(ckpt: &Loader<'_>, cfg: &ModelConfig, i: usize) -> Result<LayerWeights, EngineError> {
    let h = cfg.hidden_size;
    let p = format!("model.layers.{i}");
    let mlp = if cfg.sparse_layers[i] {
        let router = ckpt
            .load_matrix(
                &format!("{p}.{}.gate.weight", cfg.arch.moe_block_name()),
                [cfg.num_experts, h],
            )
            .or_else(|e| match e {
                // transformers-5 fused checkpoints keep the router under `mlp`.
                EngineError::MissingTensor { .. } => {
                    ckpt.load_matrix(&format!("{p}.mlp.gate.weight"), [cfg.num_experts, h])
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
        q_proj: ckpt.load_matrix(&format!("{p}.self_attn.q_proj.weight"), [q_width, h])?,
        k_proj: ckpt.load_matrix(&format!("{p}.self_attn.k_proj.weight"), [kv_width, h])?,
        v_proj: ckpt.load_matrix(&format!("{p}.self_attn.v_proj.weight"), [kv_width, h])?,
        o_proj: ckpt.load_matrix(&format!("{p}.self_attn.o_proj.weight"), [h, q_width])?,
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
            a: ckpt.load_matrix(&format!("{a}.q_a_proj.weight"), [r, h])?,
            norm: ckpt.load_f32(&format!("{a}.q_a_layernorm.weight"), &[r])?,
            b: ckpt.load_matrix(
                &format!("{a}.q_b_proj.weight"),
                [heads * m.qk_head_dim(), r],
            )?,
        },
        None => QueryProj::Plain(
            ckpt.load_matrix(&format!("{a}.q_proj.weight"), [heads * m.qk_head_dim(), h])?,
        ),
    };
    Ok(MlaWeights {
        q,
        kv_a: ckpt.load_matrix(
            &format!("{a}.kv_a_proj_with_mqa.weight"),
            [m.kv_lora_rank + m.qk_rope_head_dim, h],
        )?,
        kv_a_norm: ckpt.load_f32(&format!("{a}.kv_a_layernorm.weight"), &[m.kv_lora_rank])?,
        kv_b: ckpt.load_matrix(
            &format!("{a}.kv_b_proj.weight"),
            [heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
        )?,
        o_proj: ckpt.load_matrix(&format!("{a}.o_proj.weight"), [h, heads * m.v_head_dim])?,
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
        gate: ckpt.load_matrix(&format!("{prefix}.gate_proj.weight"), [inter, h])?,
        up: ckpt.load_matrix(&format!("{prefix}.up_proj.weight"), [inter, h])?,
        down: ckpt.load_matrix(&format!("{prefix}.down_proj.weight"), [h, inter])?,
    })
}
