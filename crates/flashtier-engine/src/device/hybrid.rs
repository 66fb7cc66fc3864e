//! The operations of hybrid decoders (Qwen4-Exp): linear attention with a
//! recurrent state (GatedDeltaNet), sparse attention over the blocks an
//! indexer selects (QSA), hyper-connection streams, and per-layer
//! embeddings (PLE). A device that implements [`HybridOps`] runs the
//! Qwen4-Exp decoder ([`crate::family::qwen4`]) the way [`Device`] runs the
//! other families: the family describes the forward pass once, the device
//! supplies the kernels.
//!
//! Shapes are those of [`Device`]: activations are `rows x cols` f32, one
//! row per token of the step, in order. States (the convolutions' history,
//! the delta rule's matrices) are activations too, owned by the layer and
//! updated in place; a zeroed state is the start of a sequence. Every
//! operation checks its shapes and returns [`EngineError::Shape`] on a
//! mismatch; none reads or writes outside its buffers.
//!
//! Determinism: each operation reduces in an order fixed by the shapes, so
//! a device gives the same bits for the same inputs whatever the expert or
//! row budget. Devices differ from each other by rounding only (the CPU is
//! the reference; the GPU sums in other orders).

use super::Device;
use crate::error::EngineError;

/// A depthwise causal convolution (SiLU after) of `kernel` taps, tap `m`
/// reading `(kernel - 1 - m) * dilation` rows back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvSpec {
    /// Taps per channel.
    pub kernel: usize,
    /// Rows between taps (1: consecutive).
    pub dilation: usize,
}

impl ConvSpec {
    /// Rows of history the state holds: `(kernel - 1) * dilation`.
    #[must_use]
    pub fn state_rows(&self) -> usize {
        self.kernel.saturating_sub(1) * self.dilation
    }
}

/// The head geometry of the gated delta rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaSpec {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`; value head `h` reads key head
    /// `h / (v_heads / k_heads)`).
    pub v_heads: usize,
    /// Query/key head width.
    pub k_dim: usize,
    /// Value head width.
    pub v_dim: usize,
}

impl DeltaSpec {
    /// Columns of the convolved projection: `[q | k | v]`.
    #[must_use]
    pub fn mixed_cols(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }
}

/// An element-wise map of [`HybridOps::map`] (a division, not a product
/// by the reciprocal, as transformers writes them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Map {
    /// `silu(x / div)`.
    Silu {
        /// Divisor before the activation.
        div: f32,
    },
    /// `mul * sigmoid(x / div)`.
    Sigmoid {
        /// Divisor before the activation.
        div: f32,
        /// Factor after it.
        mul: f32,
    },
}

/// What a sparse-attention cache holds and how its indexer selects.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparseSpec {
    /// Positions at most.
    pub capacity: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Attention head width.
    pub head_dim: usize,
    /// Indexer query heads.
    pub index_heads: usize,
    /// Indexer head width (the index key's width too).
    pub index_dim: usize,
    /// Positions per block the indexer scores.
    pub ratio: usize,
    /// Complete blocks kept per query (more than there are keeps all).
    pub keep: usize,
    /// Leading columns of each index head RoPE rotates (`rotate_half`).
    pub rope_dims: usize,
    /// The block keys' RMSNorm epsilon.
    pub eps: f32,
}

/// The cache of one sparse-attention layer: every position's keys,
/// values and raw index keys.
pub trait SparseState {
    /// Positions held.
    fn len(&self) -> usize;
    /// Is it empty?
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Positions it can hold.
    fn capacity(&self) -> usize;
}

/// The kernels of hybrid decoders. See the module docs.
pub trait HybridOps: Device {
    /// A sparse-attention layer's cache.
    type Sparse: SparseState;
    /// Where a PLE layer's rows of a step land, step after step.
    type Landing;

    /// A zeroed `rows x cols` state (a convolution's history, the delta
    /// rule's matrices). Unlike [`Device::zeros`], whose buffers a device
    /// may recycle for outputs that are written whole, this one is zeroed
    /// on every device.
    fn state(&self, rows: usize, cols: usize) -> Result<Self::Act, EngineError>;

    /// `rows x cols` from row-major host values.
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Act, EngineError>;

    /// A landing for rows of `cols` values.
    fn landing(&self, cols: usize) -> Result<Self::Landing, EngineError>;

    /// Land `rows x cols` row-major host values (a step's PLE rows) in
    /// `at`: work issued after this call reads them through
    /// [`Self::landed`]. The GPU copies them from pinned memory on a copy
    /// stream its compute stream waits for, no host sync.
    fn land(&self, at: &mut Self::Landing, rows: usize, data: &[f32]) -> Result<(), EngineError>;

