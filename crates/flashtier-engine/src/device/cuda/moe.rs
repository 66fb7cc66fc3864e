//! The CUDA device's routing and routed-expert steps: routing on the
//! device, the tiers made ready for a step's experts (one host sync for the
//! routed ids when experts stream), and a step whose rows need more
//! distinct experts than the tiers hold taken in groups of rows whose
//! experts fit.
//!
//! A step of several rows (a prompt chunk) runs its experts grouped by
//! expert (`DecodeKernels::moe_grouped`): each pair's output does not depend
//! on which rows run with it, so the groups a small budget needs give the
//! bits the whole chunk gives when every expert is resident. One-row steps
//! (decode) keep the GEMV kernels.

use flashtier_cuda::ops::MAX_GEMV_ROWS;
use flashtier_cuda::ops::buffers::{DevAct, DevVector};
use flashtier_cuda::ops::moe::BlockOrder;
use flashtier_cuda::ops::route::DevRoutes;

use super::CudaDevice;
use super::experts::CudaExperts;
use super::profile::OpClass;
use crate::config::Routing;
use crate::device::Device;
use crate::error::EngineError;
use crate::family::route::RouteRule;

impl CudaDevice {
    pub(super) fn route_now(
        &self,
        logits: &DevAct,
        rule: &RouteRule,
        bias: Option<&DevVector>,
    ) -> Result<DevRoutes, EngineError> {
        let r = match rule.routing {
            Routing::Softmax => {
                self.kernels
                    .route_softmax(logits, rule.top_k, rule.norm_topk_prob)?
            }
            Routing::SigmoidGroups {
                n_group,
                topk_group,
                routed_scaling_factor,
            } => self.kernels.route_sigmoid_groups(
                logits,
                bias,
                rule.top_k,
                n_group,
                topk_group,
                routed_scaling_factor,
                rule.norm_topk_prob,
            )?,
        };
        Ok(r)
    }

    /// The routed experts of every row into `out`: the tiers made ready for
    /// the step's experts, then the kernels. A step of several rows runs
    /// grouped by expert (more than [`MAX_GEMV_ROWS`] rows), one whose rows
    /// need more distinct experts than the tiers hold in groups of rows.
    pub(super) fn moe_step(
        &self,
        experts: &mut CudaExperts,
        layer: usize,
        x: &DevAct,
        routes: &DevRoutes,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        self.all_resident.set(experts.resident_all());
        // Up to a GEMV pass of rows (a batch's decode tokens), each row's
        // pairs run as decode products: the router stays on the device and
        // no tile of 64 rows is launched for a handful. Longer steps (prompt
        // chunks) run grouped by expert.
        if x.rows() > MAX_GEMV_ROWS && self.kernels.grouped(experts.spec()) {
            return self.moe_grouped(experts, layer, x, routes, out);
        }
        if !experts.resident_all() {
            let (ids, _) = routes.to_host(&self.kernels)?;
            let cap = experts.step_capacity();
            let mut distinct = ids.clone();
            distinct.sort_unstable();
            distinct.dedup();
            if distinct.len() > cap {
                return self.moe_in_groups(experts, layer, x, routes, &ids, out);
            }
            experts.ensure(layer, &ids)?;
        } else {
            experts.ensure(layer, &[])?;
        }
        self.moe_rows(experts, layer, x, routes, out)
    }

    /// The routed experts of every row, all of whose records are readable.
    pub(super) fn moe_rows(
        &self,
        experts: &mut CudaExperts,
        layer: usize,
        x: &DevAct,
        routes: &DevRoutes,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let spec = *experts.spec();
        let pairs = x.rows() * routes.top_k();
        let mut act = self.zeros(pairs, spec.inter)?;
        let base = experts.entry(layer, 0);
        let per_layer = experts.experts_per_layer();
        let bytes = (pairs * 3 * spec.hidden * spec.inter * spec.ty.elem_bytes()) as u64;
        // Rows sharing an expert read it side by side (the same bits).
        let pairs_fast = self.moe_pairs_fast && (2..=MAX_GEMV_ROWS).contains(&x.rows());
        let order = if pairs_fast {
            BlockOrder::PairsFast
        } else {
            BlockOrder::PairByPair
        };
        self.timed(OpClass::Experts, bytes, || {
            let io = (x, &mut act, &mut *out);
            let tier = (base, per_layer);
            Ok(self
                .kernels
                .moe_ordered(experts.slots(), tier, routes, &spec, io, order)?)
        })?;
        experts.consumed()
    }

