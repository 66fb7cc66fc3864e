//! Measuring a drive on a given access pattern: [`LoggingBackend`] wraps any
//! backend and logs the extent of every read it passes on; [`read_extents`]
//! reads a list of extents of one file with direct I/O at a queue depth,
//! timed. Together they replay exactly the reads a workload issued (same
//! offsets, lengths and order), so the bandwidth the drive gives them is
//! comparable with the workload's own; [`record_extents`] picks fresh whole
//! records of a store for a probe of the drive on records of that size.
//!
//! Bounds: the log holds one [`Extent`] per read passed on (the caller bounds
//! the workload); [`read_extents`] holds at most `queue_depth` buffers, each
//! as long as the longest extent read so far.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use flashtier_format::{FormatError, Store};

use crate::backend::{Landing, ReadReq, StorageBackend, Ticket};
use crate::buf::AlignedBuf;
use crate::error::IoError;
use crate::file::{DirectMode, StoreFile};
use crate::posix::PosixBackend;
use crate::region::LandingRegion;

/// One read: `len` bytes at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: usize,
}

/// A [`StorageBackend`] that logs each read's [`Extent`] and passes the read
/// on to the backend it wraps.
pub struct LoggingBackend {
    inner: Arc<dyn StorageBackend>,
    log: Mutex<Vec<Extent>>,
}

impl std::fmt::Debug for LoggingBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoggingBackend")
            .field("inner", &self.inner.name())
            .finish_non_exhaustive()
    }
}

impl LoggingBackend {
    /// Log the reads that go through `inner`.
    pub fn new(inner: Arc<dyn StorageBackend>) -> Self {
        Self {
            inner,
            log: Mutex::new(Vec::new()),
        }
    }

    fn append(&self, extents: Vec<Extent>) {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(extents);
    }

    /// The reads so far, in issue order.
    pub fn reads(&self) -> Vec<Extent> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl StorageBackend for LoggingBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        self.append(extents_of(&reqs));
        self.inner.read_async(reqs)
    }

    fn read_ahead(&self, reqs: Vec<ReadReq>) -> Result<Option<Ticket>, IoError> {
        // A refused batch was never issued: only what the lane took is logged.
        let extents = extents_of(&reqs);
        let ticket = self.inner.read_ahead(reqs)?;
        if ticket.is_some() {
            self.append(extents);
        }
        Ok(ticket)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        self.inner.write(file, offset, src)
    }

    fn register_landing_region(&self, region: &Arc<LandingRegion>) -> Result<(), IoError> {
        self.inner.register_landing_region(region)
    }

    fn activity(&self) -> Option<crate::DriveActivity> {
        self.inner.activity()
    }

    fn reap_on_caller(&self) -> bool {
        self.inner.reap_on_caller()
    }
}

fn extents_of(reqs: &[ReadReq]) -> Vec<Extent> {
    reqs.iter()
        .map(|r| Extent {
            offset: r.offset,
            len: r.len,
        })
        .collect()
}

/// How [`read_extents`] keeps the drive busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refill {
    /// A new read starts as the oldest in flight lands (the queue stays full).
    Sliding,
    /// `queue_depth` reads start together and all land before the next batch
    /// (a caller that waits for each whole step, as the expert pool does).
    Batches,
}

/// What [`read_extents`] measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExtentRead {
    /// Bytes read.
    pub bytes: u64,
    /// Wall seconds from the first read started to the last landed.
    pub secs: f64,
}

impl ExtentRead {
    /// Bytes per second (0 when nothing was timed).
    pub fn bytes_per_sec(&self) -> f64 {
        if self.secs > 0.0 {
            self.bytes as f64 / self.secs
        } else {
            0.0
        }
    }
}

/// Read `extents` of the file at `path` in order with direct I/O
/// (preferred), `queue_depth` in flight on posix workers, refilled as
/// `refill` says; `progress` sees the bytes landed so far.
pub fn read_extents(
    path: &Path,
    extents: &[Extent],
    queue_depth: usize,
    refill: Refill,
    progress: &mut dyn FnMut(u64),
) -> Result<ExtentRead, IoError> {
    let backend = PosixBackend::new(queue_depth.max(1))?;
    read_extents_on(&backend, path, extents, queue_depth, refill, progress)
}

