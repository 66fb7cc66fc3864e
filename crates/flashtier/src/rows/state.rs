//! The row store's shared state: what the public API (`store`), the miss
//! path (`fetch`) and the one-time loads (`shard`) all read. Every field is
//! private to this module (and to `backing`, which holds the files a store
//! serves from); the others use it through the methods here, so none
//! reaches into another's fields.
//!
//! Invariants:
//! - the [`ServePlan`] (owned range, pinned scales, packed shard) is replaced
//!   whole under the write lock and read as an `Arc` snapshot, so one lookup
//!   sees one plan from start to end;
//! - pinned scales cover exactly the plan's owned range `[lo, hi)`;
//! - the counters only grow (relaxed atomics; a snapshot is not a
//!   consistent cut across them).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockWriteGuard};

use flashtier_io::{DirectMode, StorageBackend};

use crate::rows::backing::{Packed, RamTable, SourceFiles};
use crate::rows::{
    InlineBackend, RowCache, RowError, RowGeometry, RowPool, RowStats, RowStoreConfig,
};

/// The scales of the owned rows `[lo, lo + len / scale_bytes)`, in RAM.
#[derive(Clone)]
pub(crate) struct PinnedScales {
    lo: u64,
    scale_bytes: usize,
    bytes: Vec<u8>,
}

impl PinnedScales {
    /// Scales of rows from `lo` on, `scale_bytes` each.
    pub(crate) fn new(lo: u64, scale_bytes: usize, bytes: Vec<u8>) -> Self {
        Self {
            lo,
            scale_bytes,
            bytes,
        }
    }

    /// Row `id`'s scale, or `None` outside the pinned rows.
    pub(crate) fn row(&self, id: u64) -> Option<&[u8]> {
        let at = usize::try_from(id.checked_sub(self.lo)?)
            .ok()?
            .checked_mul(self.scale_bytes)?;
        self.bytes.get(at..at + self.scale_bytes)
    }

    /// Bytes pinned.
    pub(crate) fn len_bytes(&self) -> u64 {
        self.bytes.len() as u64
    }
}

/// What a lookup serves from; replaced whole by `set_range` / `attach_packed`.
pub(crate) struct ServePlan {
    lo: u64,
    hi: u64,
    scales: Option<PinnedScales>,
    packed: Option<Arc<Packed>>,
    fixed_by: Option<&'static str>,
}

impl ServePlan {
    /// Own `[lo, hi)`; `fixed_by` says why the range may not change, if so.
    pub(crate) fn owned(
        lo: u64,
        hi: u64,
        scales: Option<PinnedScales>,
        fixed_by: Option<&'static str>,
    ) -> Self {
        Self {
            lo,
            hi,
            scales,
            packed: None,
            fixed_by,
        }
    }

    /// This plan with `packed` attached, fixed `because`.
    pub(crate) fn with_packed(&self, packed: Packed, because: &'static str) -> Self {
        Self {
            lo: self.lo,
            hi: self.hi,
            scales: self.scales.clone(),
            packed: Some(Arc::new(packed)),
            fixed_by: Some(because),
        }
    }

    /// Whether row `id` is in the owned range.
    pub(crate) fn owns(&self, id: u64) -> bool {
        id >= self.lo && id < self.hi
    }

    /// The owned range `[lo, hi)`.
    pub(crate) fn range(&self) -> (u64, u64) {
        (self.lo, self.hi)
    }

    /// The pinned scales, if any.
    pub(crate) fn pinned_scales(&self) -> Option<&PinnedScales> {
        self.scales.as_ref()
    }

    /// The attached packed shard, if any.
    pub(crate) fn packed(&self) -> Option<&Arc<Packed>> {
        self.packed.as_ref()
    }

    /// Why the range is fixed, or `None` while it may still change.
    pub(crate) fn fixed_by(&self) -> Option<&'static str> {
        self.fixed_by
    }
}

/// Counts behind [`RowStats`].
#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    reads: AtomicU64,
    deduplicated: AtomicU64,
}

/// Everything a store's lookups, misses and loads share.
pub(crate) struct StoreState {
    rows: u64,
    geometry: RowGeometry,
    source: Option<SourceFiles>,
    cache: Option<RowCache>,
    ram: Option<RamTable>,
    backend: Arc<dyn StorageBackend>,
    pool: Arc<RowPool>,
    plan: RwLock<Arc<ServePlan>>,
    counters: Counters,
    inline_below: usize,
    pin_scales: bool,
    direct: DirectMode,
}

