//! The CUDA device's routing and routed-expert steps: routing on the
//! device, the tiers made ready for a step's experts (one host sync for the
//! routed ids when experts stream), and a step whose rows need more
//! distinct experts than the tiers hold taken row by row.

use flashtier_cuda::ops::buffers::{DevAct, DevVector};
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
        self.timed(OpClass::Experts, bytes, || {
            Ok(self.kernels.moe(
                experts.slots(),
                base,
                per_layer,
                routes,
                &spec,
                x,
                &mut act,
                out,
            )?)
        })?;
        experts.consumed()
    }

    /// A step whose rows need more distinct experts than the tiers hold at
    /// once (a long prompt chunk under a small budget): rows one at a time.
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
