//! The routed experts' step on the device: gate/up with SiLU for every
//! (row, routed expert) pair, then each row's down projections summed in
//! routed (ascending id) order, the records found through the slots' table.

use super::buffers::DevAct;
use super::experts::{ExpertSlots, ExpertSpec};
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
        let io = (x, act, out);
        self.moe_ordered(
            slots,
            (layer_base, experts),
            routes,
            spec,
            io,
            BlockOrder::PairByPair,
        )
    }

    /// [`Self::moe`] in a chosen block order ([`BlockOrder`]); every
    /// order gives the same bits.
    pub fn moe_ordered(
        &self,
        slots: &ExpertSlots,
        (layer_base, experts): (usize, usize),
        routes: &DevRoutes,
        spec: &ExpertSpec,
        (x, act, out): (&DevAct, &mut DevAct, &mut DevAct),
        order: BlockOrder,
    ) -> Result<(), CudaError> {
        let pairs_fast = order == BlockOrder::PairsFast;
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
            .buf(g, act.buf())
            .push(i32::from(pairs_fast));
        let cfg = ordered_cfg(spec.inter.div_ceil(4), pairs, pairs_fast)?;
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
            .push(i32::from(pairs_fast));
        let cfg = ordered_cfg(spec.hidden.div_ceil(self.down_rows), rows, pairs_fast)?;
        // SAFETY: as above, reading act (pairs x inter) and the routed
        // weights (rows x top_k), writing out (rows x hidden); each row's
        // experts are summed in routed (ascending id) order; top_k <=
        // MAX_TOP_K fits the kernel's shared products.
        unsafe { self.launch(&format!("moe_down_{sfx}"), cfg, a) }?;
        Ok(())
    }
}

/// The order of a routed-expert launch's blocks (`moe_block` in moe.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockOrder {
    /// Every block of one (row, expert) pair, then the next pair's.
    PairByPair,
    /// One slice of output rows for every pair, then the next slice: rows
    /// sharing an expert read its same weight rows at about the same time,
    /// and L2 serves all but the first (a batch's rows often share
    /// experts).
    PairsFast,
}

/// The grid of `out_blocks` x `units` blocks: (out_blocks, units), or
/// (units, out_blocks) in pair-fastest order (`moe_block` in moe.cu).
fn ordered_cfg(
    out_blocks: usize,
    units: usize,
    pairs_fast: bool,
) -> Result<cudarc::driver::LaunchConfig, CudaError> {
    if pairs_fast {
        blocks_cfg(units, out_blocks.max(1))
    } else {
        blocks_cfg(out_blocks, units)
    }
}
