//! Routing on the device: from router logits to each row's chosen experts
//! (ascending id, the order their outputs are summed in) and weights, as
//! the engine's host reference (`flashtier_engine::family::route`) defines
//! them. One block per row; a one-row router product and its softmax
//! routing can run as one launch ([`DecodeKernels::router_softmax`]).
//!
//! A decode step routes every layer: the id and weight buffers are
//! recycled through a [`RoutePool`] (at most
//! [`POOL_PER_SIZE`](super::buffers::POOL_PER_SIZE) free pairs per size)
//! instead of allocated per call. Work runs in issue order on the compute
//! stream, so a pair recycled on the host is reused only by work queued
//! after every kernel that read it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::buffers::{DevAct, DevMatrix, DevVector};
use super::dense::check_many;
use super::pick::ROUTER_COUNTER;
use super::{DecodeKernels, dim};
use crate::context::Gpu;
use crate::error::CudaError;
use crate::launch::Args;

/// Most experts a router may score.
pub const MAX_EXPERTS: usize = 1024;
/// Most experts a row may choose.
pub const MAX_TOP_K: usize = 32;
/// Most expert groups.
pub const MAX_GROUPS: usize = 256;

/// Each row's chosen experts and weights, on the device.
pub struct DevRoutes {
    rows: usize,
    top_k: usize,
    /// Always `Some` until dropped (then handed back to `pool`).
    bufs: Option<RouteBufs>,
    pool: Arc<RoutePool>,
}

impl Drop for DevRoutes {
    fn drop(&mut self) {
        if let Some(pair) = self.bufs.take() {
            self.pool.give_back(pair);
        }
    }
}

/// One route set's buffers: ids and weights.
type RouteBufs = (CudaSlice<i32>, CudaSlice<f32>);

/// Free routing buffers by length (ids and weights of `rows * top_k`);
/// a pair past the bound is retired (kept until queued launches that may
/// read it are issued).
pub(crate) struct RoutePool {
    gpu: Gpu,
    free: Mutex<HashMap<usize, Vec<RouteBufs>>>,
}

impl RoutePool {
    pub(crate) fn new(gpu: Gpu) -> Self {
        Self {
            gpu,
            free: Mutex::default(),
        }
    }

    fn take(&self, len: usize) -> Option<RouteBufs> {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.get_mut(&len).and_then(Vec::pop)
    }

    fn give_back(&self, pair: RouteBufs) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let list = free.entry(pair.0.len()).or_default();
        if list.len() < super::buffers::POOL_PER_SIZE {
            list.push(pair);
        } else {
            self.gpu.retire(pair);
        }
    }
}

impl std::fmt::Debug for DevRoutes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevRoutes({} rows x top-{})", self.rows, self.top_k)
    }
}

impl DevRoutes {
    /// Rows routed.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Experts per row.
    #[must_use]
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    fn pair(&self) -> &RouteBufs {
        // DevRoutes holds its buffers until it is dropped.
        self.bufs
            .as_ref()
            .unwrap_or_else(|| unreachable!("DevRoutes without buffers"))
    }

    fn pair_mut(&mut self) -> &mut RouteBufs {
        self.bufs
            .as_mut()
            .unwrap_or_else(|| unreachable!("DevRoutes without buffers"))
    }

    /// The chosen ids, `rows x top_k`.
    pub(crate) fn ids(&self) -> &CudaSlice<i32> {
        &self.pair().0
    }

    /// The chosen weights, `rows x top_k`.
    pub(crate) fn weights(&self) -> &CudaSlice<f32> {
        &self.pair().1
    }

    /// The chosen ids and weights on the host, row-major (synchronises the
    /// compute stream).
    pub fn to_host(&self, k: &DecodeKernels) -> Result<(Vec<u32>, Vec<f32>), CudaError> {
        k.gpu().flush()?;
        let stream = k.gpu().stream();
        let ids = stream
            .clone_dtoh(self.ids())
            .map_err(CudaError::driver("copy routed ids"))?;
        let w = stream
            .clone_dtoh(self.weights())
            .map_err(CudaError::driver("copy routed weights"))?;
        Ok((ids.into_iter().map(|v| v as u32).collect(), w))
    }
}

