//! The mapped backing's admission. A record enters the pool from the mapping
//! only after the file was checked (fstat) to still cover it and the record's
//! checksum matched over the bytes in the map itself, the bytes the pool
//! serves, not a copy of them. That holds for every admission: a page-cache
//! hit (`mincore`), a cold record once its `pread` into scratch landed (that
//! read is the first touch of its pages, so a drive error is a typed error),
//! and a record re-entering after eviction. A mismatch is the same
//! [`ExpertsError::Checksum`] as the slots backing's and the record is not
//! admitted.
//!
//! A ready record verified in an older epoch of its map (the file's length or
//! times changed since, or it was written less than [`flashtier_io::mapped::SETTLE`]
//! ago; the epoch is checked once per step in `acquire`) is verified again
//! before it is served again, as a hit of a step or through `addr`/`bytes`.
//! The windows a mapping leaves open are listed in [`flashtier_io::mapped`].
//!
//! Cost: one fstat and one xxh3 pass over the payload per admission (and per
//! re-check), on bytes that are in memory by then.

use std::time::Instant;

use super::{Backing, ExpertPool, Residency};
use crate::experts::ExpertsError;
use crate::experts::tracking::ReadSource;

impl ExpertPool {
    /// Mapped: admit `r` from the page cache when all its pages are there,
    /// verified in place. `Ok(false)`: it needs a read.
    pub(super) fn admit_cached(&mut self, r: usize) -> Result<bool, ExpertsError> {
        let started = Instant::now();
        let e = self.entries[r];
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        let Some(map) = &store.map else {
            return Ok(false);
        };
        let len = store.payload_bytes();
        if !map.is_resident(store.offset(r)? as usize, len)? {
            return Ok(false);
        }
        self.verify_mapped(r)?;
        self.entries[r].residency = Residency::Ready;
        let layer = self.stores.layer_of(r);
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.tracker
            .record(layer, e.precision, ReadSource::PageCache, len as u64, ns);
        Ok(true)
    }

    /// Mapped: check that the file still covers `r` and that its bytes in the
    /// map match its checksum. Returns the map's epoch they were checked in.
    pub(super) fn check_mapped(&self, r: usize) -> Result<u64, ExpertsError> {
        let e = self.entries[r];
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        let map = store
            .map
            .as_ref()
            .ok_or(ExpertsError::NotResident { record: r })?;
        let offset = store.offset(r)? as usize;
        let bytes = map
            .bytes_within(offset, store.payload_bytes())
            .map_err(|source| ExpertsError::Read {
                record: r,
                key: self.stores.key_name(r),
                source,
            })?;
        store.verify(r, bytes)?;
        Ok(map.epoch())
    }

    /// Mapped: [`ExpertPool::check_mapped`], stamping `r` with the epoch; on
    /// failure `r` is dropped (not resident) and the error returned.
    fn verify_mapped(&mut self, r: usize) -> Result<(), ExpertsError> {
        match self.check_mapped(r) {
            Ok(epoch) => {
                self.entries[r].epoch = epoch;
                Ok(())
            }
            Err(err) => {
                self.stats.failed_reads += 1;
                self.fail(r);
                Err(err)
            }
        }
    }

    /// Whether ready record `r` was verified in an older epoch of its map.
    pub(super) fn is_stale(&self, r: usize) -> bool {
        let e = self.entries[r];
        self.backing == Backing::Mapped
            && e.residency == Residency::Ready
            && self
                .stores
                .get(e.precision)
                .and_then(|s| s.map.as_ref())
                .is_some_and(|m| m.epoch() != e.epoch)
    }

    /// A ready record about to be served: verify it again when stale (it is
    /// dropped and the error returned when it no longer matches).
    pub(super) fn recheck(&mut self, r: usize) -> Result<(), ExpertsError> {
        if !self.is_stale(r) {
            return Ok(());
        }
        self.stats.rechecked_hits += 1;
        self.verify_mapped(r)
    }

    /// Mapped: ask the kernel to start reading a cold record's pages
    /// (`madvise(WILLNEED)`) as soon as it is planned; the read that `run`
    /// issues then finds them in flight or cached.
    pub(super) fn advise_will_need(&self, r: usize) -> Result<(), ExpertsError> {
        let e = self.entries[r];
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        if let Some(map) = &store.map {
            map.will_need(store.offset(r)? as usize, store.read_bytes())?;
        }
        Ok(())
    }
}
