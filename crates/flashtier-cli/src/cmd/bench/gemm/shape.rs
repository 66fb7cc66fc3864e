//! The host side of `bench gemm`: shapes (`M:N:K`) and their limits, the
//! FLOP count, the seeded operands, and the worst error of a result
//! against an f64 reference on a sample of its outputs.

use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::kit::limit::at_most;

/// Most elements of any one operand or output (`M*K`, `N*K`, `M*N`): 2^28,
/// 1 GiB as f32, held once on the host and up to three times on the device.
pub const MAX_ELEMS: u64 = 1 << 28;

/// Most outputs sampled for the error.
pub const MAX_SAMPLE: usize = 1 << 20;

/// `out[M, N] = x[M, K] w[N, K]ᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GemmShape {
    /// Input rows (prompt rows).
    pub m: usize,
    /// Weight rows (output columns).
    pub n: usize,
    /// Width.
    pub k: usize,
}

/// The default shapes: Qwen3-30B-A3B's prompt products at a 256-row chunk
/// (q/k/v together, o_proj, one expert's gate+up, its down), then the
/// first two at 512 rows.
pub const DEFAULT_SHAPES: &str =
    "256:5120:2048,256:2048:4096,256:1536:2048,256:2048:768,512:5120:2048,512:2048:4096";

impl GemmShape {
    /// `M:N:K`, each positive, K a multiple of 8 (the tiled kernels load
    /// 8 elements at a time), every operand at most [`MAX_ELEMS`].
    pub fn parse(text: &str) -> Result<Self, String> {
        let dims: Vec<&str> = text.trim().split(':').collect();
        let [m, n, k] = dims.as_slice() else {
            return Err(format!("`{text}`: a shape is M:N:K (e.g. 256:5120:2048)"));
        };
        let num = |s: &str, name: &str| match s.trim().parse::<usize>() {
            Ok(v) if v > 0 => Ok(v),
            _ => Err(format!("`{text}`: {name} must be a positive integer")),
        };
        let shape = Self {
            m: num(m, "M")?,
            n: num(n, "N")?,
            k: num(k, "K")?,
        };
        if shape.k % 8 != 0 {
            return Err(format!(
                "`{text}`: K = {} is not a multiple of 8 (the tiled kernels read 8 elements at a time)",
                shape.k
            ));
        }
        let (m, n, k) = (shape.m as u64, shape.n as u64, shape.k as u64);
        for (what, a, b) in [("M*K", m, k), ("N*K", n, k), ("M*N", m, n)] {
            at_most(&format!("`{text}`: {what}"), &[a, b], MAX_ELEMS, "elements")
                .map_err(|e| e.to_string())?;
        }
        Ok(shape)
    }

    /// Floating-point operations: a multiply and an add per `(m, n, k)`.
    #[must_use]
    pub fn flops(self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// 10^12 FLOP/s at `secs` per product (0 for a non-positive time).
    #[must_use]
    pub fn tflops(self, secs: f64) -> f64 {
        if secs > 0.0 {
            self.flops() / secs / 1e12
        } else {
            0.0
        }
    }
}

/// One shape's inputs on the host: BF16 weights (raw bits) and f32
/// activations, uniform in [-1, 1) from `seed`.
pub struct Operands {
    /// `[n, k]` BF16 bits.
    pub w_bf16: Vec<u16>,
    /// `[m, k]`.
    pub x: Vec<f32>,
}

impl Operands {
    /// Seeded random operands of `shape`.
    #[must_use]
    pub fn random(shape: GemmShape, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let w_bf16 = (0..shape.n * shape.k)
            .map(|_| half::bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_bits())
            .collect();
        let x = (0..shape.m * shape.k)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        Self { w_bf16, x }
    }

    /// The weights widened to f32 (exact).
    #[must_use]
    pub fn w_f32(&self) -> Vec<f32> {
        self.w_bf16
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect()
    }

    /// The activations rounded to BF16 (nearest even), as raw bits.
    #[must_use]
    pub fn x_bf16(&self) -> Vec<u16> {
        self.x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    }
}

/// `count` seeded output positions `(row, col)` of `shape`, drawn with
/// replacement.
#[must_use]
pub fn sample_outputs(shape: GemmShape, count: usize, seed: u64) -> Vec<(usize, usize)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| (rng.random_range(0..shape.m), rng.random_range(0..shape.n)))
        .collect()
}

/// The exact products at `picks`, in f64 from the BF16 weights and the f32
/// activations (each term is exact in f64; the sum rounds far below f32).
#[must_use]
pub fn reference(shape: GemmShape, ops: &Operands, picks: &[(usize, usize)]) -> Vec<f64> {
    let k = shape.k;
    picks
        .iter()
        .map(|&(r, c)| {
            let x = &ops.x[r * k..(r + 1) * k];
            let w = &ops.w_bf16[c * k..(c + 1) * k];
            x.iter()
                .zip(w)
                .map(|(&a, &b)| f64::from(a) * f64::from(half::bf16::from_bits(b).to_f32()))
                .sum()
        })
        .collect()
}

