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
use std::sync::Arc;

use flashtier_format::row_shard::RowShardHeader;
use flashtier_io::{DirectMode, IoError, StorageBackend, StoreFile};

use crate::rows::backing::{RamTable, SourceFiles};
use crate::rows::fetch;
use crate::rows::shard::{load_packed, pin_scales, read_header};
use crate::rows::state::{ServePlan, StoreState};
pub use crate::rows::stats::RowStats;
use crate::rows::{InlineBackend, RowError, RowGeometry, RowStoreConfig, TableSource};

/// How many rows ahead a lookup prefetches a cache set's header lines.
const PREFETCH_SET_AHEAD: usize = 8;

/// Exact row retrieval with a cache, an owned range and packed shards. See
/// the [module docs](crate::rows).
pub struct RowStore {
    inner: Arc<StoreState>,
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

impl RowStore {
    /// Open a table source. The owned range starts as the whole table.
    pub fn open(source: TableSource, config: RowStoreConfig) -> Result<Self, RowError> {
        source.validate()?;
        let (ram, mode) = if config.ram_mode {
            (Some(RamTable::lock(&source)?), DirectMode::Off)
        } else {
            (None, config.direct)
        };
        let (rows, geometry) = (source.rows, source.geometry);
        let files = SourceFiles::open(source, mode)?;
        let inner = StoreState::new(rows, geometry, Some(files), ram, &config)?;
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
        let (rows, lo, hi) = (header.rows, header.lo, header.hi);
        let packed = load_packed(backend.as_ref(), file, header, None)?;
        let inner = StoreState::new(rows, geometry, None, None, &config)?;
        *inner.plan_mut() = Arc::new(
            ServePlan::owned(lo, hi, None, None)
                .with_packed(packed, "the store was opened from a packed shard"),
        );
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    pub(crate) fn plan(&self) -> Arc<ServePlan> {
        self.inner.plan()
    }

    /// Rows in the table.
    #[must_use]
    pub fn rows(&self) -> u64 {
        self.inner.rows()
    }

    /// Bytes per row.
    #[must_use]
    pub fn geometry(&self) -> RowGeometry {
        self.inner.geometry()
    }

    /// The owned range `[lo, hi)`.
    #[must_use]
    pub fn range(&self) -> (u64, u64) {
        self.plan().range()
    }

    /// Own rows `[lo, hi)`; pins their scales (unless RAM mode, a packed
    /// shard or `pin_scales: false`). Fixed once scales are pinned or a
    /// shard is attached: setting the same range again is fine, another
    /// range is [`RowError::RangeFixed`].
    pub fn set_range(&self, lo: u64, hi: u64) -> Result<(), RowError> {
        let rows = self.inner.rows();
        if lo > hi || hi > rows {
            return Err(RowError::InvalidRange { lo, hi, rows });
        }
        let mut guard = self.inner.plan_mut();
        let cur = guard.clone();
        if let Some(why) = cur.fixed_by() {
            let (cur_lo, cur_hi) = cur.range();
            if (cur_lo, cur_hi) == (lo, hi) {
                return Ok(());
            }
            return Err(RowError::RangeFixed {
                lo: cur_lo,
                hi: cur_hi,
                new_lo: lo,
                new_hi: hi,
                why,
            });
        }
        let mut plan = ServePlan::owned(lo, hi, None, None);
        if let Some(src) = self.inner.source() {
            if self.inner.pin_scales() && self.inner.ram().is_none() && hi > lo {
                let scales = pin_scales(self.inner.backend(), src, lo, hi)?;
                plan = ServePlan::owned(lo, hi, Some(scales), Some("the owned scales are pinned"));
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
        if self.inner.ram().is_some() {
            return Err(RowError::Config(
                "RAM mode serves the locked table; a packed shard adds nothing".into(),
            ));
        }
        let file = match StoreFile::open_read(path, self.inner.direct()) {
            Ok(f) => f,
            Err(IoError::Open { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                tracing::info!(path = %path.display(), "no packed row shard; misses read the table source");
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        let mut guard = self.inner.plan_mut();
        let cur = guard.clone();
        let (g, (lo, hi)) = (self.inner.geometry(), cur.range());
        let expected = RowShardHeader::new(
            layer,
            lo,
            hi,
            self.inner.rows(),
            g.weight_bytes,
            g.scale_bytes,
        )?;
        let header = read_header(self.inner.backend(), &file)?;
        let packed = load_packed(self.inner.backend(), file, header, Some(&expected))?;
        *guard = Arc::new(cur.with_packed(packed, "a packed shard is attached"));
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
        let (w, s) = (self.inner.geometry().w(), self.inner.geometry().s());
        check_len("weights", ids.len() * w, weights_out.len())?;
        check_len("scales", ids.len() * s, scales_out.len())?;
        self.check_ids(ids)?;
        let plan = self.plan();
        let mut misses = Vec::new();
        let mut hits = 0u64;
        let prefetching = self.inner.ram().is_none();
        let per_id = match self.inner.cache() {
            // The common case, every id owned and a cache in front of the
            // drive: one batched probe, no row-by-row pass.
            Some(cache) if prefetching && ids.iter().all(|&id| plan.owns(id)) => {
                hits = cache.get_many(ids, weights_out, scales_out, &mut misses);
                &[][..]
            }
            _ => ids,
        };
        for (i, &id) in per_id.iter().enumerate() {
            if let (Some(cache), true) = (self.inner.cache(), prefetching) {
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
            } else if let Some(ram) = self.inner.ram() {
                let Some(src) = self.inner.source() else {
                    return Err(RowError::Config("RAM mode without a source".into()));
                };
                ram.copy_row(src, id, wo, so)?;
                hits += 1;
            } else if self.inner.cache().is_some_and(|c| c.get(id, wo, so)) {
                hits += 1;
            } else {
                misses.push(i);
            }
        }
        self.inner.count_hits(hits);
        if misses.is_empty() {
            return Ok(());
        }
        let miss_ids: Vec<u64> = misses.iter().filter_map(|&i| ids.get(i).copied()).collect();
        let (uniq, rows) = fetch::serve(&self.inner, &plan, miss_ids)?;
        let stride = self.inner.geometry().stride();
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
        let Some(cache) = self.inner.cache() else {
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
        let rows = self.inner.rows();
        match ids.iter().position(|&id| id >= rows) {
            Some(index) => Err(RowError::IdOutOfRange {
                id: ids[index],
                index,
                rows,
            }),
            None => Ok(()),
        }
    }

    /// Current counters and geometry.
    #[must_use]
    pub fn stats(&self) -> RowStats {
        self.inner.stats()
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
