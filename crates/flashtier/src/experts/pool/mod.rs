//! `ExpertPool`: the resident set of expert records under a byte budget.
//!
//! Lifecycle of a step (one layer's routed experts, typically):
//! 1. [`ExpertPool::acquire`] checks mapped stores for changes (one fstat
//!    each), pins the step's records (they cannot be evicted until
//!    [`ExpertPool::finish`]), counts hits, makes room for misses by evicting
//!    unpinned records through the policy, and returns the records that are
//!    not ready yet. A step needing more records than the pool holds is
//!    [`ExpertsError::PoolTooSmall`].
//! 2. [`ExpertPool::set_precision`] may pick a low-bit copy for a miss.
//! 3. [`ExpertPool::plan`] decides the reads (mapped: records whose pages are
//!    in the page cache are admitted without one).
//! 4. [`ExpertPool::run`] reads and waits; [`ExpertPool::run_tracked`] starts
//!    the reads and returns one landed flag per record so the step can go on;
//!    [`ExpertPool::wait_ready`] waits for one record.
//! 5. [`ExpertPool::finish`] collects landed reads and unpins the step.
//!
//! Safety of bytes: a record's address or bytes are handed out only in state
//! `Ready`: its read landed and the store's checksum matched over the bytes
//! that are served (the slot; mapped: the record in the map, on every
//! admission, and again before a ready record is reused after its store
//! changed: the `mapped` submodule). A failed read or checksum leaves the record
//! non-resident and returns the error. A slot is never the target of a second
//! read before the first one landed (the slot table refuses it; eviction of a
//! record whose read is in flight waits for it first). A mapped store must
//! not be modified in place while mapped (rename-replacing it is safe);
//! [`flashtier_io::mapped`] lists what that backing checks and the windows
//! it leaves.
//!
//! Bounds: capacity = `budget_bytes / exact stride` records (slots backing:
//! that many arena slots; mapped: that many admitted records). Reads in
//! flight <= capacity; mapped reads hold one stride-sized scratch buffer each
//! until collected. Per-record bookkeeping is O(records of the store).

mod access;
mod audit;
mod config;
mod io;
mod mapped;
mod prefetch;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use flashtier_io::{LandedFlag, StorageBackend, Ticket};

use super::arena::{ArenaMemory, ExpertArena, HostMemory};
use super::policy::EvictionPolicy;
use super::store::StoreSet;
use super::tracking::{ReadSource, ReadTracker};
use super::{ExpertsError, Precision};

pub use config::{Backing, PoolConfig, PoolStats, RecordAddr};
pub use io::ReadPlan;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Residency {
    Absent,
    /// Room taken in this step, no read started.
    Reserved,
    /// A read is in flight.
    Loading,
    /// Landed and verified.
    Ready,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    residency: Residency,
    precision: Precision,
    slot: u32,
    /// Brought in by prefetch and not used since.
    prefetched: bool,
    /// A cancelled prefetch: dropped when its read lands.
    cancelled: bool,
    pinned_step: u64,
    /// Mapped: the map's epoch the record was verified in.
    epoch: u64,
}

const NO_SLOT: u32 = u32::MAX;

pub(crate) struct Inflight {
    started: Instant,
    source: ReadSource,
    /// Mapped backing: the ticket of the scratch read (slots keep theirs in
    /// the slot table).
    ticket: Option<Ticket>,
}

/// The pool; see the module docs.
pub struct ExpertPool {
    stores: StoreSet,
    backend: Arc<dyn StorageBackend>,
    backing: Backing,
    arena: Option<ExpertArena>,
    free_slots: Vec<u32>,
    capacity: usize,
    policy: Box<dyn EvictionPolicy>,
    entries: Vec<Entry>,
    resident: usize,
    step: u64,
    step_open: bool,
    step_records: Vec<usize>,
    /// Records of the open step whose read failed (absent though pinned).
    step_failed: Vec<usize>,
    inflight: HashMap<usize, Inflight>,
    tracker: ReadTracker,
    stats: PoolStats,
}

impl std::fmt::Debug for ExpertPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertPool")
            .field("backing", &self.backing)
            .field("capacity", &self.capacity)
            .field("resident", &self.resident)
            .finish()
    }
}

impl ExpertPool {
    /// A pool over `stores` with host memory for slots.
    pub fn new(
        stores: StoreSet,
        backend: Arc<dyn StorageBackend>,
        config: PoolConfig,
    ) -> Result<Self, ExpertsError> {
        Self::with_memory(stores, backend, config, &HostMemory)
    }

