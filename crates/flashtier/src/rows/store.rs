//! [`RowStore`]: the owned range, the cache, RAM mode, packed shards, stats.
//!
//! Bounds: the cache stays within `cache_bytes`; a batch's misses are read
//! by at most `pool.threads()` threads, one read each in flight, into one
//! reusable 4 KiB-aligned buffer per thread; pinned scales hold
//! `(hi - lo) * scale_bytes` bytes; RAM mode maps exactly the source file(s).
//!
//! Call order: `open` (or `open_packed`), then `set_range` (pins the owned
//! scales; the range is fixed from then on), then optionally
//! `attach_packed`, then `lookup` / `prefetch` from any number of threads.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, RwLock};

use flashtier_format::row_shard::RowShardHeader;
use flashtier_io::{DirectMode, IoError, LockedMap, StorageBackend, StoreFile};

use crate::rows::fetch;
use crate::rows::shard::{load_packed, pin_scales, read_header};
use crate::rows::stats::Counters;
pub use crate::rows::stats::RowStats;
use crate::rows::{InlineBackend, RowCache, RowError, RowGeometry, RowPool, TableSource};

/// How many rows ahead a lookup prefetches a cache set's header lines.
const PREFETCH_SET_AHEAD: usize = 8;

/// How a [`RowStore`] is built.
#[derive(Clone)]
pub struct RowStoreConfig {
    /// Cache budget in bytes (0 = no cache).
    pub cache_bytes: u64,
    /// Cache ways per set, 1..=16.
    pub ways: usize,
    /// O_DIRECT policy for row reads (buffered fallback is announced once).
    pub direct: DirectMode,
    /// Map and lock the whole source table in RAM instead of reading it.
    pub ram_mode: bool,
    /// Pin the owned scales in RAM at `set_range`, so a source miss is one read.
    pub pin_scales: bool,
    /// Miss pool (`None` = the process-wide [`RowPool::shared`]).
    pub pool: Option<Arc<RowPool>>,
    /// Backend the reads go through. `None` = [`InlineBackend`], driven by
    /// the pool; a backend with its own queue (`queue_depth() > 1`: io_uring,
    /// posix, the simulator) gets each batch's reads submitted in windows
    /// instead (see `fetch`).
    pub backend: Option<Arc<dyn StorageBackend>>,
    /// Batches with fewer read units than this are read on the caller alone.
    pub inline_below: usize,
}

impl Default for RowStoreConfig {
    fn default() -> Self {
        Self {
            cache_bytes: 64 << 20,
            ways: 4,
            direct: DirectMode::Prefer,
            ram_mode: false,
            pin_scales: true,
            pool: None,
            backend: None,
            inline_below: 8,
        }
    }
}

impl std::fmt::Debug for RowStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowStoreConfig")
            .field("cache_bytes", &self.cache_bytes)
            .field("ways", &self.ways)
            .field("direct", &self.direct)
            .field("ram_mode", &self.ram_mode)
            .field("pin_scales", &self.pin_scales)
            .field("backend", &self.backend.as_ref().map(|b| b.name()))
            .field("inline_below", &self.inline_below)
            .finish()
    }
}

pub(crate) struct SourceFiles {
    pub table: TableSource,
    /// Weights under the store's O_DIRECT policy.
    pub weights: Arc<StoreFile>,
    /// Weights buffered, for the unaligned tail of the file.
    pub weights_buffered: Arc<StoreFile>,
    pub weights_len: u64,
    /// Scales, buffered (pinned once, or read per miss without pinning).
    pub scales: Arc<StoreFile>,
}

pub(crate) struct RamTable {
    pub weights: LockedMap,
    pub scales: Option<LockedMap>,
}

pub(crate) struct Packed {
    pub file: Arc<StoreFile>,
    pub header: RowShardHeader,
    pub checksums: Vec<u64>,
}

