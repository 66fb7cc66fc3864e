//! The portable backend: positional reads and writes on a pool of worker
//! threads, which is how it gives the drive queue depth.
//!
//! Bounds: `queue_depth` workers (1..=256), each with one request in flight;
//! the job queue holds at most `2 * queue_depth` requests, so `read_async`
//! blocks (back-pressure) rather than growing memory without limit, and
//! `4 * queue_depth` read-ahead requests (`read_ahead`, refused beyond
//! that, served only when no demand read waits). A queued
//! job wakes exactly one idle worker. The workers and their queue are the
//! simulator's too (`workers.rs`, `queue.rs`).

use crate::backend::{ReadReq, StorageBackend, Ticket, read_blocking};
use crate::error::IoError;
use crate::file::StoreFile;
pub use crate::workers::MAX_QUEUE_DEPTH;
use crate::workers::{ReadWorkers, check_queue_depth};

/// pread/pwrite on worker threads.
pub struct PosixBackend {
    workers: ReadWorkers<()>,
    queue_depth: usize,
}

impl PosixBackend {
    /// A backend with `queue_depth` workers (1..=256).
    pub fn new(queue_depth: usize) -> Result<Self, IoError> {
        check_queue_depth(queue_depth)?;
        let workers = ReadWorkers::spawn("posix", queue_depth, |req, ()| read_blocking(req))?;
        Ok(Self {
            workers,
            queue_depth,
        })
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
        Ok(self.workers.submit(reqs, |_| ()))
    }

    fn activity(&self) -> Option<crate::DriveActivity> {
        Some(self.workers.activity())
    }

    fn read_ahead(&self, reqs: Vec<ReadReq>) -> Result<Option<Ticket>, IoError> {
        Ok(self.workers.try_submit_ahead(reqs, |_| ()))
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        file.write_all_at(src, offset)
    }
}