impl StoreState {
    /// The state of a store over `rows` rows of `geometry`, owning all of
    /// them; no cache in RAM mode.
    pub(crate) fn new(
        rows: u64,
        geometry: RowGeometry,
        source: Option<SourceFiles>,
        ram: Option<RamTable>,
        config: &RowStoreConfig,
    ) -> Result<Self, RowError> {
        let cache = if ram.is_some() {
            None
        } else {
            RowCache::new(config.cache_bytes, config.ways, geometry)?
        };
        let pool = match &config.pool {
            Some(p) => p.clone(),
            None => RowPool::shared()?,
        };
        Ok(Self {
            rows,
            geometry,
            source,
            cache,
            ram,
            backend: config
                .backend
                .clone()
                .unwrap_or_else(|| Arc::new(InlineBackend)),
            pool,
            plan: RwLock::new(Arc::new(ServePlan::owned(0, rows, None, None))),
            counters: Counters::default(),
            inline_below: config.inline_below,
            pin_scales: config.pin_scales,
            direct: config.direct,
        })
    }

    /// Rows in the table.
    #[inline]
    pub(crate) fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes per row.
    #[inline]
    pub(crate) fn geometry(&self) -> RowGeometry {
        self.geometry
    }

    /// The table source, unless the store serves a packed shard alone.
    #[inline]
    pub(crate) fn source(&self) -> Option<&SourceFiles> {
        self.source.as_ref()
    }

    /// The row cache (`None` without a budget, or in RAM mode).
    #[inline]
    pub(crate) fn cache(&self) -> Option<&RowCache> {
        self.cache.as_ref()
    }

    /// The locked table in RAM mode.
    #[inline]
    pub(crate) fn ram(&self) -> Option<&RamTable> {
        self.ram.as_ref()
    }

    /// The backend every read goes through.
    pub(crate) fn backend(&self) -> &dyn StorageBackend {
        self.backend.as_ref()
    }

    /// The miss pool.
    pub(crate) fn pool(&self) -> &RowPool {
        &self.pool
    }

    /// Batches with fewer read units are read on the caller alone.
    pub(crate) fn inline_below(&self) -> usize {
        self.inline_below
    }

    /// Whether `set_range` pins the owned scales.
    pub(crate) fn pin_scales(&self) -> bool {
        self.pin_scales
    }

    /// The O_DIRECT policy of row reads.
    pub(crate) fn direct(&self) -> DirectMode {
        self.direct
    }

    /// The current plan.
    #[inline]
    pub(crate) fn plan(&self) -> Arc<ServePlan> {
        self.plan
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The plan, locked for replacement.
    pub(crate) fn plan_mut(&self) -> RwLockWriteGuard<'_, Arc<ServePlan>> {
        self.plan.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Count ids served from the cache or RAM.
    #[inline]
    pub(crate) fn count_hits(&self, n: u64) {
        self.counters.hits.fetch_add(n, Ordering::Relaxed);
    }

    /// Count distinct rows read from storage.
    pub(crate) fn count_misses(&self, n: u64) {
        self.counters.misses.fetch_add(n, Ordering::Relaxed);
    }

    /// Count read operations issued.
    pub(crate) fn count_reads(&self, n: u64) {
        self.counters.reads.fetch_add(n, Ordering::Relaxed);
    }

    /// Count batch positions served by another position's read.
    pub(crate) fn count_deduplicated(&self, n: u64) {
        self.counters.deduplicated.fetch_add(n, Ordering::Relaxed);
    }

    /// Current counters and geometry.
    pub(crate) fn stats(&self) -> RowStats {
        let c = &self.counters;
        let plan = self.plan();
        let cache = self.cache.as_ref();
        RowStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            deduplicated: c.deduplicated.load(Ordering::Relaxed),
            cache_bytes: cache.map_or(0, RowCache::bytes),
            slots: cache.map_or(0, |c| c.slots() as u64),
            sets: cache.map_or(0, |c| c.sets() as u64),
            ways: cache.map_or(0, |c| c.ways() as u64),
            threads: self.pool.threads() as u64,
            packed: plan.packed.is_some(),
            scales_bytes: plan.scales.as_ref().map_or(0, PinnedScales::len_bytes),
            ram_mode: self.ram.is_some(),
            direct: match (&plan.packed, &self.source) {
                (Some(p), _) => p.file().is_direct(),
                (None, Some(s)) => s.weights().is_direct(),
                (None, None) => false,
            },
            lo: plan.lo,
            hi: plan.hi,
            rows: self.rows,
        }
    }
}
