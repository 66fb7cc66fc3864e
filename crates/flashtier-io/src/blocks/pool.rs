//! A pool of block slots that reads land in, with a state per slot.
//!
//! Invariant: a slot's bytes can be viewed only in [`SlotState::Landed`] (a
//! read into it completed without error) or written by the owner only while
//! no read targets it. `submit` takes `&mut self`, so no view outlives the
//! start of a read; a read in flight only touches slots marked
//! [`SlotState::InFlight`], which no view may reach. A batch whose submission
//! failed part-way leaves its slots [`SlotState::Poisoned`] forever (a request
//! may still be running), so bytes that may not have landed are never served.
//!
//! Bounds: `num_slots * slot_bytes <= MAX_POOL_BYTES`; at most `num_slots`
//! batches can be in flight (each holds at least one slot).

use std::sync::Arc;

use flashtier_format::kv::GroupLayout;

use super::{BlockPath, BlockSpan, span_read_reqs};
use crate::backend::{StorageBackend, Ticket};
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::LandingRegion;

/// Largest pool: 64 GiB.
pub const MAX_POOL_BYTES: usize = 64 << 30;

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing valid (fresh, reset, or filled by the owner for a write).
    Empty,
    /// A read into it is in flight in this batch.
    InFlight(BatchId),
    /// The last read into it landed exactly.
    Landed,
    /// The last read into it failed; its bytes are not served.
    Failed,
    /// A submission failed part-way; a request may still write here.
    Poisoned,
}

/// A batch of reads started by [`SlotPool::submit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchId(u64);

impl std::fmt::Display for BatchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "batch {}", self.0)
    }
}

impl std::fmt::Display for SlotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Empty => f.write_str("empty"),
            Self::InFlight(b) => write!(f, "a read of {b} in flight"),
            Self::Landed => f.write_str("landed"),
            Self::Failed => f.write_str("failed"),
            Self::Poisoned => f.write_str("poisoned by a failed submission"),
        }
    }
}

struct Batch {
    id: BatchId,
    ticket: Ticket,
    slots: Vec<usize>,
}

/// Slots of `slot_bytes` (a multiple of 4096) in one landing region.
pub struct SlotPool {
    region: Arc<LandingRegion>,
    slot_bytes: usize,
    states: Vec<SlotState>,
    batches: Vec<Batch>,
    next_batch: u64,
}

impl SlotPool {
    /// A zeroed pool of `num_slots` slots of `slot_bytes` each.
    pub fn new(slot_bytes: usize, num_slots: usize) -> Result<Self, IoError> {
        let total = Self::check_size(slot_bytes, num_slots)?;
        Ok(Self::over(
            LandingRegion::host(total),
            slot_bytes,
            num_slots,
        ))
    }

    /// A pool of `num_slots` slots of `slot_bytes` each over `region`
    /// (e.g. pinned memory a device copies from), which must hold them.
    /// The caller hands the region over: whoever else holds it touches no
    /// byte of it (the region's accessors are `unsafe` for that reason).
    pub fn in_region(
        region: Arc<LandingRegion>,
        slot_bytes: usize,
        num_slots: usize,
    ) -> Result<Self, IoError> {
        let total = Self::check_size(slot_bytes, num_slots)?;
        if region.len_bytes() < total || region.base_ptr() as usize % crate::buf::ALIGN != 0 {
            return Err(IoError::Invalid(format!(
                "a region of {} bytes cannot hold {num_slots} slots of {slot_bytes} bytes",
                region.len_bytes()
            )));
        }
        Ok(Self::over(region, slot_bytes, num_slots))
    }

    fn check_size(slot_bytes: usize, num_slots: usize) -> Result<usize, IoError> {
        let total = slot_bytes.checked_mul(num_slots);
        let ok = slot_bytes > 0
            && num_slots > 0
            && slot_bytes % crate::buf::ALIGN == 0
            && total.is_some_and(|t| t <= MAX_POOL_BYTES);
        match total {
            Some(t) if ok => Ok(t),
            _ => Err(IoError::Invalid(format!(
                "slot pool of {num_slots} x {slot_bytes} bytes (slots must be non-zero multiples of 4096, pool <= {MAX_POOL_BYTES} bytes)"
            ))),
        }
    }

    fn over(region: Arc<LandingRegion>, slot_bytes: usize, num_slots: usize) -> Self {
        Self {
            region,
            slot_bytes,
            states: vec![SlotState::Empty; num_slots],
            batches: Vec::new(),
            next_batch: 1,
        }
    }

    /// Slots in the pool.
    #[must_use]
    pub fn num_slots(&self) -> usize {
        self.states.len()
    }

    /// Bytes per slot.
    #[must_use]
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// State of slot `slot`.
    pub fn state(&self, slot: usize) -> Result<SlotState, IoError> {
        self.states
            .get(slot)
            .copied()
            .ok_or_else(|| self.out_of_range(slot, 1))
    }

    fn out_of_range(&self, slot: usize, count: usize) -> IoError {
        IoError::Invalid(format!(
            "slots {slot}..{} outside the pool of {}",
            slot.saturating_add(count),
            self.states.len()
        ))
    }

    /// Register the pool's memory with `backend` (io_uring fixed buffers).
    pub fn register_with<B: StorageBackend + ?Sized>(&self, backend: &B) -> Result<(), IoError> {
        backend.register_landing_region(&self.region)
    }

