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
use crate::experts::ExpertView;

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
        scratch.swiglu_rows(y, view, x, 1);
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
            scratch.swiglu_rows(&mut y, view, &xs, rows.len());
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

/// Scratch of one SwiGLU: the gate and up activations (side by side per
/// row when the expert's gate and up are one matrix).
#[derive(Default)]
struct SwigluScratch {
    act: Vec<f32>,
    up: Vec<f32>,
}

impl SwigluScratch {
    /// `out = down(silu(gate xs) * up xs)` for `tokens` rows of `xs`;
    /// bit-identical to one row at a time, and with gate and up as one
    /// matrix or two.
    fn swiglu_rows(&mut self, out: &mut [f32], view: ExpertView<'_>, xs: &[f32], tokens: usize) {
        let h = xs.len() / tokens.max(1);
        let inter = view.gate.len() / h.max(1);
        self.act.resize(inter * tokens, 0.0);
        match view.gate_up {
            // One token reads the same bytes either way; a chunk's rows take
            // one product (one dispatch, one rearranged copy of the rows).
            Some(gate_up) if tokens > 1 => {
                self.up.resize(2 * inter * tokens, 0.0);
                matmul(&mut self.up, gate_up, xs, tokens);
                for (a, gu) in self
                    .act
                    .chunks_exact_mut(inter)
                    .zip(self.up.chunks_exact(2 * inter))
                {
                    let (g, u) = gu.split_at(inter);
                    for ((a, g), u) in a.iter_mut().zip(g).zip(u) {
                        *a = silu(*g) * u;
                    }
                }
            }
            _ => {
                self.up.resize(inter * tokens, 0.0);
                matmul(&mut self.act, view.gate, xs, tokens);
                matmul(&mut self.up, view.up, xs, tokens);
                for (a, u) in self.act.iter_mut().zip(&self.up) {
                    *a = silu(*a) * u;
                }
            }
        }
        matmul(out, view.down, &self.act, tokens);
    }
}

#[cfg(test)]
mod tests {
    use flashtier_format::Dtype;

    use super::*;
    use crate::experts::{RecordLayout, Span};

    /// Gate and up taken as one matrix give the bits of two products, for
    /// one token and for chunks with every token remainder.
    #[test]
    fn gate_and_up_as_one_matrix_keep_the_bits() {
        let (h, i) = (96, 40);
        let n = i * h * 2;
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let record: Vec<u8> = (0..3 * i * h)
            .flat_map(|_| half::bf16::from_f32(next()).to_le_bytes())
            .collect();
        let layout = RecordLayout {
            matrices: [0, n, 2 * n].map(|offset| Span { offset, len: n }),
            dtype: Dtype::Bf16,
            fp8: None,
            hidden: h,
            intermediate: i,
        };
        let view = layout.view(&record).expect("view");
        assert!(view.gate_up.is_some());
        let apart = ExpertView {
            gate_up: None,
            ..view
        };
        for tokens in [1, 2, 5, 7, 9] {
            let xs: Vec<f32> = (0..tokens * h).map(|_| next()).collect();
            let (mut one, mut two) = (vec![0f32; tokens * h], vec![0f32; tokens * h]);
            SwigluScratch::default().swiglu_rows(&mut one, view, &xs, tokens);
            SwigluScratch::default().swiglu_rows(&mut two, apart, &xs, tokens);
            assert_eq!(one, two, "{tokens} tokens");
            assert!(one.iter().any(|v| *v != 0.0));
        }
    }
}