/// [`read_extents`] on `backend` (the one whose reads the probe stands
/// for: a caller reading through io_uring probes through it too).
pub fn read_extents_on(
    backend: &dyn StorageBackend,
    path: &Path,
    extents: &[Extent],
    queue_depth: usize,
    refill: Refill,
    progress: &mut dyn FnMut(u64),
) -> Result<ExtentRead, IoError> {
    let depth = queue_depth.max(1);
    let file = StoreFile::open_read(path, DirectMode::Prefer)?;
    let mut spare: Vec<AlignedBuf> = Vec::with_capacity(depth);
    let mut window: VecDeque<Ticket> = VecDeque::with_capacity(depth);
    let mut bytes = 0u64;
    let mut land = |ticket: Ticket, spare: &mut Vec<AlignedBuf>| -> Result<(), IoError> {
        for landed in ticket.wait()? {
            bytes += landed.len as u64;
            spare.extend(landed.buf);
        }
        progress(bytes);
        Ok(())
    };
    let started = Instant::now();
    for (i, e) in extents.iter().enumerate() {
        let full = match refill {
            Refill::Sliding => window.len() == depth,
            Refill::Batches => i % depth == 0,
        };
        if full {
            while let Some(t) = window.pop_front() {
                land(t, &mut spare)?;
                if refill == Refill::Sliding {
                    break;
                }
            }
        }
        let buf = match spare.pop() {
            Some(mut b) if b.capacity() >= e.len => {
                b.set_len(e.len);
                b
            }
            _ => AlignedBuf::zeroed(e.len),
        };
        let req = ReadReq {
            file: file.clone(),
            offset: e.offset,
            len: e.len,
            landing: Landing::Host(buf),
            tag: i as u64,
        };
        window.push_back(backend.read_async(vec![req])?);
    }
    while let Some(t) = window.pop_front() {
        land(t, &mut spare)?;
    }
    Ok(ExtentRead {
        bytes,
        secs: started.elapsed().as_secs_f64(),
    })
}

/// `count` whole records of `store` (each its stride long), spread
/// pseudo-randomly over the store; `round` picks another set.
pub fn record_extents(store: &Store, count: usize, round: u64) -> Result<Vec<Extent>, FormatError> {
    let stride = store.stride_bytes();
    let len = usize::try_from(stride).map_err(|_| FormatError::BadField {
        path: store.path().to_path_buf(),
        field: "record_stride_bytes",
        value: stride,
        why: "overflows this machine's sizes",
    })?;
    let records = store.record_count().max(1);
    (0..count as u64)
        .map(|i| {
            let r = i
                .wrapping_mul(0x9E37_79B9)
                .wrapping_add(round.wrapping_mul(0x85EB_CA6B))
                % records;
            Ok(Extent {
                offset: store.record_offset(r)?,
                len,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::StorageBackend;

    #[test]
    fn logged_reads_replay_in_order_in_both_refills() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("data.bin");
        std::fs::write(&path, vec![5u8; 64 << 10])?;
        let logger = LoggingBackend::new(Arc::new(PosixBackend::new(2)?));
        let file = StoreFile::open_read(&path, DirectMode::Prefer)?;
        let reqs = [(8192u64, 4096usize), (0, 8192), (40960, 4096)].map(|(offset, len)| ReadReq {
            file: file.clone(),
            offset,
            len,
            landing: Landing::Host(AlignedBuf::zeroed(len)),
            tag: offset,
        });
        logger.read(reqs.into())?;
        let log = logger.reads();
        let want = [
            Extent {
                offset: 8192,
                len: 4096,
            },
            Extent {
                offset: 0,
                len: 8192,
            },
            Extent {
                offset: 40960,
                len: 4096,
            },
        ];
        assert_eq!(log, want);
        for (depth, refill) in [
            (1, Refill::Sliding),
            (2, Refill::Sliding),
            (2, Refill::Batches),
        ] {
            let mut seen = Vec::new();
            let r = read_extents(&path, &log, depth, refill, &mut |b| seen.push(b))?;
            assert_eq!(r.bytes, 16384, "{refill:?} at {depth}");
            assert_eq!(seen.last(), Some(&16384));
            assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        }
        let err = read_extents(
            &path,
            &[Extent {
                offset: 1 << 20,
                len: 4096,
            }],
            1,
            Refill::Sliding,
            &mut |_| {},
        );
        assert!(err.is_err(), "a read past the end is an error");
        // The same reads on a caller's backend go through it, each once.
        let other = LoggingBackend::new(Arc::new(PosixBackend::new(2)?));
        let r = read_extents_on(&other, &path, &log, 2, Refill::Batches, &mut |_| {})?;
        assert_eq!(r.bytes, 16384);
        assert_eq!(other.reads(), want);
        Ok(())
    }
}
