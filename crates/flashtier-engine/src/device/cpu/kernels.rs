//! The CPU device's f32 kernels besides the matrix products
//! ([`super::gemv`]): RMSNorm, RoPE in transformers' `rotate_half`
//! convention, SiLU and argmax (softmax is [`crate::math`], top-k
//! [`crate::topk`]).
//!
//! Every reduction runs in a fixed order that depends only on the shapes, so
//! the same inputs give bit-identical outputs however the weights arrived
//! (resident, streamed, mapped) and however many threads run.

pub use super::gemv::{dot, matmul, matvec};

/// `out = x / rms(x) * weight`, as transformers' RMSNorm computes it in f32.
pub fn rms_norm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    let mean_sq = dot(x, x) / x.len() as f32;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