fn check(logits: &DevAct, top_k: usize) -> Result<(), CudaError> {
    let e = logits.cols();
    if e == 0 || e > MAX_EXPERTS || top_k == 0 || top_k > MAX_TOP_K || top_k > e {
        return Err(CudaError::invalid(
            "routing",
            format!("top-{top_k} of {e} experts (at most {MAX_TOP_K} of {MAX_EXPERTS})"),
        ));
    }
    Ok(())
}

impl DecodeKernels {
    /// Buffers for `rows x top_k` routes: recycled, or new and zeroed.
    fn routes(&self, rows: usize, top_k: usize) -> Result<DevRoutes, CudaError> {
        let len = rows * top_k;
        let pair = match self.routes_pool.take(len) {
            Some(pair) => pair,
            None => {
                // Fresh memory no queued launch uses: no need to issue them.
                let stream = self.gpu.raw_stream();
                let ids = stream
                    .alloc_zeros::<i32>(len)
                    .map_err(CudaError::driver("allocate routed ids"))?;
                let weights = stream
                    .alloc_zeros::<f32>(len)
                    .map_err(CudaError::driver("allocate routed weights"))?;
                (ids, weights)
            }
        };
        Ok(DevRoutes {
            rows,
            top_k,
            bufs: Some(pair),
            pool: self.routes_pool.clone(),
        })
    }

