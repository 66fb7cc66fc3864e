//! A step's small host data on the device without a host sync: a PLE
//! layer's rows, gathered on the host (row store or checkpoint), are
//! written into pinned memory and copied to HBM on a copy stream; the
//! compute stream waits for the copy's event, so the kernels queued after
//! [`RowLanding::land`] read the rows and nothing on the host waits for
//! the compute stream (a copy from pageable memory would: the driver
//! synchronises the stream before such a copy).
//!
//! Two slots take turns. A slot's copy starts once the kernels that read
//! the slot's previous rows are done ([`RowLanding::read_done`] records
//! that on the compute stream), not after everything queued since, so it
//! overlaps the compute of the layers before the one that reads it.
//! While a step records its launches as graphs no event can go between
//! them; such a use is then not marked, and the slot's next copy waits for
//! everything queued on the compute stream at that time instead.
//!
//! Bounds: two pinned buffers and two device buffers, each the largest
//! landing so far (`rows x cols` f32: one row per token of a step, so a
//! prompt chunk's rows at most); at most one copy in flight per slot (the
//! host waits for a slot's last copy before it rewrites the slot).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::addr;
use super::buffers::DevAct;
use crate::context::Gpu;
use crate::error::CudaError;
use crate::pinned::PinnedMemory;

/// One of the two slots.
struct Slot {
    /// The landed values on the host (grown to the largest landing).
    host: Option<PinnedMemory>,
    /// The landed values on the device (`rows x cols` of the last landing).
    dev: Option<DevAct>,
    /// Recorded on the copy stream after the slot's last copy.
    copied: CudaEvent,
    /// Recorded on the compute stream after the slot's last readers.
    consumed: CudaEvent,
    /// A copy out of `host` was queued and not waited for yet.
    copying: bool,
    /// `consumed` stands after every reader of the slot's current rows.
    read_marked: bool,
}

/// Pinned landing of per-step rows into HBM (see the module docs).
pub struct RowLanding {
    gpu: Gpu,
    copy: Arc<CudaStream>,
    cols: usize,
    slots: [Slot; 2],
    /// The slot the next landing takes.
    next: usize,
    /// The slot of the last landing.
    current: Option<usize>,
}

impl std::fmt::Debug for RowLanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowLanding")
            .field("cols", &self.cols)
            .field("current", &self.current)
            .finish_non_exhaustive()
    }
}

impl RowLanding {
    /// A landing for rows of `cols` f32 values, with its own copy stream.
    pub fn new(gpu: &Gpu, cols: usize) -> Result<Self, CudaError> {
        if cols == 0 {
            return Err(CudaError::invalid("row landing", "rows of 0 values"));
        }
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(CudaError::driver("create landing event"))
        };
        let slot = || -> Result<Slot, CudaError> {
            Ok(Slot {
                host: None,
                dev: None,
                copied: event()?,
                consumed: event()?,
                copying: false,
                read_marked: false,
            })
        };
        Ok(Self {
            gpu: gpu.clone(),
            copy: gpu.new_stream()?,
            cols,
            slots: [slot()?, slot()?],
            next: 0,
            current: None,
        })
    }

    /// Land `rows x cols` row-major `values`: every kernel queued on the
    /// compute stream after this call sees them in [`Self::rows`].
    pub fn land(&mut self, rows: usize, values: &[f32]) -> Result<(), CudaError> {
        let want = rows.checked_mul(self.cols).filter(|&n| n > 0);
        if want != Some(values.len()) {
            return Err(CudaError::invalid(
                "row landing",
                format!("{} values for {rows} rows of {}", values.len(), self.cols),
            ));
        }
        let (gpu, cols) = (self.gpu.clone(), self.cols);
        let i = self.next;
        self.next = 1 - i;
        self.current = None;
        let slot = &mut self.slots[i];
        if slot.copying {
            // Two landings ago: long done in a decode, so rarely a wait.
            slot.copied
                .synchronize()
                .map_err(CudaError::driver("wait for the slot's last row copy"))?;
            slot.copying = false;
        }
        let bytes = std::mem::size_of_val(values);
        if slot.host.as_ref().is_none_or(|h| h.len_bytes() < bytes) {
            slot.host = Some(PinnedMemory::new(&gpu, bytes)?);
        }
        let host = slot
            .host
            .as_mut()
            .ok_or_else(|| CudaError::invalid("row landing", "no pinned buffer"))?;
        host.write(0, bytemuck::cast_slice(values))?;
        let fresh = slot.dev.as_ref().is_none_or(|d| d.rows() != rows);
        if fresh {
            if let Some(old) = slot.dev.take() {
                // Queued launches may still read it: freed once issued.
                gpu.retire(old.into_buf());
            }
            slot.dev = Some(DevAct::detached(&gpu, rows, cols)?);
        }
        if slot.read_marked && !fresh {
            self.copy.wait(&slot.consumed).map_err(CudaError::driver(
                "order the slot's readers before its copy",
            ))?;
        } else {
            // Unmarked readers, or a buffer just allocated on the compute
            // stream: after everything queued there.
            self.copy.join(gpu.stream()).map_err(CudaError::driver(
                "order the compute stream before a row copy",
            ))?;
        }
        slot.read_marked = false;
        let dst = slot
            .dev
            .as_ref()
            .map(|d| addr(&gpu, d.buf(), 0))
            .ok_or_else(|| CudaError::invalid("row landing", "no device buffer"))?;
        let src = host.host_address() as *const u8;
        gpu.context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        // SAFETY: `src..src + bytes` lies inside the pinned buffer (it holds
        // at least `bytes`, checked above), which the slot keeps until the
        // copy's event has completed (the host waits for it before it
        // rewrites or drops the buffer, see `copying` and `Drop`); `dst` is
        // the slot's device buffer of `rows x cols` f32 (`bytes` bytes),
        // kept alive (or retired behind the queued launches) by the slot.
        unsafe {
            let src = std::slice::from_raw_parts(src, bytes);
            cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream())
        }
        .map_err(CudaError::driver(format!(
            "copy {bytes} bytes of rows to the device"
        )))?;
        slot.copied
            .record(&self.copy)
            .map_err(CudaError::driver("record a row copy"))?;
        slot.copying = true;
        gpu.stream()
            .wait(&slot.copied)
            .map_err(CudaError::driver("order a row copy before its readers"))?;
        self.current = Some(i);
        Ok(())
    }

    /// The rows of the last [`Self::land`].
    pub fn rows(&self) -> Result<&DevAct, CudaError> {
        self.current
            .and_then(|i| self.slots[i].dev.as_ref())
            .ok_or_else(|| CudaError::invalid("row landing", "no rows landed"))
    }

    /// The kernels queued so far are the last readers of the landed rows
    /// (not marked while the step records: see the module docs).
    pub fn read_done(&mut self) -> Result<(), CudaError> {
        let Some(i) = self.current else {
            return Ok(());
        };
        if self.gpu.recording() {
            return Ok(());
        }
        let slot = &mut self.slots[i];
        slot.consumed
            .record(self.gpu.stream())
            .map_err(CudaError::driver("record the rows' last readers"))?;
        slot.read_marked = true;
        Ok(())
    }
}

impl Drop for RowLanding {
    fn drop(&mut self) {
        // The pinned buffers must outlive the copies that read them.
        for s in &self.slots {
            if s.copying {
                let _ = s.copied.synchronize();
            }
        }
    }
}
