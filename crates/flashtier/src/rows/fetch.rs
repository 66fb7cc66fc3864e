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
//!   gets the whole batch submitted at once, cut into windows of about a
//!   quarter of the batch (16..=[`SUBMIT_WINDOW`] units), with enough windows
//!   in flight to fill the backend's queue (`queue_depth / window + 1`, at
//!   least two), while the caller verifies, cuts out and caches the rows of
//!   each window as it lands and later windows are still reading. The
//!   caller's thread waits once per window, never per read. At most
//!   `queue_depth + 2 * SUBMIT_WINDOW` landing buffers are in flight per
//!   batch, and each thread keeps at most [`MAX_SPARE`] of them for the next
//!   batch, so a steady stream of batches allocates none.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use flashtier_io::{AlignedBuf, Landing, ReadReq, StoreFile};

use crate::rows::RowError;
use crate::rows::pool::PoolTask;
use crate::rows::shard::read_bytes;
use crate::rows::store::{Inner, ServePlan};

/// Units per submission in the submit mode.
pub const SUBMIT_WINDOW: usize = 256;

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
    inner: Arc<Inner>,
    plan: Arc<ServePlan>,
    ids: Vec<u64>,
    units: Vec<ReadUnit>,
    /// One slot per unit, filled by whichever thread ran it.
    results: Vec<UnitResult>,
}

/// Most landing buffers the submit mode keeps per thread between batches.
pub const MAX_SPARE: usize = 2 * SUBMIT_WINDOW;

thread_local! {
    /// One reusable landing buffer per thread: bounded at the largest unit.
    static LANDING: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
    /// The submit mode's reusable landing buffers (at most [`MAX_SPARE`]).
    static SPARE: RefCell<Vec<AlignedBuf>> = const { RefCell::new(Vec::new()) };
}

/// Units per window for a batch of `units`: about a quarter of the batch
/// (so the caller verifies and copies the first windows while the rest are
/// still reading), at least 16, at most [`SUBMIT_WINDOW`].
fn submit_window(units: usize) -> usize {
    units.div_ceil(4).clamp(16, SUBMIT_WINDOW)
}

/// Read the distinct rows among `ids` (all owned and in range). Returns the
/// sorted distinct ids and their rows (`stride` bytes each, weight then
/// scale), inserted into the cache on the way.
pub(crate) fn serve(
    inner: &Arc<Inner>,
    plan: &Arc<ServePlan>,
    mut ids: Vec<u64>,
) -> Result<(Vec<u64>, Vec<u8>), RowError> {
    let asked = ids.len();
    ids.sort_unstable();
    ids.dedup();
    inner
        .counters
        .deduplicated
        .fetch_add((asked - ids.len()) as u64, Ordering::Relaxed);
    let units = plan_units(inner, plan, &ids)?;
    let n = units.len();
    let task = Arc::new(MissTask {
        inner: inner.clone(),
        plan: plan.clone(),
        ids,
        results: (0..n).map(|_| Mutex::new(None)).collect(),
        units,
    });
    if n < inner.inline_below.max(1) {
        for u in 0..n {
            task.run(u);
        }
    } else if inner.backend.queue_depth() > 1 {
        task.submit_all();
    } else {
        inner.pool.run(task.clone(), n);
    }
    let stride = inner.geometry.stride();
    let mut rows = Vec::with_capacity(task.ids.len() * stride);
    for (unit, result) in task.units.iter().zip(&task.results) {
        match result.lock().unwrap_or_else(PoisonError::into_inner).take() {
            Some(Ok(bytes)) => rows.extend_from_slice(&bytes),
            Some(Err(e)) => return Err(e),
            None => {
                return Err(RowError::WorkerLost {
                    path: unit.file.path().to_path_buf(),
                    offset: unit.offset,
                });
            }
        }
    }
    inner
        .counters
        .misses
        .fetch_add(task.ids.len() as u64, Ordering::Relaxed);
    Ok((task.ids.clone(), rows))
}

