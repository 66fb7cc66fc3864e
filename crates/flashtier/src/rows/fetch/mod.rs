//! The miss path: deduplicate, group into read units, read through the
//! backend on the pool, verify, fill the cache.
//!
//! A read unit is one read of one aligned window: a 4096-byte block of a
//! packed shard (checked against its xxh3 before any row of it is used), or
//! the aligned window of the source's weight file around one or more rows
//! within the same 4 KiB page. Rows of a unit are served together, so two
//! misses in one block cost one read.
//!
//! Two ways to get queue depth, chosen by the backend:
//! - a backend that reads on the calling thread (`queue_depth() == 1`, the
//!   default [`crate::rows::InlineBackend`]) is driven by the shared
//!   [`crate::rows::RowPool`]: its threads and the caller each claim units;
//! - a backend with its own queue (io_uring, posix workers, the simulator)
//!   gets the whole batch submitted at once (the submit mode, `submit.rs`),
//!   cut into windows of about a quarter of the batch
//!   (16..=[`SUBMIT_WINDOW`](submit::SUBMIT_WINDOW) units), with enough
//!   windows in flight to fill the backend's queue (`queue_depth / window +
//!   1`, at least two), while the caller verifies, cuts out and caches the
//!   rows of each window as it lands and later windows are still reading.
//!   The caller's thread waits once per window, never per read. At most
//!   `queue_depth + 2 * SUBMIT_WINDOW` landing buffers are in flight per
//!   batch, and each thread keeps at most [`MAX_SPARE`](submit::MAX_SPARE)
//!   of them for the next batch, so a steady stream of batches allocates
//!   none.
//!
//! A prefetch can also be split in two ([`start`], then [`Pending::wait`]):
//! `start` submits the first windows (at least
//! [`START_UNITS`](submit::START_UNITS) units, so a decode step's batch goes
//! in whole, or the queue depth plus one window) and returns, so the caller
//! looks up this step's rows while the next step's are reading (in flight
//! per started prefetch: at most `max(START_UNITS, queue_depth +
//! SUBMIT_WINDOW) + SUBMIT_WINDOW` landing buffers); `wait` submits the rest
//! and finishes every window as above. With the pool instead of a queued
//! backend, `start` does all the reads.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

use flashtier_io::{AlignedBuf, Landing, ReadReq, StoreFile};

use crate::rows::RowError;
use crate::rows::pool::PoolTask;
use crate::rows::state::{ServePlan, StoreState};
use crate::verify::read_extent;

mod submit;

use submit::Submitting;

struct ReadUnit {
    file: Arc<StoreFile>,
    offset: u64,
    len: usize,
    /// Packed block index (checksum-verified), or `None` for a source window.
    block: Option<u64>,
    /// First row of this unit in the sorted distinct ids.
    first: usize,
    count: usize,
}

/// A unit's rows, or why it failed; `None` until a thread has run it.
type UnitResult = Mutex<Option<Result<Vec<u8>, RowError>>>;

struct MissTask {
    inner: Arc<StoreState>,
    plan: Arc<ServePlan>,
    ids: Vec<u64>,
    units: Vec<ReadUnit>,
    /// One slot per unit, filled by whichever thread ran it.
    results: Vec<UnitResult>,
}

