//! One token's routed experts on the CPU: each chosen expert's SwiGLU
//! (`down(silu(gate x) * up x)`) computed in whatever order the expert tier
//! serves the records, then summed with the routing weights in ascending
//! expert order, so the output does not depend on the order reads land in.
//!
//! Bounds: one output row of `hidden` f32 per chosen expert, and one
//! scratch of two `intermediate`-wide rows reused across them.

use super::experts::PoolExperts;
use super::kernels::{matvec, silu};
use crate::error::EngineError;
use crate::matrix::MatRef;

/// One token's routed experts: each expert's output filled in whatever
/// order the tier serves them, summed in ascending expert order.
pub(super) fn moe_row(
    experts: &mut PoolExperts,
    layer: usize,
    x: &[f32],
    chosen: &[(usize, f32)],
) -> Result<Vec<f32>, EngineError> {
    let h = x.len();
    let ids: Vec<usize> = chosen.iter().map(|(e, _)| *e).collect();
    let mut outs = vec![vec![0f32; h]; ids.len()];
    let mut scratch = SwigluScratch::default();
    experts.with_experts(layer, &ids, &mut |pos, view| {
        let y = outs.get_mut(pos).ok_or_else(|| EngineError::Layout {
            what: format!("expert request of {} experts", ids.len()),
            reason: format!("the tier served position {pos}"),
        })?;
        scratch.swiglu(y, view.gate, view.up, view.down, x);
        Ok(())
    })?;
    let mut out = vec![0f32; h];
    for (y, (_, w)) in outs.iter().zip(chosen) {
        for (o, yi) in out.iter_mut().zip(y) {
            *o += yi * w;
        }
    }
    Ok(out)
}

/// Scratch of one SwiGLU: the gate and up activations.
#[derive(Default)]
struct SwigluScratch {
    act: Vec<f32>,
    up: Vec<f32>,
}

impl SwigluScratch {
    /// `out = down(silu(gate x) * up x)`.
    fn swiglu(
        &mut self,
        out: &mut [f32],
        gate: MatRef<'_>,
        up: MatRef<'_>,
        down: MatRef<'_>,
        x: &[f32],
    ) {
        let inter = gate.len() / x.len().max(1);
        self.act.resize(inter, 0.0);
        self.up.resize(inter, 0.0);
        matvec(&mut self.act, gate, x);
        matvec(&mut self.up, up, x);
        for (a, u) in self.act.iter_mut().zip(&self.up) {
            *a = silu(*a) * u;
        }
        matvec(out, down, &self.act);
    }
}
