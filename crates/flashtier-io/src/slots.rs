//! `SlotTable`: equal slots of one landing region that reads land in, with
//! the bookkeeping that makes reading a slot's bytes safe: a slot has at most
//! one read in flight, and its bytes can be viewed only when no read is in
//! flight into it.
//!
//! The table creates its landing region itself and never hands out the
//! `Arc<LandingRegion>`, so every write into a slot goes through
//! [`SlotTable::submit`], which records the read's ticket; [`SlotTable::bytes`]
//! refuses a slot whose ticket has not been collected by
//! [`SlotTable::collect`]. That is the whole protocol the region's `unsafe`
//! accessors ask for, so this module is where the unsafety of the slots
//! backing lives.
//!
//! Bounds: `count` slots of `stride` bytes (fixed at construction), at most
//! one read in flight per slot.

use std::sync::Arc;
use std::sync::mpsc::Sender;

use crate::backend::{Landing, ReadReq, StorageBackend, Ticket};
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::{LandingRegion, RegionMemory};

/// Completion of one slot read, as a flag: it can be polled, never waited
/// on or drained (the table collects the result).
#[derive(Clone)]
pub struct LandedFlag(Option<Ticket>);

impl LandedFlag {
    /// A flag that is already set (nothing to read).
    #[must_use]
    pub fn landed() -> Self {
        Self(None)
    }

    /// Whether the read has completed (landed or failed).
    #[must_use]
    pub fn is_landed(&self) -> bool {
        self.0.as_ref().is_none_or(Ticket::is_done)
    }
}

impl From<Ticket> for LandedFlag {
    fn from(t: Ticket) -> Self {
        Self(Some(t))
    }
}

impl std::fmt::Debug for LandedFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LandedFlag({})", self.is_landed())
    }
}

/// Slots of a landing region; see the module docs.
pub struct SlotTable {
    region: Arc<LandingRegion>,
    stride: usize,
    inflight: Vec<Option<Ticket>>,
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable")
            .field("region", &self.region)
            .field("stride", &self.stride)
            .field("slots", &self.inflight.len())
            .finish()
    }
}

impl SlotTable {
    /// `count` slots of `stride` bytes over `mem` (which must cover them).
    pub fn new(mem: Box<dyn RegionMemory>, stride: usize, count: usize) -> Result<Self, IoError> {
        let need = stride.checked_mul(count);
        if need.is_none_or(|n| n > mem.len_bytes()) || stride == 0 {
            return Err(IoError::Invalid(format!(
                "{count} slots of {stride} bytes do not fit {} bytes of memory",
                mem.len_bytes()
            )));
        }
        Ok(Self {
            region: LandingRegion::from_memory(mem),
            stride,
            inflight: (0..count).map(|_| None).collect(),
        })
    }

    /// Number of slots.
    #[must_use]
    pub fn count(&self) -> usize {
        self.inflight.len()
    }

    /// Bytes per slot.
    #[must_use]
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Host address of slot `slot`'s first byte.
    #[must_use]
    pub fn host_addr(&self, slot: usize) -> Option<u64> {
        (slot < self.count()).then(|| self.region.base_ptr() as u64 + (slot * self.stride) as u64)
    }

    /// Device address of slot `slot` where the memory has one.
    #[must_use]
    pub fn device_addr(&self, slot: usize) -> Option<u64> {
        let base = self.region.device_ptr()?;
        (slot < self.count()).then(|| base + (slot * self.stride) as u64)
    }

    /// Register the region with `backend` (io_uring fixed buffers).
    pub fn register_with(&self, backend: &dyn StorageBackend) -> Result<(), IoError> {
        backend.register_landing_region(&self.region)
    }

    fn check(&self, slot: usize, len: usize) -> Result<(), IoError> {
        if slot >= self.count() || len > self.stride {
            return Err(IoError::Invalid(format!(
                "slot {slot} / {len} bytes outside {} slots of {} bytes",
                self.count(),
                self.stride
            )));
        }
        Ok(())
    }

    /// Start reading `len` bytes of `file` at `offset` into slot `slot`.
    /// Fails when the slot still has a read in flight or uncollected.
    pub fn submit(
        &mut self,
        backend: &dyn StorageBackend,
        slot: usize,
        file: Arc<StoreFile>,
        offset: u64,
        len: usize,
    ) -> Result<LandedFlag, IoError> {
        let req = self.request(slot, file, offset, len)?;
        let ticket = backend.read_async(vec![req])?;
        Ok(self.started(slot, ticket))
    }

    /// [`Self::submit`] as read-ahead ([`StorageBackend::read_ahead`]):
    /// behind every demand read, and `Ok(None)` (the slot left idle) when
    /// the backend has no room for it now.
    pub fn submit_ahead(
        &mut self,
        backend: &dyn StorageBackend,
        slot: usize,
        file: Arc<StoreFile>,
        offset: u64,
        len: usize,
    ) -> Result<Option<LandedFlag>, IoError> {
        let req = self.request(slot, file, offset, len)?;
        Ok(backend
            .read_ahead(vec![req])?
            .map(|ticket| self.started(slot, ticket)))
    }

