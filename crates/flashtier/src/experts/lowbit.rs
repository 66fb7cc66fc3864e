//! Low-bit companions: a 3-bit or 2-bit group-quantized copy of every record
//! of an expert store, in a store of its own, that a pool slot may hold
//! instead of the exact record by explicit choice (the address then says
//! so: [`super::Precision`]). Format: `docs/lowbit-format.md`.
//!
//! Each floating-point tensor of a record (BF16, F16, F32, F8_E4M3) whose name
//! does not contain `scale` is split into groups of `group` consecutive
//! elements. Per group: `min` and `step` as f16 (the group's range, shrunk
//! about its centre by the factor in 1.0, 0.9, ..., 0.5 that gives the lowest
//! squared error), codes `q = round((x - min) / step)` clamped to
//! `0..2^bits - 1`, packed
//! little-endian (`bits` bits per element, element `i` at bit `i * bits` of
//! the tensor's code stream). Dequantization: `x' = min + q * step`, with
//! `min` and `step` read as f16 ([`dequantize`] is the reference). Other
//! tensors (scales, raw bytes) are copied exactly. Codes are computed against
//! the f16-rounded `min` and `step`, so the dequantized value is what the
//! error figures measure.
//!
//! Bounds: one source record and one companion record in memory at a time.

use half::f16;

/// Bytes every companion tensor starts on (SIMD-friendly).
pub const TENSOR_ALIGN_BYTES: u64 = 64;

/// A low-bit failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LowbitError {
    /// Bits other than 2 or 3, or a zero group.
    #[error("low-bit: bits must be 2 or 3 and group >= 1 (got bits {bits}, group {group})")]
    Spec {
        /// Bits asked for.
        bits: u32,
        /// Group size asked for.
        group: usize,
    },
    /// A value is NaN or infinite, or a group's range does not fit f16.
    #[error("low-bit: tensor {tensor}: element {index} = {value} cannot be quantized")]
    Value {
        /// Tensor name.
        tensor: String,
        /// Element index.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A buffer does not match the layout.
    #[error("low-bit: {0}")]
    Layout(String),
    /// The store layer failed.
    #[error(transparent)]
    Format(#[from] flashtier_format::FormatError),
    /// I/O failed.
    #[error(transparent)]
    Io(#[from] flashtier_io::IoError),
    /// The output was refused, locked by another writer, or not persisted.
    #[error(transparent)]
    Persist(#[from] flashtier_io::PersistError),
}

/// Bits and group size of a companion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LowbitSpec {
    /// Bits per element: 2 or 3.
    pub bits: u32,
    /// Elements per group.
    pub group: usize,
}

impl LowbitSpec {
    /// A checked spec.
    pub fn new(bits: u32, group: usize) -> Result<Self, LowbitError> {
        if !(bits == 2 || bits == 3) || group == 0 {
            return Err(LowbitError::Spec { bits, group });
        }
        Ok(Self { bits, group })
    }

    /// Groups of a tensor of `n` elements.
    #[must_use]
    pub fn groups(&self, n: usize) -> usize {
        n.div_ceil(self.group)
    }

    /// Code bytes of a tensor of `n` elements.
    #[must_use]
    pub fn code_bytes(&self, n: usize) -> usize {
        (n * self.bits as usize).div_ceil(8)
    }
}

/// One quantized tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantTensor {
    /// Per-group minimum.
    pub mins: Vec<f16>,
    /// Per-group step.
    pub steps: Vec<f16>,
    /// Packed codes.
    pub codes: Vec<u8>,
}

fn put_code(codes: &mut [u8], i: usize, bits: u32, q: u32) {
    let bit = i * bits as usize;
    for b in 0..bits as usize {
        if q >> b & 1 == 1 {
            let j = bit + b;
            if let Some(byte) = codes.get_mut(j / 8) {
                *byte |= 1 << (j % 8);
            }
        }
    }
}

/// Code of element `i` in a packed stream.
#[must_use]
pub fn get_code(codes: &[u8], i: usize, bits: u32) -> u32 {
    let bit = i * bits as usize;
    (0..bits as usize).fold(0, |q, b| {
        let j = bit + b;
        let set = codes
            .get(j / 8)
            .is_some_and(|byte| byte >> (j % 8) & 1 == 1);
        q | (u32::from(set) << b)
    })
}

/// Range shrink factors tried per group: clipping the extremes of a group
/// lowers the error of the bulk of its values; the factor with the lowest
/// squared error wins.
const CLIP_FACTORS: [f32; 6] = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5];