    fn route_cfg(rows: usize, threads: u32) -> Result<LaunchConfig, CudaError> {
        Ok(LaunchConfig {
            grid_dim: (dim(rows, "x")?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Routes made on the host: `ids` and `weights` row-major, `top_k` a row.
    pub fn routes_from_host(
        &self,
        ids: &[u32],
        weights: &[f32],
        top_k: usize,
    ) -> Result<DevRoutes, CudaError> {
        if top_k == 0 || ids.len() != weights.len() || ids.len() % top_k != 0 {
            return Err(CudaError::invalid(
                "routes",
                format!(
                    "{} ids and {} weights of top-{top_k}",
                    ids.len(),
                    weights.len()
                ),
            ));
        }
        let stream = self.gpu.stream();
        let host_ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let pair = (
            stream
                .clone_htod(&host_ids)
                .map_err(CudaError::driver("upload routed ids"))?,
            stream
                .clone_htod(weights)
                .map_err(CudaError::driver("upload routed weights"))?,
        );
        Ok(DevRoutes {
            rows: ids.len() / top_k,
            top_k,
            bufs: Some(pair),
            pool: self.routes_pool.clone(),
        })
    }

    /// Softmax over each row's logits, the top `top_k`, renormalised when `norm`.
    pub fn route_softmax(
        &self,
        logits: &DevAct,
        top_k: usize,
        norm: bool,
    ) -> Result<DevRoutes, CudaError> {
        check(logits, top_k)?;
        let mut r = self.routes(logits.rows(), top_k)?;
        let (n, k, nm) = (logits.cols() as i32, top_k as i32, i32::from(norm));
        let (ids, weights) = r.pair_mut();
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, logits.buf())
            .push(n)
            .push(k)
            .push(nm)
            .buf(g, ids)
            .buf(g, weights);
        // SAFETY: matches `route_softmax`; one block per row reads its n
        // logits (n <= MAX_EXPERTS, the kernel's shared arrays) and writes
        // top_k ids and weights (top_k <= MAX_TOP_K) into buffers of
        // rows x top_k.
        unsafe { self.launch("route_softmax", Self::route_cfg(logits.rows(), 256)?, a) }?;
        Ok(r)
    }

    /// `logits = w x` for a one-row `x` and its softmax routing (as
    /// [`Self::route_softmax`]) in one launch: the logits and routes are
    /// the bits [`Self::gemv`] then [`Self::route_softmax`] give.
    pub fn router_softmax(
        &self,
        w: &DevMatrix,
        x: &DevAct,
        logits: &mut DevAct,
        top_k: usize,
        norm: bool,
    ) -> Result<DevRoutes, CudaError> {
        if x.rows() != 1 {
            return Err(CudaError::invalid(
                "router",
                format!("{} rows (one at a time)", x.rows()),
            ));
        }
        let outs = [logits];
        check_many(&outs, &[w], x)?;
        let [logits] = outs;
        check(logits, top_k)?;
        let (mut a, cfg) = self.gemv_pass(std::slice::from_ref(&logits), &[w], x, 0, 1)?;
        let mut r = self.routes(1, top_k)?;
        let g = &self.gpu;
        let counter = self.scratch.counter(g, ROUTER_COUNTER);
        let (ids, weights) = r.pair_mut();
        a.push(top_k as i32)
            .push(i32::from(norm))
            .buf(g, ids)
            .buf(g, weights)
            .push(counter);
        let f = format!("router_softmax_{}", w.ty().suffix());
        // SAFETY: matches `router_softmax_*`: its first ten arguments are
        // gemv1's for `w` over the one row of `x` into `logits` (shapes
        // checked by `check_many`; see `gemv_many`), then the routing of
        // those logits as `route_softmax` (n = w.rows() <= MAX_EXPERTS and
        // top_k <= MAX_TOP_K, checked) into buffers of top_k; the counter
        // is 0 between launches (stream order; the last block resets it).
        unsafe { self.launch(&f, cfg, a) }?;
        Ok(r)
    }

    /// DeepSeek-V3's grouped sigmoid routing (see the kernel).
    #[allow(clippy::too_many_arguments, reason = "the routing rule's parameters")]
    pub fn route_sigmoid_groups(
        &self,
        logits: &DevAct,
        bias: Option<&DevVector>,
        top_k: usize,
        n_group: usize,
        topk_group: usize,
        scaling: f32,
        norm: bool,
    ) -> Result<DevRoutes, CudaError> {
        check(logits, top_k)?;
        let e = logits.cols();
        let ok = n_group > 0
            && n_group <= MAX_GROUPS
            && e % n_group == 0
            && topk_group > 0
            && topk_group <= n_group
            && top_k <= topk_group * (e / n_group)
            && bias.is_none_or(|b| b.len() == e);
        if !ok {
            return Err(CudaError::invalid(
                "routing",
                format!("{n_group} groups (choose {topk_group}) of {e} experts, top-{top_k}"),
            ));
        }
        let mut r = self.routes(logits.rows(), top_k)?;
        let g = &self.gpu;
        let zero_bias = match bias {
            Some(_) => None,
            // Fresh memory no queued launch uses.
            None => Some(
                g.raw_stream()
                    .alloc_zeros::<f32>(e)
                    .map_err(CudaError::driver("allocate zero bias"))?,
            ),
        };
        let bias_buf = bias
            .map(DevVector::data)
            .or(zero_bias.as_ref())
            .ok_or_else(|| CudaError::invalid("routing", "no bias".to_string()))?;
        let v = [e, top_k, n_group, topk_group].map(|v| v as i32);
        let nm = i32::from(norm);
        let (ids, weights) = r.pair_mut();
        let mut a = Args::new();
        a.buf(g, logits.buf()).buf(g, bias_buf);
        for x in v {
            a.push(x);
        }
        a.push(scaling).push(nm).buf(g, ids).buf(g, weights);
        // SAFETY: matches `route_sigmoid_groups`; as `route_softmax`, plus a
        // bias of e values and n_group <= MAX_GROUPS (one thread per group);
        // the zero bias is retired, kept until the launch was issued.
        unsafe {
            self.launch(
                "route_sigmoid_groups",
                Self::route_cfg(logits.rows(), 256)?,
                a,
            )
        }?;
        if let Some(z) = zero_bias {
            g.retire(z);
        }
        Ok(r)
    }
}
