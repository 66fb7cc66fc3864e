//! The operations of hybrid decoders (Qwen4-Exp) that the other families
//! lack (`kernels/decode/hybrid.cu`): stream mixers and gates, RMSNorm with
//! a weight per group, the causal convolution with its state, and the gated
//! delta rule. Each checks its shapes before the launch; states are
//! activations owned by the caller and updated in place. The sparse
//! attention is [`super::sparse`].
//!
//! Every kernel sums in an order fixed by the shapes (the delta rule one
//! row after another, each state column by one thread), so the same inputs
//! give the same bits.

use cudarc::driver::LaunchConfig;

use super::buffers::{DevAct, DevVector};
use super::dense::{same, shape};
use super::{DecodeKernels, dim, linear_cfg};
use crate::error::CudaError;
use crate::launch::Args;

/// Widest key head of the delta rule (its q and k sit in shared memory).
pub const MAX_DELTA_K_DIM: usize = 4096;
/// Widest key head whose state the delta rule holds in registers
/// (`GD_KMAX` of the kernel); wider ones run a thread per state column.
pub const MAX_DELTA_K_DIM_REGS: usize = 256;

/// An element-wise map of [`DecodeKernels::map`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MapFn {
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

impl MapFn {
    /// The kernels' arguments: (sigmoid?, divisor, factor).
    fn params(self) -> (i32, f32, f32) {
        match self {
            Self::Silu { div } => (0, div, 1.0),
            Self::Sigmoid { div, mul } => (1, div, mul),
        }
    }
}

/// The gated delta rule's head geometry (see [`DecodeKernels::gated_delta`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaHeads {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`).
    pub v_heads: usize,
    /// Query/key head width.
    pub k_dim: usize,
    /// Value head width.
    pub v_dim: usize,
}

fn elems(x: &DevAct) -> i64 {
    (x.rows() * x.cols()) as i64
}

