//! The demo's measure of the drive on the decode's own access pattern: a
//! backend wrapper that logs every read the expert pool issues, and a replay
//! of that log (same offsets, same lengths, same order, direct I/O, the
//! pool's queue depth kept full). The replay's bandwidth is what the drive
//! gives for exactly the reads the decode needed, host cache and all, so the
//! I/O bound it yields is comparable with the decode's tokens/s.
//!
//! Bound: the log holds one `(offset, len)` per read of one decode (at most
//! tokens x sparse layers x (top_k + hinted) entries); the replay holds
//! `queue_depth` record buffers.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use flashtier_io::{
    AlignedBuf, DirectMode, IoError, Landing, LandingRegion, PosixBackend, ReadReq, StorageBackend,
    StoreFile, Ticket,
};

use crate::error::EngineError;

/// A [`StorageBackend`] that logs each read's `(offset, len)` and passes it on.
pub struct RecordingBackend {
    inner: PosixBackend,
    log: Mutex<Vec<(u64, usize)>>,
}

impl std::fmt::Debug for RecordingBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingBackend").finish_non_exhaustive()
    }
}

impl RecordingBackend {
    /// A posix backend of `queue_depth` readers, logging.
    pub fn new(queue_depth: usize) -> Result<Self, IoError> {
        Ok(Self {
            inner: PosixBackend::new(queue_depth.max(1))?,
            log: Mutex::new(Vec::new()),
        })
    }

    /// The reads so far, in issue order.
    pub fn reads(&self) -> Vec<(u64, usize)> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl StorageBackend for RecordingBackend {
    fn name(&self) -> &'static str {
        "posix (logged)"
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        if let Ok(mut log) = self.log.lock() {
            log.extend(reqs.iter().map(|r| (r.offset, r.len)));
        }
        self.inner.read_async(reqs)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        self.inner.write(file, offset, src)
    }

    fn register_landing_region(&self, region: &Arc<LandingRegion>) -> Result<(), IoError> {
        self.inner.register_landing_region(region)
    }
}

/// Read `reads` from `path` with direct I/O, keeping `queue_depth` reads in
/// flight (a new one starts as the oldest lands); returns bytes per second.
pub fn replay(path: &Path, reads: &[(u64, usize)], queue_depth: usize) -> Result<f64, EngineError> {
    let depth = queue_depth.max(1);
    let file = StoreFile::open_read(path, DirectMode::Prefer)?;
    let backend = PosixBackend::new(depth)?;
    let mut spare: Vec<AlignedBuf> = Vec::with_capacity(depth);
    let mut window: VecDeque<Ticket> = VecDeque::with_capacity(depth);
    let mut bytes = 0u64;
    let mut land = |ticket: Ticket, spare: &mut Vec<AlignedBuf>| -> Result<(), EngineError> {
        for landed in ticket.wait()? {
            bytes += landed.buf.as_ref().map_or(0, |b| b.len() as u64);
            spare.extend(landed.buf);
        }
        Ok(())
    };
    let started = Instant::now();
    for &(offset, len) in reads {
        if window.len() == depth {
            if let Some(t) = window.pop_front() {
                land(t, &mut spare)?;
            }
        }
        let buf = match spare.pop() {
            Some(mut b) if b.capacity() >= len => {
                b.set_len(len);
                b
            }
            _ => AlignedBuf::zeroed(len),
        };
        let req = ReadReq {
            file: file.clone(),
            offset,
            len,
            landing: Landing::Host(buf),
            tag: offset,
        };
        window.push_back(backend.read_async(vec![req])?);
    }
    while let Some(t) = window.pop_front() {
        land(t, &mut spare)?;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(if secs > 0.0 { bytes as f64 / secs } else { 0.0 })
}
