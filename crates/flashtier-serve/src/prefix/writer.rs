//! The spill's writer: one thread that writes demoted caches to the store
//! while the scheduler thread goes on (the bounds are the spill's, see
//! [`super::spill`]).
//!
//! Hand-off: the scheduler thread pushes a [`Job`] (the cache, shared, and
//! the block numbers it reserved for it) onto the queue and returns. The
//! thread takes jobs in order and writes a job's block numbers one at a
//! time, each under the store's lock, so a restore on the scheduler thread
//! waits for at most one block number's write (`layers` blocks). It lets go
//! of the cache, then leaves a [`Done`] (the block numbers handed back,
//! with the versions or why not) for the scheduler thread to collect. This
//! module does not bound the queue: the spill refuses a job while its limit
//! of jobs are pushed and not collected.
//!
//! Exactness: a block's version is sealed by the store only after its
//! write completed, and only a collected [`Outcome::Written`] makes an
//! entry restorable, so no read ever asks for a block still being written.
//!
//! Cancellation: a job's flag, set when its entry is taken. A queued job is
//! taken off the queue ([`Writer::unqueue`]); the running one stops before
//! its next block number. Stop (on drop): the thread ends before its next
//! block number, the queued jobs are dropped unwritten, and drop joins it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use flashtier::kv::swap::BlockVersion;
use flashtier_engine::device::KvState;
use flashtier_engine::device::cpu::kv::KvCache;

use super::error::SpillError;
use super::store::{Store, StoreIo};

/// One demoted cache to write.
pub(super) struct Job {
    pub(super) ticket: u64,
    pub(super) kv: Arc<KvCache>,
    /// Its `i`th block goes to block number `blocks[i]` of every layer.
    pub(super) blocks: Vec<u32>,
    pub(super) cancel: Arc<AtomicBool>,
    /// Positions the cache could hold (its entry's, handed back).
    pub(super) capacity: usize,
}

/// How a job ended.
pub(super) enum Outcome {
    /// Every block written and sealed: the versions, block number by block
    /// number, layer by layer.
    Written(Vec<BlockVersion>),
    /// Cancelled or stopped before its last block number.
    Stopped,
    /// A write (or the store's creation) failed.
    Failed(SpillError),
}

/// A finished job, for the scheduler thread to collect.
pub(super) struct Done {
    pub(super) ticket: u64,
    pub(super) blocks: Vec<u32>,
    pub(super) len: usize,
    pub(super) capacity: usize,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) outcome: Outcome,
    /// Bytes written, whatever the outcome.
    pub(super) bytes: u64,
}

struct Queue {
    jobs: VecDeque<Job>,
    done: Vec<Done>,
    /// The thread is between taking a job and leaving its [`Done`].
    busy: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Wakes the thread: a job, or the stop.
    work: Condvar,
    /// Wakes [`Writer::flush`]: the thread found the queue empty.
    idle: Condvar,
    stop: AtomicBool,
    /// Made by the first job, from its cache's shape; shared with the
    /// restorer thread.
    store: Arc<Mutex<Option<Store>>>,
}

/// A lock that a panic elsewhere does not make unusable: every state the
/// queue and the store are left in between two statements is consistent
/// (a store whose write failed half way has its blocks unsealed).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Stop a spill thread that waits on `work` under `queue`: raise `stop`
/// under the queue's lock (so the thread cannot miss it between its check
/// and its wait), wake it and join it. `what` names it in the log if it
/// panicked.
pub(super) fn stop_thread<Q>(
    queue: &Mutex<Q>,
    stop: &AtomicBool,
    work: &Condvar,
    thread: Option<JoinHandle<()>>,
    what: &str,
) {
    {
        let _q = lock(queue);
        stop.store(true, Ordering::Release);
    }
    work.notify_all();
    if let Some(t) = thread
        && t.join().is_err()
    {
        tracing::error!("the prefix spill's {what} thread panicked");
    }
}

