//! Disk -> pinned staging -> HBM: the device sink the `flashtier-io` backends
//! land device-destined reads through.
//!
//! A read with [`Landing::Device`](flashtier_io::Landing) asks the sink for a
//! staging slot ([`DeviceSink::stage`]), reads the file with O_DIRECT straight
//! into that pinned, page-aligned slot (no bounce buffer), then hands it back
//! ([`DeviceSink::commit`]), which enqueues the host-to-device copy on the
//! sink's copy stream and records the slot's event. The slot is reused once
//! that event has completed, so while one slot is being copied the next one
//! is being read from the disk: with at least two slots per reader, disk and
//! copy overlap (double buffering).
//!
//! Semantics: when a backend's `read` returns, every copy has been enqueued
//! on the copy stream, so the bytes are landed and visible to work ordered
//! after it ([`HbmSink::order_before`] makes another stream wait for them, with
//! no host sync). Destinations must be ready before the copies: call
//! [`HbmSink::order_after`] with the stream that allocated them. `read_async`
//! never synchronises with the device; only
//! [`DeviceSink::flush`] (and a full staging ring) waits on the host.
//!
//! Bounds: `slots` staging slots of `slot_bytes` each (one pinned allocation
//! of `slots * slot_bytes` bytes); at most `slots` reads staged or copying at
//! once; `stage` blocks until a slot is free.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use flashtier_io::{ALIGN, DeviceSink, LandingRegion};

use crate::context::Gpu;
use crate::error::CudaError;
use crate::pinned::PinnedMemory;

/// Most staging slots a sink may have.
pub const MAX_SLOTS: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    /// Reserved by `stage`; a read is landing in it.
    Reading,
    /// Its copy is enqueued; free once its event completes.
    Copying,
}

struct Ring {
    slots: Vec<Slot>,
    /// Bumped each time a slot's event is re-recorded (ABA guard).
    generation: Vec<u64>,
    cursor: usize,
}

/// Pinned staging plus a copy stream into device memory.
pub struct HbmSink {
    gpu: Gpu,
    copy_stream: Arc<CudaStream>,
    staging: Arc<LandingRegion>,
    slot_bytes: usize,
    events: Vec<CudaEvent>,
    ring: Mutex<Ring>,
    freed: Condvar,
}