impl DecodeKernels {
    /// Zero `x` (the pool recycles activations without clearing them).
    pub fn zero(&self, x: &mut DevAct) -> Result<(), CudaError> {
        let n = elems(x);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf()).push(n);
        // SAFETY: matches `zero_fill`; writes elements 0..n of x.
        unsafe { self.launch("zero_fill", linear_cfg(n as usize, 256)?, a) }
    }

    /// RMSNorm of every `group`-wide slice of each row, slice `g` with the
    /// weights `w[g * group..][..group]` (`w` as wide as a row).
    pub fn rms_norm_wide(
        &self,
        out: &mut DevAct,
        x: &DevAct,
        w: &DevVector,
        group: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        same("rms_norm_wide", out, x)?;
        if group == 0 || w.len() != x.cols() || x.cols() % group != 0 {
            return Err(shape(
                "rms_norm_wide",
                format!(
                    "{} columns, {}-wide weight, groups of {group}",
                    x.cols(),
                    w.len()
                ),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(x.cols() / group, "x")?, dim(x.rows(), "y")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf())
            .buf(g, w.data())
            .push(x.cols() as i32)
            .push(group as i32)
            .push(eps)
            .buf(g, out.buf());
        // SAFETY: matches `rms_norm_wide`; block (s, r) reads slice s of row
        // r of x and of w and writes the same slice of out (shapes checked).
        unsafe { self.launch("rms_norm_wide", cfg, a) }
    }

    /// `x = f(x)` element-wise.
    pub fn map(&self, x: &mut DevAct, f: MapFn) -> Result<(), CudaError> {
        let (sig, div, mul) = f.params();
        let n = elems(x);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf()).push(n).push(sig).push(div).push(mul);
        // SAFETY: matches `hy_map`; rewrites elements 0..n of x.
        unsafe { self.launch("hy_map", linear_cfg(n as usize, 256)?, a) }
    }

    /// `x *= sigmoid(gate)` element-wise.
    pub fn mul_sigmoid(&self, x: &mut DevAct, gate: &DevAct) -> Result<(), CudaError> {
        same("mul_sigmoid", x, gate)?;
        let n = elems(x);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf()).buf(g, gate.buf()).push(n);
        // SAFETY: matches `mul_sigmoid`; x and gate hold n elements each.
        unsafe { self.launch("mul_sigmoid", linear_cfg(n as usize, 256)?, a) }
    }

    /// `out[r][j] = (sum over s ascending of sigmoid(gates[r][s h + j]) *
    /// normed[r][s h + j]) / streams` with `h = out.cols()`.
    pub fn hc_mix(
        &self,
        out: &mut DevAct,
        gates: &DevAct,
        normed: &DevAct,
        streams: usize,
    ) -> Result<(), CudaError> {
        same("hc_mix", gates, normed)?;
        let h = out.cols();
        if streams == 0 || gates.cols() != streams * h || gates.rows() != out.rows() {
            return Err(shape(
                "hc_mix",
                format!(
                    "{}x{} gates into {}x{h} over {streams} streams",
                    gates.rows(),
                    gates.cols(),
                    out.rows()
                ),
            ));
        }
        let n = elems(out);
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, gates.buf())
            .buf(g, normed.buf())
            .push(h as i32)
            .push(streams as i32)
            .push(n)
            .buf(g, out.buf());
        // SAFETY: matches `hc_mix`; thread i writes out[i] (n elements) and
        // reads row i / h of gates and normed (streams * h wide, checked).
        unsafe { self.launch("hc_mix", linear_cfg(n as usize, 256)?, a) }
    }

    /// `x[r][s h + j] += y[r][j] * w[r][s]` (`h = y.cols()`, `w`: `rows x
    /// streams`).
    pub fn hc_inject(
        &self,
        x: &mut DevAct,
        y: &DevAct,
        w: &DevAct,
        gate: MapFn,
    ) -> Result<(), CudaError> {
        let (h, streams) = (y.cols(), w.cols());
        if x.rows() != y.rows() || w.rows() != y.rows() || x.cols() != streams * h {
            return Err(shape(
                "hc_inject",
                format!(
                    "{}x{} block output, {}x{} weights into {}x{}",
                    y.rows(),
                    y.cols(),
                    w.rows(),
                    w.cols(),
                    x.rows(),
                    x.cols()
                ),
            ));
        }
        let n = elems(x);
        let (sig, div, mul) = gate.params();
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, x.buf())
            .buf(g, y.buf())
            .buf(g, w.buf())
            .push(h as i32)
            .push(streams as i32)
            .push(n)
            .push(sig)
            .push(div)
            .push(mul);
        // SAFETY: matches `hc_inject`; thread i updates x[i] (n elements)
        // from row i / (streams h) of y and w (shapes checked).
        unsafe { self.launch("hc_inject", linear_cfg(n as usize, 256)?, a) }
    }

    /// The causal depthwise convolution of `kernel` taps every `dilation`
    /// rows (SiLU after) of the rows of `x` after the history in `state`
    /// (`(kernel - 1) * dilation` rows, oldest first); the state then holds
    /// the last rows. `w`: `[cols][kernel]`.
    pub fn causal_conv(
        &self,
        state: &mut DevAct,
        x: &DevAct,
        w: &DevVector,
        (kernel, dilation): (usize, usize),
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        same("causal_conv", out, x)?;
        let c = x.cols();
        let held = kernel.saturating_sub(1).saturating_mul(dilation);
        if kernel < 2
            || dilation == 0
            || state.cols() != c
            || state.rows() != held
            || Some(w.len()) != c.checked_mul(kernel)
            || i32::try_from(held + x.rows()).is_err()
        {
            return Err(shape(
                "causal_conv",
                format!(
                    "{kernel} taps every {dilation} rows over {c} channels: state {}x{}, {} \
                     weights",
                    state.rows(),
                    state.cols(),
                    w.len()
                ),
            ));
        }
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, state.buf())
            .buf(g, x.buf())
            .buf(g, w.data())
            .push(x.rows() as i32)
            .push(c as i32)
            .push(kernel as i32)
            .push(dilation as i32)
            .buf(g, out.buf());
        // SAFETY: matches `causal_conv`; thread c reads and writes column c
        // of state (held rows), x and out (rows rows) and w[c * kernel..]
        // (shapes checked).
        unsafe { self.launch("causal_conv", linear_cfg(c, 128)?, a) }
    }

    /// The gated delta rule over the rows of `mixed` (`[q | k | v]` per
    /// row), in order, on `state` (`v_heads x k_dim * v_dim`): per row and
    /// value head, q and k L2-normed (q also scaled by `1/sqrt(k_dim)`),
    /// `beta = sigmoid(b)`, `decay = exp(-a_exp softplus(a + dt_bias))`,
    /// `S *= decay; d = (v - S^T k) beta; S += k d^T; out = S^T q`.
    #[allow(clippy::too_many_arguments, reason = "one recurrence's operands")]
    pub fn gated_delta(
        &self,
        state: &mut DevAct,
        mixed: &DevAct,
        (b, a): (&DevAct, &DevAct),
        (a_exp, dt_bias): (&DevVector, &DevVector),
        s: DeltaHeads,
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        let rows = mixed.rows();
        let vh = s.v_heads;
        let fits = s.k_heads > 0
            && vh % s.k_heads == 0
            && s.k_dim > 0
            && s.k_dim <= MAX_DELTA_K_DIM
            && s.v_dim > 0
            && mixed.cols() == 2 * s.k_heads * s.k_dim + vh * s.v_dim
            && (b.rows(), b.cols(), a.rows(), a.cols()) == (rows, vh, rows, vh)
            && a_exp.len() == vh
            && dt_bias.len() == vh
            && (state.rows(), state.cols()) == (vh, s.k_dim * s.v_dim)
            && (out.rows(), out.cols()) == (rows, vh * s.v_dim);
        if !fits {
            return Err(shape(
                "gated_delta",
                format!(
                    "{rows}x{} projection, {}x{} state, {}x{} output for {} key heads of {} and \
                     {vh} value heads of {}",
                    mixed.cols(),
                    state.rows(),
                    state.cols(),
                    out.rows(),
                    out.cols(),
                    s.k_heads,
                    s.k_dim,
                    s.v_dim
                ),
            ));
        }
        let (kernel, cfg) = if s.k_dim <= MAX_DELTA_K_DIM_REGS {
            let cfg = LaunchConfig {
                grid_dim: (dim(vh, "x")?, dim(s.v_dim.div_ceil(32), "y")?, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            ("gated_delta", cfg)
        } else {
            let cfg = LaunchConfig {
                grid_dim: (dim(vh, "x")?, dim(s.v_dim.div_ceil(64), "y")?, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: (2 * s.k_dim * 4) as u32,
            };
            ("gated_delta_cols", cfg)
        };
        let g = &self.gpu;
        let mut args = Args::new();
        args.buf(g, state.buf())
            .buf(g, mixed.buf())
            .buf(g, b.buf())
            .buf(g, a.buf())
            .buf(g, a_exp.data())
            .buf(g, dt_bias.data())
            .push(rows as i32)
            .push(s.k_heads as i32)
            .push(vh as i32)
            .push(s.k_dim as i32)
            .push(s.v_dim as i32)
            .buf(g, out.buf());
        // SAFETY: matches `gated_delta` and `gated_delta_cols`; block (h, y)
        // reads and writes columns y * 32.. (y * 64..) of head h's state,
        // reads the rows of mixed, b and a and writes head h's columns of
        // out (shapes checked; k_dim within the register kernel's GD_KMAX,
        // or shared memory for 2 k_dim floats).
        unsafe { self.launch(kernel, cfg, args) }
    }

    /// `out = w * rms_norm(o) * act(z)` per `w.len()`-wide head, act
    /// sigmoid (`sigmoid_gate`) or SiLU.
    pub fn gated_norm(
        &self,
        out: &mut DevAct,
        (o, z): (&DevAct, &DevAct),
        w: &DevVector,
        eps: f32,
        sigmoid_gate: bool,
    ) -> Result<(), CudaError> {
        same("gated_norm", out, o)?;
        same("gated_norm", out, z)?;
        let dv = w.len();
        if dv == 0 || o.cols() % dv != 0 {
            return Err(shape(
                "gated_norm",
                format!("{dv}-wide weight over {} columns", o.cols()),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (dim(o.cols() / dv, "x")?, dim(o.rows(), "y")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, o.buf())
            .buf(g, z.buf())
            .buf(g, w.data())
            .push(o.cols() as i32)
            .push(dv as i32)
            .push(eps)
            .push(i32::from(sigmoid_gate))
            .buf(g, out.buf());
        // SAFETY: matches `gated_norm`; block (h, r) reads head h of row r
        // of o and z and writes it in out (one shape, checked).
        unsafe { self.launch("gated_norm", cfg, a) }
    }

    /// PLE's gated value per stream: with `h = value.cols()`, `g = key[r][s]
    /// . query[r][s] / sqrt(h)`, `g = sign(g) sqrt(max(|g|, 1e-6))`, and
    /// `gated[r][s h + j] = sigmoid(g) * value[r][j]`.
    pub fn ple_gate(
        &self,
        gated: &mut DevAct,
        (key, query): (&DevAct, &DevAct),
        value: &DevAct,
    ) -> Result<(), CudaError> {
        same("ple_gate", gated, key)?;
        same("ple_gate", gated, query)?;
        let h = value.cols();
        if h == 0 || value.rows() != gated.rows() || gated.cols() % h != 0 {
            return Err(shape(
                "ple_gate",
                format!(
                    "{}x{} values for {}x{} streams",
                    value.rows(),
                    value.cols(),
                    gated.rows(),
                    gated.cols()
                ),
            ));
        }
        let streams = gated.cols() / h;
        let cfg = LaunchConfig {
            grid_dim: (dim(streams, "x")?, dim(gated.rows(), "y")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let g = &self.gpu;
        let mut a = Args::new();
        a.buf(g, key.buf())
            .buf(g, query.buf())
            .buf(g, value.buf())
            .push(h as i32)
            .push(streams as i32)
            .buf(g, gated.buf());
        // SAFETY: matches `ple_gate`; block (s, r) reads stream s of row r
        // of key and query, row r of value, and writes stream s of row r of
        // gated (shapes checked).
        unsafe { self.launch("ple_gate", cfg, a) }
    }
}