/// What a lookup serves from; replaced whole by `set_range` / `attach_packed`.
pub(crate) struct ServePlan {
    pub lo: u64,
    pub hi: u64,
    pub scales: Option<Vec<u8>>,
    pub packed: Option<Arc<Packed>>,
    pub fixed_by: Option<&'static str>,
}

impl ServePlan {
    pub fn owns(&self, id: u64) -> bool {
        id >= self.lo && id < self.hi
    }
}

pub(crate) struct Inner {
    pub rows: u64,
    pub geometry: RowGeometry,
    pub source: Option<SourceFiles>,
    pub cache: Option<RowCache>,
    pub ram: Option<RamTable>,
    pub backend: Arc<dyn StorageBackend>,
    pub pool: Arc<RowPool>,
    pub plan: RwLock<Arc<ServePlan>>,
    pub counters: Counters,
    pub inline_below: usize,
    pub pin_scales: bool,
    pub direct: DirectMode,
}

/// Exact row retrieval with a cache, an owned range and packed shards. See
/// the [module docs](crate::rows).
pub struct RowStore {
    inner: Arc<Inner>,
}

/// A prefetch in flight, from [`RowStore::prefetch_start`].
#[must_use = "a prefetch caches nothing until it is waited on"]
pub struct RowPrefetch {
    pending: Option<fetch::Pending>,
}

impl RowPrefetch {
    /// Finish the prefetch: wait for its reads, verify them and cache the
    /// rows. Returns the first failure (the rows of failed reads are not
    /// cached, and a later lookup reads them again).
    pub fn wait(self) -> Result<(), RowError> {
        self.pending.map_or(Ok(()), fetch::Pending::wait)
    }
}

impl std::fmt::Debug for RowPrefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowPrefetch")
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl std::fmt::Debug for RowStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowStore")
            .field("stats", &self.stats())
            .finish()
    }
}

fn open_inner(
    rows: u64,
    geometry: RowGeometry,
    source: Option<SourceFiles>,
    ram: Option<RamTable>,
    config: &RowStoreConfig,
) -> Result<Inner, RowError> {
    let cache = if ram.is_some() {
        None
    } else {
        RowCache::new(config.cache_bytes, config.ways, geometry)?
    };
    let pool = match &config.pool {
        Some(p) => p.clone(),
        None => RowPool::shared()?,
    };
    Ok(Inner {
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
        plan: RwLock::new(Arc::new(ServePlan {
            lo: 0,
            hi: rows,
            scales: None,
            packed: None,
            fixed_by: None,
        })),
        counters: Counters::default(),
        inline_below: config.inline_below,
        pin_scales: config.pin_scales,
        direct: config.direct,
    })
}

