//! A bounded multi-producer multi-consumer job queue for worker pools
//! (posix and sim backends).
//!
//! One mutex around a `VecDeque` with two condition variables: a push wakes
//! exactly one idle worker (`notify_one`), unlike a shared
//! `Mutex<Receiver>`, where every job also hands the receiver lock from one
//! sleeping worker to the next. Bound: `capacity` jobs; `push` blocks while
//! the queue is full.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

pub(crate) struct JobQueue<T> {
    state: Mutex<State<T>>,
    not_empty: Condvar,
    not_full: Condvar,
    capacity: usize,
}

struct State<T> {
    jobs: VecDeque<T>,
    closed: bool,
    /// Workers blocked in `pop` and producers blocked in `push`: wake-ups
    /// (a syscall each) are skipped when nobody waits.
    idle_workers: usize,
    blocked_producers: usize,
}

impl<T> JobQueue<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                jobs: VecDeque::with_capacity(capacity),
                closed: false,
                idle_workers: 0,
                blocked_producers: 0,
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queue `job`, blocking while full; gives it back once closed.
    pub(crate) fn push(&self, job: T) -> Result<(), T> {
        let mut g = self.lock();
        while g.jobs.len() >= self.capacity && !g.closed {
            g.blocked_producers += 1;
            g = self
                .not_full
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
            g.blocked_producers -= 1;
        }
        if g.closed {
            return Err(job);
        }
        g.jobs.push_back(job);
        let wake = g.idle_workers > 0;
        drop(g);
        if wake {
            self.not_empty.notify_one();
        }
        Ok(())
    }

    /// The next job, blocking while empty; `None` once closed and drained.
    pub(crate) fn pop(&self) -> Option<T> {
        let mut g = self.lock();
        loop {
            if let Some(job) = g.jobs.pop_front() {
                let wake = g.blocked_producers > 0;
                drop(g);
                if wake {
                    self.not_full.notify_one();
                }
                return Some(job);
            }
            if g.closed {
                return None;
            }
            g.idle_workers += 1;
            g = self
                .not_empty
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
            g.idle_workers -= 1;
        }
    }

    /// Refuse new jobs; workers drain what is queued, then stop.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_job_is_taken_once_and_close_drains() {
        let q = Arc::new(JobQueue::new(4));
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    while let Some(j) = q.pop() {
                        got.push(j);
                    }
                    got
                })
            })
            .collect();
        for j in 0..100u32 {
            assert!(q.push(j).is_ok());
        }
        q.close();
        assert_eq!(q.push(7), Err(7));
        let mut all: Vec<u32> = workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
    }
}