thread_local! {
    /// One reusable landing buffer per thread: bounded at the largest unit.
    static LANDING: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Read the distinct rows among `ids` (all owned and in range). Returns the
/// sorted distinct ids and their rows (`stride` bytes each, weight then
/// scale), inserted into the cache on the way.
pub(crate) fn serve(
    inner: &Arc<StoreState>,
    plan: &Arc<ServePlan>,
    ids: Vec<u64>,
) -> Result<(Vec<u64>, Vec<u8>), RowError> {
    let task = Arc::new(MissTask::new(inner, plan, ids)?);
    task.run_all();
    let rows = task.collect()?;
    Ok((task.ids.clone(), rows))
}

fn plan_units(
    inner: &StoreState,
    plan: &ServePlan,
    ids: &[u64],
) -> Result<Vec<ReadUnit>, RowError> {
    let mut units: Vec<ReadUnit> = Vec::new();
    if let Some(p) = plan.packed() {
        for (i, &id) in ids.iter().enumerate() {
            let Some(loc) = p.locate(id) else {
                return Err(RowError::Config(format!(
                    "row {id} is not in the packed shard's range"
                )));
            };
            match units.last_mut() {
                Some(u) if u.block == Some(loc.block) => u.count += 1,
                _ => units.push(ReadUnit {
                    file: p.file().clone(),
                    offset: loc.block_offset,
                    len: 4096,
                    block: Some(loc.block),
                    first: i,
                    count: 1,
                }),
            }
        }
        return Ok(units);
    }
    let Some(src) = inner.source() else {
        return Err(RowError::Config(
            "no packed shard and no source to read".into(),
        ));
    };
    let w = u64::from(inner.geometry().weight_bytes);
    let align = src.weights().offset_align() as u64;
    for (i, &id) in ids.iter().enumerate() {
        let start = src.weight_offset(id);
        let base = start / align * align;
        let end = (start + w).div_ceil(align) * align;
        if let Some(u) = units.last_mut() {
            // Rows whose windows share one 4 KiB page share one read.
            let same_page = (end - 1) / 4096 == u.offset / 4096 && u.offset + u.len as u64 >= base;
            if u.block.is_none() && same_page {
                let cur_end = u.offset + u.len as u64;
                u.len = (cur_end.max(end) - u.offset) as usize;
                u.count += 1;
                continue;
            }
        }
        units.push(ReadUnit {
            file: src.weights().clone(),
            offset: base,
            len: (end - base) as usize,
            block: None,
            first: i,
            count: 1,
        });
    }
    // A window that runs past the end of the file cannot be read directly:
    // read exactly its rows from the buffered handle instead.
    for u in &mut units {
        if u.offset + u.len as u64 > src.weights_len() {
            let first = ids.get(u.first).copied().unwrap_or(0);
            let last = ids.get(u.first + u.count - 1).copied().unwrap_or(0);
            let start = src.weight_offset(first);
            u.file = src.weights_buffered().clone();
            u.offset = start;
            u.len = ((last - first + 1) * w) as usize;
        }
    }
    Ok(units)
}

impl PoolTask for MissTask {
    fn run(&self, unit: usize) {
        let (Some(u), Some(slot)) = (self.units.get(unit), self.results.get(unit)) else {
            return;
        };
        let result = self.read_unit(u);
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
    }
}

impl MissTask {
    /// Sort and deduplicate `ids` and plan their read units.
    fn new(
        inner: &Arc<StoreState>,
        plan: &Arc<ServePlan>,
        mut ids: Vec<u64>,
    ) -> Result<Self, RowError> {
        let asked = ids.len();
        ids.sort_unstable();
        ids.dedup();
        inner.count_deduplicated((asked - ids.len()) as u64);
        let units = plan_units(inner, plan, &ids)?;
        Ok(Self {
            inner: inner.clone(),
            plan: plan.clone(),
            ids,
            results: (0..units.len()).map(|_| Mutex::new(None)).collect(),
            units,
        })
    }

    /// Read every unit: on the caller alone for a tiny batch, submitted in
    /// windows to a backend with its own queue, or on the pool.
    fn run_all(self: &Arc<Self>) {
        let n = self.units.len();
        if n < self.inner.inline_below().max(1) {
            for u in 0..n {
                self.run(u);
            }
        } else if self.inner.backend().queue_depth() > 1 {
            self.submit_all();
        } else {
            self.inner.pool().run(self.clone(), n);
        }
    }

    /// The rows of every unit in id order (`stride` bytes each), or the
    /// first unit's failure; counts the distinct rows as misses.
    fn collect(&self) -> Result<Vec<u8>, RowError> {
        let mut rows = Vec::with_capacity(self.ids.len() * self.inner.geometry().stride());
        self.each_result(|bytes| rows.extend_from_slice(&bytes))?;
        Ok(rows)
    }

    /// Hand every unit's rows to `f` in id order, or return the first
    /// unit's failure; counts the distinct rows as misses.
    fn each_result(&self, mut f: impl FnMut(Vec<u8>)) -> Result<(), RowError> {
        for (unit, result) in self.units.iter().zip(&self.results) {
            match result.lock().unwrap_or_else(PoisonError::into_inner).take() {
                Some(Ok(bytes)) => f(bytes),
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(RowError::WorkerLost {
                        path: unit.file.path().to_path_buf(),
                        offset: unit.offset,
                    });
                }
            }
        }
        self.inner.count_misses(self.ids.len() as u64);
        Ok(())
    }

    fn read_unit(&self, u: &ReadUnit) -> Result<Vec<u8>, RowError> {
        let buf = LANDING
            .with(|l| l.borrow_mut().take())
            .filter(|b| b.capacity() >= u.len);
        let buf = buf.unwrap_or_else(|| AlignedBuf::zeroed(u.len.max(4096)));
        let req = ReadReq {
            file: u.file.clone(),
            offset: u.offset,
            len: u.len,
            landing: Landing::Host(buf),
            tag: u.offset,
        };
        let landed = self.inner.backend().read(vec![req])?;
        self.inner.count_reads(1);
        let Some(buf) = landed.into_iter().next().and_then(|l| l.buf) else {
            return Err(RowError::WorkerLost {
                path: u.file.path().to_path_buf(),
                offset: u.offset,
            });
        };
        let out = self.finish_unit(u, &buf);
        LANDING.with(|l| *l.borrow_mut() = Some(buf));
        out
    }

    /// Verify and cut out a landed unit's rows, and cache them.
    fn finish_unit(&self, u: &ReadUnit, buf: &AlignedBuf) -> Result<Vec<u8>, RowError> {
        let out = self.rows_from(u, buf)?;
        if let Some(cache) = self.inner.cache() {
            let stride = self.inner.geometry().stride();
            for (k, row) in out.chunks_exact(stride).enumerate() {
                if let Some(&id) = self.ids.get(u.first + k) {
                    cache.insert(id, row);
                }
            }
        }
        Ok(out)
    }

    /// The submit mode (see the module docs): windows of units through
    /// `read_async`, enough of them in flight to fill the backend's queue,
    /// each finished on the caller as it lands while later windows are
    /// still reading.
    fn submit_all(&self) {
        Submitting::new(self).run_to_end(self);
    }

    fn record(&self, unit: usize, result: Result<Vec<u8>, RowError>) {
        if let Some(slot) = self.results.get(unit) {
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
        }
    }

    /// Cut the unit's rows out of its landed window (`buf`).
    fn rows_from(&self, u: &ReadUnit, buf: &AlignedBuf) -> Result<Vec<u8>, RowError> {
        let g = self.inner.geometry();
        let (w, stride) = (g.w(), g.stride());
        let window = buf.get(..u.len).unwrap_or(&[]);
        let ids = self.ids.get(u.first..u.first + u.count).unwrap_or(&[]);
        let mut out = vec![0u8; ids.len() * stride];
        if let (Some(block), Some(p)) = (u.block, self.plan.packed()) {
            p.verify_block(block, window)?;
            for (row, &id) in out.chunks_exact_mut(stride).zip(ids) {
                let at = p.locate(id).map_or(usize::MAX, |l| l.in_block);
                let src = window
                    .get(at..at.saturating_add(stride))
                    .ok_or_else(|| short(u, id))?;
                row.copy_from_slice(src);
            }
            return Ok(out);
        }
        let src = self
            .inner
            .source()
            .ok_or_else(|| RowError::Config("no source".into()))?;
        let s = g.s();
        for (row, &id) in out.chunks_exact_mut(stride).zip(ids) {
            let at = (src.weight_offset(id) - u.offset) as usize;
            let bytes = window.get(at..at + w).ok_or_else(|| short(u, id))?;
            row[..w].copy_from_slice(bytes);
            let scale = &mut row[w..];
            match self.plan.pinned_scales() {
                Some(pinned) => {
                    scale.copy_from_slice(pinned.row(id).ok_or_else(|| short(u, id))?);
                }
                None if s > 0 => {
                    let off = src.scale_offset(id);
                    let b = read_extent(self.inner.backend(), src.scales(), off, s)?;
                    self.inner.count_reads(1);
                    scale.copy_from_slice(b.get(..s).ok_or_else(|| short(u, id))?);
                }
                None => {}
            }
        }
        Ok(out)
    }
}

