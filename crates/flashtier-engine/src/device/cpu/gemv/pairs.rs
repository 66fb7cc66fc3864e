//! BF16 prompt products on AVX-512 without a shuffle: each little-endian
//! 32-bit word of a 64-byte weight chunk holds elements `2l` (low half) and
//! `2l + 1` (high half), so one shift and one mask widen the chunk into two
//! registers, the even elements in the first and the odd in the second
//! (the portable widening spends a shuffle and a shift per 16 elements).
//!
//! The activations are laid out to match once per product
//! ([`pair_lanes`]), and the sums are put back in element order before the
//! tree ([`unpair`]): every one of the `LANES` chains sees the same
//! elements in the same order as [`super::dots`], so the outputs keep their
//! bits (the tests in `gemv::tests` compare every path with the scalar one).

use pulp::{Simd, f32x16, u32x16, x86::V4};

use super::{Bf16, Kernel, LANES, Widen, reduce};

/// Activation rows (`cols` values each) in the pairs' lane order: in each
/// whole chunk of `LANES` values the even-indexed ones first, then the odd;
/// a trailing part chunk as it is. One copy of the activations.
pub(super) fn pair_lanes(xs: &[f32], cols: usize) -> Vec<f32> {
    let mut out = xs.to_vec();
    let full = cols / LANES * LANES;
    for (row, src) in out.chunks_exact_mut(cols).zip(xs.chunks_exact(cols)) {
        for (o, x) in row[..full]
            .chunks_exact_mut(LANES)
            .zip(src[..full].chunks_exact(LANES))
        {
            for l in 0..LANES / 2 {
                o[l] = x[2 * l];
                o[LANES / 2 + l] = x[2 * l + 1];
            }
        }
    }
    out
}

/// Sums in the pairs' lane order (evens, then odds) put back in element
/// order.
#[inline(always)]
fn unpair(acc: [f32; LANES]) -> [f32; LANES] {
    let mut a = [0f32; LANES];
    for l in 0..LANES / 2 {
        a[2 * l] = acc[l];
        a[2 * l + 1] = acc[LANES / 2 + l];
    }
    a
}

/// The AVX-512 pair kernel; its activations must be in [`pair_lanes`]
/// order.
#[derive(Clone, Copy)]
pub(super) struct PairsV4(pub(super) V4);

impl Kernel for PairsV4 {
    const BYTES: usize = 2;

    #[inline(always)]
    fn tile<const R: usize, const T: usize>(
        self,
        rows: [&[u8]; R],
        xs: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        let simd = self.0;
        let full = cols / LANES;
        let mut wc: [&[[u8; 2 * LANES]]; R] = [&[]; R];
        for (c, r) in wc.iter_mut().zip(rows) {
            *c = &Bf16::chunks(r)[..full];
        }
        let mut xc: [&[[f32; LANES]]; T] = [&[]; T];
        for (c, x) in xc.iter_mut().zip(xs) {
            *c = bytemuck::cast_slice(&x[..full * LANES]);
        }
        let zero = simd.splat_f32x16(0.0);
        let high = simd.splat_u32x16(0xFFFF_0000);
        let mut acc = [[[zero; 2]; T]; R];
        for c in 0..full {
            let mut w = [[zero; 2]; R];
            for (w, rc) in w.iter_mut().zip(&wc) {
                let words: u32x16 = pulp::bytemuck::cast(rc[c]);
                w[0] = pulp::bytemuck::cast(simd.shl_const_u32x16::<16>(words));
                w[1] = pulp::bytemuck::cast(simd.and_u32s(words, high));
            }
            for t in 0..T {
                let x: [f32x16; 2] = pulp::bytemuck::cast(xc[t][c]);
                for r in 0..R {
                    let a = &mut acc[r][t];
                    a[0] = simd.mul_add_f32x16(w[r][0], x[0], a[0]);
                    a[1] = simd.mul_add_f32x16(w[r][1], x[1], a[1]);
                }
            }
        }
        let mut out = [[0f32; T]; R];
        for ((out_r, acc_r), row) in out.iter_mut().zip(acc).zip(rows) {
            for ((o, a), x) in out_r.iter_mut().zip(acc_r).zip(xs) {
                let mut tail = 0f32;
                for i in full * LANES..cols {
                    let w = Bf16::one(&row[i * 2..(i + 1) * 2]);
                    tail = w.mul_add(x[i], tail);
                }
                *o = reduce(unpair(pulp::bytemuck::cast(a))) + tail;
            }
        }
        out
    }
}