    /// A pool whose slots (slots backing) come from `memory`.
    pub fn with_memory(
        stores: StoreSet,
        backend: Arc<dyn StorageBackend>,
        config: PoolConfig,
        memory: &dyn ArenaMemory,
    ) -> Result<Self, ExpertsError> {
        let stride = stores.full().read_bytes();
        let capacity = usize::try_from(config.budget_bytes / stride as u64).unwrap_or(usize::MAX);
        let records = stores.records();
        let capacity = capacity.min(records.max(1));
        if capacity == 0 {
            return Err(ExpertsError::PoolTooSmall {
                capacity: 0,
                needed: 1,
            });
        }
        if config.backing == Backing::Mapped && stores.full().map.is_none() {
            return Err(ExpertsError::Lifecycle(
                "mapped backing needs a StoreSet opened with mapped = true",
            ));
        }
        let arena = match config.backing {
            Backing::Slots => {
                let slots = u32::try_from(capacity).map_err(|_| ExpertsError::PoolTooSmall {
                    capacity,
                    needed: 0,
                })?;
                let a = ExpertArena::new(1, slots, stride, memory)?;
                a.table().register_with(backend.as_ref())?;
                Some(a)
            }
            Backing::Mapped => None,
        };
        let free_slots = match &arena {
            Some(a) => (0..a.slots() as u32).rev().collect(),
            None => Vec::new(),
        };
        let entry = Entry {
            residency: Residency::Absent,
            precision: Precision::Full,
            slot: NO_SLOT,
            prefetched: false,
            cancelled: false,
            pinned_step: 0,
            epoch: 0,
        };
        let layer_of: Vec<u32> = (0..records).map(|r| stores.layer_of(r)).collect();
        Ok(Self {
            stores,
            backend,
            backing: config.backing,
            arena,
            free_slots,
            capacity,
            policy: config.policy.build(&layer_of, capacity),
            entries: vec![entry; records],
            resident: 0,
            step: 0,
            step_open: false,
            step_records: Vec::new(),
            step_failed: Vec::new(),
            inflight: HashMap::new(),
            tracker: ReadTracker::default(),
            stats: PoolStats {
                capacity_records: capacity,
                ..PoolStats::default()
            },
        })
    }

    /// Capacity in records.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The backing.
    #[must_use]
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The stores.
    #[must_use]
    pub fn stores(&self) -> &StoreSet {
        &self.stores
    }

    /// Record index of `(layer, expert)`.
    pub fn index_of(&self, layer: u32, expert: u32) -> Result<usize, ExpertsError> {
        self.stores.index_of(layer, expert)
    }

    fn check_record(&self, record: usize) -> Result<(), ExpertsError> {
        if record >= self.entries.len() {
            return Err(ExpertsError::RecordOutOfRange {
                record,
                records: self.entries.len(),
            });
        }
        Ok(())
    }

    fn is_pinned(entries: &[Entry], step: u64, open: bool, r: usize) -> bool {
        open && entries.get(r).is_some_and(|e| e.pinned_step == step)
    }

    /// Start a step: pin `records`, count hits, make room for misses. Returns
    /// the records that are not ready yet (to pass to [`ExpertPool::plan`]).
    pub fn acquire(&mut self, records: &[usize]) -> Result<Vec<usize>, ExpertsError> {
        if self.step_open {
            return Err(ExpertsError::Lifecycle(
                "acquire while a step is open (call finish)",
            ));
        }
        let mut distinct: Vec<usize> = Vec::with_capacity(records.len());
        for &r in records {
            self.check_record(r)?;
            if !distinct.contains(&r) {
                distinct.push(r);
            }
        }
        if distinct.len() > self.capacity {
            return Err(ExpertsError::PoolTooSmall {
                capacity: self.capacity,
                needed: distinct.len(),
            });
        }
        self.stores.check_epochs()?;
        self.step += 1;
        self.step_open = true;
        self.step_failed.clear();
        for &r in &distinct {
            self.entries[r].pinned_step = self.step;
        }
        self.policy.on_step(&distinct);
        let mut need = Vec::new();
        for &r in &distinct {
            if let Err(e) = self.admit(r, &mut need) {
                self.abort_step();
                return Err(e);
            }
        }
        self.step_records = distinct;
        Ok(need)
    }

    fn admit(&mut self, r: usize, need: &mut Vec<usize>) -> Result<(), ExpertsError> {
        self.stats.accesses += 1;
        let e = self.entries[r];
        let bytes = self.payload_bytes(r);
        if e.prefetched {
            self.stats.prefetch_used_bytes += self.read_bytes(e.precision) as u64;
            self.entries[r].prefetched = false;
            self.entries[r].cancelled = false;
        }
        let layer = self.stores.layer_of(r);
        match e.residency {
            Residency::Ready => {
                self.recheck(r)?;
                self.stats.hits += 1;
                self.policy.on_hit(r);
                self.tracker
                    .record(layer, e.precision, ReadSource::Hit, bytes, 0);
            }
            Residency::Loading | Residency::Reserved => {
                self.stats.hits += 1;
                self.policy.on_hit(r);
                need.push(r);
            }
            Residency::Absent => {
                self.make_room()?;
                self.insert(r, Precision::Full)?;
                need.push(r);
            }
        }
        Ok(())
    }

