//! A BF16 prompt chunk's products on the tensor cores
//! (`kernels/decode/mma.cu`): the dense products and the grouped experts
//! of [`super::gemm`] with the same operands, as `mma.sync` tiles. Each f32
//! input is split into two BF16 parts (`hi = bf16(x)`, `lo = bf16(x -
//! hi)`, which keep 16 of its 24 significand bits) and BF16 weights are
//! exact, so an output is `Σ w·hi + w·lo` accumulated in f32: each product
//! term carries an extra relative error of at most 2^-17 against the f32
//! tiles. As there, an output's bits depend on its input row and weight row
//! only, so a row gives the same bits alone, in any group of rows and at
//! every expert budget.
//!
//! Used for BF16 weights on devices of compute capability 8.0 and later
//! unless [`crate::settings::PROMPT_MMA`] is `0`; other dtypes keep the f32
//! tiles.
//!
//! The split runs once per product (`split_bf16_rows`, into a scratch
//! buffer the next product reuses), not in each of its column tiles.
//!
//! Bounds: as the f32 tiles (the grouped step's pair order and tile list);
//! a block stages at most 27 KiB of shared memory (15 KiB with
//! `FLASHTIER_MMA_BK=32`); the split scratch holds
//! the largest input's parts (2 x its values, u16, rounded up to a power of
//! two: one step's widest product input), for as long as the kernels live.

use cudarc::driver::LaunchConfig;

use super::buffers::{DevAct, DevMatrix, WeightType};
use super::dense::mats;
use super::{DecodeKernels, dim, linear_cfg};
use crate::error::CudaError;
use crate::launch::Args;

/// Threads of a tensor-core tile's block (`MMA_THREADS`).
pub const MMA_THREADS: u32 = 128;
/// Output columns of a tile (`MMA_BN`).
pub const MMA_COLS: usize = 64;
/// Input rows of a dense tile (`BM` of `gemm_mma_bf16`).
pub const MMA_DENSE_ROWS: usize = 64;
/// Pairs of a grouped expert tile (`MMA_GROUP_ROWS`).
pub const MMA_GROUP_ROWS: usize = 32;

impl DecodeKernels {
    /// Whether a prompt's tiles of `ty` weights run on the tensor cores.
    #[must_use]
    pub fn mma(&self, ty: WeightType) -> bool {
        self.mma_on && ty == WeightType::Bf16
    }

    /// Split `x` into its BF16 hi and lo parts (`split_bf16_rows`) in the
    /// split scratch: the scratch's address and the lo parts' offset in
    /// elements (`x`'s value count). The scratch grows to the largest
    /// input split (a buffer it outgrows is retired: queued launches may
    /// still read it) and is reused by the next product, which the stream
    /// runs after this one's tiles.
    pub(super) fn split_input(&self, x: &DevAct) -> Result<(u64, i64), CudaError> {
        let n = x.rows() * x.cols();
        if n == 0 || n % 4 != 0 {
            return Err(CudaError::invalid(
                "split input",
                format!("{}x{} values", x.rows(), x.cols()),
            ));
        }
        let mut scratch = self.split.borrow_mut();
        if scratch.as_ref().is_none_or(|s| s.len() < 2 * n) {
            let fresh = self
                .gpu
                .stream()
                .alloc_zeros::<u16>((2 * n).next_power_of_two())
                .map_err(CudaError::driver("allocate the split input"))?;
            if let Some(old) = scratch.replace(fresh) {
                self.gpu.retire(old);
            }
        }
        let dst = scratch
            .as_ref()
            .ok_or_else(|| CudaError::invalid("split input", "no scratch".to_string()))?;
        let at = super::addr(&self.gpu, dst, 0);
        let mut a = Args::new();
        a.buf(&self.gpu, x.buf()).push(n as i64).push(at);
        // SAFETY: matches `split_bf16_rows`; reads x's n values (n % 4 ==
        // 0, whole float4s from a 256-byte aligned buffer) and writes 2n
        // BF16 values into the scratch, which holds at least 2n.
        unsafe { self.launch("split_bf16_rows", linear_cfg(n / 4, 256)?, a) }?;
        Ok((at, n as i64))
    }

    /// Whether a BF16 prompt's dense products run through cuBLASLt
    /// ([`super::lt`]; `FLASHTIER_PROMPT_BLAS` and a loadable library).
    #[must_use]
    pub fn prompt_blas(&self) -> bool {
        self.lt.is_some()
    }

    /// [`Self::gemm_many`] on the tensor cores, for checked operands of
    /// BF16 weights `k` wide (a multiple of 8): through cuBLASLt where
    /// every matrix's shape has a pinned algorithm, else as tiles.
    pub(super) fn gemm_mma(
        &self,
        outs: &mut [&mut DevAct],
        ws: &[&DevMatrix],
        x: &DevAct,
        k: usize,
    ) -> Result<(), CudaError> {
        let (xs, lo_off) = self.split_input(x)?;
        if let Some(lt) = &self.lt {
            let mut covered = true;
            for w in ws {
                covered &= lt.covers(w.rows(), k)?;
            }
            if covered {
                let lo = xs + 2 * lo_off as u64;
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    let (wp, op) = (
                        super::addr(&self.gpu, w.data(), 0),
                        super::addr(&self.gpu, out.buf(), 0),
                    );
                    // SAFETY: `check_many` (by the caller) made w hold
                    // w.rows() x k BF16 values, out x.rows() x w.rows() f32
                    // and x x.rows() x k, split above into as many hi values
                    // at xs and lo values 2 * lo_off bytes after; buffers
                    // start 256-byte aligned and k % 8 == 0, so the lo part
                    // is 16-byte aligned; the weights and the output live
                    // as long as their owners, who free device memory only
                    // after the stream ran (or through `Gpu::retire`), and
                    // the split scratch is retired, not freed, when it grows.
                    unsafe { lt.product([w.rows(), k, x.rows()], wp, [xs, lo], op) }?;
                }
                return Ok(());
            }
        }
        let col_tiles: usize = ws.iter().map(|w| w.rows().div_ceil(MMA_COLS)).sum();
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(col_tiles)
                    .map_err(|_| CudaError::invalid("gemm", format!("{col_tiles} tiles")))?,
                dim(x.rows().div_ceil(MMA_DENSE_ROWS), "gemm rows")?,
                1,
            ),
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let gpu = &self.gpu;
        let mut a = Args::new();
        a.push(mats(gpu, outs, ws, 0))
            .push((k * 2) as i64)
            .push(k as i32)
            .push(xs)
            .push(lo_off)
            .push(x.rows() as i32);
        // SAFETY: matches `gemm_mma_bf16` in kernels/decode/mma.cu. Each
        // matrix holds its rows of k BF16 values (checked at upload), every
        // output holds x.rows() rows of its matrix's rows and x holds
        // x.rows() rows of k (`check_many`, by the caller), split above into
        // x.rows() * k hi values at xs and as many lo values lo_off after;
        // k % 8 == 0 makes every 16-byte weight and input load whole, and
        // buffers start 256-byte aligned; a block reads and writes only rows
        // below x.rows() and columns below its matrix's rows.
        unsafe { self.launch("gemm_mma_bf16", cfg, a) }
    }
}
