//! The CPU device's f32 kernels: matrix-vector products (rayon over rows,
//! eight independent accumulators per row so the loop vectorises), RMSNorm,
//! RoPE in transformers' `rotate_half` convention, SiLU and softmax.
//!
//! Every reduction runs in a fixed order that depends only on the shapes, so
//! the same inputs give bit-identical outputs however the weights arrived
//! (resident, streamed, mapped) and however many threads run.

use rayon::prelude::*;

use flashtier_format::Dtype;

use crate::matrix::{MatRef, block_scale};

/// Rows per rayon task: small enough to spread a 64-row matrix over two
/// cores, large enough that task overhead stays under the arithmetic.
const ROWS_PER_TASK: usize = 16;

/// Lanes of the unrolled dot product.
const LANES: usize = 8;

/// `out = W x` for a `out.len() x x.len()` matrix `w`.
///
/// # Panics
/// When `w` does not hold exactly `out.len() * x.len()` elements (a caller
/// bug: shapes are validated when the weights are loaded).
pub fn matvec(out: &mut [f32], w: MatRef<'_>, x: &[f32]) {
    let cols = x.len();
    assert_eq!(w.len(), out.len() * cols, "matvec shape mismatch");
    out.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, chunk)| {
            let row0 = task * ROWS_PER_TASK;
            for (i, o) in chunk.iter_mut().enumerate() {
                let r = row0 + i;
                *o = match w {
                    MatRef::F32(m) => dot_f32(&m[r * cols..(r + 1) * cols], x),
                    MatRef::Raw(b, dt) => {
                        let width = dt.size_bytes() as usize;
                        dot_raw(&b[r * cols * width..(r + 1) * cols * width], dt, x)
                    }
                    MatRef::F8Block {
                        codes,
                        scales,
                        block: [br, bc],
                        ..
                    } => {
                        let row = &codes[r * cols..(r + 1) * cols];
                        let per_row = cols.div_ceil(bc);
                        let mut acc = 0f32;
                        for (b, (seg, xs)) in row.chunks(bc).zip(x.chunks(bc)).enumerate() {
                            acc += block_scale(scales, r / br, b, per_row) * dot_f8(seg, xs);
                        }
                        acc
                    }
                };
            }
        });
}

/// Dot product with eight lane accumulators, summed pairwise at the end.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += xa[l] * xb[l];
        }
    }
    let mut tail = 0f32;
    for (xa, xb) in ca.remainder().iter().zip(cb.remainder()) {
        tail += xa * xb;
    }
    reduce_lanes(acc) + tail
}

/// Dot product of unscaled FP8 E4M3 codes with `x`.
fn dot_f8(codes: &[u8], x: &[f32]) -> f32 {
    let table = &flashtier_format::fp8::E4M3_TO_F32;
    let mut acc = [0f32; LANES];
    let mut cc = codes.chunks_exact(LANES);
    let mut cx = x.chunks_exact(LANES);
    for (c, xs) in (&mut cc).zip(&mut cx) {
        for l in 0..LANES {
            acc[l] += table[usize::from(c[l])] * xs[l];
        }
    }
    let mut tail = 0f32;
    for (c, xv) in cc.remainder().iter().zip(cx.remainder()) {
        tail += table[usize::from(*c)] * xv;
    }
    reduce_lanes(acc) + tail
}

fn dot_raw(row: &[u8], dtype: Dtype, x: &[f32]) -> f32 {
    match dtype {
        Dtype::F8E4M3 => dot_f8(row, x),
        Dtype::Bf16 => dot_half(row, x, |b| f32::from_bits(u32::from(b) << 16)),
        Dtype::F16 => dot_half(row, x, |b| half::f16::from_bits(b).to_f32()),
        Dtype::F32 => {
            let mut acc = [0f32; LANES];
            let mut tail = 0f32;
            let mut cr = row.chunks_exact(4 * LANES);
            let mut cx = x.chunks_exact(LANES);
            for (r, xs) in (&mut cr).zip(&mut cx) {
                for l in 0..LANES {
                    let w =
                        f32::from_le_bytes([r[4 * l], r[4 * l + 1], r[4 * l + 2], r[4 * l + 3]]);
                    acc[l] += w * xs[l];
                }
            }
            for (r, xv) in cr.remainder().chunks_exact(4).zip(cx.remainder()) {
                tail += f32::from_le_bytes([r[0], r[1], r[2], r[3]]) * xv;
            }
            reduce_lanes(acc) + tail
        }
        // Refused by every checked constructor of a matrix; NaN rather than
        // a plausible number if one were ever built by hand.
        _ => f32::NAN,
    }
}