impl RowStore {
    /// Open a table source. The owned range starts as the whole table.
    pub fn open(source: TableSource, config: RowStoreConfig) -> Result<Self, RowError> {
        source.validate()?;
        let ram = if config.ram_mode {
            let weights = LockedMap::open(&source.weights.path)?;
            let scales = if source.scales.path == source.weights.path {
                None
            } else {
                Some(LockedMap::open(&source.scales.path)?)
            };
            Some(RamTable { weights, scales })
        } else {
            None
        };
        let mode = if config.ram_mode {
            DirectMode::Off
        } else {
            config.direct
        };
        let weights = StoreFile::open_read(&source.weights.path, mode)?;
        let weights_len = weights.len_bytes()?;
        let files = SourceFiles {
            weights_buffered: StoreFile::open_read(&source.weights.path, DirectMode::Off)?,
            scales: StoreFile::open_read(&source.scales.path, DirectMode::Off)?,
            weights,
            weights_len,
            table: source,
        };
        let inner = open_inner(
            files.table.rows,
            files.table.geometry,
            Some(files),
            ram,
            &config,
        )?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Open a packed shard alone (no source to fall back to): the table size,
    /// geometry and owned range come from its header, and the range is fixed.
    pub fn open_packed(path: &Path, config: RowStoreConfig) -> Result<Self, RowError> {
        if config.ram_mode {
            return Err(RowError::Config(
                "RAM mode maps a table source; open the source instead of the shard".into(),
            ));
        }
        let file = StoreFile::open_read(path, config.direct)?;
        let backend: Arc<dyn StorageBackend> = config
            .backend
            .clone()
            .unwrap_or_else(|| Arc::new(InlineBackend));
        let header = read_header(backend.as_ref(), &file)?;
        let geometry = RowGeometry {
            weight_bytes: header.row_weight_bytes,
            scale_bytes: header.scale_bytes,
        };
        let packed = load_packed(backend.as_ref(), file, header, None)?;
        let inner = open_inner(packed.header.rows, geometry, None, None, &config)?;
        *inner.plan.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(ServePlan {
            lo: packed.header.lo,
            hi: packed.header.hi,
            scales: None,
            packed: Some(Arc::new(packed)),
            fixed_by: Some("the store was opened from a packed shard"),
        });
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    pub(crate) fn plan(&self) -> Arc<ServePlan> {
        self.inner
            .plan
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Rows in the table.
    #[must_use]
    pub fn rows(&self) -> u64 {
        self.inner.rows
    }

    /// Bytes per row.
    #[must_use]
    pub fn geometry(&self) -> RowGeometry {
        self.inner.geometry
    }

    /// The owned range `[lo, hi)`.
    #[must_use]
    pub fn range(&self) -> (u64, u64) {
        let p = self.plan();
        (p.lo, p.hi)
    }

    /// Own rows `[lo, hi)`; pins their scales (unless RAM mode, a packed
    /// shard or `pin_scales: false`). Fixed once scales are pinned or a
    /// shard is attached: setting the same range again is fine, another
    /// range is [`RowError::RangeFixed`].
    pub fn set_range(&self, lo: u64, hi: u64) -> Result<(), RowError> {
        if lo > hi || hi > self.inner.rows {
            return Err(RowError::InvalidRange {
                lo,
                hi,
                rows: self.inner.rows,
            });
        }
        let mut guard = self
            .inner
            .plan
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let cur = guard.clone();
        if let Some(why) = cur.fixed_by {
            if (cur.lo, cur.hi) == (lo, hi) {
                return Ok(());
            }
            return Err(RowError::RangeFixed {
                lo: cur.lo,
                hi: cur.hi,
                new_lo: lo,
                new_hi: hi,
                why,
            });
        }
        let mut plan = ServePlan {
            lo,
            hi,
            scales: None,
            packed: None,
            fixed_by: None,
        };
        if let Some(src) = &self.inner.source {
            if self.inner.pin_scales && self.inner.ram.is_none() && hi > lo {
                plan.scales = Some(pin_scales(self.inner.backend.as_ref(), src, lo, hi)?);
                plan.fixed_by = Some("the owned scales are pinned");
            }
        }
        *guard = Arc::new(plan);
        Ok(())
    }

    /// Attach this rank's packed shard for `layer`. A missing file is fine:
    /// `Ok(false)`, and misses keep reading the source. A shard that is
    /// present but packed for another layer, range, table or geometry, or is
    /// truncated or corrupt, is an error and is never served.
    pub fn attach_packed(&self, path: &Path, layer: u64) -> Result<bool, RowError> {
        if self.inner.ram.is_some() {
            return Err(RowError::Config(
                "RAM mode serves the locked table; a packed shard adds nothing".into(),
            ));
        }
        let file = match StoreFile::open_read(path, self.inner.direct) {
            Ok(f) => f,
            Err(IoError::Open { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                tracing::info!(path = %path.display(), "no packed row shard; misses read the table source");
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        let mut guard = self
            .inner
            .plan
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let cur = guard.clone();
        let g = self.inner.geometry;
        let expected = RowShardHeader::new(
            layer,
            cur.lo,
            cur.hi,
            self.inner.rows,
            g.weight_bytes,
            g.scale_bytes,
        )?;
        let header = read_header(self.inner.backend.as_ref(), &file)?;
        let packed = load_packed(self.inner.backend.as_ref(), file, header, Some(&expected))?;
        *guard = Arc::new(ServePlan {
            lo: cur.lo,
            hi: cur.hi,
            scales: cur.scales.clone(),
            packed: Some(Arc::new(packed)),
            fixed_by: Some("a packed shard is attached"),
        });
        Ok(true)
    }

    /// Fill `weights_out[i]` / `scales_out[i]` with row `ids[i]`: exact bytes
    /// for owned rows, zeros for rows another rank owns. An id outside the
    /// table fails the whole batch before anything is written. A repeated
    /// id is read once.
    pub fn lookup(
        &self,
        ids: &[u64],
        weights_out: &mut [u8],
        scales_out: &mut [u8],
    ) -> Result<(), RowError> {
        let (w, s) = (self.inner.geometry.w(), self.inner.geometry.s());
        check_len("weights", ids.len() * w, weights_out.len())?;
        check_len("scales", ids.len() * s, scales_out.len())?;
        self.check_ids(ids)?;
        let plan = self.plan();
        let mut misses = Vec::new();
        let mut hits = 0u64;
        let prefetching = self.inner.ram.is_none();
        let per_id = match &self.inner.cache {
            // The common case, every id owned and a cache in front of the
            // drive: one batched probe, no row-by-row pass.
            Some(cache) if prefetching && ids.iter().all(|&id| plan.owns(id)) => {
                hits = cache.get_many(ids, weights_out, scales_out, &mut misses);
                &[][..]
            }
            _ => ids,
        };
        for (i, &id) in per_id.iter().enumerate() {
            if let (Some(cache), true) = (&self.inner.cache, prefetching) {
                // Hide the probes' memory latency behind earlier rows' copies.
                if let Some(&ahead) = ids.get(i + PREFETCH_SET_AHEAD) {
                    cache.prefetch_set(ahead);
                }
            }
            let (Some(wo), Some(so)) = (
                weights_out.get_mut(i * w..(i + 1) * w),
                scales_out.get_mut(i * s..(i + 1) * s),
            ) else {
                continue;
            };
            if !plan.owns(id) {
                wo.fill(0);
                so.fill(0);
            } else if let Some(ram) = &self.inner.ram {
                self.copy_from_ram(ram, id, wo, so)?;
                hits += 1;
            } else if self.inner.cache.as_ref().is_some_and(|c| c.get(id, wo, so)) {
                hits += 1;
            } else {
                misses.push(i);
            }
        }
        self.inner.counters.hits.fetch_add(hits, Ordering::Relaxed);
        if misses.is_empty() {
            return Ok(());
        }
        let miss_ids: Vec<u64> = misses.iter().filter_map(|&i| ids.get(i).copied()).collect();
        let (uniq, rows) = fetch::serve(&self.inner, &plan, miss_ids)?;
        let stride = self.inner.geometry.stride();
        for &i in &misses {
            let Some(&id) = ids.get(i) else { continue };
            let Ok(u) = uniq.binary_search(&id) else {
                continue;
            };
            let Some(row) = rows.get(u * stride..(u + 1) * stride) else {
                continue;
            };
            if let (Some(wo), Some(so)) = (
                weights_out.get_mut(i * w..(i + 1) * w),
                scales_out.get_mut(i * s..(i + 1) * s),
            ) {
                wo.copy_from_slice(&row[..w]);
                so.copy_from_slice(&row[w..]);
            }
        }
        Ok(())
    }

    /// Warm the cache with the owned rows among `ids` that it lacks (the
    /// next step's rows, known one step ahead). Returns when they are cached.
    /// A no-op without a cache or in RAM mode.
    pub fn prefetch(&self, ids: &[u64]) -> Result<(), RowError> {
        self.prefetch_start(ids)?.wait()
    }

    /// Start warming the cache with the owned rows among `ids` that it
    /// lacks, and return without waiting for the drive: the non-blocking
    /// [`Self::prefetch`], for a caller that looks up this step's rows while
    /// the next step's are still reading, so the drive's queue never drains
    /// between steps.
    ///
    /// With a backend that has its own queue (io_uring, posix, the
    /// simulator) the reads are submitted here (up to 512 read units, or
    /// the backend's queue depth plus one window, whichever is more); [`RowPrefetch::wait`] submits the rest, then
    /// verifies and caches every row. With the inline backend (the pool's
    /// threads read) the reads run here and `wait` only reports.
    ///
    /// Dropping the handle without waiting abandons the prefetch: the reads
    /// already submitted complete into buffers the backend owns and are
    /// freed, and no row of them is cached.
    pub fn prefetch_start(&self, ids: &[u64]) -> Result<RowPrefetch, RowError> {
        self.check_ids(ids)?;
        let Some(cache) = &self.inner.cache else {
            return Ok(RowPrefetch { pending: None });
        };
        let plan = self.plan();
        let want: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|&id| plan.owns(id) && !cache.contains(id))
            .collect();
        if want.is_empty() {
            return Ok(RowPrefetch { pending: None });
        }
        Ok(RowPrefetch {
            pending: Some(fetch::start(&self.inner, &plan, want)?),
        })
    }

    fn check_ids(&self, ids: &[u64]) -> Result<(), RowError> {
        let rows = self.inner.rows;
        match ids.iter().position(|&id| id >= rows) {
            Some(index) => Err(RowError::IdOutOfRange {
                id: ids[index],
                index,
                rows,
            }),
            None => Ok(()),
        }
    }

    fn copy_from_ram(
        &self,
        ram: &RamTable,
        id: u64,
        wo: &mut [u8],
        so: &mut [u8],
    ) -> Result<(), RowError> {
        let Some(src) = &self.inner.source else {
            return Err(RowError::Config("RAM mode without a source".into()));
        };
        let g = self.inner.geometry;
        let at = |base: u64, n: usize| -> Option<std::ops::Range<usize>> {
            let start = usize::try_from(base + id * n as u64).ok()?;
            Some(start..start + n)
        };
        let sbytes = ram.scales.as_ref().unwrap_or(&ram.weights).bytes();
        let w = at(src.table.weights.offset, g.w()).and_then(|r| ram.weights.bytes().get(r));
        let s = at(src.table.scales.offset, g.s()).and_then(|r| sbytes.get(r));
        match (w, s) {
            (Some(w), Some(s)) => {
                wo.copy_from_slice(w);
                so.copy_from_slice(s);
                Ok(())
            }
            _ => Err(RowError::Source {
                path: src.table.weights.path.clone(),
                what: format!(
                    "row {id} lies outside the locked mapping (file changed after open?)"
                ),
            }),
        }
    }

    /// Current counters and geometry.
    #[must_use]
    pub fn stats(&self) -> RowStats {
        let c = &self.inner.counters;
        let plan = self.plan();
        let cache = self.inner.cache.as_ref();
        RowStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            deduplicated: c.deduplicated.load(Ordering::Relaxed),
            cache_bytes: cache.map_or(0, RowCache::bytes),
            slots: cache.map_or(0, |c| c.slots() as u64),
            sets: cache.map_or(0, |c| c.sets() as u64),
            ways: cache.map_or(0, |c| c.ways() as u64),
            threads: self.inner.pool.threads() as u64,
            packed: plan.packed.is_some(),
            scales_bytes: plan.scales.as_ref().map_or(0, |s| s.len() as u64),
            ram_mode: self.inner.ram.is_some(),
            direct: match (&plan.packed, &self.inner.source) {
                (Some(p), _) => p.file.is_direct(),
                (None, Some(s)) => s.weights.is_direct(),
                (None, None) => false,
            },
            lo: plan.lo,
            hi: plan.hi,
            rows: self.inner.rows,
        }
    }
}

fn check_len(what: &'static str, expected_bytes: usize, got_bytes: usize) -> Result<(), RowError> {
    if expected_bytes != got_bytes {
        return Err(RowError::BufferSize {
            what,
            expected_bytes,
            got_bytes,
        });
    }
    Ok(())
}