    /// Start reading `spans` (slots `span.slot..span.slot + span.count`).
    /// Every target slot must be idle (not in flight, not poisoned) and no
    /// two spans may share a slot.
    pub fn submit<B: StorageBackend + ?Sized>(
        &mut self,
        backend: &B,
        file: &Arc<StoreFile>,
        layout: &GroupLayout,
        spans: &[BlockSpan],
        path: BlockPath,
    ) -> Result<BatchId, IoError> {
        if layout.block_bytes() != self.slot_bytes as u64 {
            return Err(IoError::Invalid(format!(
                "layout blocks are {} bytes, pool slots {}",
                layout.block_bytes(),
                self.slot_bytes
            )));
        }
        let mut slots = Vec::new();
        for span in spans {
            let count = span.count as usize;
            let end = span
                .slot
                .checked_add(count)
                .filter(|&e| e <= self.states.len());
            if end.is_none() {
                return Err(self.out_of_range(span.slot, count));
            }
            slots.extend(span.slot..span.slot + count);
        }
        let mut sorted = slots.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != slots.len() {
            return Err(IoError::Invalid(
                "two spans of one batch share a slot".into(),
            ));
        }
        for &s in &slots {
            let st = self.states.get(s).copied();
            if matches!(
                st,
                Some(SlotState::InFlight(_) | SlotState::Poisoned) | None
            ) {
                let st = st.map_or_else(|| "outside the pool".to_string(), |st| st.to_string());
                return Err(IoError::Invalid(format!("slot {s} is busy ({st})")));
            }
        }
        let reqs = span_read_reqs(file, layout, &self.region, spans, path)?;
        let id = BatchId(self.next_batch);
        self.next_batch += 1;
        match backend.read_async(reqs) {
            Ok(ticket) => {
                self.set_states(&slots, SlotState::InFlight(id));
                self.batches.push(Batch { id, ticket, slots });
                Ok(id)
            }
            Err(e) => {
                self.set_states(&slots, SlotState::Poisoned);
                Err(e)
            }
        }
    }

    fn set_states(&mut self, slots: &[usize], state: SlotState) {
        for &s in slots {
            if let Some(st) = self.states.get_mut(s) {
                *st = state;
            }
        }
    }

    /// Whether `batch` has completed (landed or failed); unknown batches are done.
    #[must_use]
    pub fn is_done(&self, batch: BatchId) -> bool {
        self.batches
            .iter()
            .find(|b| b.id == batch)
            .is_none_or(|b| b.ticket.is_done())
    }

    /// Wait for `batch`. Its slots become `Landed`, or all `Failed` with the
    /// first failure returned.
    pub fn wait(&mut self, batch: BatchId) -> Result<(), IoError> {
        let Some(pos) = self.batches.iter().position(|b| b.id == batch) else {
            return Err(IoError::Invalid(format!("unknown {batch}")));
        };
        let b = self.batches.swap_remove(pos);
        match b.ticket.wait() {
            Ok(_) => {
                self.set_states(&b.slots, SlotState::Landed);
                Ok(())
            }
            Err(e) => {
                self.set_states(&b.slots, SlotState::Failed);
                Err(e)
            }
        }
    }

    /// Mark slot `slot` as holding nothing valid (after a failed check).
    pub fn invalidate(&mut self, slot: usize) -> Result<(), IoError> {
        match self.state(slot)? {
            SlotState::InFlight(_) | SlotState::Poisoned => Err(IoError::Invalid(format!(
                "slot {slot} cannot be invalidated while a read may target it"
            ))),
            _ => {
                self.set_states(&[slot], SlotState::Empty);
                Ok(())
            }
        }
    }

    fn check_range(
        &self,
        slot: usize,
        count: usize,
        ok: fn(SlotState) -> bool,
    ) -> Result<(), IoError> {
        let end = slot.checked_add(count).filter(|&e| e <= self.states.len());
        let Some(end) = end else {
            return Err(self.out_of_range(slot, count));
        };
        for s in slot..end {
            let st = self.state(s)?;
            if !ok(st) {
                return Err(IoError::Invalid(format!(
                    "slot {s} is not available ({st})"
                )));
            }
        }
        Ok(())
    }

    /// The bytes of `count` consecutive slots from `slot`, all `Landed`.
    pub fn landed(&self, slot: usize, count: usize) -> Result<&[u8], IoError> {
        self.check_range(slot, count, |s| s == SlotState::Landed)?;
        // SAFETY: the slots are Landed, so no read targets them; reads start
        // only through `submit(&mut self)`, which cannot run while this
        // shared borrow lives; the pool never hands out the region, so no
        // other writer exists. The range is in bounds (checked above).
        Ok(unsafe {
            self.region
                .slice(slot * self.slot_bytes, count * self.slot_bytes)
        })
    }

    /// Fill slots from the owner's side (e.g. before an offload write). The
    /// slots must be idle; they become `Empty` (their old bytes are no
    /// longer a landed read).
    pub fn fill(&mut self, slot: usize, count: usize) -> Result<&mut [u8], IoError> {
        self.check_range(slot, count, |s| {
            !matches!(s, SlotState::InFlight(_) | SlotState::Poisoned)
        })?;
        for s in slot..slot + count {
            self.set_states(&[s], SlotState::Empty);
        }
        // SAFETY: no read targets these slots (checked), `&mut self` excludes
        // every other view from this pool, and the region is never shared
        // outside it. In bounds (checked above).
        Ok(unsafe {
            self.region
                .slice_mut(slot * self.slot_bytes, count * self.slot_bytes)
        })
    }
}

impl Drop for SlotPool {
    fn drop(&mut self) {
        // Reads in flight keep the region alive through their own Arc; wait
        // anyway so a dropped pool leaves no work behind on the backend.
        for b in self.batches.drain(..) {
            let _ = b.ticket.wait();
        }
    }
}

impl std::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotPool")
            .field("slot_bytes", &self.slot_bytes)
            .field("num_slots", &self.states.len())
            .field("batches_in_flight", &self.batches.len())
            .finish()
    }
}
