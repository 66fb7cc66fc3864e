//! The compute-device seam. A model family describes its forward pass once,
//! as a sequence of [`Device`] operations on activations; a device supplies
//! the memory (activations, resident weights, the KV cache, the expert tier)
//! and the kernels. [`cpu::CpuDevice`] is the reference; the CUDA device is
//! a second implementation of the same trait, not a second forward pass.
//!
//! Shapes: an activation is `rows x cols` f32, one row per token of the
//! step (1 while decoding, up to the prefill chunk for a prompt). Weights
//! are `[out, in]` row-major, so `linear` computes `out[r] = W x[r]`.
//! Operations validate shapes and return [`EngineError::Shape`] on a
//! mismatch; they never read or write outside their buffers.
//!
//! Determinism: every operation reduces in an order fixed by the shapes
//! alone, and routed experts are summed in ascending expert id, so the same
//! inputs give bit-identical outputs on a device whatever the expert
//! budget, the order reads land in, or the thread count.

pub mod cpu;
pub mod cuda;
pub mod hybrid;
pub mod pick;
pub mod tier_stats;

pub use pick::PickTicket;

use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::route::RouteRule;
use crate::matrix::Matrix;

/// An activation: `rows x cols` f32 in the device's memory.
pub trait Activation {
    /// Rows (tokens).
    fn rows(&self) -> usize;
    /// Columns (features).
    fn cols(&self) -> usize;
}

/// A resident f32 vector (norm weights, biases).
pub trait VectorLen {
    /// Elements.
    fn len(&self) -> usize;
    /// Is it empty?
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The KV cache of one sequence.
pub trait KvState {
    /// Positions every layer holds.
    fn len(&self) -> usize;
    /// Is it empty?
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Positions it can hold.
    fn capacity(&self) -> usize;
    /// Mark `n` positions that every layer pushed as complete.
    fn advance(&mut self, n: usize);
    /// What the KV tier did for this cache (`None`: every position stays
    /// in the device's memory).
    fn tier_stats(&self) -> Option<tier_stats::KvTierStats> {
        None
    }
    /// Whether [`KvState::rewind`] can take positions back.
    fn rewinds(&self) -> bool {
        false
    }
    /// Forget the last `n` complete positions (a step whose token nobody
    /// reads), so the next step writes over them.
    fn rewind(&mut self, n: usize) -> Result<(), EngineError> {
        Err(EngineError::Shape {
            op: "kv rewind",
            what: format!("{n} positions of a cache that cannot take them back"),
        })
    }
}

/// The expert tier a device reads expert matrices from.
pub trait ExpertTier {
    /// Counters so far.
    fn stats(&self) -> ExpertStats;
}

/// How the KV cache stores keys and values for the BF16 decode attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvPrecision {
    /// One BF16 per value (half the memory; logits differ from an f32
    /// reference by about 1e-2).
    Bf16,
    /// Each f32 value as a BF16 hi/lo pair in a head twice as wide:
    /// attention on values accurate to about 2^-17 relative (see
    /// [`cpu::kv`]). Needs twice the head width within the tier's limit.
    #[default]
    Bf16x2,
}

impl std::fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Bf16 => "BF16",
            Self::Bf16x2 => "BF16 hi/lo pairs",
        })
    }
}

/// What a KV cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpec {
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (`q_heads` is a multiple).
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Positions at most.
    pub capacity: usize,
    /// Storage of keys and values.
    pub precision: KvPrecision,
}

/// Which columns of each row RoPE rotates: `heads` groups of `dims`
/// columns, group `h` starting at `h * head_stride + offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeSpec {
    /// Groups per row.
    pub heads: usize,
    /// Columns from one group to the next.
    pub head_stride: usize,
    /// First rotated column of a group.
    pub offset: usize,
    /// Rotated columns per group (even).
    pub dims: usize,
    /// Pairs are `(x0, x1), (x2, x3)...` written back evens first
    /// (DeepSeek), instead of the two halves (`rotate_half`).
    pub interleaved: bool,
}