fn plan_units(inner: &Inner, plan: &ServePlan, ids: &[u64]) -> Result<Vec<ReadUnit>, RowError> {
    let mut units: Vec<ReadUnit> = Vec::new();
    if let Some(p) = &plan.packed {
        for (i, &id) in ids.iter().enumerate() {
            let Some(loc) = p.header.locate(id) else {
                return Err(RowError::Config(format!(
                    "row {id} is not in the packed shard's range"
                )));
            };
            match units.last_mut() {
                Some(u) if u.block == Some(loc.block) => u.count += 1,
                _ => units.push(ReadUnit {
                    file: p.file.clone(),
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
    let Some(src) = &inner.source else {
        return Err(RowError::Config(
            "no packed shard and no source to read".into(),
        ));
    };
    let w = u64::from(inner.geometry.weight_bytes);
    let align = src.weights.offset_align() as u64;
    for (i, &id) in ids.iter().enumerate() {
        let start = src.table.weights.offset + id * w;
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
            file: src.weights.clone(),
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
        if u.offset + u.len as u64 > src.weights_len {
            let first = ids.get(u.first).copied().unwrap_or(0);
            let last = ids.get(u.first + u.count - 1).copied().unwrap_or(0);
            let start = src.table.weights.offset + first * w;
            u.file = src.weights_buffered.clone();
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
        let landed = self.inner.backend.read(vec![req])?;
        self.inner.counters.reads.fetch_add(1, Ordering::Relaxed);
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
        if let Some(cache) = &self.inner.cache {
            let stride = self.inner.geometry.stride();
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
        let n = self.units.len();
        let window = submit_window(n);
        let max_windows = self.inner.backend.queue_depth().div_ceil(window) + 1;
        let mut spare = SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
        let mut in_flight: VecDeque<(usize, usize, flashtier_io::Ticket)> = VecDeque::new();
        let mut next = 0;
        while next < n || !in_flight.is_empty() {
            while next < n && in_flight.len() < max_windows.max(2) {
                let end = (next + window).min(n);
                let reqs = (next..end)
                    .filter_map(|i| self.units.get(i).map(|u| (i, u)))
                    .map(|(i, u)| {
                        let buf = spare
                            .pop()
                            .filter(|b| b.capacity() >= u.len)
                            .unwrap_or_else(|| AlignedBuf::zeroed(u.len.max(4096)));
                        ReadReq {
                            file: u.file.clone(),
                            offset: u.offset,
                            len: u.len,
                            landing: Landing::Host(buf),
                            tag: i as u64,
                        }
                    });
                match self.inner.backend.read_async(reqs.collect()) {
                    Ok(ticket) => in_flight.push_back((next, end, ticket)),
                    Err(e) => self.record(next, Err(e.into())),
                }
                next = end;
            }
            let Some((start, end, ticket)) = in_flight.pop_front() else {
                break;
            };
            match ticket.wait() {
                Ok(landed) => {
                    self.inner
                        .counters
                        .reads
                        .fetch_add((end - start) as u64, Ordering::Relaxed);
                    for l in landed {
                        let i = l.tag as usize;
                        let (Some(u), Some(buf)) = (self.units.get(i), l.buf) else {
                            continue;
                        };
                        self.record(i, self.finish_unit(u, &buf));
                        if spare.len() < MAX_SPARE {
                            spare.push(buf);
                        }
                    }
                }
                // The ticket reports its first failure; charge it to the
                // window's first unit so the batch fails with it.
                Err(e) => self.record(start, Err(e.into())),
            }
        }
        SPARE.with(|s| *s.borrow_mut() = spare);
    }

    fn record(&self, unit: usize, result: Result<Vec<u8>, RowError>) {
        if let Some(slot) = self.results.get(unit) {
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
        }
    }

    /// Cut the unit's rows out of its landed window (`buf`).
    fn rows_from(&self, u: &ReadUnit, buf: &AlignedBuf) -> Result<Vec<u8>, RowError> {
        let g = self.inner.geometry;
        let (w, stride) = (g.w(), g.stride());
        let window = buf.get(..u.len).unwrap_or(&[]);
        let ids = self.ids.get(u.first..u.first + u.count).unwrap_or(&[]);
        let mut out = vec![0u8; ids.len() * stride];
        if let (Some(block), Some(p)) = (u.block, &self.plan.packed) {
            let stored = p.checksums.get(block as usize).copied().unwrap_or(0);
            p.header
                .verify_block(u.file.path(), block, window, stored)?;
            for (row, &id) in out.chunks_exact_mut(stride).zip(ids) {
                let at = p.header.locate(id).map_or(usize::MAX, |l| l.in_block);
                let src = window
                    .get(at..at.saturating_add(stride))
                    .ok_or_else(|| short(u, id))?;
                row.copy_from_slice(src);
            }
            return Ok(out);
        }
        let src = self
            .inner
            .source
            .as_ref()
            .ok_or_else(|| RowError::Config("no source".into()))?;
        let s = g.s();
        for (row, &id) in out.chunks_exact_mut(stride).zip(ids) {
            let at = (src.table.weights.offset + id * w as u64 - u.offset) as usize;
            let bytes = window.get(at..at + w).ok_or_else(|| short(u, id))?;
            row[..w].copy_from_slice(bytes);
            let scale = &mut row[w..];
            match &self.plan.scales {
                Some(pinned) => {
                    let at = ((id - self.plan.lo) as usize) * s;
                    scale.copy_from_slice(pinned.get(at..at + s).ok_or_else(|| short(u, id))?);
                }
                None if s > 0 => {
                    let off = src.table.scales.offset + id * s as u64;
                    let b = read_bytes(self.inner.backend.as_ref(), &src.scales, off, s)?;
                    self.inner.counters.reads.fetch_add(1, Ordering::Relaxed);
                    scale.copy_from_slice(b.get(..s).ok_or_else(|| short(u, id))?);
                }
                None => {}
            }
        }
        Ok(out)
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
