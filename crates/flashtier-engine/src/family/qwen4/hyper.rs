//! Hyper-connections: `hc_count` residual streams of `hidden` each. A gated
//! residual mixer normalises the streams (RMSNorm per stream, `(1 + w)`),
//! mixes them into the block's input
//! `mean_s(sigmoid(up(silu(down(n) / hc)))_s * n_s)` and, around a block,
//! gives each stream its injection weight `2 sigmoid(inject(n) / hc)`; the
//! block's output times that weight is added to each (un-normed) stream.
//! The final mixer has no injection.

use crate::checkpoint::Checkpoint;
use crate::config::qwen4::Qwen4Config;
use crate::device::cpu::kernels::silu;
use crate::error::EngineError;
use crate::matrix::Matrix;

use super::ops::{host_loader, linear, norm_groups, one_plus, sigmoid};

/// One gated residual mixer.
pub struct GatedResidual {
    norm: Vec<f32>,
    down: Matrix,
    up: Matrix,
    inject: Option<Matrix>,
    streams: usize,
    hidden: usize,
    eps: f32,
}

/// What a mixer gives a block: its input and each stream's weight.
pub struct Mixed {
    /// `rows x hidden`.
    pub input: Vec<f32>,
    /// `rows x streams` (empty for the final mixer).
    pub inject: Vec<f32>,
}

impl GatedResidual {
    /// Load `{prefix}.*` (`inject`: with `block_inject_weight`).
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        cfg: &Qwen4Config,
        inject: bool,
    ) -> Result<Self, EngineError> {
        let l = host_loader(ckpt);
        let (streams, hidden, lowrank) = (cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank);
        let wide = streams * hidden;
        let matrix = |name: &str, shape| l.host_matrix(&format!("{prefix}.{name}.weight"), shape);
        Ok(Self {
            norm: one_plus(l.vector(&format!("{prefix}.hc_norm.weight"), &[wide])?),
            down: matrix("input_mix_weight_down", [lowrank, wide])?,
            up: matrix("input_mix_weight_up", [wide, lowrank])?,
            inject: if inject {
                Some(matrix("block_inject_weight", [streams, wide])?)
            } else {
                None
            },
            streams,
            hidden,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Mix the `rows` rows of `x` (`rows x streams * hidden`).
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Mixed, EngineError> {
        let (hc, h) = (self.streams, self.hidden);
        let n = norm_groups(x, &self.norm, h, self.eps)?;
        let mut low = linear(&self.down, &n, rows)?;
        low.iter_mut().for_each(|v| *v = silu(*v / hc as f32));
        let gates = linear(&self.up, &low, rows)?;
        let mut input = vec![0f32; rows * h];
        for ((out, gr), nr) in input
            .chunks_exact_mut(h)
            .zip(gates.chunks_exact(hc * h))
            .zip(n.chunks_exact(hc * h))
        {
            for (s, (gs, ns)) in gr.chunks_exact(h).zip(nr.chunks_exact(h)).enumerate() {
                for (j, o) in out.iter_mut().enumerate() {
                    let v = sigmoid(gs[j]) * ns[j];
                    *o = if s == 0 { v } else { *o + v };
                }
            }
            out.iter_mut().for_each(|o| *o /= hc as f32);
        }
        let inject = match &self.inject {
            Some(w) => {
                let mut g = linear(w, &n, rows)?;
                g.iter_mut()
                    .for_each(|v| *v = 2.0 * sigmoid(*v / hc as f32));
                g
            }
            None => Vec::new(),
        };
        Ok(Mixed { input, inject })
    }
}
