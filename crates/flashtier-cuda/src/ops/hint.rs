//! L2 prefetch hints: a kernel that asks L2 for the lines of up to four
//! matrices a later kernel of the step reads, and computes nothing. In a
//! recorded step it starts while the kernel before it runs (it waits
//! itself, see [`crate::launch`]), so the reads overlap kernels that leave
//! HBM idle (the attention's small kernels before the output product).
//!
//! Bound: one launch of at most one block of 256 threads per SM; each
//! thread issues one prefetch per 128-byte line in its turn.

use cudarc::driver::LaunchConfig;

use super::DecodeKernels;
use super::buffers::DevMatrix;
use crate::error::CudaError;
use crate::launch::{Args, KernelArg};

/// Up to four byte ranges of device matrices to ask L2 for (the C layout
/// of `struct Spans`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Spans {
    p: [u64; 4],
    len: [i64; 4],
}

// SAFETY: plain-old-data with the C layout of `struct Spans` in
// kernels/decode/: four 8-byte pointers and four 8-byte lengths, no padding.
unsafe impl KernelArg for Spans {}

impl DecodeKernels {
    /// Ask L2 for the stored bytes of `ws` (at most four; FP8 scales are
    /// left out). A hint: it changes no result.
    pub fn prefetch(&self, ws: &[&DevMatrix]) -> Result<(), CudaError> {
        let s = self.spans(ws)?;
        self.prefetch_spans(s)
    }

    /// The stored bytes of `ws` (one to four matrices) as spans.
    fn spans(&self, ws: &[&DevMatrix]) -> Result<Spans, CudaError> {
        if ws.is_empty() || ws.len() > 4 {
            return Err(CudaError::invalid(
                "prefetch",
                format!("{} matrices (1 to 4)", ws.len()),
            ));
        }
        let mut s = Spans::default();
        for (q, w) in ws.iter().enumerate() {
            s.p[q] = super::addr(&self.gpu, w.data(), 0);
            s.len[q] = w.data().len() as i64;
        }
        Ok(s)
    }

    /// Ask L2 for the bytes of `s`. The matrices `s` was made from must
    /// still be allocated when the launch runs (the model's weights are,
    /// for as long as it decodes).
    fn prefetch_spans(&self, s: Spans) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (self.gpu.info().sm_count.max(1), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = Args::new();
        a.push(s);
        // SAFETY: matches `prefetch_spans`; span q is matrix q's whole data
        // buffer (its stored bytes, still allocated: see above), and the
        // kernel only issues prefetches of lines that start inside a span.
        unsafe { self.launch("prefetch_spans", cfg, a) }
    }
}
