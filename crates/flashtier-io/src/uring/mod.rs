//! The io_uring backend.
//!
//! One thread owns the ring (the *reaper*): it takes batches from a bounded
//! channel, turns each request into an SQE, keeps up to `queue_depth` reads in
//! flight, refills the ring as completions arrive (not batch by batch), and
//! completes tickets. Callers never touch the ring.
//!
//! - Probe at open: the opcodes it needs (`READ`, `READ_FIXED`, `NOP`) must be
//!   supported and a NOP must round-trip, else [`UringBackend::new`] fails and
//!   [`crate::open_backend`] falls back to posix with a one-line notice.
//! - Registered files: a sparse table of [`FILE_SLOTS`] slots keyed by
//!   [`StoreFile::id`]; a file with no free slot is read by plain descriptor.
//!   A file all owners dropped is released when the ring goes idle or the
//!   next file or region is registered, and its last close (for an unlinked
//!   store, freeing its blocks) runs on a background thread, never in the
//!   ring's path.
//! - Fixed buffers: regions passed to `register_landing_region` go into a
//!   sparse table of [`BUFFER_SLOTS`] (a slot whose region was dropped by its
//!   owner is reused); a read whose landing lies inside one uses
//!   `READ_FIXED`, every other read plain `READ`.
//! - Short reads are resubmitted for the remainder until exact; EOF is
//!   [`IoError::ShortRead`] naming the file.
//! - Every SQE's `user_data` is its in-flight slot, which records the ticket
//!   and the request index, so every completion (and failure) names its
//!   request.
//! - No busy spinning: the reaper always sleeps in `io_uring_enter`. With
//!   fewer than `max(1, queue_depth / 4)` reads in flight it also waits on an
//!   eventfd read that submitters poke (only when it sleeps so); with more in
//!   flight, new batches are taken at the next wake-up, which is near. It
//!   never sleeps with nothing in flight unless its sleeping flag is set
//!   (a batch found in its last look goes round the loop again, since its
//!   reads may all fail before reaching the kernel). With
//!   many reads in flight a wake-up waits for an eighth of them (at most 8)
//!   to complete, so one `io_uring_enter` refills several slots; the device
//!   queue stays at least 7/8 full meanwhile.
//!
//! Bounds: at most `queue_depth` (1..=256) reads in flight; the channel holds
//! at most `2 * queue_depth` batches (`read_async` blocks beyond it); the
//! batch being drained is held by the reaper. Writes are blocking `pwrite` on
//! the caller's thread.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use crate::backend::{Completer, Landing, ReadReq, StorageBackend, Ticket};
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::LandingRegion;
use crate::workers::check_queue_depth;
use ring::{MAX_SQE_BYTES, Reaper};

mod local;
mod ring;
mod tables;

pub use local::UringLocal;

/// Registered-file slots per ring.
pub const FILE_SLOTS: u32 = 64;
/// Fixed-buffer slots per ring (one per registered landing region).
pub const BUFFER_SLOTS: u32 = 32;

/// A batch handed to the reaper.
pub(crate) struct Batch {
    pub(crate) reqs: std::vec::IntoIter<ReadReq>,
    /// Staging of device landings, by request index (empty when none).
    pub(crate) staged: Vec<Option<(Arc<LandingRegion>, usize)>>,
    pub(crate) next_idx: usize,
    pub(crate) done: Completer,
}

/// Messages to the reaper.
pub(crate) enum Msg {
    Read(Batch),
    Register(Arc<LandingRegion>, SyncSender<Result<(), String>>),
}

/// Wakes the reaper when it sleeps with nothing in flight.
pub(crate) struct Waker {
    pub(crate) fd: OwnedFd,
    /// Set by the reaper right before it sleeps; submitters that clear it
    /// write the eventfd.
    pub(crate) sleeping: AtomicBool,
}

impl Waker {
    fn new() -> Result<Self, IoError> {
        // SAFETY: plain syscall with constant arguments; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(IoError::Backend {
                backend: "uring",
                what: format!("eventfd: {}", std::io::Error::last_os_error()),
            });
        }
        // SAFETY: `fd` is a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            fd,
            sleeping: AtomicBool::new(false),
        })
    }

    /// Wake the reaper if it sleeps (or always, when `force`).
    pub(crate) fn wake(&self, force: bool) {
        if self.sleeping.swap(false, Ordering::SeqCst) || force {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live local to our own eventfd.
            let _ = unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    (&raw const one).cast::<libc::c_void>(),
                    8,
                )
            };
        }
    }
}

/// The io_uring backend. See the module docs.
pub struct UringBackend {
    tx: Option<SyncSender<Msg>>,
    waker: Arc<Waker>,
    reaper: Option<JoinHandle<()>>,
    queue_depth: usize,
}

impl UringBackend {
    /// Open a ring with `queue_depth` (1..=256) reads in flight, probing
    /// io_uring first; fails where the kernel refuses it.
    pub fn new(queue_depth: usize) -> Result<Self, IoError> {
        Self::with_max_op_bytes(queue_depth, MAX_SQE_BYTES)
    }

