//! Shared by the GPU tests: open the device or say why the test is skipped.
#![allow(dead_code, reason = "each test binary uses a subset of these helpers")]

use flashtier_cuda::ops::buffers::WeightType;
use flashtier_cuda::{CudaError, Gpu, nvrtc_present};
use rand::Rng;
use rand::rngs::SmallRng;

/// The GPU, or `None` with a printed reason (no driver, no device, no NVRTC).
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => {
            if nvrtc_present() {
                Some(g)
            } else {
                flashtier_io::skip::notice(test, "libnvrtc not found, kernels cannot be compiled");
                None
            }
        }
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice { .. })) => {
            flashtier_io::skip::notice(test, &e.to_string());
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed: {e}"),
    }
}

/// Round-to-nearest-even f32 -> bf16 bits.
pub fn bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// bf16 bits -> f32.
pub fn f32_of(b: u16) -> f32 {
    half::bf16::from_bits(b).to_f32()
}

pub fn e4m3(b: u8) -> f32 {
    flashtier_format::fp8::e4m3_to_f32(b)
}

/// A random matrix of `ty` as stored bytes, its scales, and its f64 values.
pub fn random_matrix(
    rng: &mut SmallRng,
    rows: usize,
    cols: usize,
    ty: WeightType,
) -> (Vec<u8>, Option<Vec<u8>>, Vec<f64>) {
    let n = rows * cols;
    match ty {
        WeightType::Bf16 => {
            let bits: Vec<u16> = (0..n).map(|_| bf16(rng.random_range(-1.0..1.0))).collect();
            let vals = bits.iter().map(|&b| f64::from(f32_of(b))).collect();
            (
                bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
                None,
                vals,
            )
        }
        WeightType::F16 => {
            let h: Vec<half::f16> = (0..n)
                .map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)))
                .collect();
            let vals = h.iter().map(|v| f64::from(v.to_f32())).collect();
            (h.iter().flat_map(|v| v.to_le_bytes()).collect(), None, vals)
        }
        WeightType::F32 => {
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            (
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                None,
                v.iter().map(|&x| f64::from(x)).collect(),
            )
        }
        WeightType::Fp8 { block: [br, bc] } => {
            let codes: Vec<u8> = (0..n)
                .map(|_| {
                    let c: u8 = rng.random();
                    if c & 0x7F == 0x7F { c - 1 } else { c }
                })
                .collect();
            let [sr, sc] = ty.scale_grid(rows, cols);
            let scales: Vec<f32> = (0..sr * sc)
                .map(|_| rng.random_range(0.001..0.01))
                .collect();
            let vals = (0..n)
                .map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    f64::from(e4m3(codes[i])) * f64::from(scales[(r / br) * sc + c / bc])
                })
                .collect();
            (
                codes,
                Some(scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
                vals,
            )
        }
    }
}
