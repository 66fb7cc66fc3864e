//! cuBLAS as a yardstick for the prompt products of [`crate::ops::gemm`]:
//! `out = x wᵀ` for row-major weights `w` `[n, k]`, inputs `x` `[m, k]`
//! and outputs `[m, n]`, the layout of
//! [`DecodeKernels::gemm_many`](crate::ops::DecodeKernels::gemm_many).
//!
//! `libcublas` is loaded at run time, and only here: nothing else in the
//! workspace needs it. [`Blas::new`] checks that it can be loaded before
//! any cuBLAS call (cudarc panics on a missing library) and returns
//! [`CudaError::NoCublas`], naming the files searched for, when it cannot.
//!
//! Precisions ([`BlasMath`]): f32 inputs with the pedantic f32 compute type
//! (no TF32, no reduced-precision shortcut: the exact-f32 peer), f32 inputs
//! with the default math mode, and BF16 inputs with f32 accumulation on
//! the tensor cores (what a BF16 model runs in transformers). Outputs are
//! f32 in every case.
//!
//! Bounds: one cuBLAS handle on the [`Gpu`]'s compute stream, so its work
//! is ordered with the kernels of this crate; cuBLAS keeps its own
//! workspace per handle, freed with it.

use core::ffi::{c_int, c_void};

use cudarc::cublas::{CudaBlas, result, sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::context::Gpu;
use crate::error::CudaError;

/// Whether `libcublas` can be loaded on this machine.
#[must_use]
pub fn cublas_present() -> bool {
    // SAFETY: a dlopen probe of libcublas by its candidate names; the handle
    // is dropped and no function of the library is called.
    unsafe { sys::is_culib_present() }
}

/// [`CudaError::NoCublas`], listing the file names cudarc searches for.
#[must_use]
pub fn no_cublas() -> CudaError {
    let mut tried: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates("cublas") {
        if !tried.contains(&name) {
            tried.push(name);
        }
    }
    CudaError::NoCublas {
        tried: tried.join(", "),
    }
}

/// Shape of `out[m, n] = x[m, k] w[n, k]ᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmDims {
    /// Input rows.
    pub m: usize,
    /// Weight rows (output columns).
    pub n: usize,
    /// Width (columns of both).
    pub k: usize,
}

impl GemmDims {
    /// The dims as cuBLAS integers, when each is in `1..=i32::MAX` and the
    /// buffers hold `w_len = n * k`, `x_len = m * k`, `out_len = m * n`
    /// elements.
    fn check(self, w_len: usize, x_len: usize, out_len: usize) -> Result<[c_int; 3], CudaError> {
        let GemmDims { m, n, k } = self;
        let int = |v: usize| c_int::try_from(v).ok().filter(|&v| v > 0);
        let sizes_ok = m.checked_mul(k) == Some(x_len)
            && n.checked_mul(k) == Some(w_len)
            && m.checked_mul(n) == Some(out_len);
        match (int(m), int(n), int(k)) {
            (Some(m), Some(n), Some(k)) if sizes_ok => Ok([m, n, k]),
            _ => Err(CudaError::invalid(
                "cuBLAS product",
                format!("{m}x{n}x{k} with {w_len} weights, {x_len} inputs, {out_len} outputs"),
            )),
        }
    }
}

/// How cuBLAS computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlasMath {
    /// f32 inputs, `CUBLAS_COMPUTE_32F_PEDANTIC` under `CUBLAS_PEDANTIC_MATH`.
    F32Pedantic,
    /// f32 inputs, `CUBLAS_COMPUTE_32F` under `CUBLAS_DEFAULT_MATH` (no TF32
    /// either: that takes the TF32 compute type or math mode).
    F32,
    /// BF16 inputs, `CUBLAS_COMPUTE_32F` (f32 accumulation, tensor cores).
    Bf16,
}

/// A cuBLAS handle on a device's compute stream.
#[derive(Debug)]
pub struct Blas {
    gpu: Gpu,
    handle: CudaBlas,
}

