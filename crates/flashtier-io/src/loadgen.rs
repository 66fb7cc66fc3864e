//! A closed-loop load generator over any [`StorageBackend`]: keeps the
//! backend's `queue_depth` reads in flight, plus `backlog` more queued in the
//! backend so a freed slot is refilled at once (by the ring thread or a posix
//! worker) instead of after a round trip through the caller; each completion
//! submits a replacement. The backend never has more than `queue_depth` reads
//! at the device, so the device sees the same queue depth as fio's
//! `--iodepth`.
//!
//! The generator wakes for batches of completions ([`DoneQueue`]): half the
//! backlog, so the device never runs short while it sleeps. With a backend
//! that reaps on the caller's thread ([`StorageBackend::reap_on_caller`],
//! e.g. [`crate::UringLocal`]) it instead submits and reaps on its own
//! thread, like fio: it sleeps in the kernel for the next completion, which
//! is processed inline, with no cross-thread wake-up.
//!
//! Latency is service time, from the moment the backend starts a read
//! ([`Ticket::started_at`]) to its completion ([`Ticket::finished_at`]), the
//! analogue of fio's `clat`; turnaround (from `read_async`, queueing
//! included) is recorded beside it.
//!
//! Used by `flashtier bench io` and reusable by other benches. Reads land in
//! one [`LandingRegion`] of `(queue_depth + backlog) * block_bytes` bytes,
//! registered with the backend (io_uring fixed buffers), so the hot loop
//! allocates no buffers.
//!
//! Bounds: `queue_depth + backlog` reads outstanding (each at most 256), one
//! landing region of that many blocks, one [`DoneQueue`] holding at most that
//! many tokens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::backend::{Landing, ReadReq, StorageBackend, Ticket};
use crate::done::DoneQueue;
use crate::error::IoError;
use crate::file::StoreFile;
use crate::region::LandingRegion;
use crate::workers::MAX_QUEUE_DEPTH;

/// Offset pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Uniform random block-aligned offsets.
    Random,
    /// Consecutive blocks from a random start, wrapping at the span.
    Sequential,
}

