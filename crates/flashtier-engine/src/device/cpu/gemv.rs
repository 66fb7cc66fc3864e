//! Matrix times vector(s) on the CPU, at memory bandwidth: `out = W x` for
//! one token (decode) and for a few tokens at once (a prompt chunk, where
//! each weight row is read once for up to [`TOKENS`] tokens).
//!
//! Weights stay in their stored form (BF16, F16, F32, FP8 E4M3 with block
//! scales) and widen to f32 in registers; activations and accumulation are
//! f32. Each output is `LANES` fused multiply-add chains over the columns,
//! reduced in a fixed tree, plus a tail chain: the order depends on the
//! shape alone, so the result is bit-identical for every instruction set
//! ([`Isa`]), every thread count, and whether a token is computed alone or
//! in a group (a prompt chunk gives the same bits as decoding its rows one
//! at a time).
//!
//! Threads: rayon's global pool (one persistent pool, sized to the cores),
//! over tasks of [`ROWS_PER_TASK`] weight rows; a group of tokens is taken
//! [`TOKEN_TILE`] at a time so their activations stay in cache. Memory: no
//! allocation for one token; a group of tokens uses one `tokens x rows`
//! transposition buffer per calling thread, kept between calls (bounded by
//! the largest product: a prompt chunk times the widest matrix).

use pulp::NullaryFnOnce;
use rayon::prelude::*;

use flashtier_format::Dtype;
use flashtier_format::fp8::E4M3_TO_F32;

use super::isa::Isa;
use crate::matrix::{MatRef, block_scale};

/// Independent accumulation lanes per output: 2 AVX-512, 4 AVX2 or 8 NEON
/// registers, enough chains to hide the multiply-add latency.
pub const LANES: usize = 32;

/// Weight rows dotted together for one token (eight memory streams).
pub const ROW_BLOCK: usize = 8;

/// Tokens that share one pass over a weight row.
pub const TOKENS: usize = 4;

/// Tokens whose activations a task keeps in cache at once (16 rows of 2048
/// f32 are 128 KiB, within a core's L2).
pub const TOKEN_TILE: usize = 16;

/// Weight rows per rayon task: 16 rows of 2048 BF16 are 64 KiB, small
/// enough to spread a 64-row matrix over cores and large enough that task
/// overhead stays under the arithmetic.
pub const ROWS_PER_TASK: usize = 64;

/// Stored element encodings, widened to f32 exactly.
trait Widen {
    const BYTES: usize;
    fn one(b: &[u8]) -> f32;
}

struct Bf16;
struct F16;
struct F32le;
struct E4m3;

impl Widen for Bf16 {
    const BYTES: usize = 2;
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
    }
}

impl Widen for F16 {
    const BYTES: usize = 2;
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Widen for F32le {
    const BYTES: usize = 4;
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Widen for E4m3 {
    const BYTES: usize = 1;
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        E4M3_TO_F32[usize::from(b[0])]
    }
}

/// IEEE half to single, exact, without branches (so it vectorises): the
/// magnitude bits shifted into place and rescaled by 2^112 cover normals and
/// subnormals; an all-ones exponent becomes infinity or NaN.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let magnitude = f32::from_bits((h & 0x7FFF) << 13) * f32::from_bits(0x7780_0000);
    let special = if h & 0x7C00 == 0x7C00 { 0x7F80_0000 } else { 0 };
    f32::from_bits(magnitude.to_bits() | special | ((h & 0x8000) << 16))
}

