//! GatedDeltaNet (`linear_attention` layers), one token at a time with its
//! two states, as transformers' recurrent rule computes it (its chunked
//! prompt form is the same sums regrouped):
//!
//! - a causal depthwise conv (width `K`) over the q/k/v projection, SiLU;
//!   the state is the last `K - 1` projections (zeros before the first);
//! - per value head (query/key heads repeated `v_heads / k_heads` times),
//!   L2-normed q and k, q scaled by `1/sqrt(k_dim)`,
//!   `beta = sigmoid(b)`, decay `g = -exp(A_log) softplus(a + dt_bias)`;
//!   the `k_dim x v_dim` state `S` decays by `exp(g)`, then takes the delta
//!   rule `S += k (beta (v - S^T k))^T`, and the output is `S^T q`;
//! - a gated RMSNorm per value head (`w * norm(o) * act(z)`, act SiLU or
//!   sigmoid), then `out_proj`.
//!
//! State memory: `(K - 1) * conv_dim + v_heads * k_dim * v_dim` f32.

use crate::checkpoint::Checkpoint;
use crate::config::qwen4::{LinearAttn, Qwen4Config};
use crate::device::cpu::kernels::{rms_norm, silu};
use crate::error::EngineError;
use crate::matrix::Matrix;

use super::ops::{host_loader, l2norm, linear, sigmoid, softplus};

/// One GatedDeltaNet layer with its states.
pub struct GatedDeltaNet {
    shape: LinearAttn,
    in_qkv: Matrix,
    in_z: Matrix,
    in_b: Matrix,
    in_a: Matrix,
    out: Matrix,
    /// `[conv_dim][K]`.
    conv: Vec<f32>,
    a_log_exp: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
    eps: f32,
    /// The last `K - 1` q/k/v projections, oldest first.
    conv_state: Vec<f32>,
    /// Per value head, `S` as `[k_dim][v_dim]`.
    state: Vec<f32>,
    /// Leave out the conv state (only to show the fixture needs it).
    pub(crate) drop_conv_state: bool,
}

impl GatedDeltaNet {
    /// Load `{prefix}.linear_attn.*`.
    pub fn load(ckpt: &Checkpoint, cfg: &Qwen4Config, prefix: &str) -> Result<Self, EngineError> {
        let s = cfg.linear.clone();
        let l = host_loader(ckpt);
        let h = cfg.hidden_size;
        let (kd, vd) = (s.k_heads * s.k_dim, s.v_heads * s.v_dim);
        let conv_dim = 2 * kd + vd;
        let p = format!("{prefix}.linear_attn");
        let a_log = l.vector(&format!("{p}.A_log"), &[s.v_heads])?;
        Ok(Self {
            in_qkv: l.host_matrix(&format!("{p}.in_proj_qkv.weight"), [conv_dim, h])?,
            in_z: l.host_matrix(&format!("{p}.in_proj_z.weight"), [vd, h])?,
            in_b: l.host_matrix(&format!("{p}.in_proj_b.weight"), [s.v_heads, h])?,
            in_a: l.host_matrix(&format!("{p}.in_proj_a.weight"), [s.v_heads, h])?,
            out: l.host_matrix(&format!("{p}.out_proj.weight"), [h, vd])?,
            conv: ckpt.load_f32(&format!("{p}.conv1d.weight"), &[conv_dim, 1, s.conv_kernel])?,
            a_log_exp: a_log.iter().map(|v| v.exp()).collect(),
            dt_bias: l.vector(&format!("{p}.dt_bias"), &[s.v_heads])?,
            norm: l.vector(&format!("{p}.norm.weight"), &[s.v_dim])?,
            eps: cfg.rms_norm_eps,
            conv_state: vec![0.0; (s.conv_kernel - 1) * conv_dim],
            state: vec![0.0; s.v_heads * s.k_dim * s.v_dim],
            shape: s,
            drop_conv_state: false,
        })
    }

    /// Forget the sequence.
    pub fn reset(&mut self) {
        self.conv_state.iter_mut().for_each(|v| *v = 0.0);
        self.state.iter_mut().for_each(|v| *v = 0.0);
    }

