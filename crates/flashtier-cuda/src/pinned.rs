//! Pinned (page-locked) host memory that the device can read in place, and
//! the SPEC's device-address check for the expert arena.
//!
//! Memory comes from `cuMemHostAlloc` with `DEVICEMAP` and without
//! `WRITECOMBINED` (write-combined memory is very slow for the CPU to read),
//! is zeroed before it is handed out, and is asserted page-aligned so it can
//! be an O_DIRECT / io_uring read target with no bounce buffer.
//!
//! Device addressing: where the device address of the allocation equals its
//! host address (unified addressing, and on UMA machines the very same
//! memory), a record read into a slot is used by the device with no copy and
//! no translation. Where it differs, the mapped device pointer from
//! `cuMemHostGetDevicePointer` is used instead, and that is said once per
//! process (a warning), never silently.
//!
//! Bound: one allocation per [`PinnedMemory`], of exactly the requested size
//! rounded up to 4096 bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::CudaContext;
use flashtier_io::{ALIGN, LandingRegion, RegionMemory, round_up};

use crate::context::Gpu;
use crate::error::CudaError;

/// How the device reaches pinned host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum DeviceAddressing {
    /// Device VA == host VA: zero-copy with the host pointer itself.
    SameAddress,
    /// The device reads through a different, mapped device pointer.
    Mapped {
        /// Device address of the first byte.
        device_ptr: u64,
    },
}

static SAID_MAPPED: AtomicBool = AtomicBool::new(false);

/// Page-locked, device-mapped, zeroed host memory.
pub struct PinnedMemory {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len_bytes: usize,
    device_ptr: u64,
    addressing: DeviceAddressing,
}

// SAFETY: the allocation is owned exclusively by this value and freed once in
// Drop; shared access goes through raw pointers whose use is governed by the
// LandingRegion protocol.
unsafe impl Send for PinnedMemory {}
// SAFETY: see Send; `&self` methods only read immutable fields.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Allocate `len` bytes (rounded up to 4096, at least 4096), zeroed.
    pub fn new(gpu: &Gpu, len: usize) -> Result<Self, CudaError> {
        let len_bytes = round_up(len.max(1));
        let ctx = gpu.context().clone();
        ctx.bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: cuMemHostAlloc returns page-locked memory of `len_bytes`
        // bytes or an error; it is zeroed below before any use.
        let raw = unsafe { cudarc::driver::result::malloc_host(len_bytes, flags) }.map_err(
            CudaError::driver(format!("pin {len_bytes} bytes of host memory")),
        )?;
        let ptr = raw.cast::<u8>();
        if ptr.is_null() || ptr as usize % ALIGN != 0 {
            // SAFETY: `raw` came from malloc_host and is freed once here.
            let _ = unsafe { cudarc::driver::result::free_host(raw) };
            return Err(CudaError::invalid(
                "pinned allocation",
                format!("cuMemHostAlloc returned {ptr:p}, not {ALIGN}-byte aligned"),
            ));
        }
        // SAFETY: `ptr` is valid for `len_bytes` writable bytes (just allocated).
        unsafe { std::ptr::write_bytes(ptr, 0, len_bytes) };
        let mut device_ptr = 0u64;
        // SAFETY: `ptr` is a live cuMemHostAlloc allocation with DEVICEMAP; the
        // driver writes one device pointer.
        let got = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&raw mut device_ptr, raw, 0)
        }
        .result();
        if let Err(e) = got {
            // SAFETY: freed once, nothing else refers to it yet.
            let _ = unsafe { cudarc::driver::result::free_host(raw) };
            return Err(CudaError::driver("cuMemHostGetDevicePointer")(e));
        }
        let addressing = classify(ptr as u64, device_ptr);
        if let DeviceAddressing::Mapped { device_ptr } = addressing {
            if !SAID_MAPPED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    host = format_args!("{ptr:p}"),
                    device = format_args!("{device_ptr:#x}"),
                    "pinned memory: device address differs from host address; \
                     kernels use the mapped device pointer (no UVA zero-copy identity)"
                );
            }
        }
        Ok(Self {
            ctx,
            ptr,
            len_bytes,
            device_ptr,
            addressing,
        })
    }

    /// A landing region over new pinned memory of `len` bytes.
    pub fn region(gpu: &Gpu, len: usize) -> Result<Arc<LandingRegion>, CudaError> {
        Ok(LandingRegion::from_memory(Box::new(Self::new(gpu, len)?)))
    }

    /// How the device reaches this memory.
    #[must_use]
    pub fn addressing(&self) -> DeviceAddressing {
        self.addressing
    }

    /// Device address of the first byte (equal to the host address under
    /// [`DeviceAddressing::SameAddress`]).
    #[must_use]
    pub fn device_address(&self) -> u64 {
        self.device_ptr
    }

    /// Bytes allocated.
    #[must_use]
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Host address of the first byte.
    #[must_use]
    pub fn host_address(&self) -> u64 {
        self.ptr as u64
    }

    /// Copy `src` into the allocation at `offset` (exclusive access: nothing
    /// else can read or write it meanwhile).
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        if !self.contains(offset, src.len()) {
            return Err(CudaError::invalid(
                "pinned write",
                format!("{} bytes at {offset} of {}", src.len(), self.len_bytes),
            ));
        }
        // SAFETY: `offset..offset + src.len()` lies inside the live
        // allocation (checked), `&mut self` excludes every other access
        // through this value, and `src` cannot overlap pinned memory that
        // only raw pointers reach.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
        Ok(())
    }

    /// The bytes `offset..offset + len`, to fill or read on the host
    /// (`&mut`: no copy or read through this value can touch them
    /// meanwhile; copies this crate starts into pinned memory are waited
    /// for before they return).
    pub fn bytes_mut(&mut self, offset: usize, len: usize) -> Result<&mut [u8], CudaError> {
        if !self.contains(offset, len) {
            return Err(CudaError::invalid(
                "pinned bytes",
                format!("{len} bytes at {offset} of {}", self.len_bytes),
            ));
        }
        // SAFETY: `offset..offset + len` lies inside the live, initialised
        // (zeroed at allocation) allocation (checked); `&mut self` is the
        // only way to reach it from safe code (a region built from a
        // `PinnedMemory` owns it; `shared` hands out an `Arc`, which gives
        // no `&mut`), so the slice is not aliased for its lifetime.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) })
    }

    /// Does `offset..offset + len` lie inside the allocation?
    #[must_use]
    pub fn contains(&self, offset: usize, len: usize) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.len_bytes)
    }

    /// Pinned memory shared between a tier that lands reads in it (the
    /// returned region memory, e.g. an expert arena's) and the copies and
    /// kernels that read it (the `Arc`, which keeps it alive).
    pub fn shared(gpu: &Gpu, len: usize) -> Result<(Arc<Self>, Box<dyn RegionMemory>), CudaError> {
        let mem = Arc::new(Self::new(gpu, len)?);
        Ok((mem.clone(), Box::new(SharedPinned(mem))))
    }
}

