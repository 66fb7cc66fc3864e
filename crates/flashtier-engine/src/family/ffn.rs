//! The feed-forward half of a decoder layer: a dense SwiGLU, or the sparse
//! MoE block (router, routed experts from the expert tier, and the shared
//! expert of Qwen2-MoE and DeepSeek-V3).
//!
//! Order of a sparse step, as transformers computes it: router logits ->
//! routing (see [`super::route`]) -> the routed experts' weighted sum in
//! ascending expert id -> plus the shared expert (scaled by
//! `sigmoid(shared_expert_gate · x)` for Qwen2-MoE). Before the routed
//! experts run, the next sparse layer's router is applied to this layer's
//! input ("pre-gating") and its guess handed to the tier as a hint.

use crate::config::{ModelConfig, Routing};
use crate::device::{Activation, AddNormTo, Device};
use crate::error::EngineError;
use crate::family::Step;
use crate::load::weights::Loader;

/// A dense SwiGLU: `down(silu(gate x) * up x)`.
pub struct DenseMlp<D: Device> {
    /// `[intermediate, hidden]`.
    pub gate: D::Mat,
    /// `[intermediate, hidden]`.
    pub up: D::Mat,
    /// `[hidden, intermediate]`.
    pub down: D::Mat,
    /// Intermediate width.
    pub width: usize,
}

impl<D: Device> DenseMlp<D> {
    /// Load `{prefix}.gate_proj.weight` and its siblings.
    pub fn load(
        l: &Loader<'_, D>,
        prefix: &str,
        width: usize,
        hidden: usize,
    ) -> Result<Self, EngineError> {
        Ok(Self {
            gate: l.matrix(&format!("{prefix}.gate_proj.weight"), [width, hidden])?,
            up: l.matrix(&format!("{prefix}.up_proj.weight"), [width, hidden])?,
            down: l.matrix(&format!("{prefix}.down_proj.weight"), [hidden, width])?,
            width,
        })
    }

    /// The MLP of every row of `x`, added into `to`'s residual stream and
    /// normed.
    pub fn forward_into(
        &self,
        dev: &D,
        x: &D::Act,
        to: AddNormTo<'_, D>,
    ) -> Result<(), EngineError> {
        let rows = x.rows();
        let mut act = dev.zeros(rows, self.width)?;
        let mut up = dev.zeros(rows, self.width)?;
        dev.linear(&mut act, &self.gate, x)?;
        dev.linear(&mut up, &self.up, x)?;
        dev.silu_mul(&mut act, &up)?;
        to.linear(dev, &self.down, &act)
    }

    /// The MLP of every row of `x`.
    pub fn forward(
        &self,
        dev: &D,
        x: &D::Act,
        rows: usize,
        hidden: usize,
    ) -> Result<D::Act, EngineError> {
        let mut act = dev.zeros(rows, self.width)?;
        let mut up = dev.zeros(rows, self.width)?;
        dev.linear(&mut act, &self.gate, x)?;
        dev.linear(&mut up, &self.up, x)?;
        dev.silu_mul(&mut act, &up)?;
        let mut out = dev.zeros(rows, hidden)?;
        dev.linear(&mut out, &self.down, &act)?;
        Ok(out)
    }
}

/// A shared expert every token runs beside the routed ones.
pub struct SharedExpert<D: Device> {
    /// Its SwiGLU.
    pub mlp: DenseMlp<D>,
    /// Qwen2-MoE's `shared_expert_gate` `[1, hidden]` (as f32), if gated.
    pub gate: Option<D::Mat>,
}

/// The sparse MoE block's resident weights.
pub struct SparseMlp<D: Device> {
    /// Router `[num_experts, hidden]`.
    pub router: D::Mat,
    /// DeepSeek-V3's `e_score_correction_bias` `[num_experts]`.
    pub score_bias: Option<D::Vector>,
    /// The shared expert, resident.
    pub shared: Option<SharedExpert<D>>,
}

