//! FP8 E4M3 (`e4m3fn`), the one decoder of the workspace.
//!
//! E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
//! infinities; exponent 0 is subnormal (`m / 8 * 2^-6`), and only `S.1111.111`
//! (0x7F, 0xFF) is NaN, so 0x7E is the largest finite value, 448. Codes are
//! decoded by exact bit construction into a 256-entry table at compile time
//! ([`E4M3_TO_F32`]); every decode is one table load. Codes travel as raw `u8`
//! everywhere else (the row tier, the expert records, the GPU kernels); the
//! row-scale logic lives with its users, on top of this.

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

/// Every E4M3FN code as f32 (NaN codes carry the code's sign bit).
pub static E4M3_TO_F32: [f32; 256] = build_table();

/// One E4M3FN code as f32.
#[must_use]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TO_F32[code as usize]
}

/// The largest finite E4M3FN value (code 0x7E).
pub const E4M3_MAX: f32 = 448.0;

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

    /// The definition as arithmetic: `(-1)^s * 2^(e - 7) * (1 + m / 8)`, or
    /// `(-1)^s * 2^-6 * m / 8` for `e = 0`.
    fn by_formula(code: u8) -> f32 {
        let sign = if code & 0x80 == 0 { 1.0f32 } else { -1.0 };
        let (e, m) = (i32::from((code >> 3) & 0xF), f32::from(code & 7));
        if e == 0xF && code & 7 == 7 {
            return f32::NAN;
        }
        if e == 0 {
            sign * (m / 8.0) * 2f32.powi(-6)
        } else {
            sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
        }
    }

    fn same(got: f32, want: f32) -> bool {
        if want.is_nan() {
            got.is_nan()
        } else {
            got.to_bits() == want.to_bits()
        }
    }

    #[test]
    fn every_code_matches_the_table_and_the_formula() {
        for code in 0..=255u8 {
            let got = e4m3_to_f32(code);
            let (table, formula) = (REFERENCE[code as usize], by_formula(code));
            assert!(same(got, table), "code {code:#04x}: {got} vs {table}");
            assert!(same(got, formula), "code {code:#04x}: {got} vs {formula}");
        }
    }

    #[test]
    fn special_codes() {
        assert_eq!(e4m3_to_f32(0x7E), E4M3_MAX);
        assert_eq!(e4m3_to_f32(0xFE), -E4M3_MAX);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        // 0x78..=0x7D are finite: only mantissa 7 of exponent 15 is NaN.
        assert!((0x78..=0x7Du8).all(|c| e4m3_to_f32(c).is_finite()));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x00).to_bits(), 0);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        let finite_max = (0..=255u8)
            .map(e4m3_to_f32)
            .filter(|v| v.is_finite())
            .fold(0.0f32, f32::max);
        assert_eq!(finite_max, E4M3_MAX);
    }

    #[test]
    fn subnormals_are_multiples_of_two_to_the_minus_nine() {
        for m in 1..8u8 {
            assert_eq!(e4m3_to_f32(m), f32::from(m) * 2f32.powi(-9));
            assert_eq!(e4m3_to_f32(0x80 | m), -f32::from(m) * 2f32.powi(-9));
        }
        // The smallest normal (0x08) is one step above the largest subnormal.
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x08) - e4m3_to_f32(0x07), 2f32.powi(-9));
    }
}
