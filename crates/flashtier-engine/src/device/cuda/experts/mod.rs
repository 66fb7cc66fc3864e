//! [`CudaExperts`]: the GPU's expert tiers, one budget each, one residency
//! decision per step.
//!
//! - **HBM**: a slot arena of `budget_hbm / stride` records
//!   ([`ExpertSlots`]), its own eviction policy (the tier's policies,
//!   layer-aware CLOCK by default); the kernels read records here.
//! - **Pinned RAM**: the expert pool ([`ExpertPool`]) over a pinned host
//!   arena of `budget_ram / stride` records (at least the staging one step
//!   needs): the second chance before the drive, and where every read from
//!   the drive lands, O_DIRECT, checksummed before anything leaves it.
//! - **NVMe**: the packed store.
//!
//! A step (the routed experts of one layer): records in HBM are hits; the
//! others are acquired from the RAM pool (hits there, or reads from the
//! drive started at queue depth), and each one, once landed and verified,
//! is copied into an HBM slot on the copy stream. The compute stream waits
//! for those copies (an event, no host sync) and a slot is overwritten
//! only after the kernels queued before it finished ([`ExpertSlots`]).
//! When the HBM budget holds every record, all are loaded up front and a
//! step needs no host work at all ("resident").
//!
//! Unified memory (device address == host address, an integrated GPU): the
//! kernels read the pinned RAM tier in place and there is no HBM tier
//! ([`ExpertPath::InPlace`]); the pinned slot a kernel reads is reused
//! only after the compute stream passed it.
//!
//! Bounds: HBM slots and RAM records as budgeted; reads in flight at most
//! the RAM pool's capacity; the device table holds `layers x experts`
//! addresses.
//!
//! Files: `open.rs` (budgets into slot and record counts, the pinned pool,
//! the up-front loads), `hbm.rs` (HBM residency and the copies into it),
//! `in_place.rs` (the unified-memory path).

mod hbm;
mod in_place;
mod open;

use std::sync::Arc;

use flashtier::experts::ExpertPool;
use flashtier_cuda::PinnedMemory;
use flashtier_cuda::ops::experts::{ExpertSlots, ExpertSpec};

use crate::device::ExpertTier;
use crate::error::EngineError;
use crate::experts::{ExpertRecordLayout, ExpertStats, PoolTier};
use crate::hint::HintTracker;
use hbm::HbmSlots;

/// Which memory the expert kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertPath {
    /// Records are copied into HBM slots (discrete GPUs).
    Hbm,
    /// The pinned RAM tier is read in place (unified memory).
    InPlace,
}

/// Budgets of the GPU's expert tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierBudgets {
    /// HBM slot arena, bytes (`None`: every record).
    pub hbm_bytes: Option<u64>,
    /// Pinned RAM tier, bytes (raised to the staging one step needs).
    pub ram_bytes: u64,
    /// Force the in-place path even on a discrete GPU (tests of it).
    pub in_place: bool,
}

/// Counters beyond [`ExpertStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierStats {
    /// Uses served from HBM.
    pub hbm_hits: u64,
    /// Uses served from the pinned RAM tier (a host-to-device copy).
    pub ram_hits: u64,
    /// Uses that read the drive.
    pub drive_reads: u64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
}

/// The GPU's expert tiers over one packed store.
pub struct CudaExperts {
    path: ExpertPath,
    ram: ExpertPool,
    pinned: Arc<PinnedMemory>,
    layout: ExpertRecordLayout,
    spec: ExpertSpec,
    slots: ExpertSlots,
    hbm: Option<HbmSlots>,
    experts: usize,
    record_bytes: usize,
    resident_all: bool,
    /// Table entries the last in-place step set.
    in_place_set: Vec<usize>,
    stall_ns: u64,
    uses: u64,
    /// Distinct records per `ensure`, summed ([`ExpertStats::records_used`]).
    records_used: u64,
    tier: TierStats,
    hint: Option<(u32, Vec<u32>)>,
    /// Which ranks of a guess have been worth reading.
    tracker: HintTracker,
}

impl std::fmt::Debug for CudaExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExperts")
            .field("path", &self.path)
            .field("hbm_slots", &self.slots.slots())
            .field("ram_records", &self.ram.capacity())
            .field("resident_all", &self.resident_all)
            .finish()
    }
}

impl CudaExperts {
    /// Which memory the kernels read.
    pub fn path(&self) -> ExpertPath {
        self.path
    }

    /// Whether every record sits in HBM for good.
    pub fn resident_all(&self) -> bool {
        self.resident_all
    }

    /// The kernels' record layout.
    pub fn spec(&self) -> &ExpertSpec {
        &self.spec
    }

    /// The engine's record layout.
    pub fn layout(&self) -> &ExpertRecordLayout {
        &self.layout
    }

    /// The HBM slots and table.
    pub fn slots(&self) -> &ExpertSlots {
        &self.slots
    }

