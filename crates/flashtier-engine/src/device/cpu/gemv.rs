//! Matrix times vector(s) on the CPU: `out = W x` for one token (decode,
//! memory-bound) and for a prompt chunk (compute-bound: a register block of
//! a few weight rows times a few tokens, `tasks::Blocking`; on AVX-512 the BF16
//! blocks widen in pairs, [`pairs`], against one rearranged copy of the
//! chunk's activations, `tokens x cols` f32).
//!
//! Weights stay in their stored form (BF16, F16, F32, FP8 E4M3 with block
//! scales) and widen to f32 in registers; activations and accumulation are
//! f32. Each output is `LANES` fused multiply-add chains over the columns,
//! reduced in a fixed tree, plus a tail chain: the order depends on the
//! shape alone, so the result is bit-identical for every instruction set
//! ([`Isa`]), every thread count, every register block, and whether a token
//! is computed alone or in a group (a prompt chunk gives the same bits as
//! decoding its rows one at a time).
//!
//! Threads: rayon's global pool (one persistent pool, sized to the cores),
//! over tasks of [`ROWS_PER_TASK`] weight rows; a group of tokens is taken
//! [`TOKEN_TILE`] at a time so their activations stay in cache. Memory: no
//! allocation for one token; a group of tokens allocates one slice
//! reference per token per task (its part of that token's output row).

use pulp::NullaryFnOnce;

use flashtier_format::Dtype;
use flashtier_format::fp8::E4M3_TO_F32;
use flashtier_format::widen::bf16_to_f32;

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
    /// `LANES` stored elements.
    type Chunk;
    fn one(b: &[u8]) -> f32;
    /// Whole chunks of `b` (a trailing part chunk is left out).
    fn chunks(b: &[u8]) -> &[Self::Chunk];
    /// A chunk widened, lane `l` from element `l`.
    fn widen(c: &Self::Chunk) -> [f32; LANES];
}

/// The `Chunk`, `chunks` and `widen` of a [`Widen`] from its `one`.
macro_rules! chunked {
    ($bytes:literal) => {
        const BYTES: usize = $bytes;
        type Chunk = [u8; $bytes * LANES];
        #[inline(always)]
        fn chunks(b: &[u8]) -> &[Self::Chunk] {
            let whole = b.len() - b.len() % ($bytes * LANES);
            bytemuck::cast_slice(&b[..whole])
        }
        #[inline(always)]
        fn widen(c: &Self::Chunk) -> [f32; LANES] {
            // A plain loop: `array::from_fn`'s machinery is not always
            // inlined into the instruction set's function.
            let mut w = [0f32; LANES];
            for (l, wl) in w.iter_mut().enumerate() {
                *wl = Self::one(&c[l * $bytes..(l + 1) * $bytes]);
            }
            w
        }
    };
}

struct Bf16;
struct F16;
struct F32le;
struct E4m3;

