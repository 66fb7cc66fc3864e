//! The `StorageBackend` seam: what to read, where it lands, and how the caller
//! learns it landed.
//!
//! A [`ReadReq`] names a file, an extent and a [`Landing`]. `read` returns
//! when every landing holds its bytes; `read_async` returns a [`Ticket`] at
//! once that the caller waits on or polls. Host buffers travel with the
//! request and come back in the [`Landed`] result (foyer's ownership shape,
//! which is what io_uring needs); region and device landings stay with their
//! owner and are reached by offset.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use crate::activity::DriveActivity;
use crate::buf::AlignedBuf;
use crate::done::DoneQueue;
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::LandingRegion;

/// Where a device-destined read is staged and how it reaches the device.
/// `flashtier-cuda` implements it with pinned staging and a copy stream.
pub trait DeviceSink: Send + Sync {
    /// Reserve `len` bytes of staging memory (pinned, page-aligned) for one
    /// read; may block until staging is free. Returns the region and offset.
    fn stage(&self, len: usize) -> Result<(Arc<LandingRegion>, usize), String>;
    /// The staged bytes at `offset..offset+len` hold the read; move them to
    /// device address `dst` (for example, enqueue a host-to-device copy).
    /// Runs on the backend's completion thread: it must not block on, or
    /// submit to, the same backend.
    fn commit(&self, offset: usize, len: usize, dst: u64) -> Result<(), String>;
    /// Make every committed copy visible (synchronise the copy stream).
    fn flush(&self) -> Result<(), String>;
    /// The read into `offset..offset+len` of a staged slot failed and will
    /// never be committed: give the slot back. The default does nothing.
    fn abort(&self, offset: usize, len: usize) {
        let _ = (offset, len);
    }
}

/// Where the bytes of one read land.
pub enum Landing {
    /// An owned host buffer of at least `len` bytes, returned in [`Landed`].
    Host(AlignedBuf),
    /// A slice of a landing region owned by a tier.
    Region {
        /// The region.
        region: Arc<LandingRegion>,
        /// Byte offset in the region.
        offset: usize,
    },
    /// Device memory, reached through a sink's staging.
    Device {
        /// The sink.
        sink: Arc<dyn DeviceSink>,
        /// Device address of the destination.
        dst: u64,
    },
}

impl std::fmt::Debug for Landing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Host(b) => write!(f, "Host({} bytes)", b.capacity()),
            Self::Region { region, offset } => write!(f, "Region({} @ {offset})", region.id()),
            Self::Device { dst, .. } => write!(f, "Device({dst:#x})"),
        }
    }
}

/// One read request.
#[derive(Debug)]
pub struct ReadReq {
    /// File to read.
    pub file: Arc<StoreFile>,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: usize,
    /// Where the bytes land.
    pub landing: Landing,
    /// Caller's tag, echoed in the result (record index, row id, block...).
    pub tag: u64,
}

/// A completed read.
#[derive(Debug)]
pub struct Landed {
    /// The request's tag.
    pub tag: u64,
    /// Bytes read.
    pub len: usize,
    /// The host buffer for [`Landing::Host`] requests.
    pub buf: Option<AlignedBuf>,
}

/// The storage seam every tier reads through.
pub trait StorageBackend: Send + Sync {
    /// Short name (`posix`, `uring`, `sim`).
    fn name(&self) -> &'static str;

    /// Queue depth this backend keeps in flight.
    fn queue_depth(&self) -> usize;

    /// Start all `reqs`; returns at once. Landed results come back in request
    /// order from [`Ticket::wait`]. A failed request fails the ticket with the
    /// error of the first failure (by request order).
    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError>;

    /// Queue `reqs` (one ticket) as read-ahead: behind every demand read
    /// ([`Self::read_async`]) that is queued or comes later, and never
    /// blocking: `Ok(None)`, nothing queued, when the backend has no room
    /// for all of them now. Backends without a read-ahead lane submit them
    /// as demand reads (the default).
    fn read_ahead(&self, reqs: Vec<ReadReq>) -> Result<Option<Ticket>, IoError> {
        self.read_async(reqs).map(Some)
    }

    /// Read all `reqs`, returning when every landing holds its bytes.
    fn read(&self, reqs: Vec<ReadReq>) -> Result<Vec<Landed>, IoError> {
        self.read_async(reqs)?.wait()
    }

    /// Write all of `src` at `offset` (blocking).
    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError>;

    /// Totals of this backend's reads so far, for backends that meter them
    /// (the thread-pool ones: posix, sim); `None` otherwise. Take two and
    /// [`DriveActivity::since`] for a window's.
    fn activity(&self) -> Option<DriveActivity> {
        None
    }

    /// Pre-register memory that reads will land in (io_uring fixed buffers).
    /// A no-op for backends that gain nothing from it.
    fn register_landing_region(&self, region: &Arc<LandingRegion>) -> Result<(), IoError> {
        let _ = region;
        Ok(())
    }