    /// Records one step may hold at once (HBM slots, or the RAM tier on
    /// the in-place path).
    pub fn step_capacity(&self) -> usize {
        match self.path {
            ExpertPath::Hbm => self.slots.slots(),
            ExpertPath::InPlace => self.ram.capacity(),
        }
    }

    /// Per-tier counters.
    pub fn tier_stats(&self) -> TierStats {
        let s = self.ram.stats();
        TierStats {
            drive_reads: s.accesses - s.hits,
            ..self.tier
        }
    }

    /// Routed experts per layer.
    pub fn experts_per_layer(&self) -> usize {
        self.experts
    }

    /// Table entry of (`layer`, `expert`).
    pub fn entry(&self, layer: usize, expert: usize) -> usize {
        layer * self.experts + expert
    }

    /// Offset of RAM record `r` (landed) within the pinned arena.
    fn pinned_offset(&mut self, r: usize) -> Result<usize, EngineError> {
        let addr = self.ram.addr(r)?;
        Ok(
            usize::try_from(addr.host_addr.saturating_sub(self.pinned.host_address()))
                .unwrap_or(usize::MAX),
        )
    }

    /// Make the experts of `layer` that `ids` names (all rows, `top_k` each)
    /// readable by the kernels, and publish the table; returns nothing to
    /// the host but the time waited. Every id is below `experts`.
    pub fn ensure(&mut self, layer: usize, ids: &[u32]) -> Result<(), EngineError> {
        self.uses += ids.len() as u64;
        let mut distinct: Vec<u32> = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        self.records_used += distinct.len() as u64;
        if self.resident_all {
            self.tier.hbm_hits += ids.len() as u64;
            return Ok(());
        }
        self.tracker.served(layer, &distinct);
        if let Some(&bad) = distinct.iter().find(|&&e| e as usize >= self.experts) {
            return Err(EngineError::ExpertOutOfRange {
                layer,
                expert: bad as usize,
            });
        }
        let l =
            u32::try_from(layer).map_err(|_| EngineError::ExpertOutOfRange { layer, expert: 0 })?;
        let records = distinct
            .iter()
            .map(|&e| Ok(self.ram.index_of(l, e)?))
            .collect::<Result<Vec<usize>, EngineError>>()?;
        match self.path {
            ExpertPath::Hbm => self.ensure_hbm(layer, &distinct, &records, ids.len() as u64)?,
            ExpertPath::InPlace => self.ensure_in_place(layer, &distinct, &records)?,
        }
        self.slots.publish()?;
        Ok(())
    }

    /// The hinted next layer's experts start reading into RAM behind this
    /// step's reads.
    fn start_hinted_reads(&mut self) -> Result<(), EngineError> {
        if let Some((layer, experts)) = self.hint.take() {
            let wanted: Vec<u32> = experts
                .into_iter()
                .filter(|&e| {
                    let r = self.ram.index_of(layer, e).ok();
                    let in_hbm = self.hbm.as_ref().zip(r).is_some_and(|(h, r)| h.holds(r));
                    !in_hbm
                })
                .collect();
            self.ram.prefetch(layer, &wanted)?;
        }
        Ok(())
    }

    /// Remember a guess of `layer`'s next experts, strongest first: the
    /// ranks whose guesses have proved right often enough are read behind
    /// the next step's reads ([`HintTracker`]).
    pub fn hint(&mut self, layer: usize, experts: &[u32]) {
        if self.resident_all {
            return;
        }
        let mut ids = self.tracker.guessed(layer, experts);
        ids.sort_unstable();
        ids.dedup();
        self.hint = u32::try_from(layer).ok().map(|l| (l, ids));
    }

    /// Mark the kernels queued so far as the last readers of the slots
    /// (nothing to mark when every expert is resident: no load ever
    /// overwrites a slot, and a decode step's launches stay queued).
    pub fn consumed(&mut self) -> Result<(), EngineError> {
        if self.resident_all {
            return Ok(());
        }
        Ok(self.slots.consumed()?)
    }
}

impl PoolTier for CudaExperts {
    fn pool_mut(&mut self) -> &mut ExpertPool {
        &mut self.ram
    }

    fn add_stall_ns(&mut self, ns: u64) {
        self.stall_ns += ns;
    }
}

impl ExpertTier for CudaExperts {
    fn stats(&self) -> ExpertStats {
        let s = self.ram.stats();
        // A use reads the drive when the RAM pool missed (a read already in
        // flight for a prefetch counts as the pool's hit).
        let misses = s.accesses - s.hits;
        ExpertStats {
            hits: self.uses.saturating_sub(misses),
            misses,
            bytes_read: s.bytes_read,
            prefetch_bytes: s.prefetch_bytes,
            prefetch_used_bytes: s.prefetch_used_bytes,
            stall_ns: self.stall_ns,
            h2d_bytes: self.tier.h2d_bytes,
            records_used: self.records_used,
        }
    }
}
