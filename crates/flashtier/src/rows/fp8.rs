//! FP8 E4M3 (`e4m3fn`) rows to f32 / bf16, with the row's scale.
//!
//! E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
//! infinities; exponent 0 is subnormal (`m / 8 * 2^-6`), and only `S.1111.111`
//! (0x7F, 0xFF) is NaN, so 0x7E is the largest finite value, 448. Codes are
//! decoded by exact bit construction into a 256-entry table at compile time;
//! the unit test checks every code against an independently written table.
//!
//! Scales (8 bytes per row for Engram) come in the shapes checkpoints use:
//! - [`ScaleFormat::F32Blocks`]: `n = scale_bytes / 4` little-endian f32 block
//!   scales, block `j` scaling weight columns `[j * w / n, (j + 1) * w / n)`
//!   (Engram: two 128-column blocks, tensors `F32 [rows, 2]`, or `U8 [rows, 8]`
//!   holding those bytes);
//! - [`ScaleFormat::F64Row`]: one little-endian f64 per row (`F64 [rows]`).

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

const fn decode_bits(code: u8) -> u32 {
    let sign = ((code >> 7) as u32) << 31;
    let exp = ((code >> 3) & 0xF) as u32;
    let mant = (code & 7) as u32;
    if exp == 0xF && mant == 7 {
        return sign | 0x7FC0_0000;
    }
    if exp == 0 {
        if mant == 0 {
            return sign;
        }
        // mant * 2^-9: normalise the leading bit p of mant (0..=2).
        let p = 31 - mant.leading_zeros();
        let f32_exp = p + 127 - 9;
        let frac = (mant - (1 << p)) << (23 - p);
        return sign | (f32_exp << 23) | frac;
    }
    sign | ((exp + 127 - 7) << 23) | (mant << 20)
}

const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = f32::from_bits(decode_bits(i as u8));
        i += 1;
    }
    t
}

/// Every E4M3FN code as f32.
pub static E4M3_TO_F32: [f32; 256] = build_table();

/// One E4M3FN code as f32.
#[must_use]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TO_F32[code as usize]
}

/// The largest finite E4M3FN value (code 0x7E).
pub const E4M3_MAX: f32 = 448.0;

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
            "dequant of {} codes with {} scale bytes ({format:?}) into {out_len} values",
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
    check(weight, scale, format, out.len())?;
    let cols = weight.len();
    for (i, (o, &c)) in out.iter_mut().zip(weight).enumerate() {
        *o = e4m3_to_f32(c) * scale_at(scale, format, i, cols);
    }
    Ok(())
}

/// As [`dequant_row_f32`], rounded to bf16 (round to nearest even).
pub fn dequant_row_bf16(
    weight: &[u8],
    scale: &[u8],
    format: ScaleFormat,
    out: &mut [bf16],
) -> Result<(), RowError> {
    check(weight, scale, format, out.len())?;
    let cols = weight.len();
    for (i, (o, &c)) in out.iter_mut().zip(weight).enumerate() {
        *o = bf16::from_f32(e4m3_to_f32(c) * scale_at(scale, format, i, cols));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every E4M3FN code, written out from the format's definition.
    #[rustfmt::skip]
    const REFERENCE: [f32; 256] = [
    0.0, 0.001953125, 0.00390625, 0.005859375, 0.0078125, 0.009765625, 0.01171875, 0.013671875,
    0.015625, 0.017578125, 0.01953125, 0.021484375, 0.0234375, 0.025390625, 0.02734375, 0.029296875,
    0.03125, 0.03515625, 0.0390625, 0.04296875, 0.046875, 0.05078125, 0.0546875, 0.05859375,
    0.0625, 0.0703125, 0.078125, 0.0859375, 0.09375, 0.1015625, 0.109375, 0.1171875,
    0.125, 0.140625, 0.15625, 0.171875, 0.1875, 0.203125, 0.21875, 0.234375,
    0.25, 0.28125, 0.3125, 0.34375, 0.375, 0.40625, 0.4375, 0.46875,
    0.5, 0.5625, 0.625, 0.6875, 0.75, 0.8125, 0.875, 0.9375,
    1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875,
    2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 3.75,
    4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5,
    8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    16.0, 18.0, 20.0, 22.0, 24.0, 26.0, 28.0, 30.0,
    32.0, 36.0, 40.0, 44.0, 48.0, 52.0, 56.0, 60.0,
    64.0, 72.0, 80.0, 88.0, 96.0, 104.0, 112.0, 120.0,
    128.0, 144.0, 160.0, 176.0, 192.0, 208.0, 224.0, 240.0,
    256.0, 288.0, 320.0, 352.0, 384.0, 416.0, 448.0, f32::NAN,
    -0.0, -0.001953125, -0.00390625, -0.005859375, -0.0078125, -0.009765625, -0.01171875, -0.013671875,
    -0.015625, -0.017578125, -0.01953125, -0.021484375, -0.0234375, -0.025390625, -0.02734375, -0.029296875,
    -0.03125, -0.03515625, -0.0390625, -0.04296875, -0.046875, -0.05078125, -0.0546875, -0.05859375,
    -0.0625, -0.0703125, -0.078125, -0.0859375, -0.09375, -0.1015625, -0.109375, -0.1171875,
    -0.125, -0.140625, -0.15625, -0.171875, -0.1875, -0.203125, -0.21875, -0.234375,
    -0.25, -0.28125, -0.3125, -0.34375, -0.375, -0.40625, -0.4375, -0.46875,
    -0.5, -0.5625, -0.625, -0.6875, -0.75, -0.8125, -0.875, -0.9375,
    -1.0, -1.125, -1.25, -1.375, -1.5, -1.625, -1.75, -1.875,
    -2.0, -2.25, -2.5, -2.75, -3.0, -3.25, -3.5, -3.75,
    -4.0, -4.5, -5.0, -5.5, -6.0, -6.5, -7.0, -7.5,
    -8.0, -9.0, -10.0, -11.0, -12.0, -13.0, -14.0, -15.0,
    -16.0, -18.0, -20.0, -22.0, -24.0, -26.0, -28.0, -30.0,
    -32.0, -36.0, -40.0, -44.0, -48.0, -52.0, -56.0, -60.0,
    -64.0, -72.0, -80.0, -88.0, -96.0, -104.0, -112.0, -120.0,
    -128.0, -144.0, -160.0, -176.0, -192.0, -208.0, -224.0, -240.0,
    -256.0, -288.0, -320.0, -352.0, -384.0, -416.0, -448.0, f32::NAN,
    ];

    #[test]
    fn all_256_codes_match_the_reference() {
        for code in 0..=255u8 {
            let got = e4m3_to_f32(code);
            let want = REFERENCE[code as usize];
            if want.is_nan() {
                assert!(got.is_nan(), "code {code:#04x}");
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "code {code:#04x}: {got} vs {want}"
                );
            }
        }
        assert_eq!(e4m3_to_f32(0x7E), E4M3_MAX);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_to_f32(0x80).is_sign_negative() && e4m3_to_f32(0x80) == 0.0);
    }

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