    /// [`UringBackend::new`], splitting every read into kernel ops of at most
    /// `max_op_bytes` (a multiple of 4096, at most 1 GiB); the rest of a read
    /// is resubmitted exactly as after a short read. Tests use it to drive the
    /// resubmission path through the real kernel.
    pub fn with_max_op_bytes(queue_depth: usize, max_op_bytes: usize) -> Result<Self, IoError> {
        check_ring_args(queue_depth, max_op_bytes)?;
        let waker = Arc::new(Waker::new()?);
        let (tx, rx) = sync_channel::<Msg>(2 * queue_depth);
        let (ready_tx, ready_rx) = sync_channel::<Result<(), String>>(1);
        let w = waker.clone();
        let reaper = std::thread::Builder::new()
            .name("ft-uring".into())
            .spawn(move || reaper_main(queue_depth, max_op_bytes, &rx, &w, &ready_tx))
            .map_err(|e| IoError::Backend {
                backend: "uring",
                what: format!("spawn: {e}"),
            })?;
        let ready = ready_rx
            .recv()
            .unwrap_or_else(|_| Err("ring thread exited during setup".into()));
        if let Err(what) = ready {
            let _ = reaper.join();
            return Err(IoError::Backend {
                backend: "uring",
                what,
            });
        }
        Ok(Self {
            tx: Some(tx),
            waker,
            reaper: Some(reaper),
            queue_depth,
        })
    }

    fn send(&self, msg: Msg) -> Result<(), Msg> {
        let Some(tx) = &self.tx else { return Err(msg) };
        tx.send(msg).map_err(|e| e.0)?;
        self.waker.wake(false);
        Ok(())
    }
}

/// A ring's arguments: `queue_depth` as [`check_queue_depth`] holds, and
/// `max_op_bytes` a positive multiple of 4096 of at most [`MAX_SQE_BYTES`].
pub(crate) fn check_ring_args(queue_depth: usize, max_op_bytes: usize) -> Result<(), IoError> {
    check_queue_depth(queue_depth)?;
    if max_op_bytes == 0 || max_op_bytes % crate::ALIGN != 0 || max_op_bytes > MAX_SQE_BYTES {
        return Err(IoError::Invalid(format!(
            "max op bytes {max_op_bytes} must be a positive multiple of 4096 up to 1 GiB"
        )));
    }
    Ok(())
}

fn reaper_main(
    queue_depth: usize,
    max_op_bytes: usize,
    rx: &Receiver<Msg>,
    waker: &Waker,
    ready: &SyncSender<Result<(), String>>,
) {
    match Reaper::open(queue_depth, max_op_bytes, false) {
        Ok(mut reaper) => {
            let _ = ready.send(Ok(()));
            reaper.run(rx, waker);
        }
        Err(e) => {
            let _ = ready.send(Err(e));
        }
    }
}

pub(crate) fn shut_down() -> IoError {
    IoError::Backend {
        backend: "uring",
        what: "ring thread has exited".into(),
    }
}

impl StorageBackend for UringBackend {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        let (ticket, done) = Ticket::new(reqs.len());
        if reqs.is_empty() {
            return Ok(ticket);
        }
        let staged = stage_device_landings(&reqs, &done);
        let batch = Batch {
            reqs: reqs.into_iter(),
            staged,
            next_idx: 0,
            done,
        };
        if let Err(Msg::Read(batch)) = self.send(Msg::Read(batch)) {
            for (i, _) in batch.reqs.enumerate() {
                batch.done.complete(i, Err(shut_down()));
            }
        }
        Ok(ticket)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        file.write_all_at(src, offset)
    }

    fn register_landing_region(&self, region: &Arc<LandingRegion>) -> Result<(), IoError> {
        let (reply_tx, reply_rx) = sync_channel(1);
        self.send(Msg::Register(region.clone(), reply_tx))
            .map_err(|_| shut_down())?;
        match reply_rx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(what)) => {
                // Fixed buffers only save per-read page pinning: reads into
                // the region stay correct as plain reads. Say so once.
                eprintln!(
                    "flashtier: io_uring fixed buffer for landing region {} not registered ({what}); plain reads into it",
                    region.id()
                );
                Ok(())
            }
            Err(_) => Err(shut_down()),
        }
    }
}

/// Reserve staging for device landings on the caller's thread (staging may
/// block until free; the reaper must never block on it).
pub(crate) fn stage_device_landings(
    reqs: &[ReadReq],
    done: &Completer,
) -> Vec<Option<(Arc<LandingRegion>, usize)>> {
    if !reqs
        .iter()
        .any(|r| matches!(r.landing, Landing::Device { .. }))
    {
        return Vec::new();
    }
    let mut staged = Vec::with_capacity(reqs.len());
    for (i, req) in reqs.iter().enumerate() {
        let Landing::Device { sink, .. } = &req.landing else {
            staged.push(None);
            continue;
        };
        match sink.stage(req.len) {
            Ok(s) => staged.push(Some(s)),
            Err(what) => {
                // The reaper sees `None` for a device landing and skips it;
                // the error is recorded here.
                staged.push(None);
                done.complete(
                    i,
                    Err(IoError::Device {
                        path: req.file.path().to_path_buf(),
                        offset: req.offset,
                        len: req.len,
                        what,
                    }),
                );
            }
        }
    }
    staged
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        self.tx = None;
        self.waker.wake(true);
        if let Some(r) = self.reaper.take() {
            if let Err(p) = r.join() {
                let msg = p
                    .downcast_ref::<&str>()
                    .copied()
                    .unwrap_or("(non-string panic)");
                eprintln!("flashtier: uring ring thread panicked: {msg}");
            }
        }
    }
}
