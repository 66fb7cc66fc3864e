//! The CUDA device: the engine's forward pass on an NVIDIA GPU, through the
//! kernels of `flashtier-cuda` (loaded dynamically: this builds, and says
//! "no CUDA driver", on a machine without one).
//!
//! Memory: activations are f32 in HBM, drawn from a recycling pool; weights
//! stay in their stored form (BF16/F16/F32 bytes, FP8 codes with F32 block
//! scales) in HBM; the KV cache is f32 in HBM, within a KV budget when
//! one is set (older chunks offloaded to a KV store and restored for
//! every attention, [`kv`]); experts come from
//! [`experts::CudaExperts`] (HBM slots over a pinned RAM tier over the
//! drive). Kernels accumulate in f32 in a fixed order, so a run's output
//! does not depend on the budgets or on the order reads land in.
//!
//! Host syncs per layer: none when every expert is resident in HBM; one
//! (the routed ids) when experts stream, to decide residency.
//!
//! Launches: when every expert is resident, a one-token step (from its
//! embedding to the logits' copy to the host) records: its launches queue
//! and go out in segments, each a CUDA graph once its shape repeats
//! ([`flashtier_cuda::launch`]); the kernels and their arguments are the
//! same as launched one by one, so the output is bit-identical.
//! [`CudaDevice::set_graphs`] (or `FLASHTIER_CUDA_GRAPHS=0`) turns this off;
//! profiling and streamed steps launch one by one. Inside the graphs the
//! kernels that wait on their predecessor themselves start early
//! (programmatic dependent launch, see `flashtier_cuda::launch`), and a
//! prefetch hint asks L2 for the attention's output product while the
//! attention runs ([`Device::prefetch`]; `FLASHTIER_PREFETCH=0`: none).
//!
//! A one-row softmax router runs as one launch with its routing
//! (`FLASHTIER_FUSED_ROUTER=0`: two, the same bits); a greedy decode step
//! picks its token on the device and copies one id back. Greedy steps
//! chain ([`Device::pick_ahead`], `FLASHTIER_CHAIN=0`: off): the next step
//! embeds the pick on the device and is issued before the host reads the
//! id, so the GPU does not wait for the host between steps (a step issued
//! on a stop token is undone: the KV cache takes its position back).

pub mod experts;
mod hybrid;
pub mod kv;
mod moe;
pub mod profile;

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::attn::{DecodeRows, DevKvCache};
use flashtier_cuda::ops::buffers::{ActPool, DevAct, DevMatrix, DevVector, RopeTable, WeightType};
use flashtier_cuda::ops::norm::MAX_ROPE_DIMS;
use flashtier_cuda::ops::route::DevRoutes;
use flashtier_cuda::{Gpu, GraphStats};
use flashtier_format::Dtype;

use crate::config::Routing;
use crate::device::{
    Activation, Device, HeadCopy, KvSpec, KvState, PickTicket, RopeSpec, VectorLen,
};
use crate::error::EngineError;
use crate::family::route::RouteRule;
use crate::matrix::{Matrix, MatrixData};
use experts::CudaExperts;
use kv::{CudaKv, KvBudget};
use profile::{ClassTime, OpClass, Profiler};

impl Activation for DevAct {
    fn rows(&self) -> usize {
        DevAct::rows(self)
    }
    fn cols(&self) -> usize {
        DevAct::cols(self)
    }
}

impl VectorLen for DevVector {
    fn len(&self) -> usize {
        DevVector::len(self)
    }
}

/// Rows from which a matrix counts as the LM head in the profile.
const LM_HEAD_ROWS: usize = 32_768;

/// Most rows of one prompt step on the GPU: a 256-row chunk of a
/// 128-expert top-8 model gives each expert 16 rows, half a tensor-core
/// tile, and reads every expert's weights once per chunk; 1024 rows fill
/// the tiles and read them a quarter as often.
pub const PROMPT_ROWS: usize = crate::settings::DEFAULT_PROMPT_ROWS;
/// Most bytes of the prompt attention's split partials that a larger
/// prompt step may take (a step of one chunk may take more: the partials
/// grow with the context).
pub const PROMPT_PARTIAL_BYTES: usize = 256 << 20;

