//! The driver check and the device handle every entry point goes through.
//!
//! cudarc loads `libcuda` lazily and panics when it is missing, so nothing in
//! this crate touches the driver before [`driver_present`] said yes: [`Gpu::open`]
//! returns [`CudaError::NoDriver`] on a machine without an NVIDIA driver (CI),
//! and every other entry point needs a [`Gpu`].

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};

use crate::error::CudaError;
use crate::launch::{Args, GraphStats, Shared};
use crate::settings::LaunchSettings;

/// Whether the CUDA driver library can be loaded on this machine.
#[must_use]
pub fn driver_present() -> bool {
    // SAFETY: probing only tries to dlopen libcuda by name and drops the handle;
    // it runs no code of the library beyond its initialisers.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded on this machine.
#[must_use]
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`, a dlopen probe of libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// What the kernels and the benchmarks need to know about the device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Largest dynamic shared memory a block may opt in to, bytes.
    pub max_smem_per_block_optin_bytes: usize,
    /// Shared memory of one multiprocessor, bytes.
    pub smem_per_sm_bytes: usize,
    /// L2 cache, bytes.
    pub l2_bytes: usize,
    /// Device memory, bytes.
    pub total_mem_bytes: usize,
    /// Whether host and device share one virtual address space (UVA).
    pub unified_addressing: bool,
    /// Whether the GPU is integrated with the host memory (UMA: Jetson, GB10).
    pub integrated: bool,
    /// Driver version as reported by `cuDriverGetVersion` (13000 = 13.0).
    pub driver_version: i32,
}

impl DeviceInfo {
    /// NVRTC target for this device, e.g. `sm_90`.
    #[must_use]
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// One device: its context, a compute stream and what it is.
///
/// cudarc's automatic cross-stream event tracking is off: work on other
/// streams is ordered explicitly (see [`HbmSink`](crate::HbmSink)).
///
/// Kernels of this crate launch through [`Gpu::launch`], which queues them
/// while a decode step records ([`Gpu::begin_step`], see [`crate::launch`]);
/// [`Gpu::stream`] issues the queue before it hands out the stream, so
/// every other use of the stream stays in issue order.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    queue: Arc<Shared>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

impl Gpu {
    /// Open device `ordinal`: [`CudaError::NoDriver`] where there is no driver,
    /// [`CudaError::NoDevice`] where it reports no such device,
    /// [`CudaError::Setting`] where a launch setting's variable holds a bad
    /// value ([`crate::settings::LaunchSettings`]).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let launch = LaunchSettings::read(&flashtier_io::settings::Env::process())?;
        cudarc::driver::result::init().map_err(CudaError::driver("cuInit"))?;
        let count = CudaContext::device_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("create context"))?;
        // SAFETY: nothing is allocated in this context yet. This crate orders
        // its streams itself: kernels and their buffers live on the compute
        // stream in issue order, and the one other stream it writes from
        // (HbmSink's copy stream) writes raw device addresses, which cudarc
        // never tracked, and is ordered with `order_after` / `order_before` /
        // `flush`. cudarc's per-buffer events would otherwise add a stream
        // wait and an event record per kernel argument to every launch.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(CudaError::driver("create stream"))?;
        let info = read_info(&ctx, ordinal)?;
        Ok(Self {
            ctx,
            stream,
            info,
            queue: Arc::new(Shared::new(launch)),
        })
    }

    /// The cudarc context.
    #[must_use]
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compute stream kernels of this crate launch on, after every
    /// launch queued so far was issued (a failure to issue is returned by
    /// the next [`Gpu::launch`] or [`Gpu::flush`]); ends a recording step.
    #[must_use]
    pub fn stream(&self) -> &Arc<CudaStream> {
        if self.queue.busy() {
            // Issuing launches needs the context on this thread.
            if let Err(e) = self.ctx.bind_to_thread() {
                self.queue.fail(CudaError::driver("bind context")(e));
            }
            self.queue.flush_quietly(self.stream.cu_stream());
        }
        &self.stream
    }

    /// The compute stream without issuing the queue (device addresses).
    pub(crate) fn raw_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Launch `func` (named `name` in errors) now, or queue it while a
    /// step records. `waits`: the kernel starts with `griddepcontrol.wait`
    /// and touches nothing an earlier kernel writes before it (a recorded
    /// graph may then start it early, see [`crate::launch`]).
    ///
    /// # Safety
    /// As `cuLaunchKernel`: `args` match the kernel's parameters, and every
    /// buffer they point to stays allocated until the kernel ran (drop one
    /// that queued launches may use through [`Gpu::retire`]); `waits` only
    /// for a kernel that waits as said.
    pub(crate) unsafe fn launch(
        &self,
        name: (&'static str, bool),
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: Args,
    ) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        // SAFETY: the caller's promise, passed on.
        unsafe {
            self.queue
                .launch(self.stream.cu_stream(), name, func, cfg, args)
        }
    }

    /// Start recording a decode step: launches queue until [`Gpu::flush`]
    /// (or any use of [`Gpu::stream`]) and are issued in segments, as
    /// graphs once a segment's shape repeats. Without graphs (turned off
    /// by [`Gpu::set_graphs`] or `FLASHTIER_CUDA_GRAPHS=0`) launches go out
    /// at once.
    pub fn begin_step(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        self.queue.begin_step(self.stream.cu_stream())
    }

    /// Issue every queued launch and end the recording step; returns an
    /// earlier failure to issue if there was one.
    pub fn flush(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        self.queue.flush(self.stream.cu_stream())
    }

    /// Whether a decode step records now (its launches become graphs).
    #[must_use]
    pub fn recording(&self) -> bool {
        self.queue.recording()
    }

    /// Drop `x` (a device buffer) once the launches queued now are issued.
    pub fn retire<T: Send + 'static>(&self, x: T) {
        self.queue.retire(Box::new(x));
    }

    /// Turn the recording of decode steps on or off (on by default).
    pub fn set_graphs(&self, on: bool) {
        self.queue.set_graphs(on);
    }

    /// Let recorded graphs start kernels that wait on their predecessor
    /// themselves before it ends (on by default; `FLASHTIER_PDL=0` turns
    /// it off; the results are the same either way).
    pub fn set_pdl(&self, on: bool) {
        self.queue.set_pdl(on);
    }

    /// Launches per issued segment of a recording step (clamped to
    /// 1..=4096; [`crate::launch::SEGMENT_LAUNCHES`] by default).
    pub fn set_segment_launches(&self, n: usize) {
        self.queue.set_segment_len(n);
    }

    /// What the launch path did so far.
    #[must_use]
    pub fn graph_stats(&self) -> GraphStats {
        self.queue.stats()
    }

    /// What the device is.
    #[must_use]
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// A new stream on this device (copy streams, benchmarks).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.ctx
            .new_stream()
            .map_err(CudaError::driver("create stream"))
    }

    /// Free and total device memory, bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        cudarc::driver::result::mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))
    }

    /// Block until the compute stream has finished everything queued on it.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(CudaError::driver("synchronize compute stream"))
    }
}

fn read_info(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let attr = |a: Attr| {
        ctx.attribute(a)
            .map_err(CudaError::driver(format!("device attribute {a:?}")))
    };
    let as_usize = |v: i32| usize::try_from(v).unwrap_or(0);
    let mut driver_version = 0i32;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&raw mut driver_version) }
        .result()
        .map_err(CudaError::driver("cuDriverGetVersion"))?;
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(CudaError::driver("device name"))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(CudaError::driver("compute capability"))?,
        sm_count: u32::try_from(attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?).unwrap_or(1),
        max_smem_per_block_optin_bytes: as_usize(attr(
            Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?),
        smem_per_sm_bytes: as_usize(attr(
            Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?),
        l2_bytes: as_usize(attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?),
        total_mem_bytes: ctx.total_mem().map_err(CudaError::driver("total memory"))?,
        unified_addressing: attr(Attr::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0,
        integrated: attr(Attr::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0,
        driver_version,
    })
}

impl crate::launch::OnStream for Gpu {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_without_driver_is_a_typed_error() {
        if driver_present() {
            flashtier_io::skip::notice(
                "open_without_driver_is_a_typed_error",
                "a CUDA driver is present; this test covers machines without one",
            );
            return;
        }
        match Gpu::open(0) {
            Err(CudaError::NoDriver) => {}
            other => panic!("expected NoDriver, got {other:?}"),
        }
    }

    #[test]
    fn arch_string() {
        let info = DeviceInfo {
            ordinal: 0,
            name: "x".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            max_smem_per_block_optin_bytes: 232_448,
            smem_per_sm_bytes: 233_472,
            l2_bytes: 0,
            total_mem_bytes: 0,
            unified_addressing: true,
            integrated: false,
            driver_version: 13000,
        };
        assert_eq!(info.arch(), "sm_90");
    }
}