    /// For backends whose completions are reaped on the waiting caller's
    /// thread ([`crate::UringLocal`]): reap completions, sleeping in the
    /// kernel until at least one read has completed when any is in flight,
    /// and return `true`. Backends that complete reads on their own threads
    /// return `false` at once; callers then wait on tickets or a
    /// [`DoneQueue`].
    fn reap_on_caller(&self) -> bool {
        false
    }
}

/// Drives a ring from the thread that waits on one of its tickets (backends
/// that reap on the caller's thread).
pub trait Drive: Send + Sync {
    /// Reap completions unless `done()` already holds, sleeping in the kernel
    /// for at least one completion when reads are in flight. Never spins: it
    /// returns without sleeping only when it made progress or nothing is in
    /// flight.
    fn drive(&self, done: &dyn Fn() -> bool);
}

/// Validate a request's landing and return the raw destination pointer for
/// host and region landings (`None` for device landings, which stage first).
pub fn landing_ptr(req: &mut ReadReq) -> Result<Option<*mut u8>, IoError> {
    let bad = |what: String| IoError::Landing {
        path: req.file.path().to_path_buf(),
        offset: req.offset,
        len: req.len,
        what,
    };
    match &mut req.landing {
        Landing::Host(buf) => {
            if buf.capacity() < req.len {
                return Err(bad(format!("host buffer holds {} bytes", buf.capacity())));
            }
            Ok(Some(buf.as_mut_ptr()))
        }
        Landing::Region { region, offset } => {
            region.ptr_at(*offset, req.len).map(Some).ok_or_else(|| {
                bad(format!(
                    "region of {} bytes at {offset}",
                    region.len_bytes()
                ))
            })
        }
        Landing::Device { .. } => Ok(None),
    }
}

/// Perform one request with blocking positional reads (posix workers, sim,
/// and the staging half of device landings). Resubmits short reads until the
/// request is exact.
pub fn read_blocking(req: ReadReq) -> Result<Landed, IoError> {
    read_blocking_with(req, |file, dst, offset| file.read_exact_at(dst, offset))
}

/// [`read_blocking`] with the exact positional read supplied by the caller
/// (the simulator injects faults there). `read_exact` must fill all of `dst`
/// from `offset` or fail naming the request.
pub fn read_blocking_with<F>(mut req: ReadReq, read_exact: F) -> Result<Landed, IoError>
where
    F: Fn(&StoreFile, &mut [u8], u64) -> Result<(), IoError>,
{
    let len = req.len;
    let dst = landing_ptr(&mut req)?;
    if let Some(ptr) = dst {
        // SAFETY: `landing_ptr` checked that `ptr` is valid for `len` bytes.
        // Host buffers are owned by the request; for region landings the
        // region owner guarantees no other access while the read is in flight
        // (LandingRegion's protocol).
        let slice = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        read_exact(&req.file, slice, req.offset)?;
    } else if let Landing::Device { sink, dst } = &req.landing {
        read_via_device(&req, sink.as_ref(), *dst, &read_exact)?;
    }
    let mut landed = Landed {
        tag: req.tag,
        len,
        buf: None,
    };
    if let Landing::Host(mut buf) = req.landing {
        buf.set_len(len);
        landed.buf = Some(buf);
    }
    Ok(landed)
}

fn read_via_device<F>(
    req: &ReadReq,
    sink: &dyn DeviceSink,
    dst: u64,
    read_exact: &F,
) -> Result<(), IoError>
where
    F: Fn(&StoreFile, &mut [u8], u64) -> Result<(), IoError>,
{
    let dev_err = |what: String| IoError::Device {
        path: req.file.path().to_path_buf(),
        offset: req.offset,
        len: req.len,
        what,
    };
    let (region, off) = sink.stage(req.len).map_err(dev_err)?;
    let Some(ptr) = region.ptr_at(off, req.len) else {
        sink.abort(off, req.len);
        return Err(dev_err(format!(
            "staging slice {off}+{} outside its region",
            req.len
        )));
    };
    // SAFETY: the sink reserved `off..off+len` of its staging region for this
    // read alone until `commit`; the pointer is in bounds (checked above).
    let slice = unsafe { std::slice::from_raw_parts_mut(ptr, req.len) };
    if let Err(e) = read_exact(&req.file, slice, req.offset) {
        sink.abort(off, req.len);
        return Err(e);
    }
    sink.commit(off, req.len, dst).map_err(dev_err)
}

/// Where a finished ticket sends its token.
enum Notify {
    Channel(Sender<u64>),
    Queue(Arc<DoneQueue>),
}

impl Notify {
    fn send(self, token: u64) {
        match self {
            Self::Channel(tx) => {
                let _ = tx.send(token);
            }
            Self::Queue(q) => q.push(token),
        }
    }
}

/// Completion of a batch started by `read_async`.
#[must_use = "a ticket must be waited on before its landings are used"]
#[derive(Clone)]
pub struct Ticket {
    state: Arc<TicketState>,
    /// The ring to drive while waiting (caller-reaped backends).
    driver: Option<Arc<dyn Drive>>,
}