    /// The read of `len` bytes at `offset` into idle slot `slot`.
    fn request(
        &self,
        slot: usize,
        file: Arc<StoreFile>,
        offset: u64,
        len: usize,
    ) -> Result<ReadReq, IoError> {
        self.check(slot, len)?;
        if self.inflight[slot].is_some() {
            return Err(IoError::Invalid(format!(
                "slot {slot} already has a read in flight"
            )));
        }
        Ok(ReadReq {
            file,
            offset,
            len,
            landing: Landing::Region {
                region: self.region.clone(),
                offset: slot * self.stride,
            },
            tag: slot as u64,
        })
    }

    fn started(&mut self, slot: usize, ticket: Ticket) -> LandedFlag {
        let flag = LandedFlag(Some(ticket.clone()));
        self.inflight[slot] = Some(ticket);
        flag
    }

    /// Whether slot `slot` has a read submitted and not yet collected.
    #[must_use]
    pub fn is_busy(&self, slot: usize) -> bool {
        self.inflight.get(slot).is_some_and(Option::is_some)
    }

    /// Whether the slot's read (if any) has completed.
    #[must_use]
    pub fn is_landed(&self, slot: usize) -> bool {
        self.inflight
            .get(slot)
            .is_none_or(|t| t.as_ref().is_none_or(Ticket::is_done))
    }

    /// The landed flag of the slot's read (set when it has none).
    #[must_use]
    pub fn flag(&self, slot: usize) -> LandedFlag {
        LandedFlag(self.inflight.get(slot).cloned().flatten())
    }

    /// When the slot's read completed, as the backend saw it (`None` while in
    /// flight or when the slot has none).
    #[must_use]
    pub fn finished_at(&self, slot: usize) -> Option<std::time::Instant> {
        self.inflight
            .get(slot)
            .and_then(Option::as_ref)
            .and_then(Ticket::finished_at)
    }

    /// Send `token` on `tx` when the slot's read completes (at once when none).
    pub fn notify_on_done(&self, slot: usize, tx: Sender<u64>, token: u64) {
        match self.inflight.get(slot).and_then(Option::as_ref) {
            Some(t) => t.notify_on_done(tx, token),
            None => {
                let _ = tx.send(token);
            }
        }
    }

    /// Wait for the slot's read and return its outcome (`Ok` when the slot had
    /// none). Afterwards the slot is idle: its bytes can be viewed or a new
    /// read submitted.
    pub fn collect(&mut self, slot: usize) -> Result<(), IoError> {
        match self.inflight.get_mut(slot).and_then(Option::take) {
            Some(t) => t.wait().map(drop),
            None => Ok(()),
        }
    }

    /// The first `len` bytes of slot `slot`, or `None` when out of range or a
    /// read into it is not yet collected.
    #[must_use]
    pub fn bytes(&self, slot: usize, len: usize) -> Option<&[u8]> {
        if self.check(slot, len).is_err() || self.is_busy(slot) {
            return None;
        }
        // SAFETY: the slot is in range (checked) and has no read in flight:
        // every read into this table's region is started by `submit` (the
        // region is never handed out), which records a ticket that only
        // `collect` clears after the read completed. `submit` needs `&mut
        // self`, so no read can start while the returned borrow lives.
        Some(unsafe { self.region.slice(slot * self.stride, len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AlignedBuf, DirectMode, PosixBackend};

    #[test]
    fn bytes_only_after_collect() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.bin");
        std::fs::write(&path, vec![9u8; 8192]).expect("write");
        let file = StoreFile::open_read(&path, DirectMode::Prefer).expect("open");
        let backend = PosixBackend::new(2).expect("backend");
        let mut t = SlotTable::new(Box::new(AlignedBuf::zeroed(3 * 4096)), 4096, 3).expect("fits");
        assert!(t.bytes(1, 4096).is_some_and(|b| b.iter().all(|&x| x == 0)));
        let flag = t
            .submit(&backend, 1, file.clone(), 4096, 4096)
            .expect("submit");
        assert!(t.bytes(1, 4096).is_none());
        assert!(
            t.submit(&backend, 1, file, 0, 4096).is_err(),
            "one read per slot"
        );
        t.collect(1).expect("read ok");
        assert!(flag.is_landed());
        assert!(t.bytes(1, 4096).is_some_and(|b| b.iter().all(|&x| x == 9)));
        assert!(t.bytes(3, 1).is_none() && t.bytes(0, 4097).is_none());
        assert!(SlotTable::new(Box::new(AlignedBuf::zeroed(4096)), 4096, 2).is_err());
    }
}
