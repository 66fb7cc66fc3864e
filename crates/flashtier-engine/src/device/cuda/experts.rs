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

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use flashtier::experts::arena::ArenaMemory;
use flashtier::experts::policy::{EvictionPolicy, PolicyKind};
use flashtier::experts::{Backing, ExpertPool, ExpertsError, PoolConfig, StoreSet};
use flashtier_cuda::ops::buffers::WeightType;
use flashtier_cuda::ops::experts::{ExpertSlots, ExpertSpec};
use flashtier_cuda::{Gpu, PinnedMemory};
use flashtier_format::Dtype;
use flashtier_io::{RegionMemory, StorageBackend};

use crate::device::ExpertTier;
use crate::error::EngineError;
use crate::experts::{ExpertStats, RecordLayout};

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

/// Pinned memory for the RAM pool's arena, shared with the copies and
/// kernels that read it.
struct PinnedArena {
    gpu: Gpu,
    mem: Mutex<Option<Arc<PinnedMemory>>>,
}

impl ArenaMemory for PinnedArena {
    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn RegionMemory>, String> {
        let (shared, region) =
            PinnedMemory::shared(&self.gpu, len_bytes).map_err(|e| e.to_string())?;
        *self.mem.lock().unwrap_or_else(PoisonError::into_inner) = Some(shared);
        Ok(region)
    }
}