/// Misses whose reads were started by [`start`] and are finished by
/// [`Pending::wait`]: the non-blocking half of a prefetch.
pub(crate) struct Pending {
    task: Arc<MissTask>,
    /// `None` when the backend has no queue of its own and the reads were
    /// already done by `start`.
    submitting: Option<Submitting>,
}

/// Start reading the distinct rows among `ids` (all owned and in range)
/// without waiting for them. With a backend that has its own queue the
/// first windows (at least [`START_UNITS`](submit::START_UNITS) units, or
/// the queue depth plus one window) are submitted and this returns at once;
/// otherwise the reads run here on the pool, as [`serve`] does. Either way [`Pending::wait`] finishes the rest and caches
/// the rows.
pub(crate) fn start(
    inner: &Arc<StoreState>,
    plan: &Arc<ServePlan>,
    ids: Vec<u64>,
) -> Result<Pending, RowError> {
    let task = Arc::new(MissTask::new(inner, plan, ids)?);
    let n = task.units.len();
    if inner.backend().queue_depth() > 1 && n > 0 {
        let st = Submitting::started(&task);
        return Ok(Pending {
            task,
            submitting: Some(st),
        });
    }
    task.run_all();
    Ok(Pending {
        task,
        submitting: None,
    })
}

impl Pending {
    /// Wait for the started reads, verify and cache their rows, and read
    /// whatever was not started yet. The first failure is returned.
    pub(crate) fn wait(self) -> Result<(), RowError> {
        let Self { task, submitting } = self;
        if let Some(st) = submitting {
            st.run_to_end(&task);
        }
        // The rows are in the cache already; only failures matter here.
        task.each_result(drop)
    }
}

fn short(u: &ReadUnit, id: u64) -> RowError {
    RowError::Source {
        path: u.file.path().to_path_buf(),
        what: format!(
            "row {id} is outside the {}-byte window read at offset {}",
            u.len, u.offset
        ),
    }
}