/// One NVIDIA GPU.
pub struct CudaDevice {
    gpu: Gpu,
    kernels: DecodeKernels,
    pool: Rc<ActPool>,
    profiler: Profiler,
    /// Every expert was resident at the last routed step: one-token steps
    /// may record.
    all_resident: Cell<bool>,
    /// The KV budget caches made from now on take ([`kv`]).
    kv_budget: RefCell<Option<KvBudget>>,
    /// One-row softmax routing as one launch with its router product
    /// (`FLASHTIER_FUSED_ROUTER=0`: the product, then the routing; the
    /// same bits either way).
    fused_router: bool,
    /// Prefetch hints in recorded steps (`FLASHTIER_PREFETCH=0`: none).
    prefetch_on: bool,
    /// Greedy decodes leave their picks on the device and issue the next
    /// step before reading them (`FLASHTIER_CHAIN=0`: every step waits for
    /// its token first; the same tokens either way).
    chain: Cell<bool>,
    /// A batched decode step's sequences attend in one launch per kernel
    /// when their KV is all in HBM (`FLASHTIER_ROWS_ATTN=0`: each alone;
    /// the same bits either way), with the step's table of rows.
    rows_attn: Option<RefCell<DecodeRows>>,
    /// A step of 2 to 8 rows runs its expert blocks pair-fastest, so rows
    /// sharing an expert read it from L2 (`FLASHTIER_MOE_PAIRS_FAST=0`:
    /// pair by pair; the same bits either way).
    moe_pairs_fast: bool,
    /// Most rows of one prompt step (`FLASHTIER_PROMPT_ROWS`, default
    /// [`PROMPT_ROWS`]).
    prompt_rows: usize,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("gpu", &self.gpu.info().name)
            .finish()
    }
}

impl CudaDevice {
    /// Open GPU `ordinal` and compile the kernels for it.
    pub fn open(ordinal: usize) -> Result<Self, EngineError> {
        let gpu = Gpu::open(ordinal)?;
        let s = crate::settings::CudaSettings::read(&flashtier_io::settings::Env::process())?;
        let kernels = DecodeKernels::new(&gpu)?;
        Ok(Self {
            gpu,
            kernels,
            pool: ActPool::new(),
            profiler: Profiler::default(),
            all_resident: Cell::new(false),
            kv_budget: RefCell::new(None),
            fused_router: s.fused_router,
            prefetch_on: s.prefetch,
            chain: Cell::new(s.chain),
            rows_attn: s.rows_attn.then(|| RefCell::new(DecodeRows::new())),
            moe_pairs_fast: s.moe_pairs_fast,
            prompt_rows: s.prompt_rows,
        })
    }

    /// Start recording a one-row step (its embedding is the first launch)
    /// when every expert is resident and no profile is taken.
    fn begin_one_row_step(&self) -> Result<(), EngineError> {
        if self.all_resident.get() && !self.profiler.on() {
            self.gpu.begin_step()?;
        }
        Ok(())
    }

    /// Let a greedy decode issue its next step before it reads the token
    /// (on by default, `FLASHTIER_CHAIN=0` off): the step embeds the pick on
    /// the device, so the GPU does not wait for the host between steps. The
    /// same tokens either way.
    pub fn set_chain(&self, on: bool) {
        self.chain.set(on);
    }

    /// Record one-token steps as CUDA graphs (on by default; off, every
    /// kernel launches one by one, with the same results).
    pub fn set_graphs(&self, on: bool) {
        self.gpu.set_graphs(on);
    }

    /// What the launch path did so far (kernels launched one by one,
    /// graphs built and launched, nodes rewritten).
    #[must_use]
    pub fn graph_stats(&self) -> GraphStats {
        self.gpu.graph_stats()
    }