/// `(min, step)` in f16 covering `[lo, hi]` with `levels` steps; `None` when
/// the range does not fit f16.
fn group_params(lo: f32, hi: f32, levels: u32) -> Option<(f16, f16)> {
    let min = f16::from_f32(lo);
    // Round the step up so the top code still reaches `hi` after f16 rounding.
    let mut step = f16::from_f32((hi - min.to_f32()).max(0.0) / levels as f32);
    if step.to_f32() * (levels as f32) + min.to_f32() < hi {
        step = f16::from_bits(step.to_bits() + 1);
    }
    (min.is_finite() && step.is_finite()).then_some((min, step))
}

fn code_of(v: f32, min: f32, step: f32, levels: u32) -> u32 {
    if step > 0.0 {
        ((v - min) / step).round().clamp(0.0, levels as f32) as u32
    } else {
        0
    }
}

fn group_sq_err(chunk: &[f32], min: f32, step: f32, levels: u32) -> f32 {
    chunk
        .iter()
        .map(|&v| {
            let d = v - (min + code_of(v, min, step, levels) as f32 * step);
            d * d
        })
        .sum()
}

/// Quantize `values` (tensor `name`, for errors).
pub fn quantize(name: &str, values: &[f32], spec: LowbitSpec) -> Result<QuantTensor, LowbitError> {
    let levels = (1u32 << spec.bits) - 1;
    let groups = spec.groups(values.len());
    let mut q = QuantTensor {
        mins: Vec::with_capacity(groups),
        steps: Vec::with_capacity(groups),
        codes: vec![0; spec.code_bytes(values.len())],
    };
    for (g, chunk) in values.chunks(spec.group).enumerate() {
        let bad = |k: usize, v: f32| LowbitError::Value {
            tensor: name.to_string(),
            index: g * spec.group + k,
            value: v,
        };
        if let Some(k) = chunk.iter().position(|v| !v.is_finite()) {
            return Err(bad(k, chunk[k]));
        }
        let lo = chunk.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (mid, half) = ((lo + hi) / 2.0, (hi - lo) / 2.0);
        let mut best: Option<(f32, f16, f16)> = None;
        for c in CLIP_FACTORS {
            let (clo, chi) = if c == 1.0 {
                (lo, hi)
            } else {
                (mid - c * half, mid + c * half)
            };
            let Some((min, step)) = group_params(clo, chi, levels) else {
                continue;
            };
            let err = group_sq_err(chunk, min.to_f32(), step.to_f32(), levels);
            if best.is_none_or(|(e, _, _)| err < e) {
                best = Some((err, min, step));
            }
        }
        let Some((_, min, step)) = best else {
            return Err(bad(0, if lo.abs() > hi.abs() { lo } else { hi }));
        };
        let (m, s) = (min.to_f32(), step.to_f32());
        for (k, &v) in chunk.iter().enumerate() {
            put_code(
                &mut q.codes,
                g * spec.group + k,
                spec.bits,
                code_of(v, m, s, levels),
            );
        }
        q.mins.push(min);
        q.steps.push(step);
    }
    Ok(q)
}

