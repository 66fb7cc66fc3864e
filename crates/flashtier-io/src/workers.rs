//! The read workers of the thread-pool backends (posix, sim): `queue_depth`
//! threads popping read jobs from one [`JobQueue`] and completing each
//! job's ticket entry with the result of the backend's read. Demand reads
//! ([`ReadWorkers::submit`]) go before every queued read-ahead
//! ([`ReadWorkers::try_submit_ahead`]).
//!
//! Bounds: `queue_depth` threads (1..=[`MAX_QUEUE_DEPTH`], checked by
//! [`check_queue_depth`]), each with one read in flight; the queue holds at
//! most `2 * queue_depth` demand jobs, so submitting blocks (back-pressure)
//! rather than growing memory without limit, and at most
//! `AHEAD_PER_WORKER * queue_depth` read-ahead jobs, refused (never waited
//! for) beyond that. A job queued after the workers are
//! gone is completed at once with an error naming the backend. Dropping the
//! pool closes the queue, lets the workers drain it and joins them.

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::activity::{ActivityMeter, DriveActivity};
use crate::backend::{Completer, Landed, ReadReq, Ticket};
use crate::error::IoError;
use crate::queue::JobQueue;

/// Largest supported queue depth: reads in flight, one thread each.
pub const MAX_QUEUE_DEPTH: usize = 256;

/// `queue_depth` is in 1..=[`MAX_QUEUE_DEPTH`].
pub(crate) fn check_queue_depth(queue_depth: usize) -> Result<(), IoError> {
    if !(1..=MAX_QUEUE_DEPTH).contains(&queue_depth) {
        return Err(IoError::Invalid(format!(
            "queue depth {queue_depth} outside 1..={MAX_QUEUE_DEPTH}"
        )));
    }
    Ok(())
}

/// Read-ahead jobs queued at most per worker.
pub(crate) const AHEAD_PER_WORKER: usize = 4;

/// One read request of a ticket, with what the backend decided for it.
struct Job<X> {
    req: ReadReq,
    idx: usize,
    plan: X,
    done: Completer,
}

/// Worker threads reading the jobs of one backend; `X` is what the backend
/// decides per request when it is submitted (nothing for posix, the fault
/// decision for the simulator).
pub(crate) struct ReadWorkers<X> {
    backend: &'static str,
    queue: Arc<JobQueue<Job<X>>>,
    workers: Vec<JoinHandle<()>>,
    meter: Arc<ActivityMeter>,
}

impl<X: Send + 'static> ReadWorkers<X> {
    /// `queue_depth` threads named `ft-{backend}-{i}`, each job read by
    /// `read(req, plan)`; the caller has checked `queue_depth`.
    pub(crate) fn spawn(
        backend: &'static str,
        queue_depth: usize,
        read: impl Fn(ReadReq, X) -> Result<Landed, IoError> + Send + Sync + 'static,
    ) -> Result<Self, IoError> {
        let queue = Arc::new(JobQueue::new(
            2 * queue_depth,
            AHEAD_PER_WORKER * queue_depth,
        ));
        let read = Arc::new(read);
        let mut pool = Self {
            backend,
            queue,
            workers: Vec::with_capacity(queue_depth),
            meter: Arc::new(ActivityMeter::new()),
        };
        for i in 0..queue_depth {
            let (q, read, meter) = (pool.queue.clone(), read.clone(), pool.meter.clone());
            let handle = std::thread::Builder::new()
                .name(format!("ft-{backend}-{i}"))
                .spawn(move || {
                    while let Some(job) = q.pop() {
                        job.done.mark_started();
                        meter.start();
                        let landed = read(job.req, job.plan);
                        meter.end();
                        job.done.complete(job.idx, landed);
                    }
                })
                .map_err(|e| IoError::Backend {
                    backend,
                    what: format!("spawn: {e}"),
                })?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// The workers' reads so far (see [`crate::activity`]).
    pub(crate) fn activity(&self) -> DriveActivity {
        self.meter.snapshot()
    }

    /// Queue every request of `reqs` (one ticket), `plan(req)` deciding
    /// for each as it is queued.
    pub(crate) fn submit(&self, reqs: Vec<ReadReq>, plan: impl FnMut(&ReadReq) -> X) -> Ticket {
        let (ticket, jobs) = Self::jobs(reqs, plan);
        for job in jobs {
            if let Err(job) = self.queue.push(job) {
                let err = IoError::Backend {
                    backend: self.backend,
                    what: "workers exited".into(),
                };
                job.done.complete(job.idx, Err(err));
            }
        }
        ticket
    }
}

impl<X: Send + 'static> ReadWorkers<X> {
    /// Queue every request of `reqs` (one ticket) on the read-ahead lane,
    /// behind every demand read; `None` (nothing queued) when the lane has
    /// no room for all of them or the workers are gone. Never blocks.
    pub(crate) fn try_submit_ahead(
        &self,
        reqs: Vec<ReadReq>,
        plan: impl FnMut(&ReadReq) -> X,
    ) -> Option<Ticket> {
        // Plan only requests that will be queued (the simulator's plans
        // draw its faults).
        if !self.queue.ahead_room(reqs.len()) {
            return None;
        }
        let (ticket, jobs) = Self::jobs(reqs, plan);
        self.queue.try_push_ahead(jobs).ok().map(|()| ticket)
    }

    /// One ticket over `reqs` and its jobs, `plan(req)` deciding for each.
    fn jobs(reqs: Vec<ReadReq>, mut plan: impl FnMut(&ReadReq) -> X) -> (Ticket, Vec<Job<X>>) {
        let (ticket, done) = Ticket::new(reqs.len());
        let jobs = reqs
            .into_iter()
            .enumerate()
            .map(|(idx, req)| Job {
                plan: plan(&req),
                req,
                idx,
                done: done.clone(),
            })
            .collect();
        (ticket, jobs)
    }
}

impl<X> Drop for ReadWorkers<X> {
    fn drop(&mut self) {
        self.queue.close();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
