//! The I/O half of the pool: planning, starting, collecting and verifying
//! record reads for both backings.

use std::sync::mpsc;
use std::time::Instant;

use flashtier_io::{AlignedBuf, LandedFlag, Landing, ReadReq};

use super::{Backing, Entry, ExpertPool, Inflight, LandedFlags, Residency};
use crate::experts::ExpertsError;
use crate::experts::tracking::ReadSource;

/// The reads of one step, from [`ExpertPool::plan`].
#[derive(Debug)]
#[must_use = "a plan does nothing until run"]
pub struct ReadPlan {
    step: u64,
    need: Vec<usize>,
    reads: Vec<usize>,
    page_cache: usize,
}

impl ReadPlan {
    /// Records the plan reads from the drive.
    #[must_use]
    pub fn reads(&self) -> &[usize] {
        &self.reads
    }

    /// Records admitted from the page cache without a read (mapped backing).
    #[must_use]
    pub fn page_cache_hits(&self) -> usize {
        self.page_cache
    }
}

impl ExpertPool {
    /// Decide the reads for `need` (from [`ExpertPool::acquire`]). Mapped
    /// backing: records whose pages are all in the page cache (`mincore`) are
    /// verified in place and become ready without a read; the others get a
    /// `madvise(WILLNEED)` at once and a read in `run`, after which their
    /// bytes in the map are verified.
    pub fn plan(&mut self, need: &[usize]) -> Result<ReadPlan, ExpertsError> {
        if !self.step_open {
            return Err(ExpertsError::Lifecycle("plan without an open step"));
        }
        let mut plan = ReadPlan {
            step: self.step,
            need: need.to_vec(),
            reads: Vec::new(),
            page_cache: 0,
        };
        for &r in need {
            self.check_record(r)?;
            if self.entries[r].residency != Residency::Reserved {
                continue;
            }
            if self.backing == Backing::Mapped && self.admit_cached(r)? {
                plan.page_cache += 1;
            } else {
                self.advise_will_need(r)?;
                plan.reads.push(r);
            }
        }
        Ok(plan)
    }

    fn check_plan(&self, plan: &ReadPlan) -> Result<(), ExpertsError> {
        if !self.step_open || plan.step != self.step {
            return Err(ExpertsError::Lifecycle("plan belongs to another step"));
        }
        Ok(())
    }

