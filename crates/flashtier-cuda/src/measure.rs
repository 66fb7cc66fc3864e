//! Device-side measurements for benchmarks, timed with CUDA events (the
//! device is synchronised before any clock is read): host-to-device copy
//! bandwidth from pinned memory and device-to-device copy bandwidth.
//!
//! Bounds: each call allocates what it measures (one pinned staging buffer,
//! or two device buffers) and frees it before returning.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use flashtier_io::RegionMemory;
use flashtier_io::measure::median;

use crate::context::Gpu;
use crate::error::CudaError;
use crate::pinned::PinnedMemory;

/// A pair of timing events on one stream.
#[derive(Debug)]
pub struct EventTimer {
    start: CudaEvent,
}

impl EventTimer {
    /// Record the start on `stream`.
    pub fn start(stream: &CudaStream) -> Result<Self, CudaError> {
        let start = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("record start event"))?;
        Ok(Self { start })
    }

    /// Record the end on `stream`, wait for it, and return the elapsed seconds.
    pub fn stop(self, stream: &CudaStream) -> Result<f64, CudaError> {
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("record end event"))?;
        let ms = self
            .start
            .elapsed_ms(&end)
            .map_err(CudaError::driver("event elapsed time"))?;
        Ok(f64::from(ms) / 1e3)
    }
}

/// Host-to-device bytes/s: `total_bytes` copied in `chunk_bytes` pieces from
/// pinned memory (`slots` chunks of it, reused round robin) into device memory.
pub fn h2d_bytes_per_s(
    gpu: &Gpu,
    chunk_bytes: usize,
    slots: usize,
    total_bytes: usize,
) -> Result<f64, CudaError> {
    if chunk_bytes == 0 || slots == 0 || total_bytes < chunk_bytes {
        return Err(CudaError::invalid(
            "h2d measurement",
            format!("chunk {chunk_bytes}, slots {slots}, total {total_bytes}"),
        ));
    }
    let pinned = PinnedMemory::new(gpu, chunk_bytes * slots)?;
    let stream = gpu.new_stream()?;
    let dst: CudaSlice<u8> = stream
        .alloc_zeros(total_bytes)
        .map_err(CudaError::driver("allocate h2d target"))?;
    let (base, _sync) = cudarc::driver::DevicePtr::device_ptr(&dst, &stream);
    let chunks = total_bytes / chunk_bytes;
    let copy_all = || -> Result<(), CudaError> {
        for c in 0..chunks {
            let src_off = (c % slots) * chunk_bytes;
            // SAFETY: `src_off + chunk_bytes <= slots * chunk_bytes`, the pinned
            // allocation's size, and `base + c * chunk_bytes + chunk_bytes <=
            // base + total_bytes`; both stay alive until the stream is synced
            // below. The host does not write the pinned memory meanwhile.
            unsafe {
                let src = std::slice::from_raw_parts(
                    pinned.base_ptr().add(src_off).cast_const(),
                    chunk_bytes,
                );
                cudarc::driver::result::memcpy_htod_async(
                    base + (c * chunk_bytes) as u64,
                    src,
                    stream.cu_stream(),
                )
            }
            .map_err(CudaError::driver("host-to-device copy"))?;
        }
        Ok(())
    };
    copy_all()?; // warm-up
    let timer = EventTimer::start(&stream)?;
    copy_all()?;
    let secs = timer.stop(&stream)?;
    stream
        .synchronize()
        .map_err(CudaError::driver("synchronize h2d stream"))?;
    Ok((chunks * chunk_bytes) as f64 / secs)
}

/// Device-to-device copy bytes/s, counting bytes read plus bytes written,
/// for a copy of `bytes`; the median of `reps` timed copies after a warm-up.
pub fn d2d_bytes_per_s(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64, CudaError> {
    let stream = gpu.stream();
    let src: CudaSlice<u8> = stream
        .alloc_zeros(bytes)
        .map_err(CudaError::driver("allocate copy source"))?;
    let mut dst: CudaSlice<u8> = stream
        .alloc_zeros(bytes)
        .map_err(CudaError::driver("allocate copy target"))?;
    stream
        .memcpy_dtod(&src, &mut dst)
        .map_err(CudaError::driver("warm-up copy"))?;
    let mut rates = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let timer = EventTimer::start(stream)?;
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(CudaError::driver("device-to-device copy"))?;
        let secs = timer.stop(stream)?;
        rates.push(2.0 * bytes as f64 / secs);
    }
    Ok(median(&rates))
}
