//! RMSNorm (per row or per head group, fused with the residual add),
//! RoPE, and Qwen3's per-head q/k norm fused with RoPE, with their shape
//! checks.

use cudarc::driver::LaunchConfig;

use super::buffers::{DevAct, DevVector, RopeTable};
use super::dense::{same, shape};
use super::{DecodeKernels, dim};
use crate::error::CudaError;
use crate::launch::Args;

/// Widest head (or rotated slice) the RoPE kernels hold in shared memory.
pub const MAX_ROPE_DIMS: usize = 512;

impl DecodeKernels {
    /// RMSNorm of every `w.len()`-wide group of columns.
    pub fn rms_norm(
        &self,
        out: &mut DevAct,
        x: &DevAct,
        w: &DevVector,
        eps: f32,
    ) -> Result<(), CudaError> {
        same("rms_norm", out, x)?;
        let g = w.len();
        if x.cols() % g != 0 {
            return Err(shape(
                "rms_norm",
                format!("{g}-wide weight over {} columns", x.cols()),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(x.cols() / g, "x")?, dim(x.rows(), "y")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cols, group) = (x.cols() as i32, g as i32);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf())
            .buf(g, w.data())
            .push(cols)
            .push(group)
            .push(eps)
            .buf(g, out.buf());
        // SAFETY: matches `rms_norm`; each block reads one group of one row
        // of x and writes the same range of out (same shape, checked).
        unsafe { self.launch("rms_norm", cfg, a) }?;
        Ok(())
    }

    /// `x += y`, then `out = rms_norm(x) * w` over whole rows, one pass.
    pub fn add_rms_norm(
        &self,
        x: &mut DevAct,
        y: &DevAct,
        w: &DevVector,
        eps: f32,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        same("add_rms_norm", x, y)?;
        same("add_rms_norm", x, out)?;
        if w.len() != x.cols() {
            return Err(shape(
                "add_rms_norm",
                format!("{}-wide weight over {} columns", w.len(), x.cols()),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(x.rows(), "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let cols = x.cols() as i32;
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf())
            .buf(g, y.buf())
            .buf(g, w.data())
            .push(cols)
            .push(eps)
            .buf(g, out.buf());
        // SAFETY: matches `add_rms_norm`; one block per row of x, y and out
        // (one shape, checked), the weight as wide as a row.
        unsafe { self.launch("add_rms_norm", cfg, a) }?;
        Ok(())
    }

    /// Rotate `dims` columns at `h * head_stride + offset` of `heads`
    /// heads of row r by position `first + r`.
    #[allow(clippy::too_many_arguments, reason = "the rotation's geometry")]
    pub fn rope(
        &self,
        x: &mut DevAct,
        table: &RopeTable,
        heads: usize,
        head_stride: usize,
        offset: usize,
        dims: usize,
        interleaved: bool,
        first: usize,
    ) -> Result<(), CudaError> {
        let last = heads.saturating_sub(1) * head_stride + offset + dims;
        if dims == 0
            || dims % 2 != 0
            || dims > MAX_ROPE_DIMS
            || dims / 2 > table.half()
            || heads == 0
            || last > x.cols()
        {
            return Err(shape(
                "rope",
                format!(
                    "{heads} heads of {dims} at {offset} over {} columns",
                    x.cols()
                ),
            ));
        }
        if first + x.rows() > table.positions() {
            return Err(shape(
                "rope",
                format!(
                    "positions up to {} of a {}-position table",
                    first + x.rows(),
                    table.positions()
                ),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(heads, "x")?, dim(x.rows(), "y")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cos, sin) = table.tables();
        let v = [
            x.cols(),
            head_stride,
            offset,
            dims,
            usize::from(interleaved),
        ]
        .map(|v| v as i32);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf());
        for n in v {
            a.push(n);
        }
        a.buf(g, cos).buf(g, sin).push(first as i32);
        // SAFETY: matches `rope`; each head's `dims` columns lie in the row
        // (checked), dims <= 512 fits the kernel's shared buffer, and every
        // position's half-width table row exists.
        unsafe { self.launch("rope", cfg, a) }?;
        Ok(())
    }

    /// Per-head RMSNorm of `q` and `k` (with `norms = [q_w, k_w]`, each
    /// `dim` wide; none without) and then RoPE of their whole heads
    /// (rotate-half, or interleaved pairs) for row r at position
    /// `first + r`, in place: one launch for what [`Self::rms_norm`] and
    /// [`Self::rope`] do in four, with the same arithmetic.
    #[allow(clippy::too_many_arguments, reason = "the kernel's arguments")]
    pub fn qk_norm_rope(
        &self,
        q: &mut DevAct,
        k: &mut DevAct,
        norms: Option<[&DevVector; 2]>,
        eps: f32,
        table: &RopeTable,
        head_dim: usize,
        interleaved: bool,
        first: usize,
    ) -> Result<(), CudaError> {
        let at = Positions::From(first + q.rows());
        self.qk_norm_rope_at(q, k, norms, eps, table, (head_dim, interleaved), first, at)
    }

    /// [`Self::qk_norm_rope`] with the rows' positions as `at` says
    /// (`first + r`, or a decode-rows table: [`super::attn::RowsAt`]).
    #[allow(clippy::too_many_arguments, reason = "the kernel's arguments")]
    pub(crate) fn qk_norm_rope_at(
        &self,
        q: &mut DevAct,
        k: &mut DevAct,
        norms: Option<[&DevVector; 2]>,
        eps: f32,
        table: &RopeTable,
        (head_dim, interleaved): (usize, bool),
        first: usize,
        at: Positions,
    ) -> Result<(), CudaError> {
        let (rows_table, end) = match at {
            Positions::From(end) => (0u64, end),
            Positions::Table(addr, end) => (addr, end),
        };
        let bad = head_dim == 0
            || head_dim % 2 != 0
            || head_dim > MAX_ROPE_DIMS
            || head_dim / 2 > table.half()
            || q.rows() != k.rows()
            || q.cols() % head_dim != 0
            || k.cols() % head_dim != 0
            || norms.is_some_and(|[a, b]| a.len() != head_dim || b.len() != head_dim);
        if bad {
            return Err(shape(
                "qk_norm_rope",
                format!(
                    "heads of {head_dim} over {}x{} queries and {}x{} keys",
                    q.rows(),
                    q.cols(),
                    k.rows(),
                    k.cols()
                ),
            ));
        }
        if end > table.positions() {
            return Err(shape(
                "qk_norm_rope",
                format!(
                    "positions up to {end} of a {}-position table",
                    table.positions()
                ),
            ));
        }
        let (q_heads, kv_heads) = (q.cols() / head_dim, k.cols() / head_dim);
        let cfg = LaunchConfig {
            grid_dim: (dim(q_heads + kv_heads, "x")?, dim(q.rows(), "y")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cos, sin) = table.tables();
        let v = [q_heads, kv_heads, head_dim, usize::from(interleaved), first].map(|v| v as i32);
        let has_norm = i32::from(norms.is_some());
        // Without norms the weight arguments are never read: pass the
        // table so the kernel sees valid pointers either way.
        let (qw, kw) = match norms {
            Some([qn, kn]) => (qn.data(), kn.data()),
            None => (cos, cos),
        };
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, q.buf())
            .push(v[0])
            .buf(g, qw)
            .buf(g, k.buf())
            .push(v[1])
            .buf(g, kw)
            .push(v[2])
            .push(has_norm)
            .push(eps)
            .push(v[3])
            .buf(g, cos)
            .buf(g, sin)
            .push(v[4])
            .push(rows_table);
        // SAFETY: matches `qk_norm_rope` in kernels/decode/; q and k hold `rows`
        // rows of whole `dim`-wide heads (checked), dim <= 512 fits the
        // kernel's shared buffer, the norms are `dim` wide when read, and
        // every position's half-width table row exists (checked; a rows
        // table holds one entry per row, its positions below `end`).
        unsafe { self.launch("qk_norm_rope", cfg, a) }?;
        Ok(())
    }
}

/// Where [`DecodeKernels::qk_norm_rope_at`]'s rows sit: `first + r`, below
/// the given end, or as a decode-rows table at a device address says (its
/// positions below the given end).
#[derive(Clone, Copy)]
pub(crate) enum Positions {
    From(usize),
    Table(u64, usize),
}
