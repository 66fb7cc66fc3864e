//! The products' tasks on rayon's pool: one token's weight rows in tasks of
//! [`ROWS_PER_TASK`] ([`products`]), a prompt chunk's in tasks of the same
//! rows against every token, [`TOKEN_TILE`] tokens at a time
//! ([`grouped`]), and the register block each instruction set takes
//! ([`Blocking`]). The arithmetic is the parent module's: a task only
//! chooses which rows and tokens go through it together.

use pulp::NullaryFnOnce;
use rayon::prelude::*;

use flashtier_format::Dtype;

use super::{
    Bf16, E4m3, F16, F32le, Isa, ROW_BLOCK, ROWS_PER_TASK, TOKEN_TILE, TOKENS, auto_rows,
    block_dots, pairs, row_dots, tile_rows,
};
use crate::matrix::MatRef;

/// A prompt chunk's products: each task takes [`ROWS_PER_TASK`] weight rows
/// against every token and writes its part of each token's output row in
/// place (one slice per token, so no transposition afterwards).
pub(super) fn grouped(
    isa: Isa,
    out: &mut [f32],
    w: &MatRef<'_>,
    xs: &[f32],
    [rows, cols, tokens]: [usize; 3],
) {
    let tasks = rows.div_ceil(ROWS_PER_TASK);
    let mut parts: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::with_capacity(tokens)).collect();
    for token_row in out.chunks_exact_mut(rows) {
        for (part, piece) in parts.iter_mut().zip(token_row.chunks_mut(ROWS_PER_TASK)) {
            part.push(piece);
        }
    }
    let blocking = Blocking::of(isa);
    // AVX-512 widens BF16 in pairs, against activations laid out to match
    // (one copy of them per product).
    let paired = (blocking.is_wide() && matches!(w, MatRef::Raw(_, Dtype::Bf16)))
        .then(|| pairs::pair_lanes(xs, cols));
    let xs = paired.as_deref().unwrap_or(xs);
    parts
        .into_par_iter()
        .enumerate()
        .for_each(|(task, mut outs)| {
            isa.run(Group {
                outs: &mut outs,
                w,
                row0: task * ROWS_PER_TASK,
                xs,
                cols,
                blocking,
                paired: paired.is_some(),
            });
        });
}

/// One token's products: every task of [`ROWS_PER_TASK`] weight rows on the
/// pool, into `out`.
pub(super) fn products(isa: Isa, out: &mut [f32], w: &MatRef<'_>, x: &[f32], cols: usize) {
    out.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, out)| {
            isa.run(Rows {
                out,
                w,
                row0: task * ROWS_PER_TASK,
                x,
                cols,
            });
        });
}

/// One task of one token: weight rows from `row0` against `x`, into `out`.
struct Rows<'a, 'w> {
    out: &'a mut [f32],
    w: &'a MatRef<'w>,
    row0: usize,
    x: &'a [f32],
    cols: usize,
}

impl NullaryFnOnce for Rows<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn call(self) {
        let Rows {
            out,
            w,
            row0,
            x,
            cols,
        } = self;
        // A full task: ROW_BLOCK streams, each over a contiguous run of
        // `step` rows (row `g + k step` in group `g`, stream `k`).
        let step = out.len() / ROW_BLOCK;
        for g in 0..step {
            let got = block_dots::<ROW_BLOCK, 1>(w, row0 + g, step, x, cols);
            for (k, v) in got.iter().enumerate() {
                out[g + k * step] = v[0];
            }
        }
        for (i, o) in out.iter_mut().enumerate().skip(step * ROW_BLOCK) {
            *o = row_dots::<1>(w, row0 + i, x, cols)[0];
        }
    }
}

/// One task of a prompt chunk: weight rows from `row0` against every token,
/// into `outs` (per token, this task's rows of its output).
struct Group<'a, 'o, 'w> {
    outs: &'a mut [&'o mut [f32]],
    w: &'a MatRef<'w>,
    row0: usize,
    xs: &'a [f32],
    cols: usize,
    blocking: Blocking,
    /// `xs` in [`pairs::pair_lanes`] order (AVX-512 and BF16 weights).
    paired: bool,
}

