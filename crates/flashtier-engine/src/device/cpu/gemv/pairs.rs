//! BF16 prompt products on AVX-512 without a shuffle: each little-endian
//! 32-bit word of a 64-byte weight chunk holds elements `2l` (low half) and
//! `2l + 1` (high half), so one shift and one mask widen the chunk into two
//! registers, the even elements in the first and the odd in the second
//! (the portable widening spends a shuffle and a shift per 16 elements).
//!
//! The activations are laid out to match once per product
//! ([`pair_lanes`]), and the sums go through the tree in registers as if
//! they had been put back in element order first ([`reduce_pairs`]): every
//! one of the `LANES` chains sees the same elements in the same order as
//! [`super::dots`], and every add of the tree the same operands, so the
//! outputs keep their bits (the tests in `gemv::tests` compare every path
//! with the scalar one).

use pulp::bytemuck::cast;
use pulp::{Simd, f32x16, u32x16, x86::V4};

use std::arch::x86_64::__m512;

use super::{Bf16, Kernel, LANES, Widen};

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

/// [`super::reduce`] of the sums put back in element order, from the sums in the
/// pairs' order (`even[m]` is element `2m`, `odd[m]` element `2m + 1`), in
/// registers. That tree adds element `l` and `l + w` for `w` = 16,
/// 8, 4, 2, then the last two: for an even `l = 2m` that is `even[m] +
/// even[m + w / 2]`, for an odd one the same in `odd`, and the last add is
/// `even`'s total plus `odd`'s. So the tree is run on both halves at once,
/// each add with the same operands in the same order (the lower element
/// first) as the scalar tree's, and the bits are its bits.
#[inline(always)]
fn reduce_pairs(simd: V4, even: f32x16, odd: f32x16) -> f32 {
    let f = simd.avx512f;
    let (even, odd): (__m512, __m512) = (cast(even), cast(odd));
    // w = 16: quarters 0-1 of each half plus quarters 2-3; lanes 0-7 then
    // hold `even`'s sums, lanes 8-15 `odd`'s.
    let lo = f._mm512_shuffle_f32x4::<0b01_00_01_00>(even, odd);
    let hi = f._mm512_shuffle_f32x4::<0b11_10_11_10>(even, odd);
    let s = f._mm512_add_ps(lo, hi);
    // w = 8: quarter 0 plus quarter 1, quarter 2 plus quarter 3.
    let s = f._mm512_add_ps(s, f._mm512_shuffle_f32x4::<0b11_11_01_01>(s, s));
    // w = 4, then w = 2: within each quarter, lanes 0-1 plus 2-3, lane 0
    // plus lane 1.
    let s = f._mm512_add_ps(s, f._mm512_permute_ps::<0b11_10_11_10>(s));
    let s = f._mm512_add_ps(s, f._mm512_permute_ps::<0b01_01_01_01>(s));
    let lanes: [f32; 16] = cast(s);
    lanes[0] + lanes[8]
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
                *o = reduce_pairs(simd, a[0], a[1]) + tail;
            }
        }
        out
    }
}