    /// Start timing every operation by kernel class (see [`profile`]).
    pub fn profile_start(&self) {
        self.profiler.start();
    }

    /// Stop timing; device seconds and bytes read per kernel class.
    pub fn profile_take(&self) -> Result<Vec<ClassTime>, EngineError> {
        self.profiler.take()
    }

    fn timed<T>(
        &self,
        class: OpClass,
        bytes: u64,
        op: impl FnOnce() -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let out = self.profiler.time(&self.gpu, class, bytes, op);
        if out.is_err() {
            // A failed step issues what it queued before the error is
            // returned, as if each kernel had launched at once.
            let _ = self.gpu.flush();
        }
        out
    }

    /// Times a product over `rows` rows of width `k` reads its weights:
    /// once per tile of rows when tiled, once per GEMV pass otherwise.
    fn weight_passes(&self, k: usize, rows: usize) -> u64 {
        let per = if self.kernels.tiled(k, rows) {
            self.kernels.tile_shapes().0.rows()
        } else {
            flashtier_cuda::ops::MAX_GEMV_ROWS
        };
        rows.div_ceil(per) as u64
    }

    /// Keep KV caches made from now on within `budget` of HBM, the rest
    /// offloaded to a KV store (`None`: every position in HBM).
    pub fn set_kv_budget(&self, budget: Option<KvBudget>) {
        *self.kv_budget.borrow_mut() = budget;
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The kernels.
    pub fn kernels(&self) -> &DecodeKernels {
        &self.kernels
    }

    /// Wait for everything queued.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        self.gpu.flush()?;
        Ok(self.gpu.synchronize()?)
    }
}

/// Positions `first..first + rows` must have RoPE table rows: the context
/// is full otherwise.
fn fits_table(table: &RopeTable, first: usize, rows: usize) -> Result<(), EngineError> {
    if first + rows > table.positions() {
        return Err(EngineError::ContextFull {
            len: first + rows,
            max: table.positions(),
        });
    }
    Ok(())
}

fn weight_type(dtype: Dtype) -> Result<WeightType, EngineError> {
    match dtype {
        Dtype::Bf16 => Ok(WeightType::Bf16),
        Dtype::F16 => Ok(WeightType::F16),
        Dtype::F32 => Ok(WeightType::F32),
        other => Err(EngineError::Layout {
            what: "a weight matrix on the GPU".into(),
            reason: format!("dtype {} has no kernel", other.name()),
        }),
    }
}

impl Device for CudaDevice {
    type Act = DevAct;
    type Mat = DevMatrix;
    type Vector = DevVector;
    type Kv = CudaKv;
    type Rope = RopeTable;
    type Routes = DevRoutes;
    type Experts = CudaExperts;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn issues_async(&self) -> bool {
        true
    }

    /// Up to [`PROMPT_ROWS`] rows (`FLASHTIER_PROMPT_ROWS`), as long as the prompt attention's split
    /// partials (rows x query heads x splits of `len` positions x (head +
    /// 2) f32) stay within [`PROMPT_PARTIAL_BYTES`]; one chunk under a KV
    /// budget, whose window is sized for one chunk's positions a step.
    fn prompt_rows(&self, spec: &KvSpec, len: usize) -> usize {
        if self.kv_budget.borrow().is_some() {
            return crate::model::PREFILL_CHUNK;
        }
        let splits = len
            .div_ceil(flashtier_cuda::ops::attn::CHUNK_POSITIONS)
            .max(1);
        let per_row = spec
            .q_heads
            .saturating_mul(splits)
            .saturating_mul(spec.head_dim + 2)
            .saturating_mul(4)
            .max(1);
        self.prompt_rows.min(PROMPT_PARTIAL_BYTES / per_row)
    }

