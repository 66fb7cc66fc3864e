//! Handing out ready records: addresses (with their precision) and bytes,
//! only after the read landed and the checksum matched (mapped: in the
//! current epoch of the map, and after checking that the file still covers
//! the record).

use super::{ExpertPool, RecordAddr, Residency};
use crate::experts::ExpertsError;

impl ExpertPool {
    /// The address of a ready record (collecting its read if it has landed).
    pub fn addr(&mut self, r: usize) -> Result<RecordAddr, ExpertsError> {
        self.ensure_ready(r, false)?;
        let e = self.entries[r];
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        let len_bytes = store.payload_bytes();
        let (host_addr, device_addr) = match &self.arena {
            Some(a) => (
                a.slot_host_addr(e.slot as usize),
                a.slot_device_addr(e.slot as usize),
            ),
            None => (Some(self.view(r, e)?.as_ptr() as u64), None),
        };
        let host_addr = host_addr.ok_or(ExpertsError::NotResident { record: r })?;
        Ok(RecordAddr {
            record: r,
            precision: e.precision,
            host_addr,
            device_addr,
            len_bytes,
        })
    }

    /// The payload bytes of a ready record, for CPU consumers and checks.
    pub fn bytes(&mut self, r: usize) -> Result<&[u8], ExpertsError> {
        self.ensure_ready(r, false)?;
        let e = self.entries[r];
        self.view(r, e)
    }

    /// The payload bytes of a record [`Self::bytes`] has already handed out
    /// ready (and verified, when mapped, in the current epoch of its map), by
    /// shared reference, so a consumer can hold several records at once.
    /// A record that is not ready is [`ExpertsError::NotResident`], one
    /// stale since its check [`ExpertsError::NotLanded`]: call
    /// [`Self::bytes`] first.
    pub fn ready_bytes(&self, r: usize) -> Result<&[u8], ExpertsError> {
        self.check_record(r)?;
        let e = self.entries[r];
        if e.residency != Residency::Ready {
            return Err(ExpertsError::NotResident { record: r });
        }
        if self.is_stale(r) {
            return Err(ExpertsError::NotLanded { record: r });
        }
        self.view(r, e)
    }

    /// Wait until `r` is ready (its read landed and verified).
    pub fn wait_ready(&mut self, r: usize) -> Result<(), ExpertsError> {
        self.ensure_ready(r, true)
    }

    fn ensure_ready(&mut self, r: usize, block: bool) -> Result<(), ExpertsError> {
        self.check_record(r)?;
        match self.entries[r].residency {
            Residency::Ready => self.recheck(r),
            Residency::Loading if block || self.is_landed(r) => {
                self.complete(r)?;
                if self.entries[r].residency == Residency::Ready {
                    Ok(())
                } else {
                    Err(ExpertsError::NotResident { record: r })
                }
            }
            Residency::Loading => Err(ExpertsError::NotLanded { record: r }),
            Residency::Absent | Residency::Reserved => Err(ExpertsError::NotResident { record: r }),
        }
    }

    /// Whether `r` is resident and verified.
    #[must_use]
    pub fn is_ready(&self, r: usize) -> bool {
        self.entries
            .get(r)
            .is_some_and(|e| e.residency == Residency::Ready)
    }
}
