//! The reaper: the one thread that owns an io_uring, its in-flight slots,
//! and its registered-file and fixed-buffer tables. See [`crate::uring`].
//!
//! Buffer lifetime (the contract behind every `push`): a read's destination
//! is either the request's own [`crate::AlignedBuf`] (moved into the slot; its
//! heap allocation does not move with it) or memory of an
//! `Arc<LandingRegion>` held by the slot (directly in the landing, or as the
//! staging of a device landing). The slot stays occupied until the kernel
//! posts the completion for its `user_data`, so the memory outlives the
//! kernel operation. If this thread ever unwinds with reads in flight, the
//! slot table leaks those entries instead of freeing memory under the kernel.
//!
//! This file holds the ring's set-up and the submission side (taking
//! batches, filling free slots, pushing SQEs); the completion side is in
//! `reap.rs`.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};

use io_uring::{IoUring, Probe, opcode, types};

use super::tables::{BufTable, FileTable};
use super::{BUFFER_SLOTS, Batch, FILE_SLOTS, Msg, Waker};
use crate::backend::{Completer, Landing, ReadReq, landing_ptr};
use crate::error::IoError;
use crate::region::LandingRegion;

#[path = "reap.rs"]
mod reap;

/// `user_data` of the eventfd read that wakes the reaper.
const WAKE_TAG: u64 = u64::MAX;
/// `user_data` of the probe NOP.
const NOP_TAG: u64 = u64::MAX - 1;
/// Most completions one wait asks for (see [`Reaper::submit_and_wait`]).
const MAX_WAIT_BATCH: usize = 8;
/// Largest single SQE length by default; longer requests continue as
/// "short" reads.
pub(crate) const MAX_SQE_BYTES: usize = 1 << 30;

/// One read in flight.
struct InFlight {
    req: ReadReq,
    idx: usize,
    done: Completer,
    /// Staging (region, offset) of a device landing.
    staged: Option<(Arc<LandingRegion>, usize)>,
    dst: *mut u8,
    got: usize,
    fixed_buf: Option<u16>,
    file_slot: Option<u32>,
}

/// In-flight slots; `user_data` is the slot index.
struct Slots {
    table: Vec<Option<InFlight>>,
    free: Vec<usize>,
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Only reachable with reads in flight if the reaper unwinds: the
        // kernel may still write into these buffers, so never free them.
        for entry in self.table.drain(..).flatten() {
            std::mem::forget(entry);
        }
    }
}

/// The ring and everything tied to it.
pub(crate) struct Reaper {
    // Declared first so the ring closes before the tables drop.
    ring: IoUring,
    slots: Slots,
    pending: VecDeque<Batch>,
    files: FileTable,
    bufs: BufTable,
    cqes: Vec<(u64, i32)>,
    /// Reads finished in this pass, completed by `deliver` (at most the
    /// queue depth).
    landed: Vec<(InFlight, Result<(), IoError>)>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    /// Below this many reads in flight the reaper sleeps wakeable.
    wake_below: usize,
    /// Largest kernel op; a longer read continues like a short read.
    max_op_bytes: usize,
    closing: bool,
}

// SAFETY: the raw destination pointers in the slots point into memory the
// slot itself keeps alive (an owned `AlignedBuf` or an `Arc<LandingRegion>`),
// not into any thread's stack, so moving the reaper to another thread (or
// handing it between threads under a mutex, as `UringLocal` does) leaves them
// valid; the ring itself is `Send`.
unsafe impl Send for Reaper {}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

