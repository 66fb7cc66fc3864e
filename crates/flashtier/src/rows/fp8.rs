//! FP8 E4M3 (`e4m3fn`) rows to f32 / bf16, with the row's scale. The codes
//! are decoded by the workspace's one decoder, [`flashtier_format::fp8`].
//!
//! Scales (8 bytes per row for Engram) come in the shapes checkpoints use:
//! - [`ScaleFormat::F32Blocks`]: `n = scale_bytes / 4` little-endian f32 block
//!   scales, block `j` scaling weight columns `[j * w / n, (j + 1) * w / n)`
//!   (Engram: two 128-column blocks, tensors `F32 [rows, 2]`, or `U8 [rows, 8]`
//!   holding those bytes);
//! - [`ScaleFormat::F64Row`]: one little-endian f64 per row (`F64 [rows]`).

use flashtier_format::fp8::e4m3_to_f32;
use half::bf16;

use crate::rows::RowError;

/// How a row's scale bytes are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScaleFormat {
    /// Little-endian f32 block scales, equal column blocks.
    #[default]
    F32Blocks,
    /// One little-endian f64 for the whole row.
    F64Row,
}

impl std::fmt::Display for ScaleFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32Blocks => "f32 block scales",
            Self::F64Row => "one f64 scale per row",
        })
    }
}

fn scale_at(scale: &[u8], format: ScaleFormat, col: usize, cols: usize) -> f32 {
    match format {
        ScaleFormat::F32Blocks => {
            let blocks = scale.len() / 4;
            let block = col * blocks / cols;
            let mut b = [0u8; 4];
            if let Some(s) = scale.get(block * 4..block * 4 + 4) {
                b.copy_from_slice(s);
            }
            f32::from_le_bytes(b)
        }
        ScaleFormat::F64Row => {
            let mut b = [0u8; 8];
            if let Some(s) = scale.get(..8) {
                b.copy_from_slice(s);
            }
            f64::from_le_bytes(b) as f32
        }
    }
}

fn check(weight: &[u8], scale: &[u8], format: ScaleFormat, out_len: usize) -> Result<(), RowError> {
    let ok = match format {
        ScaleFormat::F32Blocks => {
            let blocks = scale.len() / 4;
            scale.len() % 4 == 0 && blocks > 0 && weight.len() % blocks == 0
        }
        ScaleFormat::F64Row => scale.len() == 8,
    };
    if !ok || out_len != weight.len() {
        return Err(RowError::Config(format!(
            "dequant of {} codes with {} scale bytes ({format}) into {out_len} values",
            weight.len(),
            scale.len()
        )));
    }
    Ok(())
}

/// `out[i] = e4m3(weight[i]) * scale(i)`.
pub fn dequant_row_f32(
    weight: &[u8],
    scale: &[u8],
    format: ScaleFormat,
    out: &mut [f32],
) -> Result<(), RowError> {
    dequant_into(weight, scale, format, out, |x| x)
}

/// As [`dequant_row_f32`], rounded to bf16 (round to nearest even).
pub fn dequant_row_bf16(
    weight: &[u8],
    scale: &[u8],
    format: ScaleFormat,
    out: &mut [bf16],
) -> Result<(), RowError> {
    dequant_into(weight, scale, format, out, bf16::from_f32)
}

/// `out[i] = round(e4m3(weight[i]) * scale(i))`, after [`check`].
fn dequant_into<T>(
    weight: &[u8],
    scale: &[u8],
    format: ScaleFormat,
    out: &mut [T],
    round: impl Fn(f32) -> T,
) -> Result<(), RowError> {
    check(weight, scale, format, out.len())?;
    let cols = weight.len();
    for (i, (o, &c)) in out.iter_mut().zip(weight).enumerate() {
        *o = round(e4m3_to_f32(c) * scale_at(scale, format, i, cols));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_scales_apply_to_their_columns() {
        let weight = vec![0x38u8; 256]; // 1.0
        let mut scale = Vec::new();
        scale.extend_from_slice(&2.0f32.to_le_bytes());
        scale.extend_from_slice(&(-0.5f32).to_le_bytes());
        let mut out = vec![0f32; 256];
        dequant_row_f32(&weight, &scale, ScaleFormat::F32Blocks, &mut out).expect("valid");
        assert!(out[..128].iter().all(|&v| v == 2.0));
        assert!(out[128..].iter().all(|&v| v == -0.5));
        let mut b = vec![bf16::ZERO; 256];
        dequant_row_bf16(&weight, &scale, ScaleFormat::F32Blocks, &mut b).expect("valid");
        assert_eq!(b[0].to_f32(), 2.0);
        assert_eq!(b[200].to_f32(), -0.5);
    }

    #[test]
    fn f64_row_scale_and_bad_shapes() {
        let weight = [0x7Eu8, 0x01, 0xB8];
        let scale = 0.25f64.to_le_bytes();
        let mut out = [0f32; 3];
        dequant_row_f32(&weight, &scale, ScaleFormat::F64Row, &mut out).expect("valid");
        assert_eq!(out, [112.0, 2f32.powi(-11), -0.25]);
        assert!(dequant_row_f32(&weight, &scale, ScaleFormat::F32Blocks, &mut out).is_err());
        assert!(dequant_row_f32(&weight, &scale[..4], ScaleFormat::F64Row, &mut out).is_err());
        assert!(dequant_row_f32(&weight, &scale, ScaleFormat::F64Row, &mut [0f32; 2]).is_err());
    }
}
