//! Stored elements widened to f32: the one decoder of a tensor's bytes
//! ([`to_f32`]) and the one hand-written BF16 widening ([`bf16_to_f32`]),
//! kept for the hot loops.
//!
//! Every [`Dtype`] decodes exactly: BF16 and F16 through `half`, F32 as
//! little-endian bytes, F8 E4M3 through [`crate::fp8`] (codes unscaled), U8
//! as its value.

use crate::fp8::e4m3_to_f32;
use crate::manifest::Dtype;

/// One BF16 (its bits) as f32, exactly: the bits shifted into the top half.
///
/// The CPU GEMV and the tiled decode attention widen every weight and every
/// cached key and value through this, in loops that must vectorise: a shift
/// and nothing else. `half::bf16::to_f32`, which every other conversion
/// uses, also sets the quiet bit of a signalling NaN (a compare and a select
/// per element); the two agree on every value that is not NaN, and both give
/// NaN for a NaN.
#[must_use]
#[inline(always)]
pub const fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Little-endian `dtype` elements of `bytes` as f32 (a trailing partial
/// element is ignored).
#[must_use]
pub fn to_f32(bytes: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F8E4M3 => bytes.iter().map(|&c| e4m3_to_f32(c)).collect(),
        Dtype::U8 => bytes.iter().map(|&c| f32::from(c)).collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_widening_matches_half_on_every_value_but_nan_payloads() {
        for bits in 0..=u16::MAX {
            let ours = bf16_to_f32(bits);
            let theirs = half::bf16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn every_dtype_decodes_exactly() {
        let bf = [1.5f32, -2.0, 0.0].map(|x| half::bf16::from_f32(x).to_le_bytes());
        assert_eq!(to_f32(bf.as_flattened(), Dtype::Bf16), [1.5, -2.0, 0.0]);
        let h = [0.25f32, -65504.0].map(|x| half::f16::from_f32(x).to_le_bytes());
        assert_eq!(to_f32(h.as_flattened(), Dtype::F16), [0.25, -65504.0]);
        let f = [3.25f32, f32::MIN_POSITIVE].map(f32::to_le_bytes);
        assert_eq!(
            to_f32(f.as_flattened(), Dtype::F32),
            [3.25, f32::MIN_POSITIVE]
        );
        assert_eq!(
            to_f32(&[0x38, 0xB8, 0x7E], Dtype::F8E4M3),
            [1.0, -1.0, 448.0]
        );
        assert_eq!(to_f32(&[0, 7, 255], Dtype::U8), [0.0, 7.0, 255.0]);
        // A trailing partial element is not decoded.
        assert_eq!(to_f32(&[0, 0x3F, 0x80], Dtype::Bf16), [0.5]);
    }
}