    /// The layer's output for the `rows` rows of `x` (`rows x hidden`), in
    /// order, advancing the states.
    pub fn forward(&mut self, x: &[f32], rows: usize) -> Result<Vec<f32>, EngineError> {
        let s = self.shape.clone();
        let qkv = linear(&self.in_qkv, x, rows)?;
        let z = linear(&self.in_z, x, rows)?;
        let b = linear(&self.in_b, x, rows)?;
        let a = linear(&self.in_a, x, rows)?;
        let conv_dim = self.in_qkv.rows();
        let vd = s.v_heads * s.v_dim;
        let mut core = vec![0f32; rows * vd];
        for r in 0..rows {
            let mixed = self.conv_step(&qkv[r * conv_dim..(r + 1) * conv_dim]);
            let out = self.delta_step(&mixed, &b[r * s.v_heads..], &a[r * s.v_heads..]);
            let dst = &mut core[r * vd..(r + 1) * vd];
            self.gated_norm(dst, &out, &z[r * vd..(r + 1) * vd]);
        }
        linear(&self.out, &core, rows)
    }

    /// The conv (with SiLU) of one projection after the state; the state
    /// moves on by it.
    fn conv_step(&mut self, cur: &[f32]) -> Vec<f32> {
        let k = self.shape.conv_kernel;
        let c_dim = cur.len();
        if self.drop_conv_state {
            self.conv_state.iter_mut().for_each(|v| *v = 0.0);
        }
        let mut out = vec![0f32; c_dim];
        for (c, o) in out.iter_mut().enumerate() {
            let w = &self.conv[c * k..(c + 1) * k];
            let mut acc = 0f32;
            for (t, wt) in w.iter().enumerate().take(k - 1) {
                acc += wt * self.conv_state[t * c_dim + c];
            }
            acc += w[k - 1] * cur[c];
            *o = silu(acc);
        }
        if k > 1 {
            self.conv_state.copy_within(c_dim.., 0);
            let last = self.conv_state.len() - c_dim;
            self.conv_state[last..].copy_from_slice(cur);
        }
        out
    }

    /// The delta rule for one token's conv output; returns `v_heads x v_dim`.
    fn delta_step(&mut self, mixed: &[f32], b: &[f32], a: &[f32]) -> Vec<f32> {
        let s = &self.shape;
        let (kd, dk, dv) = (s.k_heads * s.k_dim, s.k_dim, s.v_dim);
        let mut q = mixed[..kd].to_vec();
        let mut k = mixed[kd..2 * kd].to_vec();
        let v = &mixed[2 * kd..];
        let scale = 1.0 / (dk as f32).sqrt();
        for (qh, kh) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
            l2norm(qh);
            l2norm(kh);
            qh.iter_mut().for_each(|x| *x *= scale);
        }
        let per_k = s.v_heads / s.k_heads;
        let mut out = vec![0f32; s.v_heads * dv];
        for hv in 0..s.v_heads {
            let kh = hv / per_k;
            let (qv, kv) = (&q[kh * dk..(kh + 1) * dk], &k[kh * dk..(kh + 1) * dk]);
            let beta = sigmoid(b[hv]);
            let decay = (-self.a_log_exp[hv] * softplus(a[hv] + self.dt_bias[hv])).exp();
            let st = &mut self.state[hv * dk * dv..(hv + 1) * dk * dv];
            st.iter_mut().for_each(|x| *x *= decay);
            let mut delta = vec![0f32; dv];
            for (row, kr) in st.chunks_exact(dv).zip(kv) {
                for (d, sv) in delta.iter_mut().zip(row) {
                    *d += sv * kr;
                }
            }
            for (d, vv) in delta.iter_mut().zip(&v[hv * dv..(hv + 1) * dv]) {
                *d = (vv - *d) * beta;
            }
            let o = &mut out[hv * dv..(hv + 1) * dv];
            for ((row, kr), qr) in st.chunks_exact_mut(dv).zip(kv).zip(qv) {
                for ((sv, d), ov) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
                    *sv += kr * d;
                    *ov += *sv * qr;
                }
            }
        }
        out
    }

    /// `w * rms_norm(o) * act(z)` per value head.
    fn gated_norm(&self, dst: &mut [f32], o: &[f32], z: &[f32]) {
        let dv = self.shape.v_dim;
        for ((d, oh), zh) in dst
            .chunks_exact_mut(dv)
            .zip(o.chunks_exact(dv))
            .zip(z.chunks_exact(dv))
        {
            rms_norm(d, oh, &self.norm, self.eps);
            for (dv, zv) in d.iter_mut().zip(zh) {
                let g = if self.shape.sigmoid_gate {
                    sigmoid(*zv)
                } else {
                    silu(*zv)
                };
                *dv *= g;
            }
        }
    }
}
