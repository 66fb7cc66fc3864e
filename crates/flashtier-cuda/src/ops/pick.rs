//! Greedy picks on the device: the index of each row's largest value
//! (the lowest index of the largest number, as the host's argmax), so a
//! decode step copies one id to the host instead of a row of logits; and
//! the scratch the grid-wide kernels share.
//!
//! A one-row argmax spreads the row over up to [`MAX_ARGMAX_BLOCKS`]
//! blocks of at least [`ARGMAX_BLOCK_ELEMS`] values; the last block to
//! finish reduces their partial results (a counter in [`Scratch`], 0
//! between launches). Kernels run in issue order on the compute stream,
//! so one scratch serves every launch of a device's kernels.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::buffers::DevAct;
use super::{DecodeKernels, addr, dim};
use crate::context::Gpu;
use crate::error::CudaError;
use crate::launch::Args;

/// Most blocks of a one-row argmax.
pub const MAX_ARGMAX_BLOCKS: usize = 1024;
/// Fewest values one argmax block scans (a 151,936-word vocabulary: 38
/// blocks).
pub const ARGMAX_BLOCK_ELEMS: usize = 4096;

/// Counter of the fused router (`router_softmax_*`).
pub(crate) const ROUTER_COUNTER: usize = 0;
/// Counter of `argmax_grid`.
const ARGMAX_COUNTER: usize = 1;
/// Counter of the products followed by their residual add and norm
/// (`gemv1_norm_*`, `moe_down_norm_*`).
pub(crate) const ADD_NORM_COUNTER: usize = 2;

/// Device memory of the grid-wide kernels: their last-block counters and
/// the one-row argmax's partial results and answer.
pub(crate) struct Scratch {
    counters: CudaSlice<u32>,
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<i32>,
    out: CudaSlice<i32>,
}

impl Scratch {
    /// Zeroed scratch on `gpu`.
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let s = gpu.raw_stream();
        let err = CudaError::driver("allocate kernel scratch");
        Ok(Self {
            counters: s.alloc_zeros::<u32>(3).map_err(err)?,
            part_v: s
                .alloc_zeros::<f32>(MAX_ARGMAX_BLOCKS)
                .map_err(CudaError::driver("allocate kernel scratch"))?,
            part_i: s
                .alloc_zeros::<i32>(MAX_ARGMAX_BLOCKS)
                .map_err(CudaError::driver("allocate kernel scratch"))?,
            out: s
                .alloc_zeros::<i32>(1)
                .map_err(CudaError::driver("allocate kernel scratch"))?,
        })
    }

    /// Device address of counter `slot`.
    pub(crate) fn counter(&self, gpu: &Gpu, slot: usize) -> u64 {
        addr(gpu, &self.counters, slot)
    }
}

impl DecodeKernels {
    /// Index of each row's largest value (lowest index on ties; as the
    /// host's argmax, 0 for a row whose first value is NaN), on the host.
    /// The launch joins a recording step, which this issues.
    pub fn argmax_rows(&self, x: &DevAct) -> Result<Vec<u32>, CudaError> {
        if x.rows() == 1 {
            return Ok(vec![self.argmax_one(x)?]);
        }
        let gpu = &self.gpu;
        // Fresh memory no queued launch uses: no need to issue them.
        let out = gpu
            .raw_stream()
            .alloc_zeros::<i32>(x.rows())
            .map_err(CudaError::driver("allocate argmax output"))?;
        let cfg = LaunchConfig {
            grid_dim: (dim(x.rows(), "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = Args::new();
        a.buf(gpu, x.buf()).push(cols_i32(x)?).buf(gpu, &out);
        // SAFETY: matches `argmax_rows`; one block per row of x, one output each.
        unsafe { self.launch("argmax_rows", cfg, a) }?;
        gpu.flush()?;
        let host = gpu
            .stream()
            .clone_dtoh(&out)
            .map_err(CudaError::driver("copy argmax"))?;
        Ok(host.into_iter().map(|v| v as u32).collect())
    }

    /// The argmax of a one-row `x` over several blocks (`argmax_grid`).
    fn argmax_one(&self, x: &DevAct) -> Result<u32, CudaError> {
        let gpu = &self.gpu;
        let n = x.cols();
        let per = ARGMAX_BLOCK_ELEMS.max(n.div_ceil(MAX_ARGMAX_BLOCKS));
        let blocks = n.div_ceil(per);
        let cfg = LaunchConfig {
            grid_dim: (dim(blocks, "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = &self.scratch;
        let mut a = Args::new();
        a.buf(gpu, x.buf())
            .push(cols_i32(x)?)
            .push(per as i32)
            .buf(gpu, &s.part_v)
            .buf(gpu, &s.part_i)
            .push(s.counter(gpu, ARGMAX_COUNTER))
            .buf(gpu, &s.out);
        // SAFETY: matches `argmax_grid`; block b reads x[b * per..][..per]
        // clipped to n = x's one row, and writes partial b < blocks <=
        // MAX_ARGMAX_BLOCKS (the partial arrays' length); the last block
        // writes out[0]; the counter is 0 between launches (kernels run in
        // stream order and the last block resets it).
        unsafe { self.launch("argmax_grid", cfg, a) }?;
        gpu.flush()?;
        let host = gpu
            .stream()
            .clone_dtoh(&s.out)
            .map_err(CudaError::driver("copy argmax"))?;
        host.first()
            .map(|&v| v as u32)
            .ok_or_else(|| CudaError::invalid("argmax", "no result".to_string()))
    }
}

fn cols_i32(x: &DevAct) -> Result<i32, CudaError> {
    i32::try_from(x.cols())
        .map_err(|_| CudaError::invalid("argmax", format!("{} columns", x.cols())))
}
