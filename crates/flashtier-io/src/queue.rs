//! A bounded multi-producer multi-consumer job queue for worker pools
//! (posix and sim backends), with two lanes: demand jobs, which a worker
//! always takes first, and read-ahead jobs, taken only when no demand job
//! waits.
//!
//! One mutex around two `VecDeque`s with two condition variables: a push
//! wakes exactly one idle worker (`notify_one`), unlike a shared
//! `Mutex<Receiver>`, where every job also hands the receiver lock from one
//! sleeping worker to the next. Bounds: `capacity` demand jobs (`push`
//! blocks while that lane is full) and `ahead_capacity` read-ahead jobs
//! (`try_push_ahead` never blocks: it gives the jobs back when they do not
//! all fit).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

pub(crate) struct JobQueue<T> {
    state: Mutex<State<T>>,
    not_empty: Condvar,
    not_full: Condvar,
    capacity: usize,
    ahead_capacity: usize,
}

struct State<T> {
    jobs: VecDeque<T>,
    /// Read-ahead jobs, taken when `jobs` is empty.
    ahead: VecDeque<T>,
    closed: bool,
    /// Workers blocked in `pop` and producers blocked in `push`: wake-ups
    /// (a syscall each) are skipped when nobody waits.
    idle_workers: usize,
    blocked_producers: usize,
}

impl<T> JobQueue<T> {
    /// Room for `capacity` demand and `ahead_capacity` read-ahead jobs.
    pub(crate) fn new(capacity: usize, ahead_capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                jobs: VecDeque::with_capacity(capacity),
                ahead: VecDeque::with_capacity(ahead_capacity),
                closed: false,
                idle_workers: 0,
                blocked_producers: 0,
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            capacity: capacity.max(1),
            ahead_capacity,
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

    /// Whether `n` more read-ahead jobs fit now (a hint: another producer
    /// may take the room before [`Self::try_push_ahead`]).
    pub(crate) fn ahead_room(&self, n: usize) -> bool {
        let g = self.lock();
        !g.closed && g.ahead.len() + n <= self.ahead_capacity
    }

    /// Queue every job of `jobs` on the read-ahead lane, or none of them
    /// (given back) when they do not all fit or the queue is closed. Never
    /// blocks.
    pub(crate) fn try_push_ahead(&self, jobs: Vec<T>) -> Result<(), Vec<T>> {
        let mut g = self.lock();
        if g.closed || g.ahead.len() + jobs.len() > self.ahead_capacity {
            return Err(jobs);
        }
        let n = jobs.len();
        g.ahead.extend(jobs);
        let wake = g.idle_workers.min(n);
        drop(g);
        for _ in 0..wake {
            self.not_empty.notify_one();
        }
        Ok(())
    }

    /// The next job, demand lane first, blocking while both lanes are
    /// empty; `None` once closed and drained.
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
            if let Some(job) = g.ahead.pop_front() {
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
        let q = Arc::new(JobQueue::new(4, 0));
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

    #[test]
    fn demand_jobs_go_before_read_ahead_and_the_ahead_lane_never_blocks() {
        let q = JobQueue::new(2, 3);
        assert_eq!(q.try_push_ahead(vec![10, 11]), Ok(()));
        // Two more do not fit beside the two queued: neither is queued.
        assert_eq!(q.try_push_ahead(vec![12, 13]), Err(vec![12, 13]));
        assert_eq!(q.try_push_ahead(vec![12]), Ok(()));
        assert!(q.push(1).is_ok());
        assert!(q.push(2).is_ok());
        let order: Vec<u32> = (0..5).filter_map(|_| q.pop()).collect();
        assert_eq!(order, vec![1, 2, 10, 11, 12]);
        q.close();
        assert_eq!(q.try_push_ahead(vec![14]), Err(vec![14]));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn close_drains_both_lanes() {
        let q = JobQueue::new(2, 2);
        assert_eq!(q.try_push_ahead(vec![5]), Ok(()));
        assert!(q.push(3).is_ok());
        q.close();
        assert_eq!(q.pop(), Some(3));
        assert_eq!(q.pop(), Some(5));
        assert_eq!(q.pop(), None);
    }
}
