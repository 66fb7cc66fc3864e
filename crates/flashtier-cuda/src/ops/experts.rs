//! Routed experts on the device: the HBM slot arena, the device table that
//! says where each (layer, expert) record is, and the kernels that run the
//! chosen experts of a step.
//!
//! [`ExpertSlots`] owns both. A table entry is set only through
//! [`ExpertSlots::point_to_slot`] (an HBM slot of this arena) or
//! [`ExpertSlots::point_to_pinned`] (a range of pinned host memory the
//! device reads in place, the unified-memory path), each checked to hold a
//! whole record; a cleared entry is 0, which the kernels answer with NaN
//! instead of reading anything. Pinned memory an entry or a copy uses is
//! kept alive by the slots until they are dropped, and dropping waits for
//! the copy stream.
//!
//! Ordering, with no host sync on the hot path: [`ExpertSlots::load`]
//! queues a host-to-device copy on the copy stream after the compute
//! stream's last [`ExpertSlots::consumed`] mark, so a slot is never
//! overwritten while a kernel queued before the mark still reads it;
//! [`ExpertSlots::publish`] makes the compute stream wait for the copies
//! and uploads changed table entries before the kernels that read them.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use super::addr;
use super::buffers::WeightType;
use crate::context::Gpu;
use crate::error::CudaError;
use crate::pinned::PinnedMemory;

/// Where an expert record's matrices sit: gate and up `[inter, hidden]`,
/// down `[hidden, inter]`, in one dtype; FP8 records add each matrix's F32
/// scale grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertSpec {
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub inter: usize,
    /// Element type of the three matrices.
    pub ty: WeightType,
    /// Byte offsets of gate, up and down in the record.
    pub matrices: [usize; 3],
    /// Byte offsets of the three scale grids (FP8 only).
    pub scales: [usize; 3],
}

/// A record's matrix and scale offsets (the C layout of `struct Expert`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    gate_off: i64,
    up_off: i64,
    down_off: i64,
    gate_soff: i64,
    up_soff: i64,
    down_soff: i64,
    gu_sc_cols: i32,
    dn_sc_cols: i32,
    br: i32,
    bc: i32,
}

// SAFETY: plain-old-data with the C layout of `struct Expert` in kernels/decode/
// (six 64-bit offsets, then four 32-bit ints; 64 bytes, 8-byte aligned, no
// padding).
unsafe impl crate::launch::KernelArg for Geometry {}

impl ExpertSpec {
    /// Bytes a record must hold for every matrix and scale to lie in it.
    #[must_use]
    pub fn min_record_bytes(&self) -> usize {
        let e = self.ty.elem_bytes();
        let mat = self.hidden * self.inter * e;
        let mut end = self.matrices.iter().map(|o| o + mat).max().unwrap_or(0);
        if let WeightType::Fp8 { .. } = self.ty {
            let [gr, gc] = self.ty.scale_grid(self.inter, self.hidden);
            let [dr, dc] = self.ty.scale_grid(self.hidden, self.inter);
            let lens = [gr * gc * 4, gr * gc * 4, dr * dc * 4];
            for (o, l) in self.scales.iter().zip(lens) {
                end = end.max(o + l);
            }
        }
        end
    }

