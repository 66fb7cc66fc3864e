//! A layer half's last product followed by the residual add and the next
//! RMSNorm in the same launch: once every block of the product wrote its
//! part of the output, the last block to finish adds it to the residual
//! stream and writes the stream's norm (`add_norm_tail` in
//! kernels/decode/elementwise.cu, with `add_rms_norm`'s arithmetic). Two
//! products fold it: a one-row GEMV (the attention's output product, a
//! dense MLP's down product) and the routed experts' down product. The
//! bits are those of the product and then [`DecodeKernels::add_rms_norm`];
//! a launch fewer per layer half.
//!
//! Bounds: one counter in the kernels' scratch, 0 between launches (the
//! kernels of a stream run one after another); the tail runs in one block,
//! row after row.

use super::buffers::{DevAct, DevMatrix, DevVector};
use super::dense::{check_many, same, shape};
use super::experts::{ExpertSlots, ExpertSpec};
use super::pick::ADD_NORM_COUNTER;
use super::route::DevRoutes;
use super::{DecodeKernels, addr};
use crate::error::CudaError;
use crate::launch::KernelArg;

/// The C layout of `struct AddNorm` (kernels/decode/elementwise.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct AddNorm {
    resid: u64,
    w: u64,
    out: u64,
    counter: u64,
    cols: i32,
    rows: i32,
    eps: f32,
    pad: i32,
}

// SAFETY: plain old data with the C layout of `struct AddNorm`: four
// 8-byte pointers, then four 4-byte values (48 bytes, no padding).
unsafe impl KernelArg for AddNorm {}

/// Where a folded product's output goes: `resid += y`, then `out =
/// rms_norm(resid) * norm` (eps `eps`).
pub struct AddNormInto<'a> {
    /// The residual stream (`rows x cols`), updated in place.
    pub resid: &'a mut DevAct,
    /// The norm's weight (`cols`).
    pub norm: &'a DevVector,
    /// The norm's epsilon.
    pub eps: f32,
    /// The normed rows (`rows x cols`).
    pub out: &'a mut DevAct,
}

impl DecodeKernels {
    /// The tail's arguments for a product output `y` of `into`'s shape.
    fn add_norm_tail(&self, y: &DevAct, into: &AddNormInto<'_>) -> Result<AddNorm, CudaError> {
        same("add_rms_norm", into.resid, y)?;
        same("add_rms_norm", into.resid, into.out)?;
        if into.norm.len() != y.cols() {
            return Err(shape(
                "add_rms_norm",
                format!("{}-wide weight over {} columns", into.norm.len(), y.cols()),
            ));
        }
        let g = &self.gpu;
        Ok(AddNorm {
            resid: addr(g, into.resid.buf(), 0),
            w: addr(g, into.norm.data(), 0),
            out: addr(g, into.out.buf(), 0),
            counter: self.scratch.counter(g, ADD_NORM_COUNTER),
            cols: i32::try_from(y.cols()).map_err(|_| shape("add_rms_norm", "columns".into()))?,
            rows: i32::try_from(y.rows()).map_err(|_| shape("add_rms_norm", "rows".into()))?,
            eps: into.eps,
            pad: 0,
        })
    }

    /// `y = w x` for the one row of `x` (a GEMV pass), then `into`'s add
    /// and norm of `y`, in one launch.
    pub fn gemv_add_norm(
        &self,
        y: &mut DevAct,
        w: &DevMatrix,
        x: &DevAct,
        into: AddNormInto<'_>,
    ) -> Result<(), CudaError> {
        if x.rows() != 1 {
            return Err(shape(
                "gemv_add_norm",
                format!("{} rows (one at a time)", x.rows()),
            ));
        }
        let outs = [y];
        check_many(&outs, &[w], x)?;
        let [y] = outs;
        let tail = self.add_norm_tail(y, &into)?;
        let (mut a, cfg) = self.gemv_pass(std::slice::from_ref(&y), &[w], x, 0, 1)?;
        a.push(tail);
        let f = format!("gemv1_norm_{}", w.ty().suffix());
        // SAFETY: matches `gemv1_norm_*`: its first ten arguments are
        // gemv1's for `w` over the one row of `x` into `y` (shapes checked
        // by `check_many`; see `gemv_many`); the tail's residual, output
        // and weight are one row as wide as `y` (checked above), its
        // counter is 0 between launches (stream order; the last block
        // resets it).
        unsafe { self.launch(&f, cfg, a) }
    }

    /// [`Self::moe`], then `into`'s add and norm of `out`, the down
    /// product's launch doing both.
    #[allow(clippy::too_many_arguments, reason = "the step's operands and scratch")]
    pub fn moe_add_norm(
        &self,
        slots: &ExpertSlots,
        layer_base: usize,
        experts: usize,
        routes: &DevRoutes,
        spec: &ExpertSpec,
        x: &DevAct,
        (act, out): (&mut DevAct, &mut DevAct),
        into: AddNormInto<'_>,
    ) -> Result<(), CudaError> {
        let tail = self.add_norm_tail(out, &into)?;
        self.moe_then(
            slots,
            layer_base,
            experts,
            routes,
            spec,
            x,
            act,
            out,
            Some(tail),
            None,
        )
    }
}