/// Lanes of the half-precision dot product: widen 16 weights into an f32
/// block, then multiply-add it (measured 40% faster than widening inside
/// the multiply-add loop on baseline x86-64).
const HALF_LANES: usize = 16;

#[inline(always)]
fn dot_half(row: &[u8], x: &[f32], widen: impl Fn(u16) -> f32) -> f32 {
    let mut acc = [0f32; HALF_LANES];
    let mut tail = 0f32;
    let mut cr = row.chunks_exact(2 * HALF_LANES);
    let mut cx = x.chunks_exact(HALF_LANES);
    for (r, xs) in (&mut cr).zip(&mut cx) {
        let mut w = [0f32; HALF_LANES];
        for l in 0..HALF_LANES {
            w[l] = widen(u16::from_le_bytes([r[2 * l], r[2 * l + 1]]));
        }
        for l in 0..HALF_LANES {
            acc[l] += w[l] * xs[l];
        }
    }
    for (r, xv) in cr.remainder().chunks_exact(2).zip(cx.remainder()) {
        tail += widen(u16::from_le_bytes([r[0], r[1]])) * xv;
    }
    let mut half = [0f32; LANES];
    for l in 0..LANES {
        half[l] = acc[l] + acc[l + LANES];
    }
    reduce_lanes(half) + tail
}

#[inline(always)]
fn reduce_lanes(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `out = x / rms(x) * weight`, as transformers' RMSNorm computes it in f32.
pub fn rms_norm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    let mean_sq = dot_f32(x, x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// RMSNorm of each `weight.len()`-wide head of `x`, in place (Qwen3 qk-norm).
pub fn rms_norm_heads(x: &mut [f32], weight: &[f32], eps: f32) {
    let mut tmp = vec![0f32; weight.len()];
    for head in x.chunks_exact_mut(weight.len()) {
        rms_norm(&mut tmp, head, weight, eps);
        head.copy_from_slice(&tmp);
    }
}

/// cos and sin for one position: `angle = position * inv_freq[i]` in f32,
/// as transformers computes it, times `factor` (YaRN's attention factor; 1
/// for plain RoPE). `inv_freq` comes from
/// [`crate::config::ModelConfig::rope_inv_freq`].
pub fn rope_angles(position: usize, inv_freq: &[f32], factor: f32) -> (Vec<f32>, Vec<f32>) {
    inv_freq
        .iter()
        .map(|f| {
            let angle = position as f32 * f;
            (angle.cos() * factor, angle.sin() * factor)
        })
        .unzip()
}

/// RoPE on interleaved pairs `(x0, x1), (x2, x3), ...` of each `dim`-wide
/// head (DeepSeek's layout), written out as transformers does: the rotated
/// even elements, then the rotated odd ones.
pub fn apply_rope_interleaved(x: &mut [f32], dim: usize, cos: &[f32], sin: &[f32]) {
    let half = dim / 2;
    let mut tmp = vec![0f32; dim];
    for head in x.chunks_exact_mut(dim) {
        for i in 0..half {
            let (e, o) = (head[2 * i], head[2 * i + 1]);
            tmp[i] = e * cos[i] - o * sin[i];
            tmp[half + i] = o * cos[i] + e * sin[i];
        }
        head.copy_from_slice(&tmp);
    }
}

/// Rotate every head of `x` in place: first half `a`, second half `b`,
/// `(a, b) -> (a cos - b sin, b cos + a sin)` (transformers' `rotate_half`).
pub fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (ai, bi) = (a[i], b[i]);
            a[i] = ai * cos[i] - bi * sin[i];
            b[i] = bi * cos[i] + ai * sin[i];
        }
    }
}

