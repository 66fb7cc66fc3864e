//! flashtier's CUDA path, loaded dynamically through cudarc so that the crate
//! builds, lints and tests on machines with no GPU:
//!
//! - [`context`]: the driver check ([`driver_present`]) and the device handle
//!   ([`Gpu`]); with no driver every entry point returns [`CudaError::NoDriver`].
//! - [`pinned`]: pinned, device-mapped host memory for landing regions and
//!   the expert arena, with the device-address check.
//! - [`sink`]: [`HbmSink`], the disk -> pinned -> HBM device sink of the
//!   `flashtier-io` backends (double-buffered staging, a copy stream).
//! - [`nvrtc`], [`dequant`]: kernels compiled at run time for the device's
//!   own architecture (CUBIN for `sm_90` on Hopper), and the FP8 -> BF16 row
//!   dequant.
//! - [`ops`]: the decode engine's kernels (matrix-vector products over
//!   stored weights, routing, routed experts from HBM slots or pinned
//!   memory, RMSNorm, RoPE, split-KV decode attention over an f32 KV cache
//!   whose chunks may be restored tile by tile) behind checked launches.
//! - [`launch`]: kernel launches at once, or queued for a decode step and
//!   issued as CUDA graphs that replay once a step's shape repeats.
//! - [`measure`]: CUDA-event timings and copy bandwidths for benchmarks.
//! - [`blas`]: cuBLAS products as the benchmarks' yardstick for the prompt
//!   products (libcublas loaded at run time; nothing else needs it).
//! - [`settings`]: the `FLASHTIER_*` variables this crate reads (all for
//!   measuring; none changes a result bit), read there only.
//!
//! ```no_run
//! use flashtier_cuda::{CudaError, Gpu};
//! match Gpu::open(0) {
//!     Ok(gpu) => println!("{} ({})", gpu.info().name, gpu.info().arch()),
//!     Err(CudaError::NoDriver) => println!("no GPU here"),
//!     Err(e) => eprintln!("{e}"),
//! }
//! ```

pub mod blas;
pub mod context;
pub mod dequant;
pub mod error;
pub mod launch;
pub mod measure;
pub mod nvrtc;
pub mod ops;
pub mod pinned;
pub mod settings;
pub mod sink;

pub use context::{DeviceInfo, Gpu, driver_present, nvrtc_present};
pub use cudarc;
pub use dequant::{Fp8Rows, UtilKernels};
pub use error::CudaError;
pub use launch::GraphStats;
pub use pinned::{DeviceAddressing, PinnedMemory};
pub use sink::HbmSink;
