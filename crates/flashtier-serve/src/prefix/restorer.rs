//! The spill's restorer: one thread that reads spilled entries back into
//! fresh caches while the scheduler thread goes on stepping the batch, so
//! a prompt whose reuse is on the drive does not hold up the sequences
//! already decoding (a 2048-position cache of Qwen3-30B-A3B's shape is 128
//! MiB of reads).
//!
//! Hand-off: the scheduler thread pushes a [`Restore`] (the versions to
//! read, how many positions, and the empty cache to fill) and returns; the
//! thread reads one job at a time under the store's lock (a write on the
//! writer thread waits for it, and it for at most one block number of a
//! write), then leaves a [`Restored`] with the filled cache or the error.
//! The scheduler thread collects them between steps. The job's block
//! numbers stay reserved until then (the caller holds them), so no write
//! reuses a block a restore still reads.
//!
//! Bounds: this module does not bound its queue; the caller has at most
//! one job per batch slot (a restoring prompt holds its slot). Stop (on
//! drop): the thread ends after its current job; the queued jobs and the
//! finished ones nobody collected are dropped, with their caches. A thread
//! that died (a panic) answers its running and queued restores with errors
//! at the next collect, so their prompts are computed whole.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use flashtier::kv::swap::BlockVersion;
use flashtier_engine::device::cpu::kv::KvCache;

use super::error::SpillError;
use super::store::Store;
use super::writer::{lock, stop_thread};

/// One entry to read back.
pub(super) struct Restore {
    pub(super) ticket: u64,
    /// The blocks to read, block number by block number, every layer's.
    pub(super) versions: Vec<BlockVersion>,
    /// Positions to fill (whole blocks of the entry, at most its length).
    pub(super) fill: usize,
    /// The empty cache they go into.
    pub(super) into: Box<KvCache>,
}

/// A finished restore: the filled cache and the bytes read, or why not.
pub(super) struct Restored {
    pub(super) ticket: u64,
    pub(super) result: Result<(Box<KvCache>, u64), SpillError>,
}

struct Queue {
    jobs: VecDeque<Restore>,
    done: Vec<Restored>,
    /// The ticket the thread is reading.
    running: Option<u64>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Wakes the thread: a job, or the stop.
    work: Condvar,
    /// Wakes [`Restorer::wait`]: a job finished.
    finished: Condvar,
    stop: AtomicBool,
}

/// The thread and its queue.
pub(super) struct Restorer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Restorer {
    /// Start the thread, reading from `store` (the writer's: `None` until
    /// its first job made it).
    pub(super) fn spawn(store: Arc<Mutex<Option<Store>>>) -> Result<Self, SpillError> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                done: Vec::new(),
                running: None,
            }),
            work: Condvar::new(),
            finished: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let theirs = shared.clone();
        let thread = std::thread::Builder::new()
            .name("prefix-restore".into())
            .spawn(move || run(&theirs, &store))
            .map_err(SpillError::Writer)?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Queue `job` behind the others.
    pub(super) fn push(&self, job: Restore) {
        lock(&self.shared.queue).jobs.push_back(job);
        self.shared.work.notify_one();
    }

    /// The restores finished since the last call. Should the thread have
    /// died (a panic), its running and queued restores come back as
    /// errors, so no request waits for them forever.
    pub(super) fn collect(&self) -> Vec<Restored> {
        let mut q = lock(&self.shared.queue);
        if self.thread.as_ref().is_some_and(JoinHandle::is_finished) {
            let lost = q.running.take().into_iter();
            let queued: Vec<u64> = q.jobs.drain(..).map(|j| j.ticket).collect();
            for ticket in lost.chain(queued) {
                q.done.push(Restored {
                    ticket,
                    result: Err(SpillError::RestoreThreadStopped),
                });
            }
        }
        std::mem::take(&mut q.done)
    }

    /// Block until a finished restore waits to be collected, at most
    /// `timeout` (or at once when the thread is gone).
    pub(super) fn wait(&self, timeout: Duration) {
        let q = lock(&self.shared.queue);
        if !q.done.is_empty() || self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
            return;
        }
        let _ = self
            .shared
            .finished
            .wait_timeout_while(q, timeout, |q| q.done.is_empty())
            .unwrap_or_else(PoisonError::into_inner);
    }

    /// Stop the thread after its current job and wait for it.
    pub(super) fn stop(&mut self) {
        let s = &self.shared;
        stop_thread(&s.queue, &s.stop, &s.work, self.thread.take(), "restore");
        let mut q = lock(&s.queue);
        q.jobs.clear();
        q.done.clear();
    }
}

impl Drop for Restorer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: one restore after another until the stop.
fn run(shared: &Shared, store: &Mutex<Option<Store>>) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(job) = q.jobs.pop_front() {
                    q.running = Some(job.ticket);
                    break job;
                }
                q = shared.work.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let Restore {
            ticket,
            versions,
            fill,
            mut into,
        } = job;
        let result = match lock(store).as_mut() {
            Some(s) => s
                .read(&versions, fill, &mut into)
                .map(|bytes| (into, bytes)),
            None => Err(SpillError::Shape("no spill store".into())),
        };
        let mut q = lock(&shared.queue);
        q.running = None;
        q.done.push(Restored { ticket, result });
        drop(q);
        shared.finished.notify_all();
    }
}