/// Region memory over a shared [`PinnedMemory`].
struct SharedPinned(Arc<PinnedMemory>);

// SAFETY: delegates to the `PinnedMemory`, whose allocation the Arc keeps
// alive, 4096-aligned and unmoved for as long as this value exists.
unsafe impl RegionMemory for SharedPinned {
    fn base_ptr(&self) -> *mut u8 {
        self.0.ptr
    }
    fn len_bytes(&self) -> usize {
        self.0.len_bytes
    }
    fn device_ptr(&self) -> Option<u64> {
        Some(self.0.device_ptr)
    }
}

/// The SPEC's device-address check.
#[must_use]
pub fn classify(host_ptr: u64, device_ptr: u64) -> DeviceAddressing {
    if host_ptr == device_ptr {
        DeviceAddressing::SameAddress
    } else {
        DeviceAddressing::Mapped { device_ptr }
    }
}

// SAFETY: `ptr` is 4096-aligned (checked in `new`), valid for `len_bytes`
// zeroed bytes, and neither moves nor is freed until Drop.
unsafe impl RegionMemory for PinnedMemory {
    fn base_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    fn device_ptr(&self) -> Option<u64> {
        Some(self.device_ptr)
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host in `new`, freed exactly once here.
        // Owners keep the memory alive (Arc<LandingRegion>) until every copy
        // or kernel that reads it has been waited for.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

impl std::fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedMemory")
            .field("len_bytes", &self.len_bytes)
            .field("addressing", &self.addressing)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_check() {
        assert_eq!(classify(0x1000, 0x1000), DeviceAddressing::SameAddress);
        assert_eq!(
            classify(0x1000, 0x7000_0000),
            DeviceAddressing::Mapped {
                device_ptr: 0x7000_0000
            }
        );
    }
}
