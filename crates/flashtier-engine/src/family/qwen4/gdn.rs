//! GatedDeltaNet (`linear_attention` layers) with its two states, as
//! transformers' recurrent rule computes it (its chunked prompt form is the
//! same sums regrouped):
//!
//! - a causal depthwise conv (width `K`) over the q/k/v projection, SiLU;
//!   the state is the last `K - 1` projections (zeros before the first);
//! - per value head (query/key heads repeated `v_heads / k_heads` times),
//!   L2-normed q and k, q scaled by `1/sqrt(k_dim)`,
//!   `beta = sigmoid(b)`, decay `g = -exp(A_log) softplus(a + dt_bias)`;
//!   the `k_dim x v_dim` state `S` decays by `exp(g)`, then takes the delta
//!   rule `S += k (beta (v - S^T k))^T`, and the output is `S^T q`
//!   ([`HybridOps::gated_delta`]);
//! - a gated RMSNorm per value head (`w * norm(o) * act(z)`, act SiLU or
//!   sigmoid), then `out_proj`.
//!
//! State memory: `(K - 1) * conv_dim + v_heads * k_dim * v_dim` f32, on the
//! device.

use crate::config::qwen4::{LinearAttn, Qwen4Config};
use crate::device::hybrid::{ConvSpec, DeltaSpec, HybridOps};
use crate::device::{Activation, Device};
use crate::error::EngineError;
use crate::load::weights::Loader;

/// One GatedDeltaNet layer with its states.
pub struct GatedDeltaNet<D: Device> {
    shape: LinearAttn,
    in_qkv: D::Mat,
    in_z: D::Mat,
    in_b: D::Mat,
    in_a: D::Mat,
    out: D::Mat,
    /// `[conv_dim][K]`.
    conv: D::Vector,
    a_log_exp: D::Vector,
    dt_bias: D::Vector,
    norm: D::Vector,
    eps: f32,
    hidden: usize,
    /// The last `K - 1` q/k/v projections, oldest first.
    conv_state: D::Act,
    /// Per value head, `S` as `[k_dim][v_dim]`.
    state: D::Act,
    /// Leave out the conv state (only to show the fixture needs it).
    pub(crate) drop_conv_state: bool,
}

impl<D: HybridOps> GatedDeltaNet<D> {
    /// Load `{prefix}.linear_attn.*`.
    pub fn load(l: &Loader<'_, D>, cfg: &Qwen4Config, prefix: &str) -> Result<Self, EngineError> {
        let s = cfg.linear.clone();
        let h = cfg.hidden_size;
        let vd = s.v_heads * s.v_dim;
        let conv_dim = delta_spec(&s).mixed_cols();
        let p = format!("{prefix}.linear_attn");
        let a_log = l.ckpt.load_f32(&format!("{p}.A_log"), &[s.v_heads])?;
        let conv = l
            .ckpt
            .load_f32(&format!("{p}.conv1d.weight"), &[conv_dim, 1, s.conv_kernel])?;
        let dev = l.dev;
        Ok(Self {
            in_qkv: l.matrix(&format!("{p}.in_proj_qkv.weight"), [conv_dim, h])?,
            in_z: l.matrix(&format!("{p}.in_proj_z.weight"), [vd, h])?,
            in_b: l.matrix(&format!("{p}.in_proj_b.weight"), [s.v_heads, h])?,
            in_a: l.matrix(&format!("{p}.in_proj_a.weight"), [s.v_heads, h])?,
            out: l.matrix(&format!("{p}.out_proj.weight"), [h, vd])?,
            conv: dev.vector(conv)?,
            a_log_exp: dev.vector(a_log.iter().map(|v| v.exp()).collect())?,
            dt_bias: l.vector(&format!("{p}.dt_bias"), &[s.v_heads])?,
            norm: l.vector(&format!("{p}.norm.weight"), &[s.v_dim])?,
            eps: cfg.rms_norm_eps,
            hidden: h,
            conv_state: dev.state(s.conv_kernel.saturating_sub(1), conv_dim)?,
            state: dev.state(s.v_heads, s.k_dim * s.v_dim)?,
            shape: s,
            drop_conv_state: false,
        })
    }

    /// Forget the sequence.
    pub fn reset(&mut self, dev: &D) -> Result<(), EngineError> {
        self.conv_state = dev.state(self.conv_state.rows(), self.conv_state.cols())?;
        self.state = dev.state(self.state.rows(), self.state.cols())?;
        Ok(())
    }

    /// The layer's output for the rows of `x` (`rows x hidden`), in order,
    /// advancing the states.
    pub fn forward(&mut self, dev: &D, x: &D::Act) -> Result<D::Act, EngineError> {
        let s = &self.shape;
        let rows = x.rows();
        let spec = delta_spec(s);
        let (conv_dim, vd) = (spec.mixed_cols(), s.v_heads * s.v_dim);
        let mut qkv = dev.zeros(rows, conv_dim)?;
        let mut z = dev.zeros(rows, vd)?;
        let mut b = dev.zeros(rows, s.v_heads)?;
        let mut a = dev.zeros(rows, s.v_heads)?;
        dev.linear_many(
            &mut [&mut qkv, &mut z, &mut b, &mut a],
            &[&self.in_qkv, &self.in_z, &self.in_b, &self.in_a],
            x,
        )?;
        let conv = ConvSpec {
            kernel: s.conv_kernel,
            dilation: 1,
        };
        let mut mixed = dev.zeros(rows, conv_dim)?;
        if self.drop_conv_state {
            // Each row after a zeroed state.
            for r in 0..rows {
                let mut one = dev.zeros(1, conv_dim)?;
                dev.copy_rows(&mut one, 0, &qkv, r, 1)?;
                let mut state = dev.state(self.conv_state.rows(), conv_dim)?;
                let mut y = dev.zeros(1, conv_dim)?;
                dev.causal_conv(&mut state, &one, &self.conv, conv, &mut y)?;
                dev.copy_rows(&mut mixed, r, &y, 0, 1)?;
            }
        } else {
            dev.causal_conv(&mut self.conv_state, &qkv, &self.conv, conv, &mut mixed)?;
        }
        let mut core = dev.zeros(rows, vd)?;
        dev.gated_delta(
            &mut self.state,
            &mixed,
            (&b, &a),
            &self.a_log_exp,
            &self.dt_bias,
            spec,
            &mut core,
        )?;
        let mut normed = dev.zeros(rows, vd)?;
        dev.gated_norm(
            &mut normed,
            (&core, &z),
            &self.norm,
            self.eps,
            s.sigmoid_gate,
        )?;
        let mut y = dev.zeros(rows, self.hidden)?;
        dev.linear(&mut y, &self.out, &normed)?;
        Ok(y)
    }
}

fn delta_spec(s: &LinearAttn) -> DeltaSpec {
    DeltaSpec {
        k_heads: s.k_heads,
        v_heads: s.v_heads,
        k_dim: s.k_dim,
        v_dim: s.v_dim,
    }
}
