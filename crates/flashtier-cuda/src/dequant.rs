//! FP8 E4M3 (e4m3fn) -> BF16 dequantisation of Engram rows on the GPU, and a
//! deterministic device-side fill used by tests and benchmarks.
//!
//! `out[r, c] = bf16_rne(e4m3(w[r, c]) * scale[r, c / group])`, computed in
//! f32 exactly as the CPU reference in `flashtier::rows::fp8` does
//! (`ScaleFormat::F32Blocks`: `scales_per_row` equal column blocks; an f64
//! row scale is the one-block case after `as f32`), with `e4m3` the decoding
//! of `flashtier_format::fp8` (the host side of the tests uses that one):
//! e4m3fn has no infinities, `0x7E` is 448 and `0x7F` / `0xFF` are NaN.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig, PushKernelArg};

use crate::context::Gpu;
use crate::error::CudaError;
use crate::nvrtc::{UTIL_SRC, load_module};

/// Geometry of a batch of FP8 rows in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Rows {
    /// Rows.
    pub rows: usize,
    /// FP8 weights per row (multiple of 8).
    pub cols: usize,
    /// Bytes between the starts of consecutive rows in the weight buffer
    /// (multiple of 8; `cols` for dense rows, 264 for packed Engram rows).
    pub row_stride_bytes: usize,
    /// Weights per scale (divides `cols`, multiple of 8).
    pub group: usize,
    /// f32 scales between the starts of consecutive rows in the scale buffer.
    pub scale_stride: usize,
}

impl Fp8Rows {
    fn validate(&self, w_len: usize, s_len: usize, out_len: usize) -> Result<(), CudaError> {
        let bad = |why: String| Err(CudaError::invalid("fp8 rows", why));
        if self.cols == 0 || self.cols % 8 != 0 || self.group == 0 || self.group % 8 != 0 {
            return bad(format!(
                "cols {} and group {} must be non-zero multiples of 8",
                self.cols, self.group
            ));
        }
        if self.cols % self.group != 0
            || self.row_stride_bytes % 8 != 0
            || self.row_stride_bytes < self.cols
        {
            return bad(format!(
                "{self:?}: group must divide cols; stride >= cols, multiple of 8"
            ));
        }
        let groups = self.cols / self.group;
        if self.rows == 0 {
            return Ok(());
        }
        let last = self.rows - 1;
        let w_need = last
            .checked_mul(self.row_stride_bytes)
            .and_then(|v| v.checked_add(self.cols));
        let s_need = last
            .checked_mul(self.scale_stride)
            .and_then(|v| v.checked_add(groups));
        let o_need = self.rows.checked_mul(self.cols);
        if self.scale_stride < groups || i32::try_from(self.rows).is_err() {
            return bad(format!(
                "{self:?}: scale_stride below {groups} scales per row, or too many rows"
            ));
        }
        match (w_need, s_need, o_need) {
            (Some(w), Some(s), Some(o)) if w <= w_len && s <= s_len && o <= out_len => Ok(()),
            _ => bad(format!(
                "{self:?} does not fit weights {w_len} B, scales {s_len}, output {out_len}"
            )),
        }
    }
}

/// The small kernels: FP8 dequant and the benchmark fill.
pub struct UtilKernels {
    gpu: Gpu,
    _module: Arc<CudaModule>,
    f_dequant: CudaFunction,
    f_fill: CudaFunction,
    f_spin: CudaFunction,
}

impl std::fmt::Debug for UtilKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UtilKernels").finish_non_exhaustive()
    }
}

impl UtilKernels {
    /// Compile and load the kernels for the device of `gpu`.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let (module, _) = load_module(gpu, "util", UTIL_SRC, &[])?;
        let func = |name: &str| {
            module
                .load_function(name)
                .map_err(CudaError::driver(format!("load kernel {name}")))
        };
        Ok(Self {
            gpu: gpu.clone(),
            f_dequant: func("fp8_e4m3_dequant")?,
            f_fill: func("fill_bf16_hash")?,
            f_spin: func("spin_ns")?,
            _module: module,
        })
    }

    /// Dequantise `geom.rows` rows of `weights` with `scales` into `out`
    /// (`[rows, cols]` BF16 as raw `u16`), on the compute stream.
    pub fn dequant_e4m3(
        &self,
        weights: &CudaSlice<u8>,
        scales: &CudaSlice<f32>,
        geom: Fp8Rows,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        geom.validate(weights.len(), scales.len(), out.len())?;
        if geom.rows == 0 {
            return Ok(());
        }
        let work = geom.rows * geom.cols / 8;
        let blocks = work
            .div_ceil(256)
            .min(self.gpu.info().sm_count as usize * 16)
            .max(1);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (w_stride, s_stride) = (geom.row_stride_bytes as i64, geom.scale_stride as i64);
        let (rows, cols, group) = (geom.rows as i32, geom.cols as i32, geom.group as i32);
        let stream = self.gpu.stream().clone();
        let mut launch = stream.launch_builder(&self.f_dequant);
        launch
            .arg(weights)
            .arg(&w_stride)
            .arg(scales)
            .arg(&s_stride)
            .arg(out)
            .arg(&rows)
            .arg(&cols)
            .arg(&group);
        // SAFETY: matches `fp8_e4m3_dequant`; `validate` proved every row's
        // weights, scales and outputs lie inside their buffers, and the
        // 8-byte / 16-byte accesses are aligned (strides and cols multiples of 8).
        unsafe { launch.launch(cfg) }.map_err(CudaError::driver("launch fp8_e4m3_dequant"))?;
        Ok(())
    }

    /// Fill `dst` with deterministic pseudo-random BF16 in `[-amp, amp)`.
    pub fn fill_bf16(
        &self,
        dst: &mut CudaSlice<u16>,
        seed: u32,
        amp: f32,
    ) -> Result<(), CudaError> {
        let n = dst.len() as i64;
        let blocks = (dst.len().div_ceil(256))
            .min(self.gpu.info().sm_count as usize * 32)
            .max(1);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.gpu.stream().clone();
        let mut launch = stream.launch_builder(&self.f_fill);
        launch.arg(dst).arg(&n).arg(&seed).arg(&amp);
        // SAFETY: matches `fill_bf16_hash`, which writes indices 0..n of `dst`.
        unsafe { launch.launch(cfg) }.map_err(CudaError::driver("launch fill_bf16_hash"))?;
        Ok(())
    }
}

impl UtilKernels {
    /// Keep the compute stream busy for `ns` nanoseconds, so that launches
    /// queued behind it run back to back (benchmarks).
    pub fn spin(&self, ns: u64) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.gpu.stream().clone();
        let mut launch = stream.launch_builder(&self.f_spin);
        launch.arg(&ns);
        // SAFETY: matches `spin_ns`, which touches no memory.
        unsafe { launch.launch(cfg) }.map_err(CudaError::driver("launch spin_ns"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_checked() {
        let g = Fp8Rows {
            rows: 4,
            cols: 256,
            row_stride_bytes: 264,
            group: 128,
            scale_stride: 2,
        };
        assert!(g.validate(3 * 264 + 256, 8, 1024).is_ok());
        assert!(g.validate(3 * 264 + 255, 8, 1024).is_err());
        assert!(g.validate(3 * 264 + 256, 7, 1024).is_err());
        let odd = Fp8Rows { cols: 250, ..g };
        assert!(odd.validate(1 << 20, 1 << 20, 1 << 20).is_err());
    }
}