/// A strided copy of head slices: for each row and head `h < heads`,
/// `dst[h * dst_stride + dst_offset..][..len] =
/// scale * src[h * src_stride + src_offset..][..len]`. A `src_stride` of 0
/// broadcasts one slice to every head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadCopy {
    /// Heads.
    pub heads: usize,
    /// Columns per head copied.
    pub len: usize,
    /// Source columns from one head to the next (0: broadcast).
    pub src_stride: usize,
    /// First source column of head 0.
    pub src_offset: usize,
    /// Destination columns from one head to the next.
    pub dst_stride: usize,
    /// First destination column of head 0.
    pub dst_offset: usize,
    /// Factor applied to every copied value.
    pub scale: f32,
}

impl std::fmt::Display for RopeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} groups of {} rotated columns (first at {}, {} columns apart)",
            self.heads, self.dims, self.offset, self.head_stride
        )
    }
}

impl std::fmt::Display for HeadCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} heads of {} columns (source from column {} every {}, destination from column {} \
             every {})",
            self.heads,
            self.len,
            self.src_offset,
            self.src_stride,
            self.dst_offset,
            self.dst_stride
        )
    }
}

/// Where a layer half's output goes: added to the residual stream
/// `resid`, whose RMSNorm (weight `norm`, epsilon `eps`) is written to
/// `out`, the next half's input ([`Device::add_norm`]).
pub struct AddNormTo<'a, D: Device + ?Sized> {
    /// The residual stream, updated in place.
    pub resid: &'a mut D::Act,
    /// The next norm's weight.
    pub norm: &'a D::Vector,
    /// The norm's epsilon.
    pub eps: f32,
    /// The normed rows.
    pub out: &'a mut D::Act,
}

impl<D: Device + ?Sized> AddNormTo<'_, D> {
    /// Add `y` (a layer half's output) into the residual stream and write
    /// its norm ([`Device::add_norm`]).
    pub fn add(self, dev: &D, y: &D::Act) -> Result<(), EngineError> {
        dev.add_norm(self.resid, y, self.norm, self.eps, self.out)
    }

    /// `y = w x[r]` for every row (a layer half's last product), then
    /// [`Self::add`] of `y`.
    pub fn linear(self, dev: &D, w: &D::Mat, x: &D::Act) -> Result<(), EngineError> {
        let mut y = dev.zeros(x.rows(), self.resid.cols())?;
        dev.linear(&mut y, w, x)?;
        self.add(dev, &y)
    }
}

/// A compute device. See the module docs for shapes and determinism.
pub trait Device {
    /// Activations.
    type Act: Activation;
    /// A resident weight matrix in its stored form.
    type Mat;
    /// A resident f32 vector.
    type Vector: VectorLen;
    /// The KV cache of one sequence.
    type Kv: KvState;
    /// RoPE's cos/sin for every position.
    type Rope;
    /// Routing decisions of one step: per row, the chosen experts and weights.
    type Routes;
    /// The expert tier.
    type Experts: ExpertTier;

    /// Short name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// Whether the device runs issued work while the host goes on (a GPU's
    /// stream), rather than computing as it is issued (the CPU).
    fn issues_async(&self) -> bool {
        false
    }

    /// Most rows of one prompt step for a sequence of the shape `spec`
    /// that will hold `len` positions after its prompt (the model rounds
    /// it to whole [`crate::model::PREFILL_CHUNK`]s and bounds it by its
    /// widest activation). Larger steps read each weight fewer times; the
    /// default is one chunk.
    fn prompt_rows(&self, spec: &KvSpec, len: usize) -> usize {
        let _ = (spec, len);
        crate::model::PREFILL_CHUNK
    }

