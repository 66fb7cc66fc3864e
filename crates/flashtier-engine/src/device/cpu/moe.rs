//! One token's routed experts on the CPU: each chosen expert's SwiGLU
//! (`down(silu(gate x) * up x)`) computed in whatever order the expert tier
//! serves the records, then summed with the routing weights in ascending
//! expert order, so the output does not depend on the order reads land in.
//!
//! A prompt chunk ([`moe_rows`]) serves each expert any row chose once and
//! runs its SwiGLU over all of those rows together, so each weight row is
//! read once per group of tokens; the products are bit-identical to one row
//! at a time, and each row's sum runs in the same order as [`moe_row`]'s.
//!
//! Bounds: one output row of `hidden` f32 per chosen expert (per row of the
//! chunk), and a scratch of two `intermediate`-wide rows per row an expert
//! serves; a chunk's experts are served at most the pool's capacity at a
//! time.

use std::collections::BTreeMap;

use super::experts::PoolExperts;
use super::kernels::{matmul, silu};
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
        scratch.swiglu_rows(y, view.gate, view.up, view.down, x, 1);
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

/// Several rows' routed experts (`x` is `routes.len() x hidden`, row-major),
/// into `out` (the same shape).
pub(super) fn moe_rows(
    experts: &mut PoolExperts,
    layer: usize,
    x: &[f32],
    routes: &[Vec<(usize, f32)>],
    out: &mut [f32],
) -> Result<(), EngineError> {
    let h = x.len() / routes.len().max(1);
    // expert -> (row, position among the row's choices)
    let mut users: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
    for (r, chosen) in routes.iter().enumerate() {
        for (slot, (e, _)) in chosen.iter().enumerate() {
            users.entry(*e).or_default().push((r, slot));
        }
    }
    let mut ys: Vec<Vec<Vec<f32>>> = routes.iter().map(|c| vec![Vec::new(); c.len()]).collect();
    let ids: Vec<usize> = users.keys().copied().collect();
    let mut scratch = SwigluScratch::default();
    for batch in ids.chunks(experts.capacity().max(1)) {
        experts.with_experts(layer, batch, &mut |pos, view| {
            let rows =
                batch
                    .get(pos)
                    .and_then(|e| users.get(e))
                    .ok_or_else(|| EngineError::Layout {
                        what: format!("expert request of {} experts", batch.len()),
                        reason: format!("the tier served position {pos}"),
                    })?;
            let mut xs = Vec::with_capacity(rows.len() * h);
            for &(r, _) in rows {
                xs.extend_from_slice(&x[r * h..(r + 1) * h]);
            }
            let mut y = vec![0f32; rows.len() * h];
            scratch.swiglu_rows(&mut y, view.gate, view.up, view.down, &xs, rows.len());
            for (&(r, slot), yr) in rows.iter().zip(y.chunks_exact(h)) {
                ys[r][slot] = yr.to_vec();
            }
            Ok(())
        })?;
    }
    for ((o, y), chosen) in out.chunks_exact_mut(h).zip(&ys).zip(routes) {
        o.fill(0.0);
        for (yi, (_, w)) in y.iter().zip(chosen) {
            for (a, v) in o.iter_mut().zip(yi) {
                *a += v * w;
            }
        }
    }
    Ok(())
}

/// Scratch of one SwiGLU: the gate and up activations.
#[derive(Default)]
struct SwigluScratch {
    act: Vec<f32>,
    up: Vec<f32>,
}

impl SwigluScratch {
    /// `out = down(silu(gate xs) * up xs)` for `tokens` rows of `xs`;
    /// bit-identical to one row at a time.
    fn swiglu_rows(
        &mut self,
        out: &mut [f32],
        gate: MatRef<'_>,
        up: MatRef<'_>,
        down: MatRef<'_>,
        xs: &[f32],
        tokens: usize,
    ) {
        let h = xs.len() / tokens.max(1);
        let inter = gate.len() / h.max(1);
        self.act.resize(inter * tokens, 0.0);
        self.up.resize(inter * tokens, 0.0);
        matmul(&mut self.act, gate, xs, tokens);
        matmul(&mut self.up, up, xs, tokens);
        for (a, u) in self.act.iter_mut().zip(&self.up) {
            *a = silu(*a) * u;
        }
        matmul(out, down, &self.act, tokens);
    }
}