    /// The rows of the last [`Self::land`] into `at`.
    fn landed<'a>(&self, at: &'a Self::Landing) -> Result<&'a Self::Act, EngineError>;

    /// The work issued so far is the last to read what `at` landed (its
    /// next landing may overwrite them once that work is done).
    fn landed_read(&self, at: &mut Self::Landing) -> Result<(), EngineError>;

    /// RMSNorm of every `group`-wide slice of each row, each column with
    /// its own weight: `out[r][c] = w[c] * (x[r][c] / rms(x[r][g]))` where
    /// `g` is `c`'s group (`w.len() == cols`, a multiple of `group`).
    fn rms_norm_wide(
        &self,
        out: &mut Self::Act,
        x: &Self::Act,
        w: &Self::Vector,
        group: usize,
        eps: f32,
    ) -> Result<(), EngineError>;

    /// `x = f(x)` element-wise.
    fn map(&self, x: &mut Self::Act, f: Map) -> Result<(), EngineError>;

    /// `x *= sigmoid(gate)` element-wise (same shapes).
    fn mul_sigmoid(&self, x: &mut Self::Act, gate: &Self::Act) -> Result<(), EngineError>;

    /// The hyper-connection input: `out[r][j] = (sum over s ascending of
    /// sigmoid(gates[r][s h + j]) * normed[r][s h + j]) / streams`, where
    /// `h = out.cols()`, `gates` and `normed` `rows x streams * h`.
    fn hc_mix(
        &self,
        out: &mut Self::Act,
        gates: &Self::Act,
        normed: &Self::Act,
        streams: usize,
    ) -> Result<(), EngineError>;

    /// A block's output into every stream: `x[r][s h + j] += y[r][j] *
    /// gate(w[r][s])` (`x`: `rows x streams * h`, `y`: `rows x h`, `w`:
    /// `rows x streams`), `gate` the map [`Self::map`] would apply to `w`
    /// (the same bits as mapping `w` first).
    fn hc_inject(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        w: &Self::Act,
        gate: Map,
    ) -> Result<(), EngineError>;

    /// The causal convolution `spec` of the rows of `x` after the history
    /// in `state` (`spec.state_rows() x cols`, oldest first, zeros before a
    /// sequence's first row): `out[r][c] = silu(sum over m ascending of
    /// w[c kernel + m] * hist[t - (kernel - 1 - m) dilation][c])` with
    /// `hist` the state followed by `x` and `t` row r's place in it; the
    /// state then holds the last `state_rows` rows of `hist`.
    fn causal_conv(
        &self,
        state: &mut Self::Act,
        x: &Self::Act,
        w: &Self::Vector,
        spec: ConvSpec,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// The gated delta rule (`ba` = `(b, a)`) over the rows of `mixed` (`rows x
    /// spec.mixed_cols()`, the convolved `[q | k | v]`), in order, on the
    /// state (`v_heads x k_dim * v_dim`, value head `h`'s `S` as `[k_dim]
    /// [v_dim]`). Per row: q and k L2-normed per head (`x / sqrt(sum x^2 +
    /// 1e-6)`), q scaled by `1/sqrt(k_dim)`; per value head `beta =
    /// sigmoid(b[r][h])`, `decay = exp(-a_exp[h] * softplus(a[r][h] +
    /// dt_bias[h]))` (softplus linear above 20); `S *= decay`, `d = (v -
    /// S^T k) beta`, `S += k d^T`, and `out[r][h] = S^T q` (`out`: `rows x
    /// v_heads * v_dim`; `b`, `a`: `rows x v_heads`).
    #[allow(clippy::too_many_arguments, reason = "one recurrence's operands")]
    fn gated_delta(
        &self,
        state: &mut Self::Act,
        mixed: &Self::Act,
        ba: (&Self::Act, &Self::Act),
        a_exp: &Self::Vector,
        dt_bias: &Self::Vector,
        spec: DeltaSpec,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// The gated RMSNorm (`oz` = `(o, z)`) of each `w.len()`-wide head: `out = w *
    /// rms_norm(o) * act(z)`, act `sigmoid` or SiLU (all three `rows x
    /// heads * w.len()`).
    fn gated_norm(
        &self,
        out: &mut Self::Act,
        oz: (&Self::Act, &Self::Act),
        w: &Self::Vector,
        eps: f32,
        sigmoid_gate: bool,
    ) -> Result<(), EngineError>;

    /// PLE's gated value per stream (`key_query` = `(key, query)`): with `h = value.cols()`, `g =
    /// key[r][s] . query[r][s] / sqrt(h)` over stream `s`'s `h` columns,
    /// then `g = sign(g) sqrt(max(|g|, 1e-6))`, and `gated[r][s h + j] =
    /// sigmoid(g) * value[r][j]` (`key`, `query`, `gated`: `rows x
    /// streams * h`).
    fn ple_gate(
        &self,
        gated: &mut Self::Act,
        key_query: (&Self::Act, &Self::Act),
        value: &Self::Act,
    ) -> Result<(), EngineError>;

    /// An empty sparse-attention cache.
    fn sparse_cache(&self, spec: &SparseSpec) -> Result<Self::Sparse, EngineError>;

    /// Forget the sequence.
    fn sparse_clear(&self, cache: &mut Self::Sparse) -> Result<(), EngineError>;

    /// With `qkv` = `(q, k, v)` and `index` = `(iq, ik)`: append each row's keys `k` (`rows x kv_heads * head_dim`, normed
    /// and rotated), values `v` and raw index keys `ik` (`rows x
    /// index_dim`) at the next positions, then attend row r at position
    /// `t = len + r` (its own row included):
    /// - each of the `(t + 1) / ratio` complete blocks gets a key: the mean
    ///   of its `ratio` index keys, RMSNormed with `k_norm` (`index_dim`
    ///   wide), its first `rope_dims` columns rotated at the block's first
    ///   position (`table`);
    /// - a block scores `sum over index heads of relu(iq[r][h] . key) /
    ///   sqrt(index_dim)` (`iq`: `rows x index_heads * index_dim`, normed
    ///   and rotated), and the `keep` best blocks are kept as torch's CPU
    ///   `topk` keeps them, ties included ([`crate::topk::kept`]); the
    ///   positions of the incomplete last block are always kept;
    /// - each query head (`q`, `out`: `rows x q_heads * head_dim`) takes the
    ///   softmax, scale `1/sqrt(head_dim)`, over the kept positions of its
    ///   key/value head.
    #[allow(clippy::too_many_arguments, reason = "the attention's operands")]
    fn sparse_attend(
        &self,
        cache: &mut Self::Sparse,
        qkv: (&Self::Act, &Self::Act, &Self::Act),
        index: (&Self::Act, &Self::Act),
        k_norm: &Self::Vector,
        table: &Self::Rope,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;
}