/// The worst `|out - ref|` over `picks`, relative to the largest `|ref|`
/// there: `out` is the whole row-major `[m, n]` result. Infinite when an
/// output is not finite; 0 when every reference is 0 and so is `out`.
#[must_use]
pub fn worst_rel_err(shape: GemmShape, out: &[f32], picks: &[(usize, usize)], refs: &[f64]) -> f64 {
    let scale = refs.iter().fold(0.0f64, |a, r| a.max(r.abs()));
    let worst = picks.iter().zip(refs).fold(0.0f64, |a, (&(r, c), &want)| {
        let got = out.get(r * shape.n + c).copied().unwrap_or(f32::NAN);
        let d = (f64::from(got) - want).abs();
        if d.is_nan() { f64::INFINITY } else { a.max(d) }
    });
    if worst == 0.0 {
        0.0
    } else if scale > 0.0 {
        worst / scale
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_as_m_n_k_and_refuse_what_the_kernels_cannot_run() {
        assert_eq!(
            GemmShape::parse(" 256:5120:2048 "),
            Ok(GemmShape {
                m: 256,
                n: 5120,
                k: 2048
            })
        );
        let defaults: Result<Vec<_>, _> = DEFAULT_SHAPES.split(',').map(GemmShape::parse).collect();
        assert_eq!(defaults.map(|v| v.len()), Ok(6));
        for (bad, why) in [
            ("256:5120", "M:N:K"),
            ("256:5120:2048:1", "M:N:K"),
            ("0:8:8", "M must be a positive integer"),
            ("8:x:8", "N must be a positive integer"),
            ("8:8:-8", "K must be a positive integer"),
            ("8:8:12", "not a multiple of 8"),
            (
                "65536:65536:8",
                "M*N: 4294967296 elements is over the limit",
            ),
        ] {
            let e = GemmShape::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn flops_count_a_multiply_and_an_add_per_term() {
        let s = GemmShape {
            m: 256,
            n: 5120,
            k: 2048,
        };
        assert_eq!(s.flops(), 5_368_709_120.0);
        assert!((s.tflops(1e-4) - 53.687_091_2).abs() < 1e-9);
        assert_eq!(s.tflops(0.0), 0.0);
    }

    #[test]
    fn errors_are_relative_to_the_largest_reference() {
        // x rows [1, 2, 0, ..] and [3, 4, 0, ..], w [0.5, -1, 0, ..].
        let s = GemmShape { m: 2, n: 1, k: 8 };
        let mut x = vec![0.0f32; 16];
        x[0] = 1.0;
        x[1] = 2.0;
        x[8] = 3.0;
        x[9] = 4.0;
        let mut w_bf16 = vec![0u16; 8];
        w_bf16[0] = half::bf16::from_f32(0.5).to_bits();
        w_bf16[1] = half::bf16::from_f32(-1.0).to_bits();
        let ops = Operands { w_bf16, x };
        let picks = [(0, 0), (1, 0)];
        let refs = reference(s, &ops, &picks);
        assert_eq!(refs, [-1.5, -2.5]);
        assert_eq!(worst_rel_err(s, &[-1.5, -2.5], &picks, &refs), 0.0);
        assert_eq!(worst_rel_err(s, &[-1.0, -2.5], &picks, &refs), 0.2);
        assert_eq!(
            worst_rel_err(s, &[f32::NAN, -2.5], &picks, &refs),
            f64::INFINITY
        );
        // An output missing from `out` counts as not finite.
        assert_eq!(worst_rel_err(s, &[-1.5], &picks, &refs), f64::INFINITY);
    }

    #[test]
    fn operands_and_samples_are_seeded_and_in_range() {
        let s = GemmShape { m: 3, n: 5, k: 8 };
        let (a, b) = (Operands::random(s, 7), Operands::random(s, 7));
        assert_eq!((a.w_bf16.len(), a.x.len()), (40, 24));
        assert_eq!((&a.w_bf16, &a.x), (&b.w_bf16, &b.x));
        assert!(a.w_f32().iter().all(|v| (-1.0..=1.0).contains(v)));
        assert_eq!(
            half::bf16::from_bits(a.x_bf16()[0]).to_f32(),
            half::bf16::from_f32(a.x[0]).to_f32()
        );
        let picks = sample_outputs(s, 100, 1);
        assert_eq!(picks, sample_outputs(s, 100, 1));
        assert!(picks.iter().all(|&(r, c)| r < 3 && c < 5));
    }
}