    fn matrix(&self, m: Matrix) -> Result<DevMatrix, EngineError> {
        let (rows, cols) = (m.rows(), m.cols());
        let up = match m.data() {
            MatrixData::Raw { bytes, dtype } => {
                DevMatrix::upload(&self.gpu, rows, cols, weight_type(*dtype)?, bytes, None)
            }
            MatrixData::F8 {
                codes,
                scales,
                block,
            } => DevMatrix::upload(
                &self.gpu,
                rows,
                cols,
                WeightType::Fp8 { block: *block },
                codes,
                Some(scales),
            ),
        };
        Ok(up?)
    }

    fn vector(&self, v: Vec<f32>) -> Result<DevVector, EngineError> {
        Ok(DevVector::upload(&self.gpu, &v)?)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<DevAct, EngineError> {
        Ok(self.pool.take(&self.gpu, rows, cols)?)
    }

    fn rope_table(
        &self,
        inv_freq: &[f32],
        factor: f32,
        positions: usize,
    ) -> Result<RopeTable, EngineError> {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            let (c, s) = crate::device::cpu::kernels::rope_angles(p, inv_freq, factor);
            cos.extend(c);
            sin.extend(s);
        }
        Ok(RopeTable::upload(&self.gpu, positions, half, &cos, &sin)?)
    }

    fn kv_cache(&self, spec: &KvSpec) -> Result<CudaKv, EngineError> {
        CudaKv::new(&self.gpu, spec, self.kv_budget.borrow().as_ref())
    }