impl Blas {
    /// A handle on `gpu`'s compute stream; [`CudaError::NoCublas`] where
    /// libcublas cannot be loaded.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        if !cublas_present() {
            return Err(no_cublas());
        }
        let handle = CudaBlas::new(gpu.stream().clone()).map_err(blas("create a handle"))?;
        Ok(Self {
            gpu: gpu.clone(),
            handle,
        })
    }

    /// The library's version (`13000` and up for CUDA 13).
    pub fn version(&self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: the handle is live (owned by self) and `v` is a valid
        // place for the one integer cuBLAS writes.
        unsafe { sys::cublasGetVersion_v2(*self.handle.handle(), &raw mut v) }
            .result()
            .map_err(blas("read the version"))?;
        Ok(v)
    }

    /// `out = x wᵀ` in f32 ([`BlasMath::F32Pedantic`] or [`BlasMath::F32`]).
    pub fn rows_f32(
        &self,
        math: BlasMath,
        dims: GemmDims,
        w: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (mode, compute) = match math {
            BlasMath::F32Pedantic => (
                sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            ),
            BlasMath::F32 => (
                sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            BlasMath::Bf16 => {
                return Err(CudaError::invalid(
                    "cuBLAS product",
                    "BF16 math takes BF16 inputs (rows_bf16)",
                ));
            }
        };
        let ints = dims.check(w.len(), x.len(), out.len())?;
        let ty = sys::cudaDataType_t::CUDA_R_32F;
        self.rows(ints, (w, x, ty), out, mode, compute)
    }

    /// `out = x wᵀ` with BF16 inputs (raw bits) and f32 accumulation and
    /// outputs ([`BlasMath::Bf16`]).
    pub fn rows_bf16(
        &self,
        dims: GemmDims,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let ints = dims.check(w.len(), x.len(), out.len())?;
        let ty = sys::cudaDataType_t::CUDA_R_16BF;
        self.rows(
            ints,
            (w, x, ty),
            out,
            sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    }

    /// One `cublasGemmEx` of checked dims. cuBLAS is column-major, so the
    /// row-major `out [m, n]` is its `n x m` matrix `outᵀ = w xᵀ`: A is `w`
    /// read as a column-major `k x n` matrix and transposed (lda = k), B is
    /// `x` read as a column-major `k x m` matrix (ldb = k), ldc = n.
    fn rows<T>(
        &self,
        [m, n, k]: [c_int; 3],
        (w, x, ty): (&CudaSlice<T>, &CudaSlice<T>, sys::cudaDataType_t),
        out: &mut CudaSlice<f32>,
        mode: sys::cublasMath_t,
        compute: sys::cublasComputeType_t,
    ) -> Result<(), CudaError> {
        let handle = *self.handle.handle();
        // Issue the crate's queued launches first; the handle's stream is
        // the compute stream.
        let stream = self.gpu.stream();
        // SAFETY: the handle is live; setting its math mode touches no memory.
        unsafe { sys::cublasSetMathMode(handle, mode) }
            .result()
            .map_err(blas("set the math mode"))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _w_sync) = w.device_ptr(stream);
        let (xp, _x_sync) = x.device_ptr(stream);
        let (op, _o_sync) = out.device_ptr_mut(stream);
        // SAFETY: `check` made w hold n * k, x m * k and out m * n elements
        // of the types named (T is f32 for CUDA_R_32F and u16 holding BF16
        // bits for CUDA_R_16BF; out is f32, CUDA_R_32F), so with lda = ldb
        // = k and ldc = n cuBLAS reads and writes inside the three buffers.
        // They stay allocated until the stream ran the product: the
        // borrows last for this call, and callers free device buffers only
        // after synchronising (cudarc frees on the stream in order).
        // alpha and beta are host f32 values, the scale type of both
        // compute types, read before the call returns (host pointer mode).
        unsafe {
            result::gemm_ex(
                handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                (&raw const alpha).cast::<c_void>(),
                wp as *const c_void,
                ty,
                k,
                xp as *const c_void,
                ty,
                k,
                (&raw const beta).cast::<c_void>(),
                op as *mut c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                n,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas("cublasGemmEx"))
    }
}

/// A closure mapping a cuBLAS status to [`CudaError::Blas`] with context.
fn blas(what: &str) -> impl FnOnce(result::CublasError) -> CudaError {
    let what = what.to_owned();
    move |source| CudaError::Blas { what, source }
}

#[cfg(test)]
mod tests {
    use super::{GemmDims, cublas_present, no_cublas};

    #[test]
    fn dims_must_match_the_buffers_and_fit_cublas_integers() {
        let d = GemmDims { m: 2, n: 3, k: 8 };
        assert_eq!(d.check(24, 16, 6).ok(), Some([2, 3, 8]));
        assert!(d.check(24, 16, 7).is_err());
        assert!(d.check(23, 16, 6).is_err());
        assert!(GemmDims { m: 0, n: 3, k: 8 }.check(24, 0, 0).is_err());
        let wide = 1usize << 31;
        let e = GemmDims {
            m: 1,
            n: 1,
            k: wide,
        }
        .check(wide, wide, 1)
        .unwrap_err();
        assert!(e.to_string().contains("1x1x2147483648"), "{e}");
    }

    #[test]
    fn a_missing_cublas_is_named_with_the_files_searched() {
        // Where libcublas is installed this only checks the probe runs.
        let _ = cublas_present();
        let e = no_cublas().to_string();
        assert!(
            e.starts_with("no cuBLAS: libcublas could not be loaded"),
            "{e}"
        );
        assert!(e.contains("libcublas.so"), "{e}");
        assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
    }
}