    /// Make `m` resident.
    fn matrix(&self, m: Matrix) -> Result<Self::Mat, EngineError>;
    /// Make `v` resident.
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector, EngineError>;
    /// A zeroed `rows x cols` activation.
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Act, EngineError>;
    /// cos and sin for positions `0..positions`: `angle = p * inv_freq[i]`
    /// in f32, both scaled by `factor`.
    fn rope_table(
        &self,
        inv_freq: &[f32],
        factor: f32,
        positions: usize,
    ) -> Result<Self::Rope, EngineError>;
    /// An empty KV cache.
    fn kv_cache(&self, spec: &KvSpec) -> Result<Self::Kv, EngineError>;

    /// `out[r] = table[ids[r]]`.
    fn embed(&self, out: &mut Self::Act, table: &Self::Mat, ids: &[u32])
    -> Result<(), EngineError>;
    /// `out[r] = W x[r]`.
    fn linear(&self, out: &mut Self::Act, w: &Self::Mat, x: &Self::Act) -> Result<(), EngineError>;
    /// RMSNorm of every `w.len()`-wide group of columns (the whole row, or
    /// each head for Qwen3's qk-norm): `x / rms(x) * w`.
    fn rms_norm(
        &self,
        out: &mut Self::Act,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
    ) -> Result<(), EngineError>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<(), EngineError>;
    /// `x += y`, then `out = rms_norm(x) * w` over whole rows (the residual
    /// add and the next norm; devices may fuse them).
    fn add_norm(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    ) -> Result<(), EngineError> {
        self.add(x, y)?;
        self.rms_norm(out, x, w, eps)
    }
    /// `outs[q][r] = ws[q] x[r]` for matrices sharing the input (q, k and v
    /// projections; devices may run them as one launch).
    fn linear_many(
        &self,
        outs: &mut [&mut Self::Act],
        ws: &[&Self::Mat],
        x: &Self::Act,
    ) -> Result<(), EngineError> {
        for (o, w) in outs.iter_mut().zip(ws) {
            self.linear(o, w, x)?;
        }
        Ok(())
    }
    /// Qwen3's per-head RMSNorm of `q` and `k` (`norms = [q_w, k_w]`; none
    /// without) and then RoPE of their whole `head_dim`-wide heads
    /// (rotate-half) for row r at position `first + r`, in place; devices
    /// may fuse them.
    #[allow(clippy::too_many_arguments, reason = "one fused operation")]
    fn qk_norm_rope(
        &self,
        q: &mut Self::Act,
        k: &mut Self::Act,
        norms: Option<[&Self::Vector; 2]>,
        eps: f32,
        table: &Self::Rope,
        head_dim: usize,
        first: usize,
    ) -> Result<(), EngineError> {
        qk_norm_rope_unfused(self, q, k, norms, eps, table, head_dim, first)
    }
    /// A hint that `ws` are read soon (the device may start reading them
    /// into a cache); never changes a result.
    fn prefetch(&self, ws: &[&Self::Mat]) -> Result<(), EngineError> {
        let _ = ws;
        Ok(())
    }
    /// `x[r] += b` for every row.
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector) -> Result<(), EngineError>;
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Self::Act, up: &Self::Act) -> Result<(), EngineError>;
    /// `acc[r] += sigmoid(gate[r][0]) * y[r]` (`gate` is `rows x 1`).
    fn add_gated(
        &self,
        acc: &mut Self::Act,
        y: &Self::Act,
        gate: &Self::Act,
    ) -> Result<(), EngineError>;
    /// Rotate the columns `spec` names of row `r` by position `first + r`.
    fn rope(
        &self,
        x: &mut Self::Act,
        table: &Self::Rope,
        spec: RopeSpec,
        first: usize,
    ) -> Result<(), EngineError>;
    /// The strided head copy `spec` (columns outside it keep their values).
    fn copy_heads(
        &self,
        dst: &mut Self::Act,
        src: &Self::Act,
        spec: HeadCopy,
    ) -> Result<(), EngineError>;
    /// Append each row's keys and values to `layer` (positions `len..len +
    /// rows`), then attend row `r`'s queries over positions `0..=len + r`
    /// (causal) with scale `1/sqrt(head_dim)`. `q`, `out`: `rows x q_heads
    /// * head_dim`; `k`, `v`: `rows x kv_heads * head_dim`.
    fn attend(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;
    /// One decode row for each of several sequences, each with its own
    /// cache: row `r` of `q`, `k`, `v` is the next position of `kvs[r]`.
    /// Its queries and keys are normed and rotated as
    /// [`Device::qk_norm_rope`] does at that position (`rope`: the norms,
    /// eps, the table, the head width), then attended as [`Device::attend`]
    /// does for that sequence alone, to the same bits. Returns false,
    /// having done nothing, where the device has no such path for these
    /// caches; the caller then runs each sequence alone.
    #[allow(clippy::type_complexity, reason = "the rope's operands")]
    fn attend_rows(
        &self,
        kvs: &mut [&mut Self::Kv],
        layer: usize,
        (q, k): (&mut Self::Act, &mut Self::Act),
        v: &Self::Act,
        rope: (Option<[&Self::Vector; 2]>, f32, &Self::Rope, usize),
        out: &mut Self::Act,
    ) -> Result<bool, EngineError> {
        let _ = (kvs, layer, q, k, v, rope, out);
        Ok(false)
    }
    /// Router logits `w x[r]` (`rows x experts`) and each row's experts
    /// chosen from them, as [`Device::linear`] then [`Device::route`];
    /// devices may fuse the two.
    fn router(
        &self,
        w: &Self::Mat,
        x: &Self::Act,
        rule: &RouteRule,
        bias: Option<&Self::Vector>,
    ) -> Result<Self::Routes, EngineError> {
        let mut logits = self.zeros(x.rows(), rule.num_experts)?;
        self.linear(&mut logits, w, x)?;
        self.route(&logits, rule, bias)
    }
    /// Choose each row's experts from its router logits (`rows x experts`).
    fn route(
        &self,
        logits: &Self::Act,
        rule: &RouteRule,
        bias: Option<&Self::Vector>,
    ) -> Result<Self::Routes, EngineError>;
    /// `out[r] = sum over row r's chosen experts e, ascending e, of
    /// weight_e * down_e(silu(gate_e x[r]) * up_e x[r])`, with the expert
    /// matrices from `experts`.
    fn moe(
        &self,
        experts: &mut Self::Experts,
        layer: usize,
        x: &Self::Act,
        routes: &Self::Routes,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;
    /// Whether the tier uses hints (a tier holding every expert does not:
    /// the next layer's routing is then not computed ahead).
    fn hints_wanted(&self, experts: &Self::Experts) -> bool {
        let _ = experts;
        true
    }
    /// Tell the tier which experts `layer` will probably ask for next, so
    /// it may start reading them; never changes what is computed.
    fn hint(
        &self,
        experts: &mut Self::Experts,
        layer: usize,
        routes: &Self::Routes,
    ) -> Result<(), EngineError>;
    /// How many layers ahead a decode step's routers guess for the tier
    /// ([`Device::hint_ahead`] distances `1..=hint_depth`).
    fn hint_depth(&self) -> usize {
        1
    }
    /// [`Device::hint`] for a guess made `distance` layers before `layer`
    /// (1: the layer before; a tier may weigh guesses by distance and
    /// ignore far ones). The default passes distance 1 on and drops the
    /// rest.
    fn hint_ahead(
        &self,
        experts: &mut Self::Experts,
        distance: usize,
        layer: usize,
        routes: &Self::Routes,
    ) -> Result<(), EngineError> {
        if distance == 1 {
            self.hint(experts, layer, routes)
        } else {
            Ok(())
        }
    }
    /// A guess of `layer`'s experts made before its attention (for a first
    /// sparse layer, which no earlier layer guesses): the tier may start
    /// reading it at once. Never changes a result; the default ignores it.
    fn read_ahead_now(
        &self,
        experts: &mut Self::Experts,
        layer: usize,
        routes: &Self::Routes,
    ) -> Result<(), EngineError> {
        let _ = (experts, layer, routes);
        Ok(())
    }
    /// [`Device::moe`], running `meanwhile` while the step's expert reads
    /// are in flight (work that does not depend on the experts' output,
    /// such as a shared expert). The default runs the experts, then
    /// `meanwhile`; the result is the bits of [`Device::moe`] either way.
    fn moe_meanwhile(
        &self,
        experts: &mut Self::Experts,
        layer: usize,
        x: &Self::Act,
        routes: &Self::Routes,
        out: &mut Self::Act,
        meanwhile: &mut dyn FnMut() -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        self.moe(experts, layer, x, routes, out)?;
        meanwhile()
    }
    /// Rows `dst_row..dst_row + n` of `dst` = rows `src_row..src_row + n`
    /// of `src` (both as wide; the rows must exist).
    fn copy_rows(
        &self,
        dst: &mut Self::Act,
        dst_row: usize,
        src: &Self::Act,
        src_row: usize,
        n: usize,
    ) -> Result<(), EngineError>;
    /// Copy `x` to the host, row-major.
    fn to_host(&self, x: &Self::Act) -> Result<Vec<f32>, EngineError>;
    /// Index of each row's largest value (lowest index on ties).
    fn argmax_rows(&self, x: &Self::Act) -> Result<Vec<u32>, EngineError>;
    /// Whether this device can leave a greedy pick on itself
    /// ([`Device::pick_ahead`]), so a decode issues its next step before
    /// it reads the token.
    fn picks_ahead(&self) -> bool {
        false
    }
    /// One-row `x`'s greedy pick ([`Device::argmax_rows`]'s rule), kept
    /// on the device for [`Device::embed_picked`]; the host reads it with
    /// [`Device::picked`] without waiting for work issued after it.
    fn pick_ahead(&self, x: &Self::Act) -> Result<PickTicket, EngineError> {
        let _ = x;
        Err(no_picks_ahead(self.name()))
    }
    /// The id `t` picked (waits for it).
    fn picked(&self, t: PickTicket) -> Result<u32, EngineError> {
        let _ = t;
        Err(no_picks_ahead(self.name()))
    }
    /// `out` (one row) = `table[id]` for the id `t` picked, read on the
    /// device (`t` the latest pick).
    fn embed_picked(
        &self,
        out: &mut Self::Act,
        table: &Self::Mat,
        t: PickTicket,
    ) -> Result<(), EngineError> {
        let _ = (out, table, t);
        Err(no_picks_ahead(self.name()))
    }
}

fn no_picks_ahead(device: &str) -> EngineError {
    EngineError::Shape {
        op: "pick_ahead",
        what: format!("{device} reads every pick back"),
    }
}

/// [`Device::qk_norm_rope`] as its parts: [`Device::rms_norm`] of each
/// head, then [`Device::rope`] of q's and k's whole heads.
#[allow(clippy::too_many_arguments, reason = "one fused operation")]
pub fn qk_norm_rope_unfused<D: Device + ?Sized>(
    dev: &D,
    q: &mut D::Act,
    k: &mut D::Act,
    norms: Option<[&D::Vector; 2]>,
    eps: f32,
    table: &D::Rope,
    head_dim: usize,
    first: usize,
) -> Result<(), EngineError> {
    if let Some([qn, kn]) = norms {
        for (x, w) in [(&mut *q, qn), (&mut *k, kn)] {
            let mut normed = dev.zeros(x.rows(), x.cols())?;
            dev.rms_norm(&mut normed, x, w, eps)?;
            *x = normed;
        }
    }
    for x in [q, k] {
        let spec = RopeSpec {
            heads: x.cols() / head_dim.max(1),
            head_stride: head_dim,
            offset: 0,
            dims: head_dim,
            interleaved: false,
        };
        dev.rope(x, table, spec, first)?;
    }
    Ok(())
}
