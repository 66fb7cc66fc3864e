//! RoPE's base and scaling from `config.json`: plain RoPE or YaRN, in the
//! spellings of transformers 4.x and 5.x.

use serde_json::{Map, Value};

use super::fields::Fields;
use super::{Mla, ModelConfig, Yarn};
use crate::error::EngineError;

/// YaRN's `mscale` of a context extension by `scale`.
pub(super) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// `rope_theta` (4.x) or `rope_parameters.rope_theta` (5.x), and the
/// scaling: plain RoPE or YaRN (`rope_scaling` with `type` or `rope_type`
/// `yarn` in 4.x, `rope_parameters` in 5.x). YaRN scales cos and sin by its
/// attention factor; DeepSeek-V3 also corrects the softmax scale
/// ([`ModelConfig::attention_scale`]).
pub(super) fn rope(c: &Fields<'_>) -> Result<(f64, Option<Yarn>), EngineError> {
    let mut yarn_fields: Option<(&'static str, &Map<String, Value>)> = None;
    for field in ["rope_scaling", "rope_parameters"] {
        let Some(v) = c.get(field) else { continue };
        let p = v
            .as_object()
            .ok_or_else(|| EngineError::config(field, "not an object"))?;
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        match kind {
            "default" => {}
            "yarn" => yarn_fields = Some((field, p)),
            other => {
                let name = match field {
                    "rope_parameters" => "rope_parameters.rope_type",
                    _ => field,
                };
                return Err(EngineError::config(
                    name,
                    format!("rope type `{other}` is not supported (default, yarn)"),
                ));
            }
        }
        if let Some(f) = p.get("partial_rotary_factor").and_then(Value::as_f64) {
            if f != 1.0 {
                return Err(EngineError::config(
                    "rope_parameters.partial_rotary_factor",
                    format!("{f} is not supported (1.0)"),
                ));
            }
        }
    }
    let theta = c
        .get("rope_parameters")
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| c.get("rope_theta"));
    let theta = match theta {
        Some(t) => t
            .as_f64()
            .filter(|t| *t > 0.0)
            .ok_or_else(|| EngineError::config("rope_theta", "not a positive number"))?,
        None => {
            return Err(EngineError::config(
                "rope_theta",
                "missing (neither rope_theta nor rope_parameters.rope_theta)",
            ));
        }
    };
    let Some((field, p)) = yarn_fields else {
        return Ok((theta, None));
    };
    let num = |k: &str| -> Result<Option<f64>, EngineError> {
        p.get(k)
            .filter(|v| !v.is_null())
            .map(|v| {
                v.as_f64()
                    .filter(|f| f.is_finite())
                    .ok_or_else(|| EngineError::config(field, format!("{k}: {v} is not a number")))
            })
            .transpose()
    };
    let original = num("original_max_position_embeddings")?
        .ok_or_else(|| EngineError::config(field, "yarn needs original_max_position_embeddings"))?;
    let max_positions = c.opt_positive("max_position_embeddings")?.unwrap_or(4096) as f64;
    let factor = num("factor")?.unwrap_or(max_positions / original);
    let (mscale, mscale_all_dim) = (num("mscale")?, num("mscale_all_dim")?);
    let attention_factor = match (num("attention_factor")?, mscale, mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            yarn_mscale(factor, m) / yarn_mscale(factor, all)
        }
        _ => yarn_mscale(factor, 1.0),
    };
    let beta = |k: &str, default: f64| -> Result<f64, EngineError> {
        Ok(num(k)?.filter(|b| *b != 0.0).unwrap_or(default))
    };
    Ok((
        theta,
        Some(Yarn {
            factor,
            original_max_positions: original,
            beta_fast: beta("beta_fast", 32.0)?,
            beta_slow: beta("beta_slow", 1.0)?,
            truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            attention_factor,
            mscale_all_dim: mscale_all_dim.unwrap_or(0.0),
        }),
    ))
}

impl ModelConfig {
    /// RoPE's inverse frequencies over `rope_dim`, in f32 as transformers
    /// computes them (plain, or YaRN's blend of interpolated and
    /// extrapolated frequencies).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.rope_dim;
        let base = self.rope_theta as f32;
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(y) = &self.yarn else {
            return pos_freqs.iter().map(|p| 1.0 / p).collect();
        };
        let correction_dim = |rotations: f64| {
            (dim as f64
                * (y.original_max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln())
                / (2.0 * self.rope_theta.ln())
        };
        let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
        if y.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        pos_freqs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let inter = 1.0 / (y.factor as f32 * p);
                let extra = 1.0 / p;
                inter * (1.0 - extrapolation) + extra * extrapolation
            })
            .collect()
    }

    /// Scale of RoPE's cos and sin (YaRN's attention factor, else 1).
    pub fn rope_attention_factor(&self) -> f32 {
        self.yarn
            .as_ref()
            .map_or(1.0, |y| y.attention_factor as f32)
    }

    /// The softmax scale of attention: `1 / sqrt(query/key head width)`,
    /// times DeepSeek's YaRN correction `mscale(factor, mscale_all_dim)^2`.
    pub fn attention_scale(&self) -> f64 {
        let qk = self.mla.as_ref().map_or(self.head_dim, Mla::qk_head_dim);
        let base = (qk as f64).powf(-0.5);
        match (&self.mla, &self.yarn) {
            (Some(_), Some(y)) if y.mscale_all_dim != 0.0 => {
                let m = yarn_mscale(y.factor, y.mscale_all_dim);
                base * m * m
            }
            _ => base,
        }
    }
}
