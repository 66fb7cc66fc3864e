//! The caller-reaped io_uring backend: no ring thread. The thread that calls
//! `read_async` turns the batch into SQEs and submits them itself, and the
//! thread that waits (on a [`Ticket`], or through
//! [`StorageBackend::reap_on_caller`]) enters the kernel with `GETEVENTS`,
//! processes the completions inline (short-read resubmission, refilling freed
//! slots from queued batches) and completes the tickets. This is fio's
//! pattern: submit and reap on one thread, with no cross-thread wake-up
//! between a completion and the caller that waits for it.
//!
//! Everything else is the [`crate::UringBackend`] machinery (one
//! [`Reaper`] behind a mutex): probe at open, registered files, fixed buffers
//! for registered landing regions, tagged completions, exact reads.
//!
//! - Several threads may share it: the ring is entered by one thread at a
//!   time (the mutex), so it is built without `SINGLE_ISSUER`. A waiter that
//!   finds the ring held blocks on the mutex, then re-checks its ticket
//!   before sleeping in the kernel; whoever holds the ring completes every
//!   ticket whose reads it reaps.
//! - No busy spinning: a driver sleeps in `io_uring_enter` for one
//!   completion whenever reads are in flight; with none in flight and its
//!   ticket still open (impossible once queued batches are started) it
//!   sleeps 1 ms rather than spin.
//! - Buffer lifetime: as for [`crate::UringBackend`] (see `uring::ring`): a
//!   slot owns or `Arc`s its destination until its completion is reaped, and
//!   dropping the backend reaps every read in flight first.
//!
//! Bounds: at most `queue_depth` (1..=256) reads in flight; at most
//! `2 * queue_depth` batches queued behind them (`read_async` reaps, sleeping
//! in the kernel, while that many are queued). Writes are blocking `pwrite`
//! on the caller's thread.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::ring::{MAX_SQE_BYTES, Reaper};
use super::{Batch, check_ring_args, stage_device_landings};
use crate::backend::{Drive, ReadReq, StorageBackend, Ticket};
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::LandingRegion;

/// The ring and its queued batches; tickets hold it to drive it.
struct Shared {
    ring: Mutex<Reaper>,
    max_pending: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Reaper> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One pass on a held ring: start queued reads, sleep in the kernel for a
/// completion when `wait` and reads are in flight, reap, refill and submit
/// freed slots, then complete tickets. Returns whether it slept.
fn pump(r: &mut Reaper, wait: bool) -> bool {
    r.fill(None);
    let slept = wait && r.in_flight() > 0;
    if slept {
        r.submit_and_wait();
    } else {
        r.submit();
    }
    r.reap(None);
    // Freed slots go back to the device before tickets are completed.
    if r.fill(None) > 0 {
        r.submit();
    }
    r.deliver();
    if r.in_flight() == 0 && r.pending_batches() == 0 {
        // Idle: release files their owners dropped meanwhile.
        r.sweep_files();
    }
    slept
}

impl Drive for Shared {
    fn drive(&self, done: &dyn Fn() -> bool) {
        let mut r = self.lock();
        if done() {
            return;
        }
        if !pump(&mut r, true) && !done() {
            drop(r);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// io_uring reaped on the caller's thread. See the module docs.
pub struct UringLocal {
    shared: Arc<Shared>,
    queue_depth: usize,
}

impl UringLocal {
    /// Open a caller-reaped ring with `queue_depth` (1..=256) reads in
    /// flight, probing io_uring first; fails where the kernel refuses it.
    pub fn new(queue_depth: usize) -> Result<Self, IoError> {
        Self::with_max_op_bytes(queue_depth, MAX_SQE_BYTES)
    }

    /// [`UringLocal::new`], splitting reads into kernel ops of at most
    /// `max_op_bytes` (a multiple of 4096, at most 1 GiB), as
    /// [`crate::UringBackend::with_max_op_bytes`].
    pub fn with_max_op_bytes(queue_depth: usize, max_op_bytes: usize) -> Result<Self, IoError> {
        check_ring_args(queue_depth, max_op_bytes)?;
        let reaper =
            Reaper::open(queue_depth, max_op_bytes, true).map_err(|what| IoError::Backend {
                backend: "uring-local",
                what,
            })?;
        Ok(Self {
            shared: Arc::new(Shared {
                ring: Mutex::new(reaper),
                max_pending: 2 * queue_depth,
            }),
            queue_depth,
        })
    }
}

impl StorageBackend for UringLocal {
    fn name(&self) -> &'static str {
        "uring-local"
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        let driver: Arc<dyn Drive> = self.shared.clone();
        let (ticket, done) = Ticket::driven(reqs.len(), driver);
        if reqs.is_empty() {
            return Ok(ticket);
        }
        let staged = stage_device_landings(&reqs, &done);
        let mut r = self.shared.lock();
        // Back-pressure: reap (sleeping for completions) while the queue of
        // batches behind the in-flight reads is full.
        while r.pending_batches() >= self.shared.max_pending {
            if !pump(&mut r, true) {
                break;
            }
        }
        r.enqueue(Batch {
            reqs: reqs.into_iter(),
            staged,
            next_idx: 0,
            done,
        });
        pump(&mut r, false);
        Ok(ticket)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        file.write_all_at(src, offset)
    }

    fn register_landing_region(&self, region: &Arc<LandingRegion>) -> Result<(), IoError> {
        if let Err(what) = self.shared.lock().register(region) {
            // Fixed buffers only save per-read page pinning: reads into the
            // region stay correct as plain reads. Say so once.
            eprintln!(
                "flashtier: io_uring fixed buffer for landing region {} not registered ({what}); plain reads into it",
                region.id()
            );
        }
        Ok(())
    }

    fn reap_on_caller(&self) -> bool {
        let mut r = self.shared.lock();
        if !pump(&mut r, true) {
            drop(r);
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

impl Drop for UringLocal {
    fn drop(&mut self) {
        // Tickets may keep the ring alive, but nobody may wait on them: reap
        // every queued and in-flight read now so no kernel op outlives the
        // owner's interest and every ticket is completed.
        let mut r = self.shared.lock();
        while r.in_flight() > 0 || r.pending_batches() > 0 {
            if !pump(&mut r, true) && r.in_flight() == 0 && r.pending_batches() > 0 {
                // Cannot start queued reads (should not happen): stop rather
                // than spin; their tickets stay open.
                break;
            }
        }
    }
}
