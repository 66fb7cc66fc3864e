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
//! chunk), and per expert running at once (at most a few per thread of the
//! pool) a scratch of its rows gathered and two `intermediate`-wide rows
//! per row it serves; a chunk's experts are served at most the pool's
//! capacity at a time.

use std::collections::BTreeMap;

use rayon::prelude::*;

use super::experts::{Meanwhile, PoolExperts};
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
/// into `out` (the same shape). The experts a batch of the tier serves run
/// in parallel, each over all of its rows; then the rows are summed in
/// parallel, each in its own choices' order. `meanwhile` runs once, while
/// the first group of experts is read (before any is computed).
pub(super) fn moe_rows(
    experts: &mut PoolExperts,
    layer: usize,
    x: &[f32],
    routes: &[Vec<(usize, f32)>],
    out: &mut [f32],
    mut meanwhile: Option<&mut Meanwhile<'_>>,
) -> Result<(), EngineError> {
    let h = x.len() / routes.len().max(1);
    // expert -> the rows that chose it, ascending; and for each row's
    // choice, its place among that expert's rows.
    let mut users: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let places: Vec<Vec<usize>> = routes
        .iter()
        .enumerate()
        .map(|(r, chosen)| {
            let places = chosen.iter().map(|(e, _)| {
                let rows = users.entry(*e).or_default();
                rows.push(r);
                rows.len() - 1
            });
            places.collect()
        })
        .collect();
    let ids: Vec<usize> = users.keys().copied().collect();
    // expert -> its rows' outputs (`rows x hidden`), in its rows' order.
    let mut ys: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    for batch in ids.chunks(experts.capacity().max(1)) {
        experts.with_expert_batches(layer, batch, meanwhile.take(), &mut |landed| {
            let done = landed
                .par_iter()
                .map_init(SwigluScratch::default, |scratch, &(pos, view)| {
                    let (e, rows) = batch
                        .get(pos)
                        .and_then(|e| Some((*e, users.get(e)?)))
                        .ok_or_else(|| EngineError::Layout {
                            what: format!("expert request of {} experts", batch.len()),
                            reason: format!("the tier served position {pos}"),
                        })?;
                    Ok((e, scratch.expert_rows(view, x, h, rows)))
                })
                .collect::<Result<Vec<_>, EngineError>>()?;
            ys.extend(done);
            Ok(())
        })?;
    }
    if let Some(m) = meanwhile {
        // No expert to read: nothing to overlap with.
        m()?;
    }
    out.par_chunks_mut(h.max(1))
        .zip(routes.par_iter().zip(&places))
        .try_for_each(|(o, (chosen, places))| {
            o.fill(0.0);
            for ((e, w), &j) in chosen.iter().zip(places) {
                let y = ys
                    .get(e)
                    .and_then(|y| y.get(j * h..(j + 1) * h))
                    .ok_or_else(|| EngineError::Layout {
                        what: format!("expert {e} of layer {layer}"),
                        reason: "the tier never served it".to_string(),
                    })?;
                for (a, v) in o.iter_mut().zip(y) {
                    *a += v * w;
                }
            }
            Ok(())
        })
}

/// Scratch of one SwiGLU: the gate and up activations (side by side per
/// row when the expert's gate and up are one matrix).
#[derive(Default)]
struct SwigluScratch {
    act: Vec<f32>,
    up: Vec<f32>,
    /// The rows an expert serves, gathered.
    xs: Vec<f32>,
}

impl SwigluScratch {
    /// One expert's SwiGLU over `rows` of `x` (`hidden`-wide rows): its
    /// outputs, `rows.len() x hidden`, in the rows' order.
    fn expert_rows(
        &mut self,
        view: ExpertView<'_>,
        x: &[f32],
        hidden: usize,
        rows: &[usize],
    ) -> Vec<f32> {
        let mut xs = std::mem::take(&mut self.xs);
        xs.clear();
        for &r in rows {
            xs.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let mut y = vec![0f32; rows.len() * hidden];
        self.swiglu_rows(&mut y, view, &xs, rows.len());
        self.xs = xs;
        y
    }

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
    use crate::experts::{ExpertRecordLayout, Span};

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
        let layout = ExpertRecordLayout {
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