/// SiLU: `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softmax in place (max-subtracted).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Index of the largest value; the lowest index wins a tie.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// The `k` largest entries as (index, value), largest first; ties go to the
/// lower index (as `torch.topk` does on CPU for distinct values).
pub fn top_k(x: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.into_iter().take(k).map(|i| (i, x[i])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matvec_raw_matches_f32() {
        let rows = 37;
        let cols = 29;
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let bytes: Vec<u8> = w
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let widened: Vec<f32> = bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect();
        let mut a = vec![0f32; rows];
        let mut b = vec![0f32; rows];
        matvec(&mut a, MatRef::F32(&widened), &x);
        matvec(&mut b, MatRef::Raw(&bytes, Dtype::Bf16), &x);
        // Same bits on every call and every thread count: the order is fixed by the shape.
        let mut again = vec![0f32; rows];
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        one.install(|| matvec(&mut again, MatRef::Raw(&bytes, Dtype::Bf16), &x));
        assert_eq!(again, b);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-5);
        }
        for r in 0..rows {
            let naive: f64 = (0..cols)
                .map(|c| f64::from(widened[r * cols + c]) * f64::from(x[c]))
                .sum();
            assert!((naive - f64::from(a[r])).abs() < 1e-4, "row {r}");
        }
    }

    #[test]
    fn rope_rotates_pairs_of_halves() {
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        let (cos, sin) = rope_angles(1, &[1.0, 0.01], 1.0);
        apply_rope(&mut x, 4, &cos, &sin);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6);
        assert!((x[2] - 1f32.sin()).abs() < 1e-6);
        assert_eq!(x[1], 0.0);
        // Interleaved: the pair (x0, x1) turns together, and the output
        // lists the even elements first.
        let mut y = vec![1.0, 0.0, 0.0, 1.0];
        apply_rope_interleaved(&mut y, 4, &cos, &sin);
        let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        for (got, want) in y.iter().zip([c1, -s2, s1, c2]) {
            assert!((got - want).abs() < 1e-6, "{y:?}");
        }
        // The factor scales both.
        let (c, _) = rope_angles(0, &[1.0], 0.5);
        assert_eq!(c, vec![0.5]);
    }

    /// Block-scaled FP8 against the same matrix dequantized up front, on a
    /// shape with partial blocks at both edges; wrong part sizes are errors.
    #[test]
    fn f8_blocks_match_the_dequantized_matrix() {
        let (rows, cols, block) = (37usize, 29usize, [16usize, 8usize]);
        let codes: Vec<u8> = (0..rows * cols)
            .map(|k| {
                let c = ((k * 89 + 7) % 254) as u8;
                // Skip the two NaN codes (0x7F, 0xFF).
                if c & 0x7F == 0x7F { c - 1 } else { c }
            })
            .collect();
        let (sr, sc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
        let scales: Vec<f32> = (0..sr * sc).map(|k| 0.001 * (k as f32 + 1.0)).collect();
        let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let dense: Vec<f32> = codes
            .iter()
            .enumerate()
            .map(|(k, &c)| {
                let (r, col) = (k / cols, k % cols);
                flashtier_format::fp8::e4m3_to_f32(c) * scales[(r / block[0]) * sc + col / block[1]]
            })
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.41).cos()).collect();
        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
        matvec(&mut a, MatRef::F32(&dense), &x);
        let m = MatRef::f8_block(&codes, &scale_bytes, rows, cols, block).expect("fits");
        matvec(&mut b, m, &x);
        for (r, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!(
                (p - q).abs() <= 1e-5 * p.abs().max(1.0),
                "row {r}: {p} vs {q}"
            );
        }
        assert!(MatRef::f8_block(&codes, &scale_bytes[4..], rows, cols, block).is_err());
        assert!(MatRef::f8_block(&codes[1..], &scale_bytes, rows, cols, block).is_err());
        assert!(MatRef::f8_block(&codes, &scale_bytes, rows, cols, [0, 8]).is_err());
    }

    #[test]
    fn top_k_orders_and_breaks_ties_low() {
        let got = top_k(&[0.1, 0.5, 0.5, -1.0, 0.9], 3);
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), vec![4, 1, 2]);
    }
}