/// Reference dequantization of `n` elements.
#[must_use]
pub fn dequantize(q: &QuantTensor, n: usize, spec: LowbitSpec) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let g = i / spec.group;
            let min = q.mins.get(g).map_or(0.0, |v| v.to_f32());
            let step = q.steps.get(g).map_or(0.0, |v| v.to_f32());
            min + get_code(&q.codes, i, spec.bits) as f32 * step
        })
        .collect()
}

/// Error of a dequantized copy against its source.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QuantError {
    /// Elements compared.
    pub elements: u64,
    /// Sum of squared errors.
    pub sum_sq_err: f64,
    /// Sum of squared source values.
    pub sum_sq_src: f64,
    /// Largest absolute error.
    pub max_abs_err: f64,
}

impl QuantError {
    /// Add `src` vs `deq`.
    pub fn add(&mut self, src: &[f32], deq: &[f32]) {
        for (a, b) in src.iter().zip(deq) {
            let e = f64::from(a - b);
            self.sum_sq_err += e * e;
            self.sum_sq_src += f64::from(*a) * f64::from(*a);
            self.max_abs_err = self.max_abs_err.max(e.abs());
            self.elements += 1;
        }
    }

    /// Merge another tally.
    pub fn merge(&mut self, o: &Self) {
        self.elements += o.elements;
        self.sum_sq_err += o.sum_sq_err;
        self.sum_sq_src += o.sum_sq_src;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
    }

    /// Root mean square error.
    #[must_use]
    pub fn rmse(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            (self.sum_sq_err / self.elements as f64).sqrt()
        }
    }

    /// RMS error relative to the RMS of the source.
    #[must_use]
    pub fn relative_rmse(&self) -> f64 {
        if self.sum_sq_src == 0.0 {
            0.0
        } else {
            (self.sum_sq_err / self.sum_sq_src).sqrt()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spec_rejects_other_bits() {
        assert!(LowbitSpec::new(4, 64).is_err() && LowbitSpec::new(3, 0).is_err());
        assert!(LowbitSpec::new(2, 64).is_ok());
    }

    #[test]
    fn non_finite_input_is_an_error() {
        let spec = LowbitSpec::new(3, 4).expect("valid");
        let err = quantize("w", &[1.0, f32::NAN, 0.0], spec).expect_err("nan");
        assert!(matches!(err, LowbitError::Value { index: 1, .. }));
    }

    proptest! {
        #[test]
        fn codes_round_trip_and_error_is_within_half_a_step(
            values in proptest::collection::vec(-4.0f32..4.0, 1..300),
            bits in 2u32..4,
            group in 1usize..80,
        ) {
            let spec = LowbitSpec::new(bits, group).expect("valid");
            let q = quantize("w", &values, spec).expect("finite");
            prop_assert_eq!(q.mins.len(), spec.groups(values.len()));
            prop_assert_eq!(q.codes.len(), spec.code_bytes(values.len()));
            let deq = dequantize(&q, values.len(), spec);
            let mut err_ours = 0.0f64;
            let mut err_minmax = 0.0f64;
            for (i, (&v, &d)) in values.iter().zip(&deq).enumerate() {
                let chunk = &values[(i / group) * group..((i / group + 1) * group).min(values.len())];
                let lo = chunk.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                // Within the group's range (plus f16 rounding of min).
                prop_assert!(d >= lo - 4e-3 * (1.0 + lo.abs()) && d <= hi + 4e-3 * (1.0 + hi.abs()), "element {}: {} outside [{}, {}]", i, d, lo, hi);
                prop_assert!(get_code(&q.codes, i, bits) < 1 << bits);
                err_ours += f64::from(v - d).powi(2);
                // Plain min/max quantization is at most half a step away.
                let levels = ((1u32 << bits) - 1) as f32;
                let step = (hi - lo) / levels;
                err_minmax += f64::from(0.5 * step + 4e-3 * (1.0 + v.abs())).powi(2);
            }
            // Clip search never does worse than min/max's worst case.
            prop_assert!(err_ours <= err_minmax + 1e-9, "{} > {}", err_ours, err_minmax);
        }
    }
}