struct TicketState {
    inner: Mutex<TicketInner>,
    cv: Condvar,
    /// When the backend started the first request (handed it to the kernel
    /// or a worker), and when the last one completed.
    started: OnceLock<Instant>,
    finished: OnceLock<Instant>,
}

struct TicketInner {
    remaining: usize,
    landed: Vec<Option<Landed>>,
    first_err: Option<(usize, IoError)>,
    notify: Option<(Notify, u64)>,
    /// Threads blocked in `wait` (the completer skips the wake-up syscall
    /// when none).
    waiters: usize,
}

/// The backend's half of a ticket: completes requests by index.
#[derive(Clone)]
pub struct Completer {
    state: Arc<TicketState>,
}

impl Ticket {
    /// A ticket for `n` requests and the completer that finishes them.
    pub fn new(n: usize) -> (Self, Completer) {
        let state = Arc::new(TicketState {
            inner: Mutex::new(TicketInner {
                remaining: n,
                landed: (0..n).map(|_| None).collect(),
                first_err: None,
                notify: None,
                waiters: 0,
            }),
            cv: Condvar::new(),
            started: OnceLock::new(),
            finished: OnceLock::new(),
        });
        (
            Self {
                state: state.clone(),
                driver: None,
            },
            Completer { state },
        )
    }

    /// [`Ticket::new`] for a backend whose completions are reaped by waiting
    /// threads: [`Ticket::wait`] drives `driver` instead of sleeping on the
    /// ticket alone.
    pub fn driven(n: usize, driver: Arc<dyn Drive>) -> (Self, Completer) {
        let (mut t, c) = Self::new(n);
        t.driver = Some(driver);
        (t, c)
    }

    /// Whether every request has completed (landed or failed).
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.state.lock().remaining == 0
    }

    /// Send `token` on `tx` once every request has completed (at once when
    /// the ticket is already done). Lets a caller with many tickets in flight
    /// (a load generator) wake on whichever finishes first. A later call
    /// replaces an earlier one. With a caller-reaped backend
    /// ([`StorageBackend::reap_on_caller`]) reads complete only while some
    /// thread reaps (waits on a ticket or calls `reap_on_caller`).
    pub fn notify_on_done(&self, tx: Sender<u64>, token: u64) {
        self.set_notify(Notify::Channel(tx), token);
    }

    /// Push `token` into `queue` once every request has completed (at once
    /// when already done); the caller waits for batches with
    /// [`DoneQueue::wait`]. A later call replaces an earlier one.
    pub fn notify_on_done_to(&self, queue: &Arc<DoneQueue>, token: u64) {
        self.set_notify(Notify::Queue(queue.clone()), token);
    }

    fn set_notify(&self, notify: Notify, token: u64) {
        let mut g = self.state.lock();
        if g.remaining == 0 {
            drop(g);
            notify.send(token);
        } else {
            g.notify = Some((notify, token));
        }
    }

    /// When the backend started the first request of this ticket (for a
    /// queued backend, when it left the queue); `None` before that.
    #[must_use]
    pub fn started_at(&self) -> Option<Instant> {
        self.state.started.get().copied()
    }

    /// When the last request completed; `None` before that.
    #[must_use]
    pub fn finished_at(&self) -> Option<Instant> {
        self.state.finished.get().copied()
    }

    /// Block until every request completes; the landed results in request
    /// order, or the first failure by request order.
    pub fn wait(self) -> Result<Vec<Landed>, IoError> {
        if let Some(driver) = &self.driver {
            let state = &self.state;
            let done = || state.lock().remaining == 0;
            while !done() {
                driver.drive(&done);
            }
        }
        let mut g = self.state.lock();
        while g.remaining > 0 {
            g.waiters += 1;
            g = self
                .state
                .cv
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
            g.waiters -= 1;
        }
        if let Some((_, e)) = g.first_err.take() {
            return Err(e);
        }
        Ok(g.landed.drain(..).flatten().collect())
    }
}

impl TicketState {
    fn lock(&self) -> std::sync::MutexGuard<'_, TicketInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Completer {
    /// Note that the backend starts a request now (the first call counts):
    /// service time is measured from here, not from `read_async`.
    pub fn mark_started(&self) {
        let _ = self.state.started.get_or_init(Instant::now);
    }

    /// Record the outcome of request `idx`. Each index completes once.
    pub fn complete(&self, idx: usize, result: Result<Landed, IoError>) {
        let mut g = self.state.lock();
        match result {
            Ok(l) => {
                if let Some(slot) = g.landed.get_mut(idx) {
                    *slot = Some(l);
                }
            }
            Err(e) => {
                if g.first_err.as_ref().is_none_or(|(i, _)| idx < *i) {
                    g.first_err = Some((idx, e));
                }
            }
        }
        g.remaining = g.remaining.saturating_sub(1);
        if g.remaining == 0 {
            let _ = self.state.finished.get_or_init(Instant::now);
            if g.waiters > 0 {
                self.state.cv.notify_all();
            }
            if let Some((notify, token)) = g.notify.take() {
                drop(g);
                notify.send(token);
            }
        }
    }
}