impl std::str::FromStr for Pattern {
    type Err = IoError;
    fn from_str(s: &str) -> Result<Self, IoError> {
        match s {
            "rand" | "random" | "randread" => Ok(Self::Random),
            "seq" | "sequential" | "read" => Ok(Self::Sequential),
            other => Err(IoError::Invalid(format!(
                "unknown pattern {other} (rand | seq)"
            ))),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// File to read.
    pub file: Arc<StoreFile>,
    /// Bytes of the file the offsets range over (from 0).
    pub span_bytes: u64,
    /// Bytes per read.
    pub block_bytes: usize,
    /// Offset pattern.
    pub pattern: Pattern,
    /// How long to keep issuing reads.
    pub duration: Duration,
    /// Seed of the offset generator (differ it per run to dodge caches).
    pub seed: u64,
    /// Reads queued in the backend beyond its queue depth (0..=256).
    pub backlog: usize,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct LoadReport {
    /// Backend name.
    pub backend: &'static str,
    /// Queue depth kept in flight.
    pub queue_depth: usize,
    /// Bytes per read.
    pub block_bytes: usize,
    /// Reads completed.
    pub ops: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Wall time from first submission to last completion.
    pub elapsed: Duration,
    /// Per-read service time (backend start to completion), nanoseconds.
    pub latency_ns: Histogram<u64>,
    /// Per-read turnaround (`read_async` to completion), nanoseconds.
    pub turnaround_ns: Histogram<u64>,
}

impl LoadReport {
    /// Reads per second.
    #[must_use]
    pub fn iops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Bytes per second.
    #[must_use]
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Latency at quantile `q` (0..=1) in microseconds.
    #[must_use]
    pub fn latency_us(&self, q: f64) -> f64 {
        self.latency_ns.value_at_quantile(q) as f64 / 1000.0
    }
}

/// Progress as the run goes (for a progress bar).
#[derive(Clone, Copy, Debug)]
pub struct LoadProgress {
    /// Time since the start.
    pub elapsed: Duration,
    /// Reads completed so far.
    pub ops: u64,
    /// Bytes read so far.
    pub bytes: u64,
}

struct Offsets {
    rng: SmallRng,
    pattern: Pattern,
    blocks: u64,
    next: u64,
    block_bytes: u64,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        let blk = match self.pattern {
            Pattern::Random => self.rng.random_range(0..self.blocks),
            Pattern::Sequential => {
                let b = self.next;
                self.next = (self.next + 1) % self.blocks;
                b
            }
        };
        blk * self.block_bytes
    }
}

/// Run `spec` on `backend` with its queue depth; `on_progress` is called
/// about every 100 ms. The first failed read ends the run with its error.
pub fn run_load(
    backend: &dyn StorageBackend,
    spec: &LoadSpec,
    mut on_progress: impl FnMut(LoadProgress),
) -> Result<LoadReport, IoError> {
    let qd = backend.queue_depth();
    if spec.backlog > MAX_QUEUE_DEPTH {
        return Err(IoError::Invalid(format!(
            "backlog {} exceeds {MAX_QUEUE_DEPTH}",
            spec.backlog
        )));
    }
    let outstanding = qd + spec.backlog;
    let bs = spec.block_bytes;
    let blocks = spec.span_bytes / bs.max(1) as u64;
    if bs == 0 || blocks == 0 {
        return Err(IoError::Invalid(format!(
            "span of {} bytes holds no {bs}-byte block",
            spec.span_bytes
        )));
    }
    let region = LandingRegion::host(outstanding * bs);
    backend.register_landing_region(&region)?;
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let start_blk = rng.random_range(0..blocks);
    let mut offsets = Offsets {
        rng,
        pattern: spec.pattern,
        blocks,
        next: start_blk,
        block_bytes: bs as u64,
    };
    let new_hist = || {
        Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
            .map_err(|e| IoError::Invalid(format!("histogram: {e}")))
    };
    let (mut latency_ns, mut turnaround_ns) = (new_hist()?, new_hist()?);
    let done_q = Arc::new(DoneQueue::new());
    let mut slots: Vec<Option<(Ticket, Instant)>> = (0..outstanding).map(|_| None).collect();
    let (mut ops, mut bytes) = (0u64, 0u64);
    let start = Instant::now();
    let deadline = start + spec.duration;
    let mut last_tick = start;
    let submit = |slot: usize, offsets: &mut Offsets| -> Result<(Ticket, Instant), IoError> {
        let req = ReadReq {
            file: spec.file.clone(),
            offset: offsets.next(),
            len: bs,
            landing: Landing::Region {
                region: region.clone(),
                offset: slot * bs,
            },
            tag: slot as u64,
        };
        let t0 = Instant::now();
        let ticket = backend.read_async(vec![req])?;
        ticket.notify_on_done_to(&done_q, slot as u64);
        Ok((ticket, t0))
    };
    for (i, s) in slots.iter_mut().enumerate() {
        *s = Some(submit(i, &mut offsets)?);
    }
    let mut in_flight = outstanding;
    let mut ready = Vec::with_capacity(outstanding);
    // A caller-reaped backend completes reads only while this thread reaps.
    let caller_reaps = backend.reap_on_caller();
    while in_flight > 0 {
        ready.clear();
        if caller_reaps {
            // fio's loop: take what is done; else sleep in the kernel for
            // the next completion, processed on this thread.
            if done_q.wait(1, Duration::ZERO, &mut ready) == 0 {
                backend.reap_on_caller();
                done_q.wait(1, Duration::ZERO, &mut ready);
            }
        } else {
            // Wake for a batch: half the backlog can complete before the
            // device would run short of queued reads.
            let min = (spec.backlog / 2).clamp(1, in_flight);
            done_q.wait(min, Duration::from_millis(100), &mut ready);
        }
        for &token in &ready {
            let slot = token as usize;
            let Some((ticket, t0)) = slots.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            let started = ticket.started_at().unwrap_or(t0);
            let finished = ticket.finished_at();
            ticket.wait()?;
            let now = Instant::now();
            let finished = finished.unwrap_or(now);
            let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            latency_ns.saturating_record(ns(finished.saturating_duration_since(started)));
            turnaround_ns.saturating_record(ns(finished.saturating_duration_since(t0)));
            ops += 1;
            bytes += bs as u64;
            in_flight -= 1;
            if now < deadline {
                if let Some(s) = slots.get_mut(slot) {
                    *s = Some(submit(slot, &mut offsets)?);
                    in_flight += 1;
                }
            }
        }
        let now = Instant::now();
        if now - last_tick >= Duration::from_millis(100) {
            last_tick = now;
            on_progress(LoadProgress {
                elapsed: now - start,
                ops,
                bytes,
            });
        }
    }
    Ok(LoadReport {
        backend: backend.name(),
        queue_depth: qd,
        block_bytes: bs,
        ops,
        bytes,
        elapsed: start.elapsed(),
        latency_ns,
        turnaround_ns,
    })
}
