//! The portable backend: positional reads and writes on a pool of worker
//! threads, which is how it gives the drive queue depth.
//!
//! Bounds: `queue_depth` workers (1..=256), each with one request in flight;
//! the job queue holds at most `2 * queue_depth` requests, so `read_async`
//! blocks (back-pressure) rather than growing memory without limit. A queued
//! job wakes exactly one idle worker (see [`crate::queue`]).

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::backend::{Completer, ReadReq, StorageBackend, Ticket, read_blocking};
use crate::error::IoError;
use crate::file::StoreFile;
use crate::queue::JobQueue;

/// Largest supported queue depth.
pub const MAX_QUEUE_DEPTH: usize = 256;

struct Job {
    req: ReadReq,
    idx: usize,
    done: Completer,
}

/// pread/pwrite on worker threads.
pub struct PosixBackend {
    queue: Arc<JobQueue<Job>>,
    workers: Vec<JoinHandle<()>>,
    queue_depth: usize,
}

impl PosixBackend {
    /// A backend with `queue_depth` workers (1..=256).
    pub fn new(queue_depth: usize) -> Result<Self, IoError> {
        if !(1..=MAX_QUEUE_DEPTH).contains(&queue_depth) {
            return Err(IoError::Invalid(format!(
                "queue depth {queue_depth} outside 1..={MAX_QUEUE_DEPTH}"
            )));
        }
        let queue = Arc::new(JobQueue::new(2 * queue_depth));
        let mut workers = Vec::with_capacity(queue_depth);
        for i in 0..queue_depth {
            let q = queue.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ft-posix-{i}"))
                .spawn(move || worker(&q))
                .map_err(|e| IoError::Backend {
                    backend: "posix",
                    what: format!("spawn: {e}"),
                })?;
            workers.push(handle);
        }
        Ok(Self {
            queue,
            workers,
            queue_depth,
        })
    }
}

fn worker(queue: &JobQueue<Job>) {
    while let Some(job) = queue.pop() {
        job.done.mark_started();
        job.done.complete(job.idx, read_blocking(job.req));
    }
}

impl StorageBackend for PosixBackend {
    fn name(&self) -> &'static str {
        "posix"
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        let (ticket, done) = Ticket::new(reqs.len());
        for (idx, req) in reqs.into_iter().enumerate() {
            let job = Job {
                req,
                idx,
                done: done.clone(),
            };
            if let Err(job) = self.queue.push(job) {
                let err = IoError::Backend {
                    backend: "posix",
                    what: "workers exited".into(),
                };
                job.done.complete(job.idx, Err(err));
            }
        }
        Ok(ticket)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        file.write_all_at(src, offset)
    }
}

impl Drop for PosixBackend {
    fn drop(&mut self) {
        self.queue.close();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
