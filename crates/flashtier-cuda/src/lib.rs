//! flashtier's CUDA path, loaded dynamically through cudarc so that the crate
//! builds, lints and tests on machines with no GPU:
//!
//! - [`context`]: the driver check ([`driver_present`]) and the device handle
//!   ([`Gpu`]); with no driver every entry point returns [`CudaError::NoDriver`].
//! - [`pinned`]: pinned, device-mapped host memory for landing regions and
//!   the expert arena, with the device-address check.
//! - [`sink`]: [`HbmSink`], the disk -> pinned -> HBM device sink of the
//!   `flashtier-io` backends (double-buffered staging, a copy stream).
//! - [`nvrtc`], [`attention`], [`plan`], [`dequant`]: kernels compiled at run
//!   time for the device's own architecture (CUBIN for `sm_90` on Hopper):
//!   tiled split-KV decode attention (flash-decoding, log-sum-exp merge) and
//!   the FP8 -> BF16 row dequant.
//! - [`ops`]: the decode engine's kernels (matrix-vector products over
//!   stored weights, routing, routed experts from HBM slots or pinned
//!   memory, RMSNorm, RoPE, f32 KV-cache attention) behind checked launches.
//! - [`launch`]: kernel launches at once, or queued for a decode step and
//!   issued as CUDA graphs that replay once a step's shape repeats.
//! - [`measure`]: CUDA-event timings and copy bandwidths for benchmarks.
//! - [`blas`]: cuBLAS products as the benchmarks' yardstick for the prompt
//!   products (libcublas loaded at run time; nothing else needs it).
//!
//! ```no_run
//! use flashtier_cuda::{CudaError, Gpu};
//! match Gpu::open(0) {
//!     Ok(gpu) => println!("{} ({})", gpu.info().name, gpu.info().arch()),
//!     Err(CudaError::NoDriver) => println!("no GPU here"),
//!     Err(e) => eprintln!("{e}"),
//! }
//! ```

pub mod attention;
pub mod blas;
pub mod context;
pub mod dequant;
pub mod error;
pub mod launch;
pub mod measure;
pub mod nvrtc;
pub mod ops;
pub mod pinned;
pub mod plan;
pub mod sink;

pub use attention::{AttnDims, DecodeAttention, TileTable};
pub use context::{DeviceInfo, Gpu, driver_present, nvrtc_present};
pub use cudarc;
pub use dequant::{Fp8Rows, UtilKernels};
pub use error::CudaError;
pub use launch::GraphStats;
pub use pinned::{DeviceAddressing, PinnedMemory};
pub use sink::HbmSink;