    /// Run the plan and wait: every record of the step is ready afterwards,
    /// except those whose read failed (non-resident; the first error is
    /// returned after all reads have been collected).
    pub fn run(&mut self, plan: ReadPlan) -> Result<(), ExpertsError> {
        self.check_plan(&plan)?;
        let mut first_err = self.start_reads(&plan.reads).err();
        let waiting = self.loading(&plan.need);
        let rx = self.notify_each(&waiting);
        for _ in 0..waiting.len() {
            let Ok(token) = rx.recv() else { break };
            let landed_at = Instant::now();
            if let Err(e) = self.complete_at(token as usize, landed_at) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Start the plan's reads and return at once with one landed flag per
    /// record of the step (set already for records that need no read). A
    /// record is usable after [`ExpertPool::wait_ready`] (or once its flag is
    /// set, through [`ExpertPool::addr`], which verifies it first).
    pub fn run_tracked(&mut self, plan: ReadPlan) -> Result<LandedFlags, ExpertsError> {
        self.check_plan(&plan)?;
        self.start_reads(&plan.reads)?;
        Ok(plan.need.iter().map(|&r| (r, self.flag(r))).collect())
    }

    fn start_reads(&mut self, reads: &[usize]) -> Result<(), ExpertsError> {
        let mut first_err = None;
        for &r in reads {
            if let Err(e) = self.start_read(r, ReadSource::Disk) {
                self.fail(r);
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Start the read of reserved record `r` (state becomes Loading).
    pub(super) fn start_read(&mut self, r: usize, source: ReadSource) -> Result<(), ExpertsError> {
        self.submit_read(r, source, false).map(|_| ())
    }

    /// Start the read of reserved record `r` as read-ahead, behind every
    /// demand read ([`flashtier_io::StorageBackend::read_ahead`]); `false`
    /// (nothing started, `r` still reserved) when the backend has no room
    /// for it now.
    pub(super) fn start_read_ahead(&mut self, r: usize) -> Result<bool, ExpertsError> {
        self.submit_read(r, ReadSource::Prefetch, true)
    }

    fn submit_read(
        &mut self,
        r: usize,
        source: ReadSource,
        ahead: bool,
    ) -> Result<bool, ExpertsError> {
        let e = self.entries[r];
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        let offset = store.offset(r)?;
        let len = store.read_bytes();
        let key = self.stores.key_name(r);
        let read_err = |source| ExpertsError::Read {
            record: r,
            key,
            source,
        };
        let ticket = match (&mut self.arena, self.backing) {
            (Some(arena), Backing::Slots) => {
                let (file, table) = (store.direct.clone(), arena.table_mut());
                let (backend, slot) = (self.backend.as_ref(), e.slot as usize);
                let started = if ahead {
                    table.submit_ahead(backend, slot, file, offset, len)
                } else {
                    table.submit(backend, slot, file, offset, len).map(Some)
                };
                if started.map_err(read_err)?.is_none() {
                    return Ok(false);
                }
                None
            }
            _ => {
                let req = ReadReq {
                    file: store.buffered.clone(),
                    offset,
                    len,
                    landing: Landing::Host(AlignedBuf::zeroed(len)),
                    tag: r as u64,
                };
                let ticket = if ahead {
                    self.backend.read_ahead(vec![req])
                } else {
                    self.backend.read_async(vec![req]).map(Some)
                };
                match ticket.map_err(read_err)? {
                    Some(t) => Some(t),
                    None => return Ok(false),
                }
            }
        };
        self.inflight.insert(
            r,
            Inflight {
                started: Instant::now(),
                source,
                ticket,
            },
        );
        self.entries[r].residency = Residency::Loading;
        Ok(true)
    }

    fn flag(&self, r: usize) -> LandedFlag {
        let e = self.entries[r];
        if e.residency != Residency::Loading {
            return LandedFlag::landed();
        }
        match (
            &self.arena,
            self.inflight.get(&r).and_then(|i| i.ticket.clone()),
        ) {
            (Some(a), _) => a.table().flag(e.slot as usize),
            (None, Some(t)) => LandedFlag::from(t),
            (None, None) => LandedFlag::landed(),
        }
    }

    fn notify(&self, r: usize, tx: mpsc::Sender<u64>, token: u64) {
        let e = self.entries[r];
        match (
            &self.arena,
            self.inflight.get(&r).and_then(|i| i.ticket.as_ref()),
        ) {
            (Some(a), _) => a.table().notify_on_done(e.slot as usize, tx, token),
            (None, Some(t)) => t.notify_on_done(tx, token),
            (None, None) => {
                let _ = tx.send(token);
            }
        }
    }

    /// Block until at least one of `records` whose read is in flight has
    /// landed (at once when one has, or none is in flight); then
    /// [`Self::collect_landed`] makes it ready. Unlike waiting for one
    /// record, a step serves whichever of its misses the drive finishes
    /// first. Bound: one notification per record in flight.
    pub fn wait_any(&self, records: &[usize]) {
        let loading = self.loading(records);
        if loading.is_empty() || loading.iter().any(|&r| self.is_landed(r)) {
            return;
        }
        let _ = self.notify_each(&loading).recv();
    }

    /// The records of `records` whose read is in flight.
    fn loading(&self, records: &[usize]) -> Vec<usize> {
        records
            .iter()
            .copied()
            .filter(|&r| {
                self.entries
                    .get(r)
                    .is_some_and(|e| e.residency == Residency::Loading)
            })
            .collect()
    }

    /// A channel that receives each record of `records` (as its token) when
    /// its read completes.
    fn notify_each(&self, records: &[usize]) -> mpsc::Receiver<u64> {
        let (tx, rx) = mpsc::channel::<u64>();
        for &r in records {
            self.notify(r, tx.clone(), r as u64);
        }
        rx
    }

    pub(super) fn is_landed(&self, r: usize) -> bool {
        self.flag(r).is_landed()
    }

    /// Wait for `r`'s read and verify it.
    pub(super) fn complete(&mut self, r: usize) -> Result<(), ExpertsError> {
        if !self.is_landed(r) {
            let (tx, rx) = mpsc::channel();
            self.notify(r, tx, 0);
            let _ = rx.recv();
        }
        self.complete_at(r, Instant::now())
    }

    /// Collect `r`'s landed read: verify, then Ready, or fail and report.
    fn complete_at(&mut self, r: usize, landed_at: Instant) -> Result<(), ExpertsError> {
        self.complete_checked(r, landed_at, false)
    }

    /// [`Self::complete_at`]; with `verified` the slot's bytes were already
    /// checked against the store's checksum since the read landed.
    fn complete_checked(
        &mut self,
        r: usize,
        landed_at: Instant,
        verified: bool,
    ) -> Result<(), ExpertsError> {
        let Some(inf) = self.inflight.get(&r) else {
            return Ok(());
        };
        // The backend's completion time where it records one.
        let finished = match (&self.arena, &inf.ticket) {
            (Some(a), _) => a.table().finished_at(self.entries[r].slot as usize),
            (None, Some(t)) => t.finished_at(),
            (None, None) => None,
        };
        let landed_at = finished.unwrap_or(landed_at);
        let Some(inf) = self.inflight.remove(&r) else {
            return Ok(());
        };
        let e = self.entries[r];
        let result = self.collect_and_verify(r, e, inf.ticket, verified);
        if e.cancelled {
            self.fail(r);
            return Ok(());
        }
        match result {
            Ok(epoch) => {
                self.entries[r].residency = Residency::Ready;
                self.entries[r].epoch = epoch;
                let len = self.read_bytes(e.precision) as u64;
                let ns = u64::try_from(landed_at.saturating_duration_since(inf.started).as_nanos())
                    .unwrap_or(u64::MAX);
                let layer = self.stores.layer_of(r);
                self.tracker.record(layer, e.precision, inf.source, len, ns);
                self.stats.bytes_read += len;
                Ok(())
            }
            Err(err) => {
                self.stats.failed_reads += 1;
                self.fail(r);
                Err(err)
            }
        }
    }

    /// Collect `r`'s read and verify the bytes that will be served: the slot
    /// (slots), or the record in the map once the scratch read landed
    /// (mapped; the scratch copy only brought the pages in). Returns the map's
    /// epoch of the check (0 for slots).
    fn collect_and_verify(
        &mut self,
        r: usize,
        e: Entry,
        ticket: Option<flashtier_io::Ticket>,
        verified: bool,
    ) -> Result<u64, ExpertsError> {
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        let key = self.stores.key_name(r);
        let read_err = |source| ExpertsError::Read {
            record: r,
            key,
            source,
        };
        match (&mut self.arena, ticket) {
            (Some(arena), _) => {
                arena
                    .table_mut()
                    .collect(e.slot as usize)
                    .map_err(read_err)?;
                let bytes = arena
                    .table()
                    .bytes(e.slot as usize, store.payload_bytes())
                    .ok_or(ExpertsError::NotResident { record: r })?;
                if !verified {
                    store.verify(r, bytes)?;
                }
                Ok(0)
            }
            (None, Some(t)) => {
                drop(t.wait().map_err(read_err)?);
                self.check_mapped(r)
            }
            (None, None) => Err(ExpertsError::NotResident { record: r }),
        }
    }

    /// Wait for a read into `r` that is being evicted and discard it.
    pub(super) fn drain(&mut self, r: usize) {
        let Some(inf) = self.inflight.remove(&r) else {
            return;
        };
        let slot = self.entries[r].slot as usize;
        match (&mut self.arena, inf.ticket) {
            (Some(a), _) => {
                let _ = a.table_mut().collect(slot);
            }
            (None, Some(t)) => {
                let _ = t.wait();
            }
            (None, None) => {}
        }
    }

    /// Collect every read that has landed, their checksums verified in
    /// parallel (hashing a record is the costly part of collecting it, and
    /// one step lands several); the first error. The mapped backing
    /// collects them one by one.
    pub fn collect_landed(&mut self) -> Result<(), ExpertsError> {
        use rayon::prelude::*;
        let Some(arena) = self.arena.as_mut() else {
            return self.collect_done();
        };
        let mut done: Vec<usize> = self
            .inflight
            .keys()
            .copied()
            .filter(|&r| arena.table().is_landed(self.entries[r].slot as usize))
            .collect();
        done.sort_unstable();
        // Collecting a slot's ticket makes its bytes readable.
        let mut readable = Vec::with_capacity(done.len());
        let mut failed = Vec::new();
        for &r in &done {
            match arena.table_mut().collect(self.entries[r].slot as usize) {
                Ok(()) => readable.push(r),
                Err(source) => failed.push((r, source)),
            }
        }
        let (stores, entries, table) = (&self.stores, &self.entries, arena.table());
        let good: Vec<usize> = readable
            .par_iter()
            .copied()
            .filter(|&r| {
                let e = entries[r];
                stores.get(e.precision).is_some_and(|store| {
                    table
                        .bytes(e.slot as usize, store.payload_bytes())
                        .is_some_and(|b| store.verify(r, b).is_ok())
                })
            })
            .collect();
        let mut first_err = None;
        for (r, source) in failed {
            self.inflight.remove(&r);
            let cancelled = self.entries[r].cancelled;
            self.fail(r);
            if !cancelled {
                self.stats.failed_reads += 1;
                let key = self.stores.key_name(r);
                first_err.get_or_insert(ExpertsError::Read {
                    record: r,
                    key,
                    source,
                });
            }
        }
        let now = Instant::now();
        for r in readable {
            // A record that failed its checksum here is verified again, to
            // report it as `complete_at` does.
            if let Err(e) = self.complete_checked(r, now, good.contains(&r)) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Collect every read that has landed; the first error.
    pub(super) fn collect_done(&mut self) -> Result<(), ExpertsError> {
        let mut done: Vec<usize> = self
            .inflight
            .keys()
            .copied()
            .filter(|&r| self.is_landed(r))
            .collect();
        done.sort_unstable();
        let mut first_err = None;
        for r in done {
            if let Err(e) = self.complete_at(r, Instant::now()) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The payload bytes of ready record `r` (mapped: after checking that the
    /// file still covers them).
    pub(super) fn view(&self, r: usize, e: Entry) -> Result<&[u8], ExpertsError> {
        let store = self
            .stores
            .get(e.precision)
            .ok_or(ExpertsError::NoStore(e.precision))?;
        let len = store.payload_bytes();
        let bytes = match (&self.arena, &store.map) {
            (Some(a), _) => a.table().bytes(e.slot as usize, len),
            (None, Some(m)) => Some(m.bytes_within(store.offset(r)? as usize, len).map_err(
                |source| ExpertsError::Read {
                    record: r,
                    key: self.stores.key_name(r),
                    source,
                },
            )?),
            (None, None) => None,
        };
        bytes.ok_or(ExpertsError::NotResident { record: r })
    }
}