impl Reaper {
    /// Create and probe a ring for `queue_depth` reads in flight. A `shared`
    /// ring may be entered from several threads (one at a time), so it is
    /// built without `SINGLE_ISSUER`/`DEFER_TASKRUN`.
    pub(crate) fn open(
        queue_depth: usize,
        max_op_bytes: usize,
        shared: bool,
    ) -> Result<Self, String> {
        let entries = u32::try_from((queue_depth + 1).next_power_of_two())
            .map_err(|_| format!("queue depth {queue_depth} too large"))?;
        let mut builder = IoUring::builder();
        builder.setup_coop_taskrun();
        if !shared {
            builder.setup_single_issuer().setup_defer_taskrun();
        }
        let mut ring = builder
            .build(entries)
            .or_else(|_| IoUring::new(entries))
            .map_err(|e| format!("io_uring_setup: {e}"))?;
        let mut probe = Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| format!("probe: {e}"))?;
        for (code, name) in [
            (opcode::Read::CODE, "READ"),
            (opcode::ReadFixed::CODE, "READ_FIXED"),
            (opcode::Nop::CODE, "NOP"),
        ] {
            if !probe.is_supported(code) {
                return Err(format!("kernel lacks IORING_OP_{name}"));
            }
        }
        let nop = opcode::Nop::new().build().user_data(NOP_TAG);
        // SAFETY: a NOP references no memory.
        unsafe { ring.submission().push(&nop) }.map_err(|_| "probe NOP: SQ full".to_string())?;
        ring.submit_and_wait(1)
            .map_err(|e| format!("probe NOP: {e}"))?;
        match ring.completion().next() {
            Some(c) if c.user_data() == NOP_TAG && c.result() >= 0 => {}
            Some(c) => return Err(format!("probe NOP failed: result {}", c.result())),
            None => return Err("probe NOP: no completion".into()),
        }
        let files_ok = ring.submitter().register_files_sparse(FILE_SLOTS).is_ok();
        let bufs_ok = ring
            .submitter()
            .register_buffers_sparse(BUFFER_SLOTS)
            .is_ok();
        Ok(Self {
            ring,
            slots: Slots {
                table: (0..queue_depth).map(|_| None).collect(),
                free: (0..queue_depth).rev().collect(),
            },
            pending: VecDeque::new(),
            files: FileTable::new(files_ok),
            bufs: BufTable::new(bufs_ok),
            cqes: Vec::with_capacity(2 * queue_depth + 2),
            landed: Vec::with_capacity(queue_depth),
            wake_buf: Box::new(0),
            wake_armed: false,
            wake_below: (queue_depth / 4).max(1),
            max_op_bytes,
            closing: false,
        })
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.slots.table.len() - self.slots.free.len()
    }

    /// Queue a batch for [`Reaper::fill`] (caller-reaped rings).
    pub(crate) fn enqueue(&mut self, batch: Batch) {
        self.pending.push_back(batch);
    }

    /// Batches queued and not yet fully started.
    pub(crate) fn pending_batches(&self) -> usize {
        self.pending.len()
    }

    /// Register `region` as a fixed buffer.
    pub(crate) fn register(&mut self, region: &Arc<LandingRegion>) -> Result<(), String> {
        self.sweep_files();
        self.bufs.register(&self.ring.submitter(), region)
    }

    /// Release registered files their owners dropped (see
    /// [`FileTable::sweep`](super::tables::FileTable::sweep)).
    pub(crate) fn sweep_files(&mut self) {
        self.files.sweep(&self.ring.submitter());
    }

    /// Submit queued SQEs without waiting.
    pub(crate) fn submit(&mut self) {
        let _ = self.ring.submit();
    }

    /// The reaper loop; returns when the backend is dropped and every read
    /// has completed.
    pub(crate) fn run(&mut self, rx: &Receiver<Msg>, waker: &Waker) {
        self.arm_wake(waker);
        loop {
            self.fill(Some(rx));
            self.deliver();
            if self.closing && self.in_flight() == 0 && self.pending.is_empty() {
                break;
            }
            if self.in_flight() == 0 {
                // Idle: release files their owners dropped meanwhile.
                self.sweep_files();
            }
            if !self.closing && self.in_flight() < self.wake_below {
                // Few reads in flight: a completion may be far off, so ask
                // submitters to poke the eventfd, then look once more so a
                // batch sent just before the flag is not missed. With more in
                // flight, new batches are picked up at the next completion,
                // which saves a wake-up and a syscall per batch.
                waker.sleeping.store(true, Ordering::SeqCst);
                if self.fill(Some(rx)) > 0 {
                    // Go round again rather than sleep: the batch's reads
                    // may all have failed at once (nothing in flight), and a
                    // sleep with the flag cleared and nothing in flight is
                    // one no submitter would wake.
                    waker.sleeping.store(false, Ordering::SeqCst);
                    let _ = self.ring.submit();
                    continue;
                }
            }
            self.submit_and_wait();
            waker.sleeping.store(false, Ordering::SeqCst);
            self.reap(Some(waker));
            // Refill freed slots and get them to the device before spending
            // time on completions.
            if self.fill(Some(rx)) > 0 {
                let _ = self.ring.submit();
            }
            self.deliver();
        }
        // The wake read points at `wake_buf`: complete it before returning.
        while self.wake_armed {
            waker.wake(true);
            self.submit_and_wait();
            self.reap(Some(waker));
        }
        self.deliver();
    }

    /// Submit queued SQEs and sleep until completions arrive (with
    /// `DEFER_TASKRUN` the kernel batches what is ready by then).
    ///
    /// With many reads in flight it sleeps until several have completed:
    /// an eighth of those in flight, at most [`MAX_WAIT_BATCH`]. Each
    /// wake-up then refills several slots with one `io_uring_enter` and one
    /// device notification instead of one each. On this 2-vCPU guest the
    /// ring thread spent ~90% of a core at 4 KiB QD32, a fifth of it in
    /// virtio notifications. The wait always ends (every read in flight
    /// completes), the device queue stays at least 7/8 full meanwhile, and a
    /// completed read waits for at most `want - 1` others, under an eighth
    /// of one read's service time on average. A timeout on the wait (50 us
    /// to 1 ms, `IORING_ENTER_EXT_ARG`) measured worse: the timer costs more
    /// than it saves.
    pub(crate) fn submit_and_wait(&mut self) {
        let want = (self.in_flight() / 8).clamp(1, MAX_WAIT_BATCH);
        let res = self.ring.submit_and_wait(want);
        match res {
            Ok(_) => {}
            Err(e) if matches!(errno_of(&e), libc::EINTR | libc::EAGAIN | libc::EBUSY) => {}
            Err(e) => {
                tracing::error!("io_uring_enter: {e}");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn arm_wake(&mut self, waker: &Waker) {
        let ptr: *mut u64 = &mut *self.wake_buf;
        let entry = opcode::Read::new(types::Fd(waker.fd.as_raw_fd()), ptr.cast(), 8)
            .build()
            .user_data(WAKE_TAG);
        // SAFETY: `wake_buf` is a heap box owned by the reaper and not
        // touched while the read is armed; `run` completes the read before
        // the reaper drops.
        self.wake_armed = unsafe { self.push(&entry) };
    }

    /// Push one SQE, submitting to make room if the SQ is full. Returns false
    /// only if the kernel refuses to take entries.
    ///
    /// # Safety
    /// Memory the entry points at must stay valid until its completion.
    unsafe fn push(&mut self, entry: &io_uring::squeue::Entry) -> bool {
        for _ in 0..2 {
            // SAFETY: forwarded from this function's contract.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return true;
            }
            let _ = self.ring.submit();
        }
        false
    }

    /// Start queued reads while slots are free. Returns how many started.
    /// `rx` is `None` for a caller-reaped ring, whose batches arrive through
    /// [`Reaper::enqueue`].
    pub(crate) fn fill(&mut self, rx: Option<&Receiver<Msg>>) -> usize {
        let mut started = 0;
        while !self.slots.free.is_empty() {
            if self.pending.is_empty() {
                let Some(rx) = rx else { break };
                match rx.try_recv() {
                    Ok(Msg::Read(batch)) => self.pending.push_back(batch),
                    Ok(Msg::Register(region, reply)) => {
                        let _ = reply.send(self.register(&region));
                        continue;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.closing = true;
                        break;
                    }
                }
            }
            let Some(batch) = self.pending.front_mut() else {
                break;
            };
            let next = batch.reqs.next();
            let idx = batch.next_idx;
            batch.next_idx += 1;
            let done = batch.done.clone();
            let staged = batch.staged.get_mut(idx).and_then(Option::take);
            if batch.reqs.len() == 0 {
                self.pending.pop_front();
            }
            if let Some(req) = next {
                self.start(req, idx, done, staged);
                started += 1;
            }
        }
        started
    }

    fn start(
        &mut self,
        mut req: ReadReq,
        idx: usize,
        done: Completer,
        staged: Option<(Arc<LandingRegion>, usize)>,
    ) {
        let dst = match (&req.landing, &staged) {
            // Staging failed: the error was recorded when it was requested.
            (Landing::Device { .. }, None) => return,
            (Landing::Device { .. }, Some((region, off))) => region.ptr_at(*off, req.len),
            _ => landing_ptr(&mut req).ok().flatten(),
        };
        let dst = match dst {
            Some(p) => p,
            None => {
                // Re-run the check for its error naming the request.
                let err = landing_ptr(&mut req).err().unwrap_or(IoError::Landing {
                    path: req.file.path().to_path_buf(),
                    offset: req.offset,
                    len: req.len,
                    what: "staging slice outside its region".into(),
                });
                return done.complete(idx, Err(err));
            }
        };
        if let Err(e) = req.file.check_aligned(req.offset, req.len, dst) {
            return done.complete(idx, Err(e));
        }
        let fixed_region = match (&req.landing, &staged) {
            (Landing::Region { region, .. }, _) | (_, Some((region, _))) => Some(region.id()),
            _ => None,
        };
        let fixed_buf = fixed_region.and_then(|id| self.bufs.index_of(id));
        let file_slot = self.files.slot_for(&self.ring.submitter(), &req.file);
        let Some(slot) = self.slots.free.pop() else {
            // `fill` starts requests only while a slot is free.
            let err = IoError::Backend {
                backend: "uring",
                what: format!(
                    "no free slot for {} at {}",
                    req.file.path().display(),
                    req.offset
                ),
            };
            return done.complete(idx, Err(err));
        };
        let flight = InFlight {
            req,
            idx,
            done,
            staged,
            dst,
            got: 0,
            fixed_buf,
            file_slot,
        };
        if flight.req.len == 0 {
            self.slots.table[slot] = Some(flight);
            return self.finish(slot, Ok(()));
        }
        flight.done.mark_started();
        self.slots.table[slot] = Some(flight);
        self.submit_slot(slot);
    }

    /// Queue the SQE for the unread remainder of slot `slot`.
    fn submit_slot(&mut self, slot: usize) {
        let Some(f) = self.slots.table.get(slot).and_then(Option::as_ref) else {
            return;
        };
        let rest = (f.req.len - f.got).min(self.max_op_bytes);
        let offset = f.req.offset + f.got as u64;
        // SAFETY: `dst` is valid for `req.len` bytes and `got < req.len`.
        let buf = unsafe { f.dst.add(f.got) };
        let len = rest as u32;
        let entry = match (f.file_slot, f.fixed_buf) {
            (Some(fs), Some(bi)) => opcode::ReadFixed::new(types::Fixed(fs), buf, len, bi)
                .offset(offset)
                .build(),
            (Some(fs), None) => opcode::Read::new(types::Fixed(fs), buf, len)
                .offset(offset)
                .build(),
            (None, Some(bi)) => {
                opcode::ReadFixed::new(types::Fd(f.req.file.file().as_raw_fd()), buf, len, bi)
                    .offset(offset)
                    .build()
            }
            (None, None) => opcode::Read::new(types::Fd(f.req.file.file().as_raw_fd()), buf, len)
                .offset(offset)
                .build(),
        }
        .user_data(slot as u64);
        // SAFETY: see the module docs: the destination belongs to the slot's
        // request (owned host buffer or Arc'd region) and the slot is held
        // until this entry's completion is reaped.
        if !unsafe { self.push(&entry) } {
            let err = std::io::Error::other("io_uring submission queue refused the entry");
            self.fail_read(slot, err);
        }
    }
}
