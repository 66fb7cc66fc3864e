//! The simulator's fault plan: what to inject, and the per-operation draw
//! that makes a seed replay (see [`crate::sim`]).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flashtier_format::splitmix::splitmix64;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::error::IoError;

/// Which operations a countdown fault targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Reads only.
    Read,
    /// Writes only.
    Write,
    /// Reads and writes, counted together.
    Any,
}

/// A fault a countdown injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// EIO on a read or a write.
    Eio,
    /// ENOSPC (writes; on a read it acts as EIO).
    Enospc,
    /// A torn write (on a read it acts as EIO).
    Torn,
}

/// "Fail the Nth operation": the `n`th matching operation (1-based, counted
/// in submission order among operations inside the plan's offset range)
/// gets `fault`; with `sticky`, every later matching operation does too
/// (a device that died).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Countdown {
    /// Which operations count.
    pub op: OpKind,
    /// 1-based index of the first failing operation.
    pub n: u64,
    /// What happens to it.
    pub fault: Fault,
    /// Whether every later matching operation fails too.
    pub sticky: bool,
}

/// Probabilities and countdowns of injected faults. All probabilities are in
/// `0.0..=1.0`; the default plan injects nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// Seed; `None` draws one from the OS. `FLASHTIER_SIM_SEED` overrides both.
    pub seed: Option<u64>,
    /// Probability a read is split into short reads (resubmitted, invisible).
    pub short_read: f64,
    /// Probability a read fails with EIO.
    pub read_eio: f64,
    /// Probability a write fails with EIO, nothing written.
    pub write_eio: f64,
    /// Probability a write fails with ENOSPC, nothing written.
    pub enospc: f64,
    /// Probability a write is torn: an aligned prefix persists, then EIO.
    pub torn_write: f64,
    /// Probability an operation is delayed by `latency`.
    pub latency_prob: f64,
    /// Added latency.
    pub latency: Duration,
    /// Countdown fault.
    pub countdown: Option<Countdown>,
    /// Restrict faults to operations overlapping this byte range of a file.
    pub offset_range: Option<Range<u64>>,
}

impl FaultPlan {
    /// No faults, OS-drawn seed (faults-off sim).
    #[must_use]
    pub fn off() -> Self {
        Self::default()
    }

    /// No faults yet, fixed seed; add faults with the builder methods.
    #[must_use]
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed: Some(seed),
            ..Self::default()
        }
    }

    /// Split reads into short reads with probability `p`.
    #[must_use]
    pub fn short_reads(mut self, p: f64) -> Self {
        self.short_read = p;
        self
    }

    /// Fail reads with EIO with probability `p`.
    #[must_use]
    pub fn read_eio(mut self, p: f64) -> Self {
        self.read_eio = p;
        self
    }

    /// Fail writes with EIO with probability `p`.
    #[must_use]
    pub fn write_eio(mut self, p: f64) -> Self {
        self.write_eio = p;
        self
    }

    /// Fail writes with ENOSPC with probability `p`.
    #[must_use]
    pub fn enospc(mut self, p: f64) -> Self {
        self.enospc = p;
        self
    }

    /// Tear writes with probability `p`.
    #[must_use]
    pub fn torn_writes(mut self, p: f64) -> Self {
        self.torn_write = p;
        self
    }

    /// Delay operations by `latency` with probability `p`.
    #[must_use]
    pub fn latency(mut self, p: f64, latency: Duration) -> Self {
        self.latency_prob = p;
        self.latency = latency;
        self
    }

    /// Inject `fault` into the `n`th (1-based) operation of kind `op`.
    #[must_use]
    pub fn fail_nth(mut self, op: OpKind, n: u64, fault: Fault) -> Self {
        self.countdown = Some(Countdown {
            op,
            n,
            fault,
            sticky: false,
        });
        self
    }

    /// Inject `fault` into the `n`th operation of kind `op` and every later one.
    #[must_use]
    pub fn fail_from_nth(mut self, op: OpKind, n: u64, fault: Fault) -> Self {
        self.countdown = Some(Countdown {
            op,
            n,
            fault,
            sticky: true,
        });
        self
    }

    /// Only inject into operations overlapping `range` (file byte offsets).
    #[must_use]
    pub fn in_range(mut self, range: Range<u64>) -> Self {
        self.offset_range = Some(range);
        self
    }

    pub(crate) fn validate(&self) -> Result<(), IoError> {
        let probs = [
            ("short_read", self.short_read),
            ("read_eio", self.read_eio),
            ("write_eio", self.write_eio),
            ("enospc", self.enospc),
            ("torn_write", self.torn_write),
            ("latency_prob", self.latency_prob),
        ];
        for (name, p) in probs {
            if !(0.0..=1.0).contains(&p) {
                return Err(IoError::Invalid(format!(
                    "sim fault probability {name} = {p} outside 0..=1"
                )));
            }
        }
        if self.countdown.is_some_and(|c| c.n == 0) {
            return Err(IoError::Invalid("sim countdown n is 1-based, got 0".into()));
        }
        Ok(())
    }
}

/// What the plan decided for one operation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Decision {
    pub(crate) fail: Option<Fault>,
    pub(crate) short: bool,
    pub(crate) delay: bool,
    /// Per-op generator seed for split points and torn prefixes.
    pub(crate) rng_seed: u64,
}

pub(crate) struct Planner {
    pub(crate) plan: FaultPlan,
    pub(crate) seed: u64,
    pub(crate) ops: AtomicU64,
    pub(crate) reads_matched: AtomicU64,
    pub(crate) writes_matched: AtomicU64,
    pub(crate) any_matched: AtomicU64,
}

impl Planner {
    pub(crate) fn decide(&self, is_write: bool, offset: u64, len: usize) -> Decision {
        let op = self.ops.fetch_add(1, Ordering::Relaxed);
        let rng_seed = splitmix64(self.seed ^ splitmix64(op));
        let mut rng = SmallRng::seed_from_u64(rng_seed);
        let p = &self.plan;
        let mut d = Decision {
            fail: None,
            short: false,
            delay: false,
            rng_seed,
        };
        let in_range = p
            .offset_range
            .as_ref()
            .is_none_or(|r| offset < r.end && offset.saturating_add(len as u64) > r.start);
        if !in_range {
            return d;
        }
        d.delay = rng.random_bool(p.latency_prob);
        if is_write {
            if rng.random_bool(p.write_eio) {
                d.fail = Some(Fault::Eio);
            } else if rng.random_bool(p.enospc) {
                d.fail = Some(Fault::Enospc);
            } else if rng.random_bool(p.torn_write) {
                d.fail = Some(Fault::Torn);
            }
        } else if rng.random_bool(p.read_eio) {
            d.fail = Some(Fault::Eio);
        } else {
            d.short = rng.random_bool(p.short_read);
        }
        if let Some(c) = p.countdown {
            let counter = match c.op {
                OpKind::Read if is_write => None,
                OpKind::Write if !is_write => None,
                OpKind::Read => Some(&self.reads_matched),
                OpKind::Write => Some(&self.writes_matched),
                OpKind::Any => Some(&self.any_matched),
            };
            if let Some(counter) = counter {
                let nth = counter.fetch_add(1, Ordering::Relaxed) + 1;
                if nth == c.n || (c.sticky && nth > c.n) {
                    d.fail = Some(c.fault);
                    d.short = false;
                }
            }
        }
        d
    }
}