impl std::fmt::Debug for HbmSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HbmSink")
            .field("slots", &self.events.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl HbmSink {
    /// A sink with `slots` pinned staging slots of `slot_bytes` (a non-zero
    /// multiple of 4096). Use at least two slots per concurrent reader.
    pub fn new(gpu: &Gpu, slots: usize, slot_bytes: usize) -> Result<Arc<Self>, CudaError> {
        if !(1..=MAX_SLOTS).contains(&slots) {
            return Err(CudaError::invalid(
                "staging slots",
                format!("{slots} outside 1..={MAX_SLOTS}"),
            ));
        }
        if slot_bytes == 0 || slot_bytes % ALIGN != 0 {
            return Err(CudaError::invalid(
                "slot_bytes",
                format!("{slot_bytes} is not a non-zero multiple of {ALIGN}"),
            ));
        }
        let total = slots.checked_mul(slot_bytes).ok_or_else(|| {
            CudaError::invalid("staging size", format!("{slots} x {slot_bytes} overflows"))
        })?;
        let staging = PinnedMemory::region(gpu, total)?;
        let copy_stream = gpu.new_stream()?;
        let events = (0..slots)
            .map(|_| {
                gpu.context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(CudaError::driver("create staging event"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(Self {
            gpu: gpu.clone(),
            copy_stream,
            staging,
            slot_bytes,
            events,
            ring: Mutex::new(Ring {
                slots: vec![Slot::Free; slots],
                generation: vec![0; slots],
                cursor: 0,
            }),
            freed: Condvar::new(),
        }))
    }

    /// The stream the host-to-device copies run on.
    #[must_use]
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy_stream
    }

    /// Staging slots. A backend that stages a whole batch before submitting
    /// it (io_uring) must not hand the sink more device reads per batch.
    #[must_use]
    pub fn slots(&self) -> usize {
        self.events.len()
    }

    /// Bytes per staging slot (the largest single read the sink takes).
    #[must_use]
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Make the copy stream wait (on the device, no host sync) for the work
    /// queued on `stream` so far, e.g. the allocation and zeroing of the
    /// device buffers that reads will land in.
    pub fn order_after(&self, stream: &CudaStream) -> Result<(), CudaError> {
        self.copy_stream
            .join(stream)
            .map_err(CudaError::driver("order producer before copy stream"))
    }

    /// Make `stream` wait (on the device, no host sync) for every copy
    /// committed so far.
    pub fn order_before(&self, stream: &CudaStream) -> Result<(), CudaError> {
        stream
            .join(&self.copy_stream)
            .map_err(CudaError::driver("order copy stream before consumer"))
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserve a free slot, reclaiming finished copies; blocks while every
    /// slot is being read into.
    fn reserve(&self) -> Result<usize, CudaError> {
        let mut ring = self.lock();
        loop {
            let n = ring.slots.len();
            for k in 0..n {
                let i = (ring.cursor + k) % n;
                let ready = match ring.slots.get(i) {
                    Some(Slot::Free) => true,
                    Some(Slot::Copying) => self
                        .event(i)?
                        .try_is_complete()
                        .map_err(CudaError::driver("query staging copy"))?,
                    _ => false,
                };
                if ready {
                    if let Some(s) = ring.slots.get_mut(i) {
                        *s = Slot::Reading;
                    }
                    ring.cursor = (i + 1) % n;
                    return Ok(i);
                }
            }
            // Wait for the oldest copy in flight, outside the lock.
            let copying = (0..n)
                .map(|k| (ring.cursor + k) % n)
                .find(|&i| ring.slots.get(i) == Some(&Slot::Copying));
            if let Some(i) = copying {
                let generation = ring.generation.get(i).copied().unwrap_or(0);
                drop(ring);
                self.event(i)?
                    .synchronize()
                    .map_err(CudaError::driver("wait for staging copy"))?;
                ring = self.lock();
                let same = ring.generation.get(i).copied() == Some(generation);
                if same && ring.slots.get(i) == Some(&Slot::Copying) {
                    if let Some(s) = ring.slots.get_mut(i) {
                        *s = Slot::Free;
                    }
                }
            } else {
                ring = self
                    .freed
                    .wait(ring)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    fn event(&self, i: usize) -> Result<&CudaEvent, CudaError> {
        self.events
            .get(i)
            .ok_or_else(|| CudaError::invalid("staging slot", format!("{i} out of range")))
    }

    fn enqueue_copy(
        &self,
        slot: usize,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<(), CudaError> {
        let src = self.staging.ptr_at(offset, len).ok_or_else(|| {
            CudaError::invalid("staging range", format!("{offset}+{len} outside staging"))
        })?;
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        // SAFETY: `src..src+len` lies inside the pinned staging region (checked
        // above), which lives as long as `self`; the slot stays reserved (not
        // handed out by `stage`) until the event recorded below completes, so
        // nothing writes these bytes while the copy reads them. `dst` is the
        // caller's device address (DeviceSink contract: valid for `len` bytes).
        unsafe {
            let bytes = std::slice::from_raw_parts(src.cast_const(), len);
            cudarc::driver::result::memcpy_htod_async(dst, bytes, self.copy_stream.cu_stream())
        }
        .map_err(CudaError::driver(format!(
            "copy {len} bytes to device {dst:#x}"
        )))?;
        self.event(slot)?
            .record(&self.copy_stream)
            .map_err(CudaError::driver("record staging event"))
    }
}

impl DeviceSink for HbmSink {
    fn stage(&self, len: usize) -> Result<(Arc<LandingRegion>, usize), String> {
        if len > self.slot_bytes {
            return Err(format!(
                "read of {len} bytes exceeds the staging slot of {} bytes",
                self.slot_bytes
            ));
        }
        let slot = self.reserve().map_err(|e| e.to_string())?;
        Ok((self.staging.clone(), slot * self.slot_bytes))
    }

    fn commit(&self, offset: usize, len: usize, dst: u64) -> Result<(), String> {
        let slot = offset / self.slot_bytes;
        if offset % self.slot_bytes != 0 || len > self.slot_bytes {
            return Err(format!(
                "commit of {len} bytes at staging offset {offset} is not a slot"
            ));
        }
        let mut ring = self.lock();
        if ring.slots.get(slot) != Some(&Slot::Reading) {
            return Err(format!(
                "commit of staging slot {slot}, which was not staged"
            ));
        }
        let result = self.enqueue_copy(slot, offset, len, dst);
        if let Some(s) = ring.slots.get_mut(slot) {
            *s = if result.is_ok() {
                Slot::Copying
            } else {
                Slot::Free
            };
        }
        if let Some(g) = ring.generation.get_mut(slot) {
            *g += 1;
        }
        drop(ring);
        self.freed.notify_all();
        result.map_err(|e| e.to_string())
    }

    fn abort(&self, offset: usize, _len: usize) {
        let slot = offset / self.slot_bytes;
        let mut ring = self.lock();
        if offset % self.slot_bytes == 0 && ring.slots.get(slot) == Some(&Slot::Reading) {
            if let Some(s) = ring.slots.get_mut(slot) {
                *s = Slot::Free;
            }
        }
        drop(ring);
        self.freed.notify_all();
    }

    fn flush(&self) -> Result<(), String> {
        self.copy_stream
            .synchronize()
            .map_err(|e| CudaError::driver("synchronize copy stream")(e).to_string())
    }
}
