//! The submit mode of the miss path (see `fetch`): a task's read units go
//! to a backend with its own queue in windows through `read_async`, enough
//! windows in flight to fill the queue, each window finished on the caller
//! as it lands while later ones are still reading.
//!
//! Bounds: at most `queue_depth + 2 * SUBMIT_WINDOW` landing buffers in
//! flight per batch (`max(START_UNITS, queue_depth + SUBMIT_WINDOW) +
//! SUBMIT_WINDOW` for a started prefetch); each thread keeps at most
//! [`MAX_SPARE`] of them between batches.

use std::cell::RefCell;
use std::collections::VecDeque;

use flashtier_io::{AlignedBuf, Landing, ReadReq};

use super::MissTask;

/// Units per submission in the submit mode.
pub const SUBMIT_WINDOW: usize = 256;

/// Units a started prefetch submits before returning, when the queue's
/// worth is fewer (the rest are submitted when it is waited on).
pub const START_UNITS: usize = 2 * SUBMIT_WINDOW;

/// Most landing buffers the submit mode keeps per thread between batches.
pub const MAX_SPARE: usize = 2 * SUBMIT_WINDOW;

thread_local! {
    /// The submit mode's reusable landing buffers (at most [`MAX_SPARE`]).
    static SPARE: RefCell<Vec<AlignedBuf>> = const { RefCell::new(Vec::new()) };
}

/// Units per window for a batch of `units`: about a quarter of the batch
/// (so the caller verifies and copies the first windows while the rest are
/// still reading), at least 16, at most [`SUBMIT_WINDOW`].
fn submit_window(units: usize) -> usize {
    units.div_ceil(4).clamp(16, SUBMIT_WINDOW)
}

/// The submit mode's progress through one task: the next unit to submit,
/// the windows in flight (oldest first) and the landing buffers to reuse.
pub(super) struct Submitting {
    next: usize,
    window: usize,
    max_windows: usize,
    in_flight: VecDeque<(usize, usize, flashtier_io::Ticket)>,
    spare: Vec<AlignedBuf>,
}

impl Submitting {
    /// Take this thread's spare buffers and size the windows for `task`.
    pub(super) fn new(task: &MissTask) -> Self {
        let window = submit_window(task.units.len());
        Self {
            next: 0,
            window,
            max_windows: (task.inner.backend().queue_depth().div_ceil(window) + 1).max(2),
            in_flight: VecDeque::new(),
            // As many of this thread's spare buffers as the task has units;
            // the rest stay for a prefetch started meanwhile.
            spare: SPARE.with(|s| {
                let mut s = s.borrow_mut();
                let keep = s.len().saturating_sub(task.units.len());
                s.split_off(keep)
            }),
        }
    }

    /// Submit windows until `windows` are in flight or none are left.
    fn top_up(&mut self, task: &MissTask, windows: usize) {
        let n = task.units.len();
        while self.next < n && self.in_flight.len() < windows {
            let (start, end) = (self.next, (self.next + self.window).min(n));
            let spare = &mut self.spare;
            let reqs = (start..end)
                .filter_map(|i| task.units.get(i).map(|u| (i, u)))
                .map(|(i, u)| {
                    let buf = spare
                        .pop()
                        .filter(|b| b.capacity() >= u.len)
                        .unwrap_or_else(|| AlignedBuf::zeroed(u.len.max(4096)));
                    ReadReq {
                        file: u.file.clone(),
                        offset: u.offset,
                        len: u.len,
                        landing: Landing::Host(buf),
                        tag: i as u64,
                    }
                });
            match task.inner.backend().read_async(reqs.collect()) {
                Ok(ticket) => self.in_flight.push_back((start, end, ticket)),
                Err(e) => task.record(start, Err(e.into())),
            }
            self.next = end;
        }
    }

    /// Top up, then wait for the oldest window and finish its units on this
    /// thread. Returns false once every unit has been finished.
    fn step(&mut self, task: &MissTask) -> bool {
        self.top_up(task, self.max_windows);
        let Some((start, end, ticket)) = self.in_flight.pop_front() else {
            return false;
        };
        match ticket.wait() {
            Ok(landed) => {
                task.inner.count_reads((end - start) as u64);
                for l in landed {
                    let i = l.tag as usize;
                    let (Some(u), Some(buf)) = (task.units.get(i), l.buf) else {
                        continue;
                    };
                    task.record(i, task.finish_unit(u, &buf));
                    if self.spare.len() < MAX_SPARE {
                        self.spare.push(buf);
                    }
                }
            }
            // The ticket reports its first failure; charge it to the
            // window's first unit so the batch fails with it.
            Err(e) => task.record(start, Err(e.into())),
        }
        true
    }

    /// Submit the first windows of a started prefetch: all of a step-sized
    /// batch (at least [`START_UNITS`] units), not just a queue's worth, since
    /// a window left for `wait` would only go in after the next step's
    /// prefetch, and the drive would drain behind it.
    pub(super) fn started(task: &MissTask) -> Self {
        let mut st = Self::new(task);
        let windows = st.max_windows.max(START_UNITS.div_ceil(st.window));
        st.top_up(task, windows);
        st
    }

    /// Step until every unit of `task` is finished, then give the buffers
    /// back.
    pub(super) fn run_to_end(mut self, task: &MissTask) {
        while self.step(task) {}
        self.finish();
    }

    /// Give the landing buffers back to this thread for its next batch
    /// (it keeps at most [`MAX_SPARE`]).
    fn finish(self) {
        SPARE.with(|s| {
            let mut s = s.borrow_mut();
            let room = MAX_SPARE.saturating_sub(s.len());
            s.extend(self.spare.into_iter().take(room));
        });
    }
}
