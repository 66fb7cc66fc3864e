//! The seeded fault-injecting backend: real files, blocking reads on worker
//! threads, and a [`FaultPlan`] that decides, per operation, whether the
//! kernel "returns" a short read, EIO, ENOSPC, a torn write or extra latency.
//!
//! Replay: every backend prints its seed to stderr once when it opens
//! (`flashtier sim: seed=N ...`); setting `FLASHTIER_SIM_SEED=N` makes the next
//! run draw the same faults for the same sequence of operations. Each
//! operation's fault is drawn from a generator seeded by `(seed, op index)`,
//! and op indexes are assigned in submission order, so concurrency does not
//! change which operation fails.
//!
//! What each fault does:
//! - short read: the simulated kernel returns fewer bytes than asked (a
//!   multiple of the file's direct-I/O alignment); the backend resubmits the
//!   remainder until the request is exact, so short reads show only in
//!   [`SimStats`], never in the landed bytes;
//! - EIO (reads and writes): the operation fails with [`IoError::Read`] or
//!   [`IoError::Write`] naming path, offset and length;
//! - ENOSPC (writes): nothing is written, the write fails;
//! - torn write: only an aligned prefix reaches the file, then the write fails
//!   with EIO; a reader sees the old bytes past the prefix;
//! - latency: the operation sleeps first.
//!
//! Bounds: `queue_depth` workers (1..=256), a job queue of `2 * queue_depth`
//! requests (`read_async` blocks beyond it), one request in flight per worker.
//!
//! ```
//! use flashtier_io::sim::{FaultPlan, SimBackend};
//! use flashtier_io::{AlignedBuf, DirectMode, Landing, ReadReq, StorageBackend, StoreFile};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("data.bin");
//! std::fs::write(&path, vec![3u8; 16384])?;
//! let file = StoreFile::open_read(&path, DirectMode::Prefer)?;
//! // Every read comes back short at least once; the bytes are still exact.
//! let sim = SimBackend::new(FaultPlan::seeded(7).short_reads(1.0), 2)?;
//! let req = ReadReq { file, offset: 0, len: 16384, landing: Landing::Host(AlignedBuf::zeroed(16384)), tag: 0 };
//! let landed = sim.read(vec![req])?;
//! assert!(landed[0].buf.as_ref().unwrap().iter().all(|&b| b == 3));
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::backend::{ReadReq, StorageBackend, Ticket, read_blocking_with};
use crate::error::IoError;
use crate::file::StoreFile;
pub use crate::sim_plan::{Countdown, Fault, FaultPlan, OpKind};
use crate::sim_plan::{Decision, Planner};
use crate::workers::{ReadWorkers, check_queue_depth};

/// Environment variable that overrides the plan's seed (replay; read by
/// [`crate::settings`]).
pub const SEED_ENV: &str = crate::settings::SIM_SEED;

/// Most short-read splits the simulator injects into one request.
const MAX_SHORT_SPLITS: u32 = 8;

/// Counters of what the simulator did (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Read requests started.
    pub reads: u64,
    /// Write requests started.
    pub writes: u64,
    /// Short reads injected (each one resubmitted).
    pub short_reads: u64,
    /// Read EIOs injected.
    pub read_eio: u64,
    /// Write EIOs injected.
    pub write_eio: u64,
    /// ENOSPCs injected.
    pub enospc: u64,
    /// Torn writes injected.
    pub torn_writes: u64,
    /// Operations delayed.
    pub delayed: u64,
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    short_reads: AtomicU64,
    read_eio: AtomicU64,
    write_eio: AtomicU64,
    enospc: AtomicU64,
    torn_writes: AtomicU64,
    delayed: AtomicU64,
}

struct Shared {
    planner: Planner,
    stats: Counters,
}

/// The fault-injecting backend. See the module docs.
pub struct SimBackend {
    shared: Arc<Shared>,
    workers: ReadWorkers<Decision>,
    queue_depth: usize,
}

impl SimBackend {
    /// Count a read as it is queued and draw its fault decision.
    fn plan_read(&self, req: &ReadReq) -> Decision {
        self.shared.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.shared.planner.decide(false, req.offset, req.len)
    }

