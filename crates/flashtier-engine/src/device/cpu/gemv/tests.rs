use proptest::prelude::*;

use super::*;

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The matrix `w` stored as `dtype` bytes (BF16/F16 by truncation through
/// `half`, FP8 as arbitrary non-NaN codes), and its exact f32 widening.
fn stored(w: &[f32], dtype: Dtype) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        Dtype::Bf16 => {
            let h: Vec<half::bf16> = w.iter().map(|v| half::bf16::from_f32(*v)).collect();
            let bytes = h.iter().flat_map(|v| v.to_le_bytes()).collect();
            (bytes, h.iter().map(|v| v.to_f32()).collect())
        }
        Dtype::F16 => {
            let h: Vec<half::f16> = w.iter().map(|v| half::f16::from_f32(*v)).collect();
            let bytes = h.iter().flat_map(|v| v.to_le_bytes()).collect();
            (bytes, h.iter().map(|v| v.to_f32()).collect())
        }
        Dtype::F8E4M3 => {
            let codes: Vec<u8> = w
                .iter()
                .map(|v| {
                    let c = (v.to_bits() >> 20) as u8;
                    if c & 0x7F == 0x7F { c - 1 } else { c }
                })
                .collect();
            let wide = codes.iter().map(|c| E4M3_TO_F32[usize::from(*c)]).collect();
            (codes, wide)
        }
        _ => (w.iter().flat_map(|v| v.to_le_bytes()).collect(), w.to_vec()),
    }
}

const DTYPES: [Dtype; 4] = [Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::F8E4M3];

/// Every instruction set this CPU runs gives the scalar path's bits, for
/// every stored form, one token or a group, full lanes or a tail; and the
/// result is within f32 rounding of an f64 reference.
fn check_shape(rows: usize, cols: usize, tokens: usize, seed: u64) {
    let w = values(rows * cols, seed);
    let xs = values(tokens * cols, seed + 1);
    for dtype in DTYPES {
        let (bytes, wide) = stored(&w, dtype);
        let m = MatRef::Raw(&bytes, dtype);
        let mut want = vec![0f32; rows * tokens];
        matmul_on(Isa::Scalar, &mut want, m, &xs, tokens);
        for isa in Isa::available() {
            let mut got = vec![0f32; rows * tokens];
            matmul_on(isa, &mut got, m, &xs, tokens);
            assert_eq!(
                got,
                want,
                "{} {} {rows}x{cols} x{tokens}",
                isa.name(),
                dtype.name()
            );
            // Each token alone gives the group's bits.
            for t in 0..tokens {
                let mut one = vec![0f32; rows];
                matmul_on(isa, &mut one, m, &xs[t * cols..(t + 1) * cols], 1);
                assert_eq!(one, want[t * rows..(t + 1) * rows], "token {t} alone");
            }
        }
        let mut f32_form = vec![0f32; rows * tokens];
        matmul_on(
            Isa::current(),
            &mut f32_form,
            MatRef::F32(&wide),
            &xs,
            tokens,
        );
        assert_eq!(f32_form, want, "f32 slice form of {}", dtype.name());
        for t in 0..tokens {
            for r in 0..rows {
                let exact: f64 = (0..cols)
                    .map(|c| f64::from(wide[r * cols + c]) * f64::from(xs[t * cols + c]))
                    .sum();
                let scale: f64 = (0..cols)
                    .map(|c| (f64::from(wide[r * cols + c]) * f64::from(xs[t * cols + c])).abs())
                    .sum();
                let err = (exact - f64::from(want[t * rows + r])).abs();
                assert!(
                    err <= 1e-6 * scale.max(1.0),
                    "{} row {r}: {err}",
                    dtype.name()
                );
            }
        }
    }
}

#[test]
fn every_isa_matches_scalar_on_edge_shapes() {
    for (rows, cols, tokens) in [
        (1, 1, 1),
        (3, 31, 2),
        (17, 32, 5),
        (33, 97, 4),
        (16, 256, 9),
        // Several tasks, several token tiles, every register-block remainder.
        (70, 64, 21),
        // Long rows (many chunks, a tail) and token blocks with remainders.
        (7, 20 * LANES + 45, 9),
        // Token remainders of 3 and 2 after whole blocks of 4.
        (12, 100, 7),
        (13, 70, 6),
    ] {
        check_shape(rows, cols, tokens, (rows * 131 + cols) as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn every_isa_matches_scalar(rows in 1usize..40, cols in 1usize..200, tokens in 1usize..20, seed in any::<u64>()) {
        check_shape(rows, cols, tokens, seed);
    }
}

#[test]
fn block_scaled_fp8_matches_its_dequantized_matrix_on_every_isa() {
    let (rows, cols, block) = (37usize, 300usize, [16usize, 128usize]);
    let (codes, wide) = stored(&values(rows * cols, 7), Dtype::F8E4M3);
    let (sr, sc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let scales: Vec<f32> = (0..sr * sc).map(|k| 0.01 * (k as f32 + 1.0)).collect();
    let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let xs = values(3 * cols, 8);
    let m = MatRef::f8_block(&codes, &scale_bytes, rows, cols, block).expect("fits");
    let mut want = vec![0f32; rows * 3];
    matmul_on(Isa::Scalar, &mut want, m, &xs, 3);
    for isa in Isa::available() {
        let mut got = vec![0f32; rows * 3];
        matmul_on(isa, &mut got, m, &xs, 3);
        assert_eq!(got, want, "{}", isa.name());
    }
    for t in 0..3 {
        for r in 0..rows {
            let exact: f64 = (0..cols)
                .map(|c| {
                    let s = scales[(r / block[0]) * sc + c / block[1]];
                    f64::from(wide[r * cols + c]) * f64::from(s) * f64::from(xs[t * cols + c])
                })
                .sum();
            let got = f64::from(want[t * rows + r]);
            assert!(
                (exact - got).abs() <= 1e-5 * exact.abs().max(1.0),
                "row {r}"
            );
        }
    }
}

#[test]
fn thread_count_does_not_change_the_bits() {
    let (rows, cols) = (100, 130);
    let (bytes, _) = stored(&values(rows * cols, 3), Dtype::Bf16);
    let x = values(cols, 4);
    let mut many = vec![0f32; rows];
    matvec(&mut many, MatRef::Raw(&bytes, Dtype::Bf16), &x);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let mut single = vec![0f32; rows];
    one.install(|| matvec(&mut single, MatRef::Raw(&bytes, Dtype::Bf16), &x));
    assert_eq!(single, many);
}

#[test]
fn half_widening_is_exact_for_every_code() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = f16_to_f32(h);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{h:#06x}: {got} vs {want}"
        );
    }
}