    pub(super) fn validate(&self) -> Result<(), CudaError> {
        let aligned =
            self.matrices.iter().all(|o| o % 16 == 0) && self.scales.iter().all(|o| o % 4 == 0);
        if self.hidden == 0 || self.inter == 0 || !aligned {
            return Err(CudaError::invalid(
                "expert layout",
                format!("{self:?}: zero width or unaligned offsets"),
            ));
        }
        if let WeightType::Fp8 { block: [br, bc] } = self.ty {
            if br == 0 || bc == 0 || bc % 8 != 0 {
                return Err(CudaError::invalid(
                    "expert layout",
                    format!("FP8 block {br}x{bc}"),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn geometry(&self) -> Geometry {
        let o = |v: usize| v as i64;
        let (gu_sc, dn_sc, br, bc) = match self.ty {
            WeightType::Fp8 { block: [br, bc] } => (
                self.ty.scale_grid(self.inter, self.hidden)[1],
                self.ty.scale_grid(self.hidden, self.inter)[1],
                br,
                bc,
            ),
            _ => (0, 0, 1, 1),
        };
        Geometry {
            gate_off: o(self.matrices[0]),
            up_off: o(self.matrices[1]),
            down_off: o(self.matrices[2]),
            gate_soff: o(self.scales[0]),
            up_soff: o(self.scales[1]),
            down_soff: o(self.scales[2]),
            gu_sc_cols: gu_sc as i32,
            dn_sc_cols: dn_sc as i32,
            br: br as i32,
            bc: bc as i32,
        }
    }
}

/// HBM expert slots and the device table of record addresses.
pub struct ExpertSlots {
    gpu: Gpu,
    copy_stream: Arc<CudaStream>,
    hbm: Option<CudaSlice<u8>>,
    slots: usize,
    stride: usize,
    pub(super) record_bytes: usize,
    table_host: Vec<u64>,
    pub(super) table_dev: CudaSlice<u64>,
    dirty: bool,
    keepalive: Vec<Arc<PinnedMemory>>,
    copied: CudaEvent,
    consumed: CudaEvent,
    /// `consumed` was recorded after the copy stream last waited for it.
    consumed_pending: bool,
    loads_since_publish: usize,
}

impl std::fmt::Debug for ExpertSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertSlots")
            .field("slots", &self.slots)
            .field("stride", &self.stride)
            .field("entries", &self.table_host.len())
            .finish()
    }
}

impl Drop for ExpertSlots {
    fn drop(&mut self) {
        // Copies out of the kept pinned memory finish before it can go.
        let _ = self.copy_stream.synchronize();
        let _ = self.gpu.stream().synchronize();
    }
}

impl ExpertSlots {
    /// `slots` HBM slots of `stride` bytes (0 slots: records are only read
    /// in place from pinned memory) for records of `record_bytes`, and a
    /// table of `entries` (layers x experts) entries, all cleared.
    pub fn new(
        gpu: &Gpu,
        slots: usize,
        stride: usize,
        record_bytes: usize,
        entries: usize,
    ) -> Result<Self, CudaError> {
        if entries == 0 || record_bytes == 0 || (slots > 0 && stride < record_bytes) {
            return Err(CudaError::invalid(
                "expert slots",
                format!(
                    "{slots} slots of {stride} bytes for {record_bytes}-byte records, {entries} entries"
                ),
            ));
        }
        let total = slots.checked_mul(stride).ok_or_else(|| {
            CudaError::invalid(
                "expert slots",
                format!("{slots} x {stride} bytes overflows"),
            )
        })?;
        let stream = gpu.stream();
        let hbm = if slots > 0 {
            Some(
                stream
                    .alloc_zeros::<u8>(total)
                    .map_err(CudaError::driver(format!(
                        "allocate {total} bytes of HBM expert slots"
                    )))?,
            )
        } else {
            None
        };
        let table_dev = stream
            .alloc_zeros::<u64>(entries)
            .map_err(CudaError::driver("allocate the expert table"))?;
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(CudaError::driver("create expert event"))
        };
        Ok(Self {
            gpu: gpu.clone(),
            copy_stream: gpu.new_stream()?,
            hbm,
            slots,
            stride,
            record_bytes,
            table_host: vec![0; entries],
            table_dev,
            dirty: false,
            keepalive: Vec::new(),
            copied: event()?,
            consumed: event()?,
            consumed_pending: false,
            loads_since_publish: 0,
        })
    }

    /// HBM slots.
    #[must_use]
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Table entries.
    #[must_use]
    pub fn entries(&self) -> usize {
        self.table_host.len()
    }

    /// Is `entry` set?
    #[must_use]
    pub fn is_set(&self, entry: usize) -> bool {
        self.table_host.get(entry).is_some_and(|&a| a != 0)
    }

    fn keep(&mut self, src: &Arc<PinnedMemory>) {
        if !self.keepalive.iter().any(|k| Arc::ptr_eq(k, src)) {
            self.keepalive.push(src.clone());
        }
    }

    fn check_source(&self, src: &PinnedMemory, offset: usize, len: usize) -> Result<(), CudaError> {
        if len < self.record_bytes || !src.contains(offset, len) {
            return Err(CudaError::invalid(
                "expert source",
                format!(
                    "{len} bytes at {offset} of {} pinned bytes (records are {} bytes)",
                    src.len_bytes(),
                    self.record_bytes
                ),
            ));
        }
        Ok(())
    }

    fn slot_base(&self, slot: usize) -> Result<u64, CudaError> {
        match &self.hbm {
            Some(h) if slot < self.slots => Ok(addr(&self.gpu, h, slot * self.stride)),
            _ => Err(CudaError::invalid(
                "expert slot",
                format!("{slot} of {}", self.slots),
            )),
        }
    }

    /// Queue the copy of a record (`len` bytes at `offset` of `src`) into
    /// HBM `slot`, on the copy stream, after every kernel queued before the
    /// last [`ExpertSlots::consumed`].
    pub fn load(
        &mut self,
        slot: usize,
        src: &Arc<PinnedMemory>,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        self.check_source(src, offset, len)?;
        let dst = self.slot_base(slot)?;
        if len > self.stride {
            return Err(CudaError::invalid(
                "expert load",
                format!("{len} bytes into {}-byte slots", self.stride),
            ));
        }
        if self.consumed_pending {
            self.copy_stream
                .wait(&self.consumed)
                .map_err(CudaError::driver("order expert loads after their readers"))?;
            self.consumed_pending = false;
        }
        self.keep(src);
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        // SAFETY: `offset..offset + len` lies inside the pinned allocation
        // (checked), which `keepalive` holds until this value is dropped and
        // Drop waits for the copy stream; `dst..dst + len` lies inside slot
        // `slot` of the HBM arena (slot < slots, len <= stride). Nothing
        // reads the slot before `publish` orders the compute stream after
        // this copy, and the copy is ordered after the kernels that read the
        // slot's previous record (the wait on `consumed` above).
        unsafe {
            let bytes = std::slice::from_raw_parts(
                (src.host_address() as usize + offset) as *const u8,
                len,
            );
            cudarc::driver::result::memcpy_htod_async(dst, bytes, self.copy_stream.cu_stream())
        }
        .map_err(CudaError::driver(format!(
            "copy an expert record into slot {slot}"
        )))?;
        self.loads_since_publish += 1;
        Ok(())
    }

    /// Point `entry` at HBM `slot`.
    pub fn point_to_slot(&mut self, entry: usize, slot: usize) -> Result<(), CudaError> {
        let base = self.slot_base(slot)?;
        self.set(entry, base)
    }

    /// Point `entry` at `len` bytes at `offset` of pinned `src`, read by
    /// the device in place.
    pub fn point_to_pinned(
        &mut self,
        entry: usize,
        src: &Arc<PinnedMemory>,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        self.check_source(src, offset, len)?;
        self.keep(src);
        self.set(entry, src.device_address() + offset as u64)
    }

    /// Clear `entry` (its kernels then write NaN).
    pub fn clear(&mut self, entry: usize) -> Result<(), CudaError> {
        self.set(entry, 0)
    }

    fn set(&mut self, entry: usize, value: u64) -> Result<(), CudaError> {
        let n = self.table_host.len();
        let e = self
            .table_host
            .get_mut(entry)
            .ok_or_else(|| CudaError::invalid("expert entry", format!("{entry} of {n}")))?;
        if *e != value {
            *e = value;
            self.dirty = true;
        }
        Ok(())
    }

    /// Make the compute stream wait for the queued loads and see the
    /// current table.
    pub fn publish(&mut self) -> Result<(), CudaError> {
        let compute = self.gpu.stream();
        if self.loads_since_publish > 0 {
            self.copied
                .record(&self.copy_stream)
                .map_err(CudaError::driver("record expert loads"))?;
            compute
                .wait(&self.copied)
                .map_err(CudaError::driver("order kernels after expert loads"))?;
            self.loads_since_publish = 0;
        }
        if self.dirty {
            compute
                .memcpy_htod(&self.table_host, &mut self.table_dev)
                .map_err(CudaError::driver("upload the expert table"))?;
            self.dirty = false;
        }
        Ok(())
    }

    /// Mark that every kernel queued so far may still read the slots: later
    /// loads wait for them.
    pub fn consumed(&mut self) -> Result<(), CudaError> {
        self.consumed
            .record(self.gpu.stream())
            .map_err(CudaError::driver("record expert readers"))?;
        self.consumed_pending = true;
        Ok(())
    }

    /// Block until the kernels queued before the last
    /// [`ExpertSlots::consumed`] finished (before pinned memory they read in
    /// place may be overwritten).
    pub fn wait_consumed(&self) -> Result<(), CudaError> {
        self.consumed
            .synchronize()
            .map_err(CudaError::driver("wait for expert readers"))
    }

    /// Block until every queued load has landed (before the pinned bytes
    /// they read may be overwritten).
    pub fn wait_loads(&self) -> Result<(), CudaError> {
        self.copy_stream
            .synchronize()
            .map_err(CudaError::driver("wait for expert loads"))
    }
}