impl Widen for Bf16 {
    chunked!(2);
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Widen for F16 {
    chunked!(2);
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Widen for F32le {
    chunked!(4);
    #[inline(always)]
    fn one(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Widen for E4m3 {
    chunked!(1);
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

/// A prompt chunk's register block: `R` stored rows (`cols` elements each)
/// against `T` activation rows (`cols` values each). Each widened weight
/// chunk serves `T` tokens and each activation chunk `R` rows from
/// registers; every output's arithmetic is [`dots`]'s (the same lanes, the
/// same order along the columns, the same tree and tail).
#[inline(always)]
fn tile<W: Widen, const R: usize, const T: usize>(
    rows: [&[u8]; R],
    xs: [&[f32]; T],
    cols: usize,
) -> [[f32; T]; R] {
    let full = cols / LANES;
    let mut wc: [&[W::Chunk]; R] = [&[]; R];
    for (c, r) in wc.iter_mut().zip(rows) {
        *c = &W::chunks(r)[..full];
    }
    let mut xc: [&[[f32; LANES]]; T] = [&[]; T];
    for (c, x) in xc.iter_mut().zip(xs) {
        *c = bytemuck::cast_slice(&x[..full * LANES]);
    }
    let mut acc = [[[0f32; LANES]; T]; R];
    for c in 0..full {
        let mut w = [[0f32; LANES]; R];
        for (w, rc) in w.iter_mut().zip(&wc) {
            *w = W::widen(&rc[c]);
        }
        for t in 0..T {
            // A copy: values, not a pointer that might alias the sums.
            let x: [f32; LANES] = xc[t][c];
            for r in 0..R {
                for l in 0..LANES {
                    acc[r][t][l] = w[r][l].mul_add(x[l], acc[r][t][l]);
                }
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for ((out_r, acc_r), row) in out.iter_mut().zip(acc).zip(rows) {
        for ((o, a), x) in out_r.iter_mut().zip(acc_r).zip(xs) {
            let mut tail = 0f32;
            for i in full * LANES..cols {
                let w = W::one(&row[i * W::BYTES..(i + 1) * W::BYTES]);
                tail = w.mul_add(x[i], tail);
            }
            *o = reduce(a) + tail;
        }
    }
    out
}

/// A register block's products for any `R x T` (the edges of a task take
/// `R x 1`, `1 x T` and `1 x 1`): [`tile`] on a stored form, or a kernel
/// for one instruction set with the same arithmetic.
trait Kernel: Copy {
    /// Bytes per stored element.
    const BYTES: usize;
    fn tile<const R: usize, const T: usize>(
        self,
        rows: [&[u8]; R],
        xs: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R];
}

/// [`tile`] of a stored form, on whatever instruction set runs it.
struct Auto<W>(std::marker::PhantomData<W>);

impl<W> Clone for Auto<W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<W> Copy for Auto<W> {}

impl<W: Widen> Kernel for Auto<W> {
    const BYTES: usize = W::BYTES;
    #[inline(always)]
    fn tile<const R: usize, const T: usize>(
        self,
        rows: [&[u8]; R],
        xs: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        tile::<W, R, T>(rows, xs, cols)
    }
}

/// [`tile_rows`] on a stored form's [`tile`].
#[inline(always)]
fn auto_rows<W: Widen, const R: usize, const T: usize>(
    outs: &mut [&mut [f32]],
    bytes: &[u8],
    row0: usize,
    xs: &[f32],
    cols: usize,
) {
    tile_rows::<_, R, T>(
        Auto::<W>(std::marker::PhantomData),
        outs,
        bytes,
        row0,
        xs,
        cols,
    );
}

/// One task's rows against one tile of tokens in `R x T` register blocks
/// (a single row or token where fewer are left): rows `row0..` of `bytes`
/// (as many as each of `outs` holds) against the tile's tokens `xs`, into
/// `outs` (one slice per token of the tile).
#[inline(always)]
fn tile_rows<K: Kernel, const R: usize, const T: usize>(
    k: K,
    outs: &mut [&mut [f32]],
    bytes: &[u8],
    row0: usize,
    xs: &[f32],
    cols: usize,
) {
    let rows = outs.first().map_or(0, |o| o.len());
    let tn = outs.len();
    let mut put = |i: usize, t: usize, v: f32| outs[t][i] = v;
    // One `$r x $s` block at rows `i..`, tokens `t..`.
    macro_rules! block {
        ($r:expr, $s:expr, $i:expr, $t:expr) => {{
            let got = k.tile::<$r, $s>(
                rows_at::<$r, u8>(bytes, row0 + $i, cols * K::BYTES),
                rows_at::<$s, f32>(xs, $t, cols),
                cols,
            );
            for (a, vals) in got.iter().enumerate() {
                for (j, v) in vals.iter().enumerate() {
                    put($i + a, $t + j, *v);
                }
            }
        }};
    }
    let mut i = 0;
    while i < rows {
        let rn = if rows - i >= R { R } else { 1 };
        let mut t = 0;
        while t < tn {
            // A remainder of fewer than T tokens still shares each widened
            // weight chunk among the tokens left.
            let step = (tn - t).min(T);
            match (rn == R, step) {
                (true, s) if s == T => block!(R, T, i, t),
                (true, 3) => block!(R, 3, i, t),
                (true, 2) => block!(R, 2, i, t),
                (true, _) => block!(R, 1, i, t),
                (false, s) if s == T => block!(1, T, i, t),
                (false, 3) => block!(1, 3, i, t),
                (false, 2) => block!(1, 2, i, t),
                (false, _) => block!(1, 1, i, t),
            }
            t += step;
        }
        i += rn;
    }
}

/// `N` consecutive rows of `width` elements from row `first` of `data`.
#[inline(always)]
fn rows_at<const N: usize, E>(data: &[E], first: usize, width: usize) -> [&[E]; N] {
    let mut a: [&[E]; N] = [&[]; N];
    for (k, r) in a.iter_mut().enumerate() {
        *r = &data[(first + k) * width..(first + k + 1) * width];
    }
    a
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
        tasks::products(isa, out, &w, xs, cols);
        return;
    }
    tasks::grouped(isa, out, &w, xs, [rows, cols, tokens]);
}

mod pairs;
mod tasks;
#[cfg(test)]
mod tests;