impl NullaryFnOnce for Group<'_, '_, '_> {
    type Output = ();
    #[inline(always)]
    fn call(self) {
        let Group {
            outs,
            w,
            row0,
            xs,
            cols,
            blocking,
            paired,
        } = self;
        // Tokens in tiles of TOKEN_TILE: a tile's activations stay in the
        // core's cache while every row of the task passes over them (all the
        // tokens' activations would be streamed again for every row).
        let mut t0 = 0;
        while t0 < outs.len() {
            let tn = (outs.len() - t0).min(TOKEN_TILE);
            let tile_xs = &xs[t0 * cols..(t0 + tn) * cols];
            let tile_outs = &mut outs[t0..t0 + tn];
            match (*w, blocking) {
                #[cfg(target_arch = "x86_64")]
                (MatRef::Raw(b, Dtype::Bf16), Blocking::Wide(Isa::Avx512(simd))) if paired => {
                    tile_rows::<_, 3, 4>(pairs::PairsV4(simd), tile_outs, b, row0, tile_xs, cols)
                }
                (MatRef::Raw(b, Dtype::Bf16), _) => {
                    auto_rows::<Bf16, 1, 4>(tile_outs, b, row0, tile_xs, cols)
                }
                (MatRef::Raw(b, Dtype::F16), Blocking::Wide(_)) => {
                    auto_rows::<F16, 2, 4>(tile_outs, b, row0, tile_xs, cols)
                }
                (MatRef::Raw(b, Dtype::F16), Blocking::Narrow) => {
                    auto_rows::<F16, 1, 4>(tile_outs, b, row0, tile_xs, cols)
                }
                (MatRef::Raw(b, Dtype::F32), _) => {
                    auto_rows::<F32le, 1, 4>(tile_outs, b, row0, tile_xs, cols)
                }
                (MatRef::Raw(b, Dtype::F8E4M3), _) => {
                    auto_rows::<E4m3, 1, 4>(tile_outs, b, row0, tile_xs, cols)
                }
                _ => token_group(tile_outs, w, row0, tile_xs, cols),
            }
            t0 += tn;
        }
    }
}

/// The register block of a prompt chunk's products on an instruction set:
/// `Wide` where there are 32 vector registers of 16 lanes (AVX-512: BF16 in
/// blocks of 3 rows x 4 tokens, 24 accumulators of two registers, widened
/// in pairs without a shuffle by [`pairs::PairsV4`]; F16, whose
/// widening needs more registers, 2 x 4), `Narrow` (1 row x 4 tokens)
/// elsewhere; F32 and FP8 rows take 1 x 4 everywhere. Measured with `flashtier
/// bench cpu --tokens 16`: 3 x 4 beat 2 x 4, 2 x 6 and 1 x 8 on BF16. The
/// block changes which registers hold what, never the arithmetic.
#[derive(Debug, Clone, Copy)]
enum Blocking {
    /// The instruction set with 32 vector registers.
    Wide(Isa),
    Narrow,
}

impl Blocking {
    fn of(isa: Isa) -> Blocking {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(_) => Blocking::Wide(isa),
            _ => Blocking::Narrow,
        }
    }

    fn is_wide(self) -> bool {
        matches!(self, Blocking::Wide(_))
    }
}

/// Rows `row0..` (as many as each of `outs` holds) against every token,
/// [`TOKENS`] at a time, for any matrix form; `outs` one slice per token.
#[inline(always)]
fn token_group(outs: &mut [&mut [f32]], w: &MatRef<'_>, row0: usize, xs: &[f32], cols: usize) {
    let rows = outs.first().map_or(0, |o| o.len());
    for i in 0..rows {
        let mut t = 0;
        while t < outs.len() {
            if outs.len() - t >= TOKENS {
                let got = row_dots::<TOKENS>(w, row0 + i, &xs[t * cols..], cols);
                for (j, v) in got.iter().enumerate() {
                    outs[t + j][i] = *v;
                }
                t += TOKENS;
            } else {
                outs[t][i] = row_dots::<1>(w, row0 + i, &xs[t * cols..], cols)[0];
                t += 1;
            }
        }
    }
}
