//! Host helpers of the Qwen4-Exp loaders: the `(1 + w)` RMSNorm weights
//! and RoPE's inverse frequencies, computed in f32 as transformers does.
//! The forward pass itself runs on the device ([`crate::device::hybrid`]).

/// The `(1 + w)` RMSNorm's weight as it multiplies: `1 + w` in f32.
pub fn one_plus(w: Vec<f32>) -> Vec<f32> {
    w.into_iter().map(|v| 1.0 + v).collect()
}

/// RoPE's inverse frequencies over `dim` rotated dims, in f32 as
/// transformers computes them.
pub fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    let base = theta as f32;
    (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
        .collect()
}
