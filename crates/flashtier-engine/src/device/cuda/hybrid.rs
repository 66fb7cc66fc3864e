//! [`HybridOps`] on the GPU: Qwen4-Exp's operations as the kernels of
//! `flashtier_cuda::ops::hybrid` and `flashtier_cuda::ops::sparse` (f32
//! states and accumulation, sums in orders fixed by the shapes). The
//! sparse layers' caches live in HBM and grow with the sequence; the
//! indexer keeps the blocks torch's CPU `topk` keeps, ties included.

use flashtier_cuda::ops::buffers::{DevAct, DevVector, RopeTable};
use flashtier_cuda::ops::hybrid::{DeltaHeads, MapFn};
use flashtier_cuda::ops::landing::RowLanding;
use flashtier_cuda::ops::sparse::{DevSparse, SparseGeometry, SparseStep};

use super::CudaDevice;
use super::profile::OpClass;
use crate::device::Device;
use crate::device::hybrid::{ConvSpec, DeltaSpec, HybridOps, Map, SparseSpec, SparseState};
use crate::error::EngineError;

impl SparseState for DevSparse {
    fn len(&self) -> usize {
        DevSparse::len(self)
    }
    fn capacity(&self) -> usize {
        DevSparse::capacity(self)
    }
}

impl HybridOps for CudaDevice {
    type Sparse = DevSparse;
    type Landing = RowLanding;

    fn state(&self, rows: usize, cols: usize) -> Result<DevAct, EngineError> {
        let mut x = self.zeros(rows, cols)?;
        self.kernels.zero(&mut x)?;
        Ok(x)
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<DevAct, EngineError> {
        let mut x = self.zeros(rows, cols)?;
        // The copy goes to the stream: issue what is queued first.
        self.gpu.flush()?;
        x.upload(self.gpu.stream(), data)?;
        Ok(x)
    }

    fn landing(&self, cols: usize) -> Result<RowLanding, EngineError> {
        Ok(RowLanding::new(&self.gpu, cols)?)
    }

    fn land(&self, at: &mut RowLanding, rows: usize, data: &[f32]) -> Result<(), EngineError> {
        Ok(at.land(rows, data)?)
    }

    fn landed<'a>(&self, at: &'a RowLanding) -> Result<&'a DevAct, EngineError> {
        Ok(at.rows()?)
    }

    fn landed_read(&self, at: &mut RowLanding) -> Result<(), EngineError> {
        Ok(at.read_done()?)
    }

    fn rms_norm_wide(
        &self,
        out: &mut DevAct,
        x: &DevAct,
        w: &DevVector,
        group: usize,
        eps: f32,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.rms_norm_wide(out, x, w, group, eps)?)
        })
    }

    fn map(&self, x: &mut DevAct, f: Map) -> Result<(), EngineError> {
        let f = map_fn(f);
        self.timed(OpClass::Other, 0, || Ok(self.kernels.map(x, f)?))
    }

    fn mul_sigmoid(&self, x: &mut DevAct, gate: &DevAct) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.mul_sigmoid(x, gate)?)
        })
    }

    fn hc_mix(
        &self,
        out: &mut DevAct,
        gates: &DevAct,
        normed: &DevAct,
        streams: usize,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.hc_mix(out, gates, normed, streams)?)
        })
    }

    fn hc_inject(
        &self,
        x: &mut DevAct,
        y: &DevAct,
        w: &DevAct,
        gate: Map,
    ) -> Result<(), EngineError> {
        let gate = map_fn(gate);
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.hc_inject(x, y, w, gate)?)
        })
    }

    fn causal_conv(
        &self,
        state: &mut DevAct,
        x: &DevAct,
        w: &DevVector,
        spec: ConvSpec,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self
                .kernels
                .causal_conv(state, x, w, (spec.kernel, spec.dilation), out)?)
        })
    }

    fn gated_delta(
        &self,
        state: &mut DevAct,
        mixed: &DevAct,
        ba: (&DevAct, &DevAct),
        a_exp: &DevVector,
        dt_bias: &DevVector,
        spec: DeltaSpec,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let heads = DeltaHeads {
            k_heads: spec.k_heads,
            v_heads: spec.v_heads,
            k_dim: spec.k_dim,
            v_dim: spec.v_dim,
        };
        // The state is read twice and written twice per row.
        let bytes = 4 * (state.rows() * state.cols() * 4 * mixed.rows()) as u64;
        self.timed(OpClass::Attention, bytes, || {
            Ok(self
                .kernels
                .gated_delta(state, mixed, ba, (a_exp, dt_bias), heads, out)?)
        })
    }

    fn gated_norm(
        &self,
        out: &mut DevAct,
        oz: (&DevAct, &DevAct),
        w: &DevVector,
        eps: f32,
        sigmoid_gate: bool,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.gated_norm(out, oz, w, eps, sigmoid_gate)?)
        })
    }

    fn ple_gate(
        &self,
        gated: &mut DevAct,
        key_query: (&DevAct, &DevAct),
        value: &DevAct,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.ple_gate(gated, key_query, value)?)
        })
    }

    fn sparse_cache(&self, spec: &SparseSpec) -> Result<DevSparse, EngineError> {
        let geo = SparseGeometry {
            capacity: spec.capacity,
            q_heads: spec.q_heads,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            index_heads: spec.index_heads,
            index_dim: spec.index_dim,
            ratio: spec.ratio,
            keep: spec.keep,
            rope_dims: spec.rope_dims,
            eps: spec.eps,
        };
        Ok(DevSparse::new(&self.gpu, geo)?)
    }

    fn sparse_clear(&self, cache: &mut DevSparse) -> Result<(), EngineError> {
        cache.clear();
        Ok(())
    }

    fn sparse_attend(
        &self,
        cache: &mut DevSparse,
        (q, k, v): (&DevAct, &DevAct, &DevAct),
        (iq, ik): (&DevAct, &DevAct),
        k_norm: &DevVector,
        table: &RopeTable,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let end = cache.len() + q.rows();
        let max = cache.capacity().min(table.positions());
        if end > max {
            return Err(EngineError::ContextFull { len: end, max });
        }
        // Keys and values of every position attended at most, read once.
        let g = cache.geometry();
        let kept = (g.keep + 1) * g.ratio;
        let bytes = 2 * (q.rows() * kept.min(end) * g.kv_heads * g.head_dim * 4) as u64;
        let step = SparseStep {
            q,
            k,
            v,
            iq,
            ik,
            k_norm,
            table,
        };
        self.timed(OpClass::Attention, bytes, || {
            Ok(self.kernels.sparse_attend(cache, step, out)?)
        })
    }
}

/// The kernels' form of a map.
fn map_fn(f: Map) -> MapFn {
    match f {
        Map::Silu { div } => MapFn::Silu { div },
        Map::Sigmoid { div, mul } => MapFn::Sigmoid { div, mul },
    }
}