/// HBM residency: which record each slot holds, and the policy.
struct HbmSlots {
    /// Table entry of each record (layer x experts + expert).
    entry_of: Vec<usize>,
    slot_of: Vec<Option<usize>>,
    record_of: Vec<Option<usize>>,
    free: Vec<usize>,
    policy: Box<dyn EvictionPolicy>,
    pinned: Vec<usize>,
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
    layout: RecordLayout,
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
    tier: TierStats,
    hint: Option<(u32, Vec<u32>)>,
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

/// The kernels' view of a record layout.
fn expert_spec(layout: &RecordLayout) -> Result<ExpertSpec, EngineError> {
    let ty = match (layout.dtype, layout.fp8) {
        (Dtype::Bf16, None) => WeightType::Bf16,
        (Dtype::F16, None) => WeightType::F16,
        (Dtype::F32, None) => WeightType::F32,
        (Dtype::F8E4M3, Some((_, block))) => WeightType::Fp8 { block },
        (other, _) => {
            return Err(EngineError::Layout {
                what: "expert records on the GPU".into(),
                reason: format!("dtype {} is not one the kernels read", other.name()),
            });
        }
    };
    let m = layout.matrices;
    let scales = layout
        .fp8
        .map_or([0; 3], |(s, _)| [s[0].offset, s[1].offset, s[2].offset]);
    Ok(ExpertSpec {
        hidden: layout.hidden,
        inter: layout.intermediate,
        ty,
        matrices: [m[0].offset, m[1].offset, m[2].offset],
        scales,
    })
}

/// Most records of one step: a token's top-k for this layer, for the
/// hinted next layer, and once more for the misses the hint did not
/// predict, so the drive always has the next reads queued.
fn staging_records(top_k: usize) -> usize {
    3 * top_k.max(1)
}

impl CudaExperts {
    /// Open the tiers over `stores` for a model with `layers x experts`
    /// routed experts and `top_k` per token.
    #[allow(clippy::too_many_arguments, reason = "the tiers' whole configuration")]
    pub fn new(
        gpu: &Gpu,
        stores: StoreSet,
        backend: Arc<dyn StorageBackend>,
        layout: RecordLayout,
        layers: usize,
        experts: usize,
        top_k: usize,
        budgets: TierBudgets,
    ) -> Result<Self, EngineError> {
        let spec = expert_spec(&layout)?;
        let stride = stores.full().read_bytes();
        let records = stores.records();
        let record_bytes = stores.full().payload_bytes();
        let path = if budgets.in_place || gpu.info().integrated {
            ExpertPath::InPlace
        } else {
            ExpertPath::Hbm
        };
        let hbm_slots = match path {
            ExpertPath::InPlace => 0,
            ExpertPath::Hbm => {
                let want = budgets
                    .hbm_bytes
                    .map_or(records as u64, |b| b / stride as u64);
                let slots = want.min(records as u64) as usize;
                if slots < top_k.min(records) {
                    return Err(EngineError::Pool(ExpertsError::PoolTooSmall {
                        capacity: slots,
                        needed: top_k,
                    }));
                }
                slots
            }
        };
        let ram_records = match path {
            ExpertPath::InPlace => (budgets.ram_bytes / stride as u64) as usize,
            ExpertPath::Hbm => (budgets.ram_bytes / stride as u64) as usize,
        }
        .max(staging_records(top_k))
        .min(records.max(1));
        let arena = PinnedArena {
            gpu: gpu.clone(),
            mem: Mutex::new(None),
        };
        let config = PoolConfig {
            backing: Backing::Slots,
            budget_bytes: (ram_records * stride) as u64,
            ..PoolConfig::default()
        };
        let layer_of: Vec<u32> = (0..records).map(|r| stores.layer_of(r)).collect();
        let ram = ExpertPool::with_memory(stores, backend, config, &arena)?;
        let pinned = arena
            .mem
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| EngineError::Layout {
                what: "the pinned RAM tier".into(),
                reason: "the pool allocated no pinned arena".into(),
            })?;
        let slots = ExpertSlots::new(gpu, hbm_slots, stride, record_bytes, layers * experts)?;
        let entry_of: Vec<usize> = (0..records)
            .map(|r| {
                let key = ram.stores().full().store.key_of(r as u64);
                key.map_or(usize::MAX, |k| k.layer as usize * experts + k.item as usize)
            })
            .collect();
        let hbm = (path == ExpertPath::Hbm).then(|| HbmSlots {
            entry_of,
            slot_of: vec![None; records],
            record_of: vec![None; hbm_slots],
            free: (0..hbm_slots).rev().collect(),
            policy: PolicyKind::default().build(&layer_of, hbm_slots),
            pinned: Vec::new(),
        });
        let mut tiers = Self {
            path,
            ram,
            pinned,
            layout,
            spec,
            slots,
            hbm,
            experts,
            record_bytes,
            resident_all: false,
            in_place_set: Vec::new(),
            stall_ns: 0,
            uses: 0,
            tier: TierStats::default(),
            hint: None,
        };
        if path == ExpertPath::Hbm && hbm_slots >= records {
            tiers.load_all(layers)?;
        } else if tiers.ram.capacity() >= records {
            // The RAM tier was asked to hold every record: read them now,
            // so decoding starts from RAM, not from the drive.
            tiers.warm_ram(layers)?;
        }
        Ok(tiers)
    }

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
    pub fn layout(&self) -> &RecordLayout {
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

    /// Every (layer, expert, record) of the store.
    fn all_records(&self, layers: usize) -> Vec<(usize, usize, usize)> {
        let mut all = Vec::new();
        for layer in 0..layers {
            for e in 0..self.experts {
                if let Ok(r) = self.ram.index_of(layer as u32, e as u32) {
                    all.push((layer, e, r));
                }
            }
        }
        all
    }

    /// Read every record into the RAM tier (which holds them all).
    fn warm_ram(&mut self, layers: usize) -> Result<(), EngineError> {
        let batch = self.ram.capacity().max(1);
        let records: Vec<usize> = self.all_records(layers).into_iter().map(|t| t.2).collect();
        for chunk in records.chunks(batch) {
            let need = self.ram.acquire(chunk)?;
            let plan = self.ram.plan(&need)?;
            self.ram.run(plan)?;
            self.ram.finish()?;
        }
        Ok(())
    }

    /// Read every record through the RAM tier into its own HBM slot.
    fn load_all(&mut self, layers: usize) -> Result<(), EngineError> {
        let batch = self.ram.capacity().max(1);
        let all = self.all_records(layers);
        for chunk in all.chunks(batch) {
            let (layer_e, records): (Vec<(usize, usize)>, Vec<usize>) =
                chunk.iter().map(|&(l, e, r)| ((l, e), r)).unzip();
            self.slots.wait_loads()?;
            let need = self.ram.acquire(&records)?;
            let plan = self.ram.plan(&need)?;
            self.ram.run(plan)?;
            for (&(l, e), &r) in layer_e.iter().zip(&records) {
                let slot = self.take_slot(r)?;
                self.copy_in(r, slot)?;
                let entry = self.entry(l, e);
                self.slots.point_to_slot(entry, slot)?;
            }
            self.ram.finish()?;
        }
        self.slots.wait_loads()?;
        self.slots.publish()?;
        self.resident_all = true;
        Ok(())
    }

    /// Copy RAM record `r` (landed and verified) into HBM `slot`.
    fn copy_in(&mut self, r: usize, slot: usize) -> Result<(), EngineError> {
        let addr = self.ram.addr(r)?;
        let offset = usize::try_from(addr.host_addr.saturating_sub(self.pinned.host_address()))
            .unwrap_or(usize::MAX);
        self.slots
            .load(slot, &self.pinned, offset, self.record_bytes)?;
        self.tier.h2d_bytes += self.record_bytes as u64;
        Ok(())
    }

    /// A free HBM slot for record `r`, evicting an unpinned record if full.
    fn take_slot(&mut self, r: usize) -> Result<usize, EngineError> {
        let h = self.hbm.as_mut().ok_or_else(|| EngineError::Layout {
            what: "the HBM tier".into(),
            reason: "not in use on this path".into(),
        })?;
        let slot = match h.free.pop() {
            Some(s) => s,
            None => {
                let pinned = &h.pinned;
                let victim = h
                    .policy
                    .evict(&|v| pinned.contains(&v))
                    .ok_or(EngineError::Pool(ExpertsError::PoolTooSmall {
                        capacity: h.record_of.len(),
                        needed: h.pinned.len() + 1,
                    }))?;
                let s = h.slot_of[victim]
                    .take()
                    .ok_or_else(|| EngineError::Layout {
                        what: "the HBM tier".into(),
                        reason: format!("evicted record {victim} held no slot"),
                    })?;
                h.record_of[s] = None;
                let gone = h.entry_of.get(victim).copied().unwrap_or(usize::MAX);
                // The victim's entry must never reach its old slot's new record.
                if gone != usize::MAX {
                    self.slots.clear(gone)?;
                }
                s
            }
        };
        h.slot_of[r] = Some(slot);
        h.record_of[slot] = Some(r);
        h.policy.on_insert(r);
        Ok(slot)
    }

    /// Make the experts of `layer` that `ids` names (all rows, `top_k` each)
    /// readable by the kernels, and publish the table; returns nothing to
    /// the host but the time waited. Every id is below `experts`.
    pub fn ensure(&mut self, layer: usize, ids: &[u32]) -> Result<(), EngineError> {
        self.uses += ids.len() as u64;
        if self.resident_all {
            self.tier.hbm_hits += ids.len() as u64;
            return Ok(());
        }
        let mut distinct: Vec<u32> = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
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

    fn ensure_hbm(
        &mut self,
        layer: usize,
        experts: &[u32],
        records: &[usize],
        uses: u64,
    ) -> Result<(), EngineError> {
        let Some(h) = self.hbm.as_mut() else {
            return Ok(());
        };
        h.pinned.clear();
        h.policy.on_step(records);
        let mut missing = Vec::new();
        for (&e, &r) in experts.iter().zip(records) {
            h.pinned.push(r);
            if h.slot_of[r].is_some() {
                h.policy.on_hit(r);
                self.tier.hbm_hits += 1;
            } else {
                missing.push((e, r));
            }
        }
        // Uses beyond the distinct experts (rows sharing one) are hits too.
        self.tier.hbm_hits += uses.saturating_sub(experts.len() as u64);
        if missing.is_empty() {
            return Ok(());
        }
        // At most the RAM tier's capacity at once: a step may need more
        // records than RAM holds (a prompt chunk under a small RAM budget).
        let batch = self.ram.capacity().max(1);
        for part in missing.chunks(batch) {
            // The pinned bytes earlier copies read may be overwritten now.
            self.slots.wait_loads()?;
            let want: Vec<usize> = part.iter().map(|m| m.1).collect();
            let need = self.ram.acquire(&want)?;
            let result = self.fill_from_ram(layer, part, &need);
            let finished = self.ram.finish();
            result?;
            finished?;
        }
        Ok(())
    }

    /// Copy each missing record into HBM as soon as it is in RAM.
    fn fill_from_ram(
        &mut self,
        layer: usize,
        missing: &[(u32, usize)],
        need: &[usize],
    ) -> Result<(), EngineError> {
        self.tier.ram_hits += (missing.len() - need.len()) as u64;
        let plan = self.ram.plan(need)?;
        self.ram.run_tracked(plan)?;
        self.start_hinted_reads()?;
        let mut pending: Vec<(u32, usize)> = missing.to_vec();
        while !pending.is_empty() {
            // Whatever landed is verified in parallel before it is used.
            self.ram.collect_landed()?;
            let mut progressed = false;
            let mut k = 0;
            while k < pending.len() {
                let (e, r) = pending[k];
                match self.ram.bytes(r) {
                    Ok(_) => {
                        let slot = self.take_slot(r)?;
                        self.copy_in(r, slot)?;
                        let entry = self.entry(layer, e as usize);
                        self.slots.point_to_slot(entry, slot)?;
                        pending.swap_remove(k);
                        progressed = true;
                    }
                    Err(ExpertsError::NotLanded { .. }) => k += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            if !progressed {
                let started = Instant::now();
                self.ram.wait_ready(pending[0].1)?;
                self.stall_ns += started.elapsed().as_nanos() as u64;
            }
        }
        Ok(())
    }

    fn ensure_in_place(
        &mut self,
        layer: usize,
        experts: &[u32],
        records: &[usize],
    ) -> Result<(), EngineError> {
        // Kernels queued earlier may still read pinned slots the pool is
        // about to reuse: wait for them.
        self.slots.consumed()?;
        self.slots.wait_consumed()?;
        for entry in std::mem::take(&mut self.in_place_set) {
            self.slots.clear(entry)?;
        }
        let need = self.ram.acquire(records)?;
        let result = (|| {
            let plan = self.ram.plan(&need)?;
            self.ram.run_tracked(plan)?;
            self.start_hinted_reads()?;
            for (&e, &r) in experts.iter().zip(records) {
                let started = Instant::now();
                self.ram.wait_ready(r)?;
                self.stall_ns += started.elapsed().as_nanos() as u64;
                let addr = self.ram.addr(r)?;
                let offset =
                    usize::try_from(addr.host_addr.saturating_sub(self.pinned.host_address()))
                        .unwrap_or(usize::MAX);
                let entry = self.entry(layer, e as usize);
                self.slots
                    .point_to_pinned(entry, &self.pinned, offset, self.record_bytes)?;
                self.in_place_set.push(entry);
            }
            Ok::<(), EngineError>(())
        })();
        let finished = self.ram.finish();
        result?;
        finished?;
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
                    let in_hbm = self
                        .hbm
                        .as_ref()
                        .zip(r)
                        .is_some_and(|(h, r)| h.slot_of.get(r).is_some_and(Option::is_some));
                    !in_hbm
                })
                .collect();
            self.ram.prefetch(layer, &wanted)?;
        }
        Ok(())
    }

    /// Remember a guess of `layer`'s next experts.
    pub fn hint(&mut self, layer: usize, experts: &[u32]) {
        if self.resident_all {
            return;
        }
        let mut ids = experts.to_vec();
        ids.sort_unstable();
        ids.dedup();
        self.hint = u32::try_from(layer).ok().map(|l| (l, ids));
    }

    /// Mark the kernels queued so far as the last readers of the slots.
    pub fn consumed(&mut self) -> Result<(), EngineError> {
        Ok(self.slots.consumed()?)
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
            stall_ns: self.stall_ns,
            h2d_bytes: self.tier.h2d_bytes,
        }
    }
}
