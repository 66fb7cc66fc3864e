//! The routed experts' step on the device: gate/up with SiLU for every
//! (row, routed expert) pair, then each row's down projections summed in
//! routed (ascending id) order, the records found through the slots' table.

use super::buffers::DevAct;
use super::experts::{ExpertSlots, ExpertSpec};
use super::hint::Spans;
use super::route::DevRoutes;
use super::{DecodeKernels, blocks_cfg};
use crate::error::CudaError;
use crate::launch::Args;

impl DecodeKernels {
    /// `out[r] = sum over row r's routed experts (ascending id) of weight *
    /// down(silu(gate x[r]) * up x[r])`, the records found through
    /// `slots`' table at `layer_base + id`; `act` (`rows * top_k x inter`)
    /// is scratch.
    #[allow(clippy::too_many_arguments, reason = "the step's operands and scratch")]
    pub fn moe(
        &self,
        slots: &ExpertSlots,
        layer_base: usize,
        experts: usize,
        routes: &DevRoutes,
        spec: &ExpertSpec,
        x: &DevAct,
        act: &mut DevAct,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        self.moe_then(
            slots, layer_base, experts, routes, spec, x, act, out, None, None,
        )
    }

    /// [`Self::moe`] with an L2 prefetch of `between` issued by the down
    /// product's blocks before they wait on the gate/up product (the
    /// weights a later kernel of the step reads, coming in while the down
    /// product leaves read bandwidth unused). A hint: the same bits as
    /// [`Self::moe`]. The matrices of `between` must outlive the launch.
    #[allow(clippy::too_many_arguments, reason = "the step's operands and scratch")]
    pub fn moe_between(
        &self,
        slots: &ExpertSlots,
        layer_base: usize,
        experts: usize,
        routes: &DevRoutes,
        spec: &ExpertSpec,
        x: &DevAct,
        (act, out): (&mut DevAct, &mut DevAct),
        between: Option<Spans>,
    ) -> Result<(), CudaError> {
        self.moe_then(
            slots, layer_base, experts, routes, spec, x, act, out, None, between,
        )
    }

    /// [`Self::moe`], the down product's launch followed by `tail` (the
    /// residual add and norm of `out`, see [`super::fold`]) when given.
    #[allow(clippy::too_many_arguments, reason = "the step's operands and scratch")]
    pub(super) fn moe_then(
        &self,
        slots: &ExpertSlots,
        layer_base: usize,
        experts: usize,
        routes: &DevRoutes,
        spec: &ExpertSpec,
        x: &DevAct,
        act: &mut DevAct,
        out: &mut DevAct,
        tail: Option<super::fold::AddNorm>,
        between: Option<Spans>,
    ) -> Result<(), CudaError> {
        spec.validate()?;
        let (rows, k) = (x.rows(), routes.top_k());
        let pairs = rows * k;
        let ok = routes.rows() == rows
            && x.cols() == spec.hidden
            && out.rows() == rows
            && out.cols() == spec.hidden
            && act.rows() == pairs
            && act.cols() == spec.inter
            && layer_base + experts <= slots.entries()
            && slots.record_bytes >= spec.min_record_bytes();
        if !ok {
            return Err(CudaError::invalid(
                "moe",
                format!(
                    "{rows} rows x top-{k}, {}x{} input, table base {layer_base} + {experts} of {}",
                    x.rows(),
                    x.cols(),
                    slots.entries()
                ),
            ));
        }
        let geo = spec.geometry();
        let sfx = spec.ty.suffix();
        let vec = i32::from(spec.hidden % 8 == 0 && spec.inter % 8 == 0);
        let (base, kk, h, i) = (
            layer_base as i32,
            k as i32,
            spec.hidden as i32,
            spec.inter as i32,
        );
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, &slots.table_dev)
            .push(base)
            .buf(g, routes.ids())
            .push(kk)
            .buf(g, x.buf())
            .push(h)
            .push(i)
            .push(geo)
            .push(vec)
            .buf(g, act.buf());
        let cfg = blocks_cfg(spec.inter.div_ceil(4), pairs)?;
        // SAFETY: matches `moe_gate_up_*`. Routed ids are below `experts`
        // (the routing kernels choose among the logits' columns), so every
        // table index is below `entries`; every set entry points at a record
        // of at least `record_bytes >= min_record_bytes` bytes (checked when
        // set), cleared ones are 0 and never read; x holds rows x hidden and
        // act pairs x inter (checked above).
        unsafe { self.launch(&format!("moe_gate_up_{sfx}"), cfg, a) }?;
        let mut a = Args::new();
        a.buf(g, &slots.table_dev)
            .push(base)
            .buf(g, routes.ids())
            .buf(g, routes.weights())
            .push(kk)
            .buf(g, act.buf())
            .push(h)
            .push(i)
            .push(geo)
            .push(vec)
            .buf(g, out.buf())
            .push(between.unwrap_or_default());
        let mut cfg = blocks_cfg(spec.hidden.div_ceil(self.down_rows), rows)?;
        // The staged path's tile (kernels/decode/moe.cu), where it fits.
        let row_bytes = spec.inter * spec.ty.elem_bytes();
        let tile = k * self.down_rows * row_bytes;
        if self.down_stage && vec == 1 && row_bytes % 16 == 0 && tile <= super::DOWN_STAGE_MAX_BYTES
        {
            cfg.shared_mem_bytes = tile as u32;
        }
        let name = match tail {
            Some(t) => {
                a.push(t);
                format!("moe_down_norm_{sfx}")
            }
            None => format!("moe_down_{sfx}"),
        };
        // SAFETY: as above, reading act (pairs x inter) and the routed
        // weights (rows x top_k), writing out (rows x hidden), staging at
        // most the launch's dynamic shared memory (the kernel checks the
        // tile fits it), prefetching only lines inside `between`'s spans
        // (allocated matrices, or empty); each row's experts are summed in
        // routed (ascending id) order; top_k <= MAX_TOP_K fits the kernel's
        // shared products. With a tail, its buffers are rows x hidden
        // (checked where it was made) and its counter is 0 between launches.
        unsafe { self.launch(&name, cfg, a) }?;
        Ok(())
    }
}
