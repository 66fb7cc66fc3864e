//! How busy a backend keeps the drive: the time with at least one of its
//! reads in flight, and the sum of its reads' service times (the integral
//! of reads in flight over time). A workload that should be bound by the
//! drive shows where it is not: a busy share under 1 is time the drive had
//! nothing to do; reads in flight while busy under the queue depth is time
//! it had less to do than it could.
//!
//! The thread-pool backends (posix, sim) meter every read from the moment a
//! worker starts it to its completion; [`crate::StorageBackend::activity`]
//! reads the totals, and [`DriveActivity::since`] turns two snapshots into
//! a window's.
//!
//! Bounds: a meter is a few counters behind one mutex, taken twice per read.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Totals of a backend's reads since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriveActivity {
    /// Reads completed (or failed).
    pub reads: u64,
    /// Time with at least one read in flight.
    pub busy: Duration,
    /// Sum over reads of their time in flight (completed reads, and the
    /// part so far of those still in flight).
    pub in_flight: Duration,
}

impl DriveActivity {
    /// The activity between `earlier` (a snapshot of the same backend) and
    /// this one.
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            reads: self.reads.saturating_sub(earlier.reads),
            busy: self.busy.saturating_sub(earlier.busy),
            in_flight: self.in_flight.saturating_sub(earlier.in_flight),
        }
    }

    /// Share of `window` with a read in flight (0 for an empty window).
    #[must_use]
    pub fn busy_share(&self, window: Duration) -> f64 {
        if window.is_zero() {
            return 0.0;
        }
        self.busy.as_secs_f64() / window.as_secs_f64()
    }

    /// Reads in flight on average while any was (0 when never busy).
    #[must_use]
    pub fn mean_in_flight_while_busy(&self) -> f64 {
        if self.busy.is_zero() {
            return 0.0;
        }
        self.in_flight.as_secs_f64() / self.busy.as_secs_f64()
    }
}

/// The counters one backend's reads update.
#[derive(Debug)]
pub(crate) struct ActivityMeter {
    state: Mutex<MeterState>,
}

#[derive(Debug)]
struct MeterState {
    totals: DriveActivity,
    /// Reads started and not yet ended.
    open: u64,
    /// When `busy` and `in_flight` were last brought up to date.
    last: Instant,
}

impl MeterState {
    /// Bring the totals up to `now`: the time since the last update was
    /// busy if any read was open, times `open` reads in flight.
    fn advance(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last);
        if self.open > 0 {
            self.totals.busy += dt;
            self.totals.in_flight += dt * u32::try_from(self.open).unwrap_or(u32::MAX);
        }
        self.last = now;
    }
}

impl ActivityMeter {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(MeterState {
                totals: DriveActivity::default(),
                open: 0,
                last: Instant::now(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A read starts now.
    pub(crate) fn start(&self) {
        let mut s = self.lock();
        s.advance(Instant::now());
        s.open += 1;
    }

    /// A read started by [`Self::start`] ends now (landed or failed).
    pub(crate) fn end(&self) {
        let mut s = self.lock();
        s.advance(Instant::now());
        s.open = s.open.saturating_sub(1);
        s.totals.reads += 1;
    }

    /// The totals up to now.
    pub(crate) fn snapshot(&self) -> DriveActivity {
        let mut s = self.lock();
        s.advance(Instant::now());
        s.totals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_is_the_union_and_in_flight_the_sum() {
        let m = ActivityMeter::new();
        let idle = m.snapshot();
        assert_eq!(idle.busy, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(5));
        // Two overlapping reads, then nothing.
        m.start();
        m.start();
        std::thread::sleep(Duration::from_millis(20));
        m.end();
        std::thread::sleep(Duration::from_millis(20));
        m.end();
        let after = m.snapshot();
        std::thread::sleep(Duration::from_millis(20));
        let later = m.snapshot();
        assert_eq!(later.reads, 2);
        // Nothing was in flight after the second end: nothing accrues.
        assert_eq!(later.busy, after.busy);
        assert_eq!(later.in_flight, after.in_flight);
        let d = later.since(&idle);
        assert!(d.busy >= Duration::from_millis(40), "{d:?}");
        // 20 ms with two in flight plus 20 ms with one: about 1.5 on average.
        let mean = d.mean_in_flight_while_busy();
        assert!((1.0..=2.0).contains(&mean), "{mean}");
        assert!(d.in_flight > d.busy, "{d:?}");
    }

    #[test]
    fn empty_windows_give_zero_shares() {
        let a = DriveActivity::default();
        assert_eq!(a.busy_share(Duration::ZERO), 0.0);
        assert_eq!(a.mean_in_flight_while_busy(), 0.0);
        assert_eq!(a.busy_share(Duration::from_secs(1)), 0.0);
    }
}
