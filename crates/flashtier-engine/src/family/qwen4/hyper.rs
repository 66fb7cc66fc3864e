//! Hyper-connections: `hc_count` residual streams of `hidden` each. A gated
//! residual mixer normalises the streams (RMSNorm per stream, `(1 + w)`),
//! mixes them into the block's input
//! `mean_s(sigmoid(up(silu(down(n) / hc)))_s * n_s)` and, around a block,
//! gives each stream its injection weight `2 sigmoid(inject(n) / hc)`
//! ([`GatedResidual::inject_gate`], applied by the injection itself); the
//! block's output times that weight is added to each (un-normed) stream.
//! The final mixer has no injection.

use crate::device::Device;
use crate::device::hybrid::{HybridOps, Map};
use crate::error::EngineError;
use crate::load::weights::Loader;

use super::ops::one_plus;

/// One gated residual mixer.
pub struct GatedResidual<D: Device> {
    norm: D::Vector,
    down: D::Mat,
    up: D::Mat,
    inject: Option<D::Mat>,
    streams: usize,
    hidden: usize,
    lowrank: usize,
    eps: f32,
}

/// What a mixer gives a block: its input and each stream's weight.
pub struct Mixed<D: Device> {
    /// `rows x hidden`.
    pub input: D::Act,
    /// `rows x streams`, before [`GatedResidual::inject_gate`] (`None`
    /// for the final mixer).
    pub inject: Option<D::Act>,
}

impl<D: HybridOps> GatedResidual<D> {
    /// Load `{prefix}.*` (`inject`: with `block_inject_weight`).
    pub fn load(
        l: &Loader<'_, D>,
        prefix: &str,
        (streams, hidden, lowrank): (usize, usize, usize),
        eps: f32,
        inject: bool,
    ) -> Result<Self, EngineError> {
        let wide = streams * hidden;
        let matrix = |name: &str, shape| l.matrix(&format!("{prefix}.{name}.weight"), shape);
        let norm = one_plus(
            l.ckpt
                .load_f32(&format!("{prefix}.hc_norm.weight"), &[wide])?,
        );
        Ok(Self {
            norm: l.dev.vector(norm)?,
            down: matrix("input_mix_weight_down", [lowrank, wide])?,
            up: matrix("input_mix_weight_up", [wide, lowrank])?,
            inject: if inject {
                Some(matrix("block_inject_weight", [streams, wide])?)
            } else {
                None
            },
            streams,
            hidden,
            lowrank,
            eps,
        })
    }

    /// The map that turns [`Mixed::inject`] into the streams' weights,
    /// `2 sigmoid(w / hc)`.
    pub fn inject_gate(&self) -> Map {
        Map::Sigmoid {
            div: self.streams as f32,
            mul: 2.0,
        }
    }

    /// Mix the rows of `x` (`rows x streams * hidden`).
    pub fn forward(&self, dev: &D, x: &D::Act) -> Result<Mixed<D>, EngineError> {
        let rows = crate::device::Activation::rows(x);
        let (hc, h) = (self.streams, self.hidden);
        let mut n = dev.zeros(rows, hc * h)?;
        dev.rms_norm_wide(&mut n, x, &self.norm, h, self.eps)?;
        let mut low = dev.zeros(rows, self.lowrank)?;
        // Both products of the normed streams in one pass where there is
        // an injection (the GPU runs them as one launch; the same bits).
        let inject = match &self.inject {
            Some(w) => {
                let mut g = dev.zeros(rows, hc)?;
                dev.linear_many(&mut [&mut low, &mut g], &[&self.down, w], &n)?;
                Some(g)
            }
            None => {
                dev.linear(&mut low, &self.down, &n)?;
                None
            }
        };
        dev.map(&mut low, Map::Silu { div: hc as f32 })?;
        let mut gates = dev.zeros(rows, hc * h)?;
        dev.linear(&mut gates, &self.up, &low)?;
        let mut input = dev.zeros(rows, h)?;
        dev.hc_mix(&mut input, &gates, &n, hc)?;
        Ok(Mixed { input, inject })
    }
}
