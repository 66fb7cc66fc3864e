//! Opening the GPU's expert tiers: the budgets turned into slot and record
//! counts, the RAM pool over a pinned arena, and the up-front loads.
//!
//! Bounds: HBM slots `min(budget_hbm / stride, records)` and at least the
//! top-k (else [`ExpertsError::PoolTooSmall`]); RAM records `budget_ram /
//! stride`, raised to the staging one step needs ([`staging_records`]) and
//! at most the store's records. When the HBM slots hold every record they
//! are all loaded here ("resident"); when the RAM tier does, it is warmed.

use std::sync::{Arc, Mutex, PoisonError};

use flashtier::experts::arena::ArenaMemory;
use flashtier::experts::{Backing, ExpertPool, ExpertsError, PoolConfig, StoreSet};
use flashtier_cuda::ops::buffers::WeightType;
use flashtier_cuda::ops::experts::{ExpertSlots, ExpertSpec};
use flashtier_cuda::{Gpu, PinnedMemory};
use flashtier_format::Dtype;
use flashtier_io::{RegionMemory, StorageBackend};

use super::hbm::HbmSlots;
use super::{CudaExperts, ExpertPath, TierBudgets, TierStats};
use crate::error::EngineError;
use crate::experts::ExpertRecordLayout;
use crate::hint::HintTracker;

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

/// The kernels' view of a record layout.
fn expert_spec(layout: &ExpertRecordLayout) -> Result<ExpertSpec, EngineError> {
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

/// HBM slots for `records` records of `stride` bytes under `budget`
/// (`None`: every record); fewer than the `top_k` one step needs is an error.
fn hbm_slot_count(
    budget: Option<u64>,
    stride: usize,
    records: usize,
    top_k: usize,
) -> Result<usize, EngineError> {
    let want = budget.map_or(records as u64, |b| b / stride as u64);
    let slots = want.min(records as u64) as usize;
    if slots < top_k.min(records) {
        return Err(EngineError::Pool(ExpertsError::PoolTooSmall {
            capacity: slots,
            needed: top_k,
        }));
    }
    Ok(slots)
}

/// The RAM pool over `stores` with `budget_bytes` of pinned arena, and
/// that arena.
fn pinned_pool(
    gpu: &Gpu,
    stores: StoreSet,
    backend: Arc<dyn StorageBackend>,
    budget_bytes: u64,
) -> Result<(ExpertPool, Arc<PinnedMemory>), EngineError> {
    let arena = PinnedArena {
        gpu: gpu.clone(),
        mem: Mutex::new(None),
    };
    let config = PoolConfig {
        backing: Backing::Slots,
        budget_bytes,
        ..PoolConfig::default()
    };
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
    Ok((ram, pinned))
}

impl CudaExperts {
    /// Open the tiers over `stores` for a model with `layers x experts`
    /// routed experts and `top_k` per token.
    #[allow(clippy::too_many_arguments, reason = "the tiers' whole configuration")]
    pub fn new(
        gpu: &Gpu,
        stores: StoreSet,
        backend: Arc<dyn StorageBackend>,
        layout: ExpertRecordLayout,
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
            ExpertPath::Hbm => hbm_slot_count(budgets.hbm_bytes, stride, records, top_k)?,
        };
        let ram_records = ((budgets.ram_bytes / stride as u64) as usize)
            .max(staging_records(top_k))
            .min(records.max(1));
        let layer_of: Vec<u32> = (0..records).map(|r| stores.layer_of(r)).collect();
        let (ram, pinned) = pinned_pool(gpu, stores, backend, (ram_records * stride) as u64)?;
        let slots = ExpertSlots::new(gpu, hbm_slots, stride, record_bytes, layers * experts)?;
        let hbm =
            (path == ExpertPath::Hbm).then(|| HbmSlots::new(&ram, experts, &layer_of, hbm_slots));
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
            records_used: 0,
            tier: TierStats::default(),
            hint: None,
            tracker: HintTracker::default(),
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
            let records: Vec<usize> = chunk.iter().map(|&(_, _, r)| r).collect();
            self.slots.wait_loads()?;
            let need = self.ram.acquire(&records)?;
            let plan = self.ram.plan(&need)?;
            self.ram.run(plan)?;
            for &(l, e, r) in chunk {
                self.place(l, e, r)?;
            }
            self.ram.finish()?;
        }
        self.slots.wait_loads()?;
        self.slots.publish()?;
        self.resident_all = true;
        Ok(())
    }
}