    fn embed(&self, out: &mut DevAct, table: &DevMatrix, ids: &[u32]) -> Result<(), EngineError> {
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= table.rows()) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: table.rows(),
            });
        }
        if ids.len() == 1 {
            self.begin_one_row_step()?;
        }
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.embed(out, table, ids)?)
        })
    }

    fn linear(&self, out: &mut DevAct, w: &DevMatrix, x: &DevAct) -> Result<(), EngineError> {
        // The LM head is the only matrix this tall.
        let class = if w.rows() >= LM_HEAD_ROWS {
            OpClass::LmHead
        } else {
            OpClass::DenseGemv
        };
        let passes = self.weight_passes(w.cols(), x.rows());
        self.timed(class, passes * w.bytes() as u64, || {
            Ok(self.kernels.products(&mut [out], &[w], x)?)
        })
    }

    fn rms_norm(
        &self,
        out: &mut DevAct,
        x: &DevAct,
        w: &DevVector,
        eps: f32,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.rms_norm(out, x, w, eps)?)
        })
    }

    fn add_norm(
        &self,
        x: &mut DevAct,
        y: &DevAct,
        w: &DevVector,
        eps: f32,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.add_rms_norm(x, y, w, eps, out)?)
        })
    }

    fn linear_many(
        &self,
        outs: &mut [&mut DevAct],
        ws: &[&DevMatrix],
        x: &DevAct,
    ) -> Result<(), EngineError> {
        let same = ws.windows(2).all(|p| p[0].ty() == p[1].ty());
        if !same || ws.len() > 4 {
            for (o, w) in outs.iter_mut().zip(ws) {
                self.linear(o, w, x)?;
            }
            return Ok(());
        }
        let passes = self.weight_passes(x.cols(), x.rows());
        let bytes: u64 = ws.iter().map(|w| w.bytes() as u64).sum();
        self.timed(OpClass::DenseGemv, passes * bytes, || {
            Ok(self.kernels.products(outs, ws, x)?)
        })
    }

    fn prefetch(&self, ws: &[&DevMatrix]) -> Result<(), EngineError> {
        // Only recorded steps: there the prefetch starts while the kernels
        // before it run; launched one by one it would only add a launch.
        if !self.prefetch_on || !self.gpu.recording() || ws.is_empty() || ws.len() > 4 {
            return Ok(());
        }
        self.timed(OpClass::Other, 0, || Ok(self.kernels.prefetch(ws)?))
    }

    fn hints_wanted(&self, experts: &CudaExperts) -> bool {
        !experts.resident_all()
    }

    fn add(&self, x: &mut DevAct, y: &DevAct) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || Ok(self.kernels.add(x, y)?))
    }

    fn add_bias(&self, x: &mut DevAct, b: &DevVector) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || Ok(self.kernels.add_bias(x, b)?))
    }

    fn silu_mul(&self, gate: &mut DevAct, up: &DevAct) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || Ok(self.kernels.silu_mul(gate, up)?))
    }

    fn add_gated(&self, acc: &mut DevAct, y: &DevAct, gate: &DevAct) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.add_gated(acc, y, gate)?)
        })
    }

    fn rope(
        &self,
        x: &mut DevAct,
        table: &RopeTable,
        spec: RopeSpec,
        first: usize,
    ) -> Result<(), EngineError> {
        fits_table(table, first, x.rows())?;
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.rope(
                x,
                table,
                spec.heads,
                spec.head_stride,
                spec.offset,
                spec.dims,
                spec.interleaved,
                first,
            )?)
        })
    }

    fn qk_norm_rope(
        &self,
        q: &mut DevAct,
        k: &mut DevAct,
        norms: Option<[&DevVector; 2]>,
        eps: f32,
        table: &RopeTable,
        head_dim: usize,
        first: usize,
    ) -> Result<(), EngineError> {
        fits_table(table, first, q.rows())?;
        if head_dim > MAX_ROPE_DIMS {
            return crate::device::qk_norm_rope_unfused(
                self, q, k, norms, eps, table, head_dim, first,
            );
        }
        self.timed(OpClass::Other, 0, || {
            Ok(self
                .kernels
                .qk_norm_rope(q, k, norms, eps, table, head_dim, false, first)?)
        })
    }

    fn copy_heads(&self, dst: &mut DevAct, src: &DevAct, s: HeadCopy) -> Result<(), EngineError> {
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.copy_heads(
                dst,
                src,
                s.heads,
                s.len,
                (s.src_stride, s.src_offset),
                (s.dst_stride, s.dst_offset),
                s.scale,
            )?)
        })
    }

    fn attend(
        &self,
        kv: &mut CudaKv,
        layer: usize,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let d = kv.dim();
        let scale = 1.0 / (d as f32).sqrt();
        let q_heads = q.cols() / d.max(1);
        // Keys and values of every position attended, read once.
        let positions = (kv.len() + q.rows()) as u64;
        let bytes = 2 * positions * (k.cols() * 4) as u64;
        self.timed(OpClass::Attention, bytes, || {
            kv.attend(&self.kernels, layer, q_heads, q, (k, v), scale, out)
        })
    }

    fn attend_rows(
        &self,
        kvs: &mut [&mut CudaKv],
        layer: usize,
        (q, k): (&mut DevAct, &mut DevAct),
        v: &DevAct,
        (norms, eps, table, head_dim): (Option<[&DevVector; 2]>, f32, &RopeTable, usize),
        out: &mut DevAct,
    ) -> Result<bool, EngineError> {
        let Some(rows) = &self.rows_attn else {
            return Ok(false);
        };
        if head_dim > MAX_ROPE_DIMS || kvs.len() < 2 || !kvs.iter().all(|kv| kv.takes_rows(layer)) {
            return Ok(false);
        }
        let mut t = rows.borrow_mut();
        let mut caches: Vec<&mut DevKvCache> = kvs.iter_mut().map(|kv| kv.cache_mut()).collect();
        let scale = 1.0 / (head_dim as f32).sqrt();
        let q_heads = q.cols() / head_dim.max(1);
        let at = self.timed(OpClass::Other, 0, || {
            let at = self.kernels.rows_at(&mut t, &mut caches, layer)?;
            self.kernels
                .qk_norm_rope_at_rows(q, k, norms, eps, table, head_dim, at)?;
            Ok(at)
        })?;
        // Keys and values of every position attended, read once.
        let positions: u64 = caches
            .iter()
            .map(|c| c.layer_len(layer).map_or(0, |h| h as u64 + 1))
            .sum();
        let bytes = 2 * positions * (k.cols() * 4) as u64;
        self.timed(OpClass::Attention, bytes, || {
            Ok(self.kernels.attend_rows(
                &mut t,
                &mut caches,
                layer,
                at,
                (q_heads, scale),
                (q, k, v),
                out,
            )?)
        })?;
        Ok(true)
    }

    fn router(
        &self,
        w: &DevMatrix,
        x: &DevAct,
        rule: &RouteRule,
        bias: Option<&DevVector>,
    ) -> Result<DevRoutes, EngineError> {
        if x.rows() != 1 || rule.routing != Routing::Softmax || !self.fused_router {
            let mut logits = self.zeros(x.rows(), rule.num_experts)?;
            self.linear(&mut logits, w, x)?;
            return self.route(&logits, rule, bias);
        }
        let mut logits = self.zeros(1, rule.num_experts)?;
        self.timed(OpClass::Routing, w.bytes() as u64, || {
            Ok(self
                .kernels
                .router_softmax(w, x, &mut logits, rule.top_k, rule.norm_topk_prob)?)
        })
    }

    fn route(
        &self,
        logits: &DevAct,
        rule: &RouteRule,
        bias: Option<&DevVector>,
    ) -> Result<DevRoutes, EngineError> {
        self.timed(OpClass::Routing, 0, || self.route_now(logits, rule, bias))
    }

    fn moe(
        &self,
        experts: &mut CudaExperts,
        layer: usize,
        x: &DevAct,
        routes: &DevRoutes,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        self.moe_step(experts, layer, x, routes, out)
    }

    fn hint(
        &self,
        experts: &mut CudaExperts,
        layer: usize,
        routes: &DevRoutes,
    ) -> Result<(), EngineError> {
        if experts.resident_all() || routes.rows() != 1 {
            return Ok(());
        }
        let (ids, weights) = routes.to_host(&self.kernels)?;
        // Strongest first: the tier scores ranks.
        experts.hint(layer, &crate::hint::ranked(ids.into_iter().zip(weights)));
        Ok(())
    }

    fn copy_rows(
        &self,
        dst: &mut DevAct,
        dst_row: usize,
        src: &DevAct,
        src_row: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        Ok(self.kernels.copy_rows(dst, dst_row, src, src_row, n)?)
    }

    fn to_host(&self, x: &DevAct) -> Result<Vec<f32>, EngineError> {
        // The end of a recorded step: issue it, then copy.
        self.gpu.flush()?;
        Ok(x.to_host(self.gpu.stream())?)
    }

    fn argmax_rows(&self, x: &DevAct) -> Result<Vec<u32>, EngineError> {
        Ok(self.kernels.argmax_rows(x)?)
    }

    fn picks_ahead(&self) -> bool {
        self.chain.get()
    }

    fn pick_ahead(&self, x: &DevAct) -> Result<PickTicket, EngineError> {
        let t = self.kernels.argmax_ahead(x)?;
        Ok(PickTicket::new(t.seq(), t.cols()))
    }

    fn picked(&self, t: PickTicket) -> Result<u32, EngineError> {
        Ok(self.kernels.picked(cuda_ticket(t))?)
    }

    fn embed_picked(
        &self,
        out: &mut DevAct,
        table: &DevMatrix,
        t: PickTicket,
    ) -> Result<(), EngineError> {
        self.begin_one_row_step()?;
        self.timed(OpClass::Other, 0, || {
            Ok(self.kernels.embed_picked(out, table, cuda_ticket(t))?)
        })
    }
}

/// The kernels' own ticket for the engine's.
fn cuda_ticket(t: PickTicket) -> flashtier_cuda::ops::pick::PickTicket {
    flashtier_cuda::ops::pick::PickTicket::from_parts(t.seq(), t.cols())
}