/// The thread and its queue.
pub(super) struct Writer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    /// Start the thread; the store goes where `io` says.
    pub(super) fn spawn(io: StoreIo) -> Result<Self, SpillError> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                done: Vec::new(),
                busy: false,
            }),
            work: Condvar::new(),
            idle: Condvar::new(),
            stop: AtomicBool::new(false),
            store: Arc::new(Mutex::new(None)),
        });
        let theirs = shared.clone();
        let thread = std::thread::Builder::new()
            .name("prefix-spill".into())
            .spawn(move || run(&theirs, &io))
            .map_err(SpillError::Writer)?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Queue `job` behind the others.
    pub(super) fn push(&self, job: Job) {
        lock(&self.shared.queue).jobs.push_back(job);
        self.shared.work.notify_one();
    }

    /// Take job `ticket` off the queue if the thread has not started it.
    pub(super) fn unqueue(&self, ticket: u64) -> Option<Job> {
        let mut q = lock(&self.shared.queue);
        let at = q.jobs.iter().position(|j| j.ticket == ticket)?;
        q.jobs.remove(at)
    }

    /// The jobs finished since the last call.
    pub(super) fn collect(&self) -> Vec<Done> {
        std::mem::take(&mut lock(&self.shared.queue).done)
    }

    /// Block until every queued job is finished (or the thread is gone).
    pub(super) fn flush(&self) {
        let mut q = lock(&self.shared.queue);
        while q.busy || !q.jobs.is_empty() {
            if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                return;
            }
            // The timeout only re-checks that the thread still runs.
            q = self
                .shared
                .idle
                .wait_timeout(q, Duration::from_millis(100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The store (`None` before the first job made it).
    pub(super) fn store(&self) -> MutexGuard<'_, Option<Store>> {
        lock(&self.shared.store)
    }

    /// The store's slot itself, for the restorer thread.
    pub(super) fn store_slot(&self) -> Arc<Mutex<Option<Store>>> {
        self.shared.store.clone()
    }

    /// Stop the thread and wait for it; the queued jobs are dropped. Then
    /// nothing else holds the store.
    pub(super) fn stop(&mut self) {
        let s = &self.shared;
        stop_thread(&s.queue, &s.stop, &s.work, self.thread.take(), "writer");
        lock(&s.queue).jobs.clear();
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: one job after another until the stop.
fn run(shared: &Shared, io: &StoreIo) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if shared.stop.load(Ordering::Acquire) {
                    q.busy = false;
                    shared.idle.notify_all();
                    return;
                }
                if let Some(job) = q.jobs.pop_front() {
                    q.busy = true;
                    break job;
                }
                q.busy = false;
                shared.idle.notify_all();
                q = shared.work.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let done = write(shared, io, job);
        lock(&shared.queue).done.push(done);
    }
}

/// Write one job's block numbers, checking its flag and the stop before
/// each; the cache is let go of before the [`Done`] is made.
fn write(shared: &Shared, io: &StoreIo, job: Job) -> Done {
    let Job {
        ticket,
        kv,
        blocks,
        cancel,
        capacity,
    } = job;
    let len = kv.len();
    let mut versions = Vec::new();
    let mut bytes = 0;
    let mut outcome = None;
    for (ordinal, &b) in blocks.iter().enumerate() {
        if cancel.load(Ordering::Acquire) || shared.stop.load(Ordering::Acquire) {
            outcome = Some(Outcome::Stopped);
            break;
        }
        match write_one(&mut lock(&shared.store), io, &kv, ordinal, b) {
            Ok((v, block_bytes)) => {
                bytes += v.len() as u64 * block_bytes;
                versions.extend(v);
            }
            Err(e) => {
                outcome = Some(Outcome::Failed(e));
                break;
            }
        }
    }
    drop(kv);
    Done {
        ticket,
        blocks,
        len,
        capacity,
        cancel,
        outcome: outcome.unwrap_or(Outcome::Written(versions)),
        bytes,
    }
}

/// Write block `ordinal` of `kv` to block number `b`, making the store
/// first if there is none; returns the versions and the bytes of a block.
fn write_one(
    slot: &mut Option<Store>,
    io: &StoreIo,
    kv: &KvCache,
    ordinal: usize,
    b: u32,
) -> Result<(Vec<BlockVersion>, u64), SpillError> {
    let store = match slot {
        Some(s) => s,
        empty => empty.insert(Store::create(io, kv)?),
    };
    let versions = store.write_block(kv, ordinal, b)?;
    Ok((versions, store.block_bytes()))
}