/// Sum of the lanes in a fixed tree (halves, then quarters, ...).
#[inline(always)]
fn reduce(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Dot products of `R` stored rows (`cols` elements each, the first at the
/// start of `rows`, each `step` rows after the last) with `T` activation
/// vectors (each `cols` long, `stride` apart in `xs`). Several rows at once
/// keep several memory streams and multiply-add chains in flight; each
/// output's arithmetic is the same as alone.
#[inline(always)]
fn dots<W: Widen, const R: usize, const T: usize>(
    rows: &[u8],
    step: usize,
    xs: &[f32],
    stride: usize,
    cols: usize,
) -> [[f32; T]; R] {
    let row_bytes = cols * W::BYTES;
    let row_step = step * row_bytes;
    let mut acc = [[[0f32; LANES]; T]; R];
    let full = cols / LANES;
    for c in 0..full {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let at = r * row_step + c * LANES * W::BYTES;
            let bytes = &rows[at..at + LANES * W::BYTES];
            let mut w = [0f32; LANES];
            for (l, wl) in w.iter_mut().enumerate() {
                *wl = W::one(&bytes[l * W::BYTES..(l + 1) * W::BYTES]);
            }
            for (t, a) in acc_r.iter_mut().enumerate() {
                let at = t * stride + c * LANES;
                let x = &xs[at..at + LANES];
                for l in 0..LANES {
                    a[l] = w[l].mul_add(x[l], a[l]);
                }
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for (r, (out_r, acc_r)) in out.iter_mut().zip(acc).enumerate() {
        let row = &rows[r * row_step..r * row_step + row_bytes];
        for (t, (o, a)) in out_r.iter_mut().zip(acc_r).enumerate() {
            let mut tail = 0f32;
            for i in full * LANES..cols {
                let w = W::one(&row[i * W::BYTES..(i + 1) * W::BYTES]);
                tail = w.mul_add(xs[t * stride + i], tail);
            }
            *o = reduce(a) + tail;
        }
    }
    out
}

/// Rows `r, r + step, .., r + (R - 1) step`'s dot products with `T`
/// tokens, for any matrix form.
#[inline(always)]
fn block_dots<const R: usize, const T: usize>(
    w: &MatRef<'_>,
    r: usize,
    step: usize,
    xs: &[f32],
    cols: usize,
) -> [[f32; T]; R] {
    match *w {
        MatRef::Raw(b, dt) => {
            let width = dt.size_bytes() as usize;
            let rows = &b[r * cols * width..((r + (R - 1) * step) + 1) * cols * width];
            match dt {
                Dtype::Bf16 => dots::<Bf16, R, T>(rows, step, xs, cols, cols),
                Dtype::F16 => dots::<F16, R, T>(rows, step, xs, cols, cols),
                Dtype::F32 => dots::<F32le, R, T>(rows, step, xs, cols, cols),
                Dtype::F8E4M3 => dots::<E4m3, R, T>(rows, step, xs, cols, cols),
                // Refused by every checked constructor of a matrix; NaN
                // rather than a plausible number if one were built by hand.
                _ => [[f32::NAN; T]; R],
            }
        }
        _ => {
            let mut out = [[0f32; T]; R];
            for (i, o) in out.iter_mut().enumerate() {
                *o = row_dots::<T>(w, r + i * step, xs, cols);
            }
            out
        }
    }
}

/// Row `r`'s dot products with `T` tokens, for any matrix form.
#[inline(always)]
fn row_dots<const T: usize>(w: &MatRef<'_>, r: usize, xs: &[f32], cols: usize) -> [f32; T] {
    match *w {
        MatRef::F32(m) => {
            // The same lanes and tree as the stored forms.
            let mut out = [0f32; T];
            let row = &m[r * cols..(r + 1) * cols];
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot_f32(row, &xs[t * cols..(t + 1) * cols]);
            }
            out
        }
        MatRef::Raw(..) => block_dots::<1, T>(w, r, 1, xs, cols)[0],
        MatRef::F8Block {
            codes,
            scales,
            block: [br, bc],
            ..
        } => {
            let row = &codes[r * cols..(r + 1) * cols];
            let per_row = cols.div_ceil(bc);
            let mut out = [0f32; T];
            for b in 0..per_row {
                let (c0, c1) = (b * bc, ((b + 1) * bc).min(cols));
                let [part] = dots::<E4m3, 1, T>(&row[c0..c1], 1, &xs[c0..], cols, c1 - c0);
                let scale = block_scale(scales, r / br, b, per_row);
                for (o, p) in out.iter_mut().zip(part) {
                    *o += scale * p;
                }
            }
            out
        }
    }
}

/// Dot product of two f32 vectors (the same lanes and tree as the stored
/// forms).
#[inline(always)]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let full = a.len().min(b.len()) / LANES;
    for c in 0..full {
        let (x, y) = (
            &a[c * LANES..(c + 1) * LANES],
            &b[c * LANES..(c + 1) * LANES],
        );
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in a[full * LANES..].iter().zip(&b[full * LANES..]) {
        tail = x.mul_add(*y, tail);
    }
    reduce(acc) + tail
}

/// Dot product of two f32 vectors on the process's instruction set.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    struct Dot<'a>(&'a [f32], &'a [f32]);
    impl NullaryFnOnce for Dot<'_> {
        type Output = f32;
        #[inline(always)]
        fn call(self) -> f32 {
            dot_f32(self.0, self.1)
        }
    }
    Isa::current().run(Dot(a, b))
}

/// `out = W x` for a `out.len() x x.len()` matrix `w`.
///
/// # Panics
/// When `w` does not hold exactly `out.len() * x.len()` elements (a caller
/// bug: shapes are validated when the weights are loaded).
pub fn matvec(out: &mut [f32], w: MatRef<'_>, x: &[f32]) {
    matmul_on(Isa::current(), out, w, x, 1);
}

/// `out[t] = W xs[t]` for `tokens` activation rows of `xs` (row-major,
/// `tokens x cols`) into `out` (`tokens x rows`), each weight row read once
/// per [`TOKENS`] tokens. Bit-identical to [`matvec`] on each row.
///
/// # Panics
/// On inconsistent shapes (a caller bug, as for [`matvec`]).
pub fn matmul(out: &mut [f32], w: MatRef<'_>, xs: &[f32], tokens: usize) {
    matmul_on(Isa::current(), out, w, xs, tokens);
}

/// [`matmul`] on a given instruction set (the tests run each one).
pub fn matmul_on(isa: Isa, out: &mut [f32], w: MatRef<'_>, xs: &[f32], tokens: usize) {
    let tokens = tokens.max(1);
    let cols = xs.len() / tokens;
    let rows = out.len() / tokens;
    assert!(
        cols * tokens == xs.len() && rows * tokens == out.len() && w.len() == rows * cols,
        "matmul shape mismatch"
    );
    if tokens == 1 {
        products(isa, out, &w, xs, cols, 1);
        return;
    }
    // Row-major by weight row (`rows x tokens`) so tasks own whole chunks;
    // transposed into `out` after.
    BY_ROW.with(|cell| {
        // A nested call on this thread (a rayon worker that stole another
        // product while waiting) finds it borrowed and uses its own.
        let mut own = Vec::new();
        let mut held = cell.try_borrow_mut();
        let by_row = match held.as_deref_mut() {
            Ok(buf) => buf,
            Err(_) => &mut own,
        };
        by_row.clear();
        by_row.resize(rows * tokens, 0.0);
        products(isa, by_row, &w, xs, cols, tokens);
        for (r, vals) in by_row.chunks_exact(tokens).enumerate() {
            for (t, v) in vals.iter().enumerate() {
                out[t * rows + r] = *v;
            }
        }
    });
}

thread_local! {
    /// The calling thread's transposition buffer, kept between calls (a
    /// fresh multi-MiB buffer per call is fresh pages the kernel must zero).
    static BY_ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Every task of [`ROWS_PER_TASK`] weight rows on the pool, into `by_row`
/// (`rows x tokens`, row-major by weight row).
fn products(isa: Isa, by_row: &mut [f32], w: &MatRef<'_>, xs: &[f32], cols: usize, tokens: usize) {
    by_row
        .par_chunks_mut(ROWS_PER_TASK * tokens)
        .enumerate()
        .for_each(|(task, out)| {
            let row0 = task * ROWS_PER_TASK;
            isa.run(Rows {
                out,
                w,
                row0,
                xs,
                cols,
                tokens,
            });
        });
}

/// One task: weight rows from `row0` against every token, into `out`
/// (`rows x tokens`, row-major by weight row).
struct Rows<'a, 'w> {
    out: &'a mut [f32],
    w: &'a MatRef<'w>,
    row0: usize,
    xs: &'a [f32],
    cols: usize,
    tokens: usize,
}

impl NullaryFnOnce for Rows<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn call(self) {
        let Rows {
            out,
            w,
            row0,
            xs,
            cols,
            tokens,
        } = self;
        if tokens == 1 {
            // A full task: ROW_BLOCK streams, each over a contiguous run of
            // `step` rows (row `g + k step` in group `g`, stream `k`).
            let step = out.len() / ROW_BLOCK;
            for g in 0..step {
                let got = block_dots::<ROW_BLOCK, 1>(w, row0 + g, step, xs, cols);
                for (k, v) in got.iter().enumerate() {
                    out[g + k * step] = v[0];
                }
            }
            for (i, o) in out.iter_mut().enumerate().skip(step * ROW_BLOCK) {
                *o = row_dots::<1>(w, row0 + i, xs, cols)[0];
            }
            return;
        }
        // Tokens in tiles of TOKEN_TILE: a tile's activations stay in the
        // core's cache while every row of the task passes over them (all the
        // tokens' activations would be streamed again for every row).
        let rows = out.len() / tokens;
        let mut t0 = 0;
        while t0 < tokens {
            let tn = (tokens - t0).min(TOKEN_TILE);
            for i in 0..rows {
                let o = &mut out[i * tokens + t0..i * tokens + t0 + tn];
                token_group(o, w, row0 + i, &xs[t0 * cols..], cols);
            }
            t0 += tn;
        }
    }
}

/// Row `r` against every token, [`TOKENS`] at a time.
#[inline(always)]
fn token_group(out: &mut [f32], w: &MatRef<'_>, r: usize, xs: &[f32], cols: usize) {
    let mut t = 0;
    while t + TOKENS <= out.len() {
        let got = row_dots::<TOKENS>(w, r, &xs[t * cols..], cols);
        out[t..t + TOKENS].copy_from_slice(&got);
        t += TOKENS;
    }
    while t < out.len() {
        out[t] = row_dots::<1>(w, r, &xs[t * cols..], cols)[0];
        t += 1;
    }
}

#[cfg(test)]
mod tests;
