//! Host f32 helpers of the Qwen4-Exp forward pass, in transformers' order
//! of operations: products through the CPU device's matrix kernel, the
//! `(1 + w)` RMSNorm per group, L2 norm, partial RoPE and the activations.
//! Activations are row-major `rows x width` slices; every helper checks the
//! lengths it is given and returns [`EngineError::Shape`] on a mismatch.

use crate::checkpoint::Checkpoint;
use crate::device::cpu::CpuDevice;
use crate::device::cpu::kernels::{apply_rope, matmul, rms_norm};
use crate::error::EngineError;
use crate::load::weights::Loader;
use crate::matrix::Matrix;

/// A loader of `ckpt`'s tensors as host matrices and f32 vectors (no FP8:
/// Qwen4-Exp checkpoints are BF16).
pub fn host_loader(ckpt: &Checkpoint) -> Loader<'_, CpuDevice> {
    Loader {
        ckpt,
        dev: &CpuDevice,
        fp8_block: None,
    }
}

fn shape(op: &'static str, what: String) -> EngineError {
    EngineError::Shape { op, what }
}

/// `out[r] = W x[r]` for the `rows` rows of `x`.
pub fn linear(w: &Matrix, x: &[f32], rows: usize) -> Result<Vec<f32>, EngineError> {
    if rows.checked_mul(w.cols()) != Some(x.len()) {
        return Err(shape(
            "qwen4 linear",
            format!(
                "{} inputs for {rows} rows of a {}x{} weight",
                x.len(),
                w.rows(),
                w.cols()
            ),
        ));
    }
    let mut out = vec![0f32; rows * w.rows()];
    if rows > 0 {
        matmul(&mut out, w.mat(), x, rows);
    }
    Ok(out)
}

/// The `(1 + w)` RMSNorm's weight as it multiplies: `1 + w` in f32.
pub fn one_plus(w: Vec<f32>) -> Vec<f32> {
    w.into_iter().map(|v| 1.0 + v).collect()
}

/// RMSNorm of every `group`-wide slice of each row of `x` (row width
/// `scale.len()`), times the matching slice of `scale`.
pub fn norm_groups(
    x: &[f32],
    scale: &[f32],
    group: usize,
    eps: f32,
) -> Result<Vec<f32>, EngineError> {
    let width = scale.len();
    if group == 0 || width % group != 0 || width == 0 || x.len() % width != 0 {
        return Err(shape(
            "qwen4 norm",
            format!("{} values, {width}-wide weight, groups of {group}", x.len()),
        ));
    }
    let mut out = vec![0f32; x.len()];
    for (o, xi) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        for ((og, xg), wg) in o
            .chunks_exact_mut(group)
            .zip(xi.chunks_exact(group))
            .zip(scale.chunks_exact(group))
        {
            rms_norm(og, xg, wg, eps);
        }
    }
    Ok(out)
}

/// `x / sqrt(sum(x^2) + 1e-6)` in place (the FLA-style L2 norm).
pub fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// RoPE (`rotate_half`) on the first `cos.len() * 2` dims of every
/// `head_dim`-wide head of `x`, in place.
pub fn rope_partial(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let dims = 2 * cos.len();
    for head in x.chunks_exact_mut(head_dim) {
        apply_rope(&mut head[..dims], dims, cos, sin);
    }
}

/// The logistic function.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, linear above 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// RoPE's inverse frequencies over `dim` rotated dims, in f32 as
/// transformers computes them.
pub fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    let base = theta as f32;
    (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// Add `y[r] * w[r][s]` into stream `s` of row `r` of `x` (`x`: `rows x
/// streams * width`, `y`: `rows x width`, `w`: `rows x streams`).
pub fn inject(x: &mut [f32], y: &[f32], w: &[f32], width: usize) {
    let streams = w.len() / (y.len() / width).max(1);
    for ((xr, yr), wr) in x
        .chunks_exact_mut(streams * width)
        .zip(y.chunks_exact(width))
        .zip(w.chunks_exact(streams))
    {
        for (xs, ws) in xr.chunks_exact_mut(width).zip(wr) {
            for (xv, yv) in xs.iter_mut().zip(yr) {
                *xv += yv * ws;
            }
        }
    }
}
