//! Qwen4-Exp's MoE block: the router, the routed experts through the
//! expert tier (the next layers' routers hinting it ahead), and the shared
//! expert scaled by `sigmoid(shared_expert_gate . x)`, run while the routed
//! experts' misses are read.

use crate::config::qwen4::Qwen4Config;
use crate::device::{Activation, Device};
use crate::error::EngineError;
use crate::family::ffn::DenseMlp;
use crate::family::route::RouteRule;
use crate::load::weights::Loader;

/// The MoE block's resident part.
pub(super) struct Moe<D: Device> {
    pub(super) router: D::Mat,
    shared: DenseMlp<D>,
    shared_gate: D::Mat,
}

pub(super) fn load_moe<D: Device>(
    l: &Loader<'_, D>,
    cfg: &Qwen4Config,
    p: &str,
) -> Result<Moe<D>, EngineError> {
    let h = cfg.hidden_size;
    Ok(Moe {
        router: l.matrix(&format!("{p}.mlp.gate.weight"), [cfg.num_experts, h])?,
        shared: DenseMlp::load(
            l,
            &format!("{p}.mlp.shared_expert"),
            cfg.shared_intermediate,
            h,
        )?,
        shared_gate: l.matrix_f32(&format!("{p}.mlp.shared_expert_gate.weight"), [1, h])?,
    })
}

/// What one layer's MoE step needs besides its weights.
pub(super) struct MoeStep<'a, D: Device> {
    pub(super) dev: &'a D,
    pub(super) experts: &'a mut D::Experts,
    pub(super) rule: &'a RouteRule,
    pub(super) layer: usize,
    pub(super) hidden: usize,
}

impl<D: Device> Moe<D> {
    /// The block's output for the rows of `x`. Before the routed experts
    /// run, the next layers' routers (`next`, nearest first) are applied
    /// to `x` and their guesses hinted to the tier (pre-gating: it changes
    /// reads, never results); the shared expert runs while the routed
    /// experts' misses are read.
    pub(super) fn forward(
        &self,
        st: &mut MoeStep<'_, D>,
        next: &[&D::Mat],
        x: &D::Act,
    ) -> Result<D::Act, EngineError> {
        let dev = st.dev;
        let (rows, h) = (x.rows(), st.hidden);
        let routes = dev.router(&self.router, x, st.rule, None)?;
        if rows == 1 && dev.hints_wanted(st.experts) {
            for (d, r) in next.iter().enumerate() {
                let guess = dev.router(r, x, st.rule, None)?;
                dev.hint_ahead(st.experts, d + 1, st.layer + d + 1, &guess)?;
            }
        }
        let mut out = dev.zeros(rows, h)?;
        let mut shared = None;
        dev.moe_meanwhile(st.experts, st.layer, x, &routes, &mut out, &mut || {
            let y = self.shared.forward(dev, x, rows, h)?;
            let mut gate = dev.zeros(rows, 1)?;
            dev.linear(&mut gate, &self.shared_gate, x)?;
            shared = Some((y, gate));
            Ok(())
        })?;
        let (y, gate) = shared.ok_or_else(|| EngineError::Layout {
            what: format!("shared expert of layer {}", st.layer),
            reason: "the MoE step never ran it".to_string(),
        })?;
        dev.add_gated(&mut out, &y, &gate)?;
        Ok(out)
    }
}