    /// A step of several rows, grouped by expert: the whole step when every
    /// expert is resident (grouped on the device unless
    /// `FLASHTIER_DEVICE_GROUPS=0`), else runs of consecutive rows whose
    /// distinct experts fit the tiers at once (one row at least; grouped on
    /// the host, which needs the ids to make the experts ready anyway),
    /// each made ready, run and marked consumed before the next.
    pub(super) fn moe_grouped(
        &self,
        experts: &mut CudaExperts,
        layer: usize,
        x: &DevAct,
        routes: &DevRoutes,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let spec = *experts.spec();
        let (rows, k) = (x.rows(), routes.top_k());
        let mut act = self.zeros(rows * k, spec.inter)?;
        let mut y = self.zeros(rows * k, spec.hidden)?;
        let per_layer = experts.experts_per_layer();
        if experts.resident_all() && self.kernels.device_groups() {
            // Every expert in HBM: the whole step, grouped on the device
            // (no host round trip for the routed ids).
            experts.ensure(layer, &[])?;
            let base = experts.entry(layer, 0);
            // At most every expert of the layer is read (the distinct count
            // stays on the device).
            let touched = per_layer.min(rows * k);
            let bytes = (touched * 3 * spec.hidden * spec.inter * spec.ty.elem_bytes()) as u64;
            self.timed(OpClass::Experts, bytes, || {
                Ok(self.kernels.moe_grouped(
                    experts.slots(),
                    (base, per_layer),
                    routes,
                    None,
                    0..rows,
                    &spec,
                    x,
                    (&mut act, &mut y),
                    out,
                )?)
            })?;
            return experts.consumed();
        }
        let (ids, _) = routes.to_host(&self.kernels)?;
        let cap = if experts.resident_all() {
            usize::MAX
        } else {
            experts.step_capacity()
        };
        let mut start = 0;
        while start < rows {
            // The longest run of rows from `start` whose distinct experts
            // fit (one row at least: a row's own experts always fit).
            let mut chosen = vec![false; per_layer];
            let mut distinct = 0usize;
            let mut end = start;
            while end < rows {
                let row = &ids[end * k..(end + 1) * k];
                let mut fresh = 0;
                for &e in row {
                    match chosen.get(e as usize) {
                        Some(false) => fresh += 1,
                        Some(true) => {}
                        None => {
                            return Err(EngineError::ExpertOutOfRange {
                                layer,
                                expert: e as usize,
                            });
                        }
                    }
                }
                if end > start && distinct + fresh > cap {
                    break;
                }
                for &e in row {
                    chosen[e as usize] = true;
                }
                distinct += fresh;
                end += 1;
            }
            if experts.resident_all() {
                experts.ensure(layer, &[])?;
            } else {
                experts.ensure(layer, &ids[start * k..end * k])?;
            }
            let base = experts.entry(layer, 0);
            let bytes = (distinct * 3 * spec.hidden * spec.inter * spec.ty.elem_bytes()) as u64;
            self.timed(OpClass::Experts, bytes, || {
                Ok(self.kernels.moe_grouped(
                    experts.slots(),
                    (base, per_layer),
                    routes,
                    Some(&ids),
                    start..end,
                    &spec,
                    x,
                    (&mut act, &mut y),
                    out,
                )?)
            })?;
            experts.consumed()?;
            start = end;
        }
        Ok(())
    }

    /// A step whose rows need more distinct experts than the tiers hold at
    /// once (a long prompt chunk under a small budget) when the experts'
    /// widths cannot run grouped: rows one at a time.
    pub(super) fn moe_in_groups(
        &self,
        experts: &mut CudaExperts,
        layer: usize,
        x: &DevAct,
        routes: &DevRoutes,
        ids: &[u32],
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let k = routes.top_k();
        let h = x.cols();
        let (_, weights) = routes.to_host(&self.kernels)?;
        let xs = x.to_host(self.gpu.stream())?;
        let mut all = Vec::with_capacity(x.rows() * h);
        for r in 0..x.rows() {
            let row_ids = &ids[r * k..(r + 1) * k];
            experts.ensure(layer, row_ids)?;
            let mut xr = self.zeros(1, h)?;
            xr.upload(self.gpu.stream(), &xs[r * h..(r + 1) * h])?;
            let one = self
                .kernels
                .routes_from_host(row_ids, &weights[r * k..(r + 1) * k], k)?;
            let mut yr = self.zeros(1, h)?;
            self.moe_rows(experts, layer, &xr, &one, &mut yr)?;
            all.extend(yr.to_host(self.gpu.stream())?);
        }
        out.upload(self.gpu.stream(), &all)?;
        Ok(())
    }
}