    /// Evict one unpinned record when the pool is full.
    fn make_room(&mut self) -> Result<bool, ExpertsError> {
        if self.resident < self.capacity {
            return Ok(true);
        }
        let (entries, step, open) = (&self.entries, self.step, self.step_open);
        let Some(victim) = self
            .policy
            .evict(&|r| Self::is_pinned(entries, step, open, r))
        else {
            return Err(ExpertsError::PoolTooSmall {
                capacity: self.capacity,
                needed: self.capacity + 1,
            });
        };
        // A read still in flight into the victim's slot lands before reuse.
        self.drain(victim);
        self.release(victim);
        Ok(true)
    }

    /// Take room for `r` (policy insert, slot) in state Reserved.
    fn insert(&mut self, r: usize, precision: Precision) -> Result<(), ExpertsError> {
        let slot = match self.backing {
            Backing::Slots => self.free_slots.pop().ok_or(ExpertsError::PoolTooSmall {
                capacity: self.capacity,
                needed: self.capacity + 1,
            })?,
            Backing::Mapped => NO_SLOT,
        };
        let e = &mut self.entries[r];
        e.residency = Residency::Reserved;
        e.precision = precision;
        e.slot = slot;
        e.prefetched = false;
        e.cancelled = false;
        self.resident += 1;
        self.policy.on_insert(r);
        Ok(())
    }

    /// Make `r` absent and give back its slot (the policy has already
    /// forgotten it, or the caller tells it).
    fn release(&mut self, r: usize) {
        let e = &mut self.entries[r];
        if e.residency == Residency::Absent {
            return;
        }
        if e.slot != NO_SLOT {
            self.free_slots.push(e.slot);
        }
        e.residency = Residency::Absent;
        e.slot = NO_SLOT;
        e.prefetched = false;
        e.cancelled = false;
        self.resident -= 1;
    }

    /// Drop a record that failed: forget it in the policy and release it.
    fn fail(&mut self, r: usize) {
        if self.entries[r].residency != Residency::Absent {
            self.policy.on_remove(r);
            self.release(r);
            if Self::is_pinned(&self.entries, self.step, self.step_open, r) {
                self.step_failed.push(r);
            }
        }
    }

    fn abort_step(&mut self) {
        for r in std::mem::take(&mut self.step_records) {
            if self.entries[r].residency == Residency::Reserved {
                self.fail(r);
            }
        }
        self.step_open = false;
    }

    /// Read `r` as `precision` instead of the exact record. Only for a record
    /// this step reserved and has not planned yet.
    pub fn set_precision(&mut self, r: usize, precision: Precision) -> Result<(), ExpertsError> {
        self.check_record(r)?;
        if self.stores.get(precision).is_none() {
            return Err(ExpertsError::NoStore(precision));
        }
        if self.entries[r].residency != Residency::Reserved {
            return Err(ExpertsError::Lifecycle(
                "set_precision only for a record acquired as a miss and not yet planned",
            ));
        }
        self.entries[r].precision = precision;
        Ok(())
    }

    fn payload_bytes(&self, r: usize) -> u64 {
        let p = self.entries.get(r).map_or(Precision::Full, |e| e.precision);
        self.stores.get(p).map_or(0, |s| s.payload_bytes() as u64)
    }

    fn read_bytes(&self, p: Precision) -> usize {
        self.stores
            .get(p)
            .map_or(0, super::store::OpenStore::read_bytes)
    }

    /// End the step: collect reads that have landed (verifying them), drop
    /// records reserved but never read, unpin the step's records. Returns the
    /// first read error among the collected ones.
    pub fn finish(&mut self) -> Result<(), ExpertsError> {
        if !self.step_open {
            return Err(ExpertsError::Lifecycle("finish without an open step"));
        }
        let first_err = self.collect_done().err();
        self.abort_step();
        first_err.map_or(Ok(()), Err)
    }

    /// Counters and per-(layer, precision, source) read rows.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            resident_records: self.resident,
            reads: self.tracker.rows(),
            ..self.stats.clone()
        }
    }

    /// The read tracker (latency quantiles by source).
    #[must_use]
    pub fn tracker(&self) -> &ReadTracker {
        &self.tracker
    }
}

/// A landed flag per record of a tracked run.
pub type LandedFlags = Vec<(usize, LandedFlag)>;