    /// A simulator running `plan` on `queue_depth` workers (1..=256). Prints
    /// its seed to stderr once.
    pub fn new(plan: FaultPlan, queue_depth: usize) -> Result<Self, IoError> {
        check_queue_depth(queue_depth)?;
        plan.validate()?;
        let seed = seed_for(&plan)?;
        eprintln!("flashtier sim: seed={seed} (replay with {SEED_ENV}={seed})");
        let shared = Arc::new(Shared {
            planner: Planner {
                plan,
                seed,
                ops: AtomicU64::new(0),
                reads_matched: AtomicU64::new(0),
                writes_matched: AtomicU64::new(0),
                any_matched: AtomicU64::new(0),
            },
            stats: Counters::default(),
        });
        let worker_shared = shared.clone();
        let workers = ReadWorkers::spawn("sim", queue_depth, move |req, d| {
            worker_shared.delay(d);
            read_blocking_with(req, |file, dst, offset| {
                worker_shared.read_exact(file, dst, offset, d)
            })
        })?;
        Ok(Self {
            shared,
            workers,
            queue_depth,
        })
    }

    /// The seed in use (printed at open).
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.shared.planner.seed
    }

    /// What has been injected so far.
    #[must_use]
    pub fn stats(&self) -> SimStats {
        let c = &self.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SimStats {
            reads: get(&c.reads),
            writes: get(&c.writes),
            short_reads: get(&c.short_reads),
            read_eio: get(&c.read_eio),
            write_eio: get(&c.write_eio),
            enospc: get(&c.enospc),
            torn_writes: get(&c.torn_writes),
            delayed: get(&c.delayed),
        }
    }
}

fn seed_for(plan: &FaultPlan) -> Result<u64, IoError> {
    let seed = crate::settings::Env::process().sim_seed()?;
    Ok(seed.or(plan.seed).unwrap_or_else(rand::random))
}

fn os_err(code: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(code)
}

impl Shared {
    fn delay(&self, d: Decision) {
        if d.delay {
            self.stats.delayed.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(self.planner.plan.latency);
        }
    }

    /// The simulated kernel's read loop: resubmits short reads until exact.
    fn read_exact(
        &self,
        file: &StoreFile,
        dst: &mut [u8],
        offset: u64,
        d: Decision,
    ) -> Result<(), IoError> {
        let len = dst.len();
        file.check_aligned(offset, len, dst.as_ptr())?;
        if d.fail.is_some() {
            self.stats.read_eio.fetch_add(1, Ordering::Relaxed);
            return Err(IoError::Read {
                path: file.path().to_path_buf(),
                offset,
                len,
                source: os_err(libc::EIO),
            });
        }
        let unit = file.offset_align().max(1);
        let mut rng = SmallRng::seed_from_u64(d.rng_seed);
        let mut splits_left = if d.short { MAX_SHORT_SPLITS } else { 0 };
        // The simulated kernel may return only an aligned part of the rest.
        file.read_exact_at_parts(dst, offset, |rest_len| {
            if splits_left > 0 && rest_len >= 2 * unit {
                splits_left -= 1;
                self.stats.short_reads.fetch_add(1, Ordering::Relaxed);
                rng.random_range(1..rest_len / unit) * unit
            } else {
                rest_len
            }
        })
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        let len = src.len();
        file.check_aligned(offset, len, src.as_ptr())?;
        let d = self.planner.decide(true, offset, len);
        self.delay(d);
        let fail = |code: i32| IoError::Write {
            path: file.path().to_path_buf(),
            offset,
            len,
            source: os_err(code),
        };
        match d.fail {
            None => file.write_all_at(src, offset),
            Some(Fault::Eio) => {
                self.stats.write_eio.fetch_add(1, Ordering::Relaxed);
                Err(fail(libc::EIO))
            }
            Some(Fault::Enospc) => {
                self.stats.enospc.fetch_add(1, Ordering::Relaxed);
                Err(fail(libc::ENOSPC))
            }
            Some(Fault::Torn) => {
                self.stats.torn_writes.fetch_add(1, Ordering::Relaxed);
                let unit = file.offset_align().max(1);
                let units = len / unit;
                let mut rng = SmallRng::seed_from_u64(d.rng_seed);
                // An aligned prefix strictly shorter than the write persists.
                let keep = if units >= 2 {
                    rng.random_range(1..units) * unit
                } else {
                    0
                };
                if let Some(prefix) = src.get(..keep) {
                    file.write_all_at(prefix, offset)?;
                }
                Err(fail(libc::EIO))
            }
        }
    }
}

impl StorageBackend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        Ok(self.workers.submit(reqs, |req| self.plan_read(req)))
    }

    fn activity(&self) -> Option<crate::DriveActivity> {
        Some(self.workers.activity())
    }

    fn read_ahead(&self, reqs: Vec<ReadReq>) -> Result<Option<Ticket>, IoError> {
        Ok(self
            .workers
            .try_submit_ahead(reqs, |req| self.plan_read(req)))
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        self.shared.write(file, offset, src)
    }
}