/// The feed-forward half of a layer.
pub enum Ffn<D: Device> {
    /// Dense SwiGLU (Qwen `mlp_only_layers`, DeepSeek's leading layers).
    Dense(DenseMlp<D>),
    /// Sparse: experts come from the tier.
    Sparse(SparseMlp<D>),
}

impl<D: Device> Ffn<D> {
    /// Load layer `i`'s feed-forward weights under `prefix` (`model.layers.{i}`).
    pub fn load(
        l: &Loader<'_, D>,
        cfg: &ModelConfig,
        i: usize,
        prefix: &str,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        if !cfg.sparse_layers.get(i).copied().unwrap_or(false) {
            return Ok(Ffn::Dense(DenseMlp::load(
                l,
                &format!("{prefix}.mlp"),
                cfg.dense_intermediate,
                h,
            )?));
        }
        let block = cfg.arch.moe_block_name();
        let router = l
            .matrix(
                &format!("{prefix}.{block}.gate.weight"),
                [cfg.num_experts, h],
            )
            .or_else(|e| match e {
                // transformers-5 fused checkpoints keep the router under `mlp`.
                EngineError::MissingTensor { .. } => {
                    l.matrix(&format!("{prefix}.mlp.gate.weight"), [cfg.num_experts, h])
                }
                other => Err(other),
            })?;
        let score_bias = match cfg.routing {
            Routing::SigmoidGroups { .. } => Some(l.vector(
                &format!("{prefix}.mlp.gate.e_score_correction_bias"),
                &[cfg.num_experts],
            )?),
            Routing::Softmax => None,
        };
        let shared = match cfg.shared_expert_intermediate {
            Some(width) if cfg.shared_expert_gated => Some(SharedExpert {
                mlp: DenseMlp::load(l, &format!("{prefix}.mlp.shared_expert"), width, h)?,
                gate: Some(
                    l.matrix_f32(&format!("{prefix}.mlp.shared_expert_gate.weight"), [1, h])?,
                ),
            }),
            Some(width) => Some(SharedExpert {
                mlp: DenseMlp::load(l, &format!("{prefix}.mlp.shared_experts"), width, h)?,
                gate: None,
            }),
            None => None,
        };
        Ok(Ffn::Sparse(SparseMlp {
            router,
            score_bias,
            shared,
        }))
    }
}

impl<D: Device> SparseMlp<D> {
    /// The routing of every row of `x` by this block's router.
    pub fn route(&self, st: &Step<'_, D>, x: &D::Act) -> Result<D::Routes, EngineError> {
        st.dev
            .router(&self.router, x, st.rule, self.score_bias.as_ref())
    }

    /// The block's output for every row of `x` at `layer`, added into
    /// `to`'s residual stream and normed; `next` is the next sparse layer
    /// and its block, whose guess is hinted first.
    pub fn forward(
        &self,
        st: &mut Step<'_, D>,
        layer: usize,
        x: &D::Act,
        next: Option<(usize, &SparseMlp<D>)>,
        to: AddNormTo<'_, D>,
    ) -> Result<(), EngineError> {
        let routes = self.route(st, x)?;
        if let Some((next_layer, block)) = next.filter(|_| st.dev.hints_wanted(st.experts)) {
            let guess = block.route(st, x)?;
            st.dev.hint(st.experts, next_layer, &guess)?;
        }
        let (dev, h) = (st.dev, st.cfg.hidden_size);
        let Some(shared) = &self.shared else {
            let mut out = dev.zeros(st.rows, h)?;
            dev.moe(st.experts, layer, x, &routes, &mut out)?;
            return to.add(dev, &out);
        };
        let mut out = dev.zeros(st.rows, h)?;
        dev.moe(st.experts, layer, x, &routes, &mut out)?;
        let y = shared.mlp.forward(dev, x, st.rows, h)?;
        match &shared.gate {
            Some(g) => {
                let mut gate = dev.zeros(st.rows, 1)?;
                dev.linear(&mut gate, g, x)?;
                dev.add_gated(&mut out, &y, &gate)?;
            }
            None => dev.add(&mut out, &y)?,
        }
        dev.add_norm(to.resid, &out, to.norm, to.eps, to.out)
    }
}
