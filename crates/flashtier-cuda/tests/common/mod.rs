//! Shared by the GPU tests: open the device or say why the test is skipped.
#![allow(dead_code, reason = "each test binary uses a subset of these helpers")]

use flashtier_cuda::{CudaError, Gpu, nvrtc_present};

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
