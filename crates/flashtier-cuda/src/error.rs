//! The error type of the CUDA path. Every variant says what was asked for, so
//! a failure on the GPU machine is never anonymous.

/// A failure of the CUDA path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// `libcuda` could not be loaded: there is no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded (no NVIDIA driver on this machine)")]
    NoDriver,
    /// `libnvrtc` could not be loaded, so kernels cannot be compiled.
    #[error("no NVRTC: libnvrtc could not be loaded (install the CUDA runtime compiler library)")]
    NoNvrtc,
    /// `libcublas` could not be loaded. Only the cuBLAS yardstick of
    /// `flashtier bench gemm` ([`crate::blas`]) needs it.
    #[error(
        "no cuBLAS: libcublas could not be loaded (looked for {tried}); it ships with the CUDA toolkit (lib64/) or the nvidia-cublas wheel, next to libcublasLt which it needs too: put that directory on LD_LIBRARY_PATH"
    )]
    NoCublas {
        /// The file names searched for.
        tried: String,
    },
    /// The driver is present but reports no device with this ordinal.
    #[error("no CUDA device {ordinal} (the driver reports {count})")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {what}: {source:?}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's status.
        source: cudarc::driver::DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {what}: {source:?}")]
    Blas {
        /// What was being done.
        what: String,
        /// cuBLAS's status.
        source: cudarc::cublas::result::CublasError,
    },
    /// A cuBLASLt call failed (a prompt's dense products, [`crate::ops::lt`]).
    #[error("cuBLASLt: {what}: {source:?}")]
    BlasLt {
        /// What was being done.
        what: &'static str,
        /// cuBLASLt's status.
        source: cudarc::cublaslt::result::CublasError,
    },
    /// NVRTC failed to compile a kernel module.
    #[error("NVRTC compile of {module} for {arch} failed: {log}")]
    Compile {
        /// Kernel module name.
        module: String,
        /// Target architecture.
        arch: String,
        /// The compiler's log.
        log: String,
    },
    /// A `FLASHTIER_*` variable held a value its reader cannot take
    /// ([`crate::settings`]).
    #[error(transparent)]
    Setting(#[from] flashtier_io::settings::SettingError),
    /// A shape, geometry or argument the kernels do not accept.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which argument.
        what: &'static str,
        /// Why it is rejected.
        why: String,
    },
}

impl CudaError {
    /// A closure mapping a driver error to [`CudaError::Driver`] with context.
    pub(crate) fn driver(
        what: impl Into<String>,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        let what = what.into();
        move |source| Self::Driver { what, source }
    }

    /// Shorthand for [`CudaError::Invalid`].
    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Self {
        Self::Invalid {
            what,
            why: why.into(),
        }
    }
}
