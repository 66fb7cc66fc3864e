//! The shared miss pool and the inline backend it reads through.
//!
//! [`RowPool`] runs one batch of read units at a time across `threads - 1`
//! worker threads and the calling thread, which claims units too, so a batch
//! makes progress even if no worker wakes. Units are claimed one at a time
//! from an atomic ticket: a bigger claim would cap the reads in flight at
//! `units / claim`, and queue depth is what the pool is for. Bounds:
//! `threads` in 1..=[`MAX_THREADS`], at most one batch in flight (callers
//! queue on a mutex), so in-flight reads never exceed `threads`.
//!
//! [`InlineBackend`] is the [`StorageBackend`] the pool's threads read
//! through by default: it performs each read on the calling thread (the pool
//! already supplies the queue depth), so a miss costs one positional read
//! and no extra hand-off. Any other backend (posix, io_uring, the fault
//! simulator) plugs in instead.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;

use flashtier_io::{IoError, ReadReq, StorageBackend, StoreFile, Ticket, read_blocking};

use crate::rows::RowError;

pub use crate::settings::{DEFAULT_THREADS, MAX_THREADS};

/// Work split into units that any thread may run.
pub trait PoolTask: Send + Sync {
    /// Run unit `unit` (each unit runs exactly once).
    fn run(&self, unit: usize);
}

struct Job {
    task: Arc<dyn PoolTask>,
    units: usize,
    next: AtomicUsize,
    finished: AtomicUsize,
}

struct State {
    job: Option<Arc<Job>>,
    generation: u64,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    ready: Condvar,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A bounded pool of reader threads shared by row stores.
pub struct RowPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    caller: Mutex<()>,
    threads: usize,
}

static SHARED_POOL: OnceLock<Result<Arc<RowPool>, String>> = OnceLock::new();

impl RowPool {
    /// A pool of `threads` (1..=256) including the caller: spawns
    /// `threads - 1` workers.
    pub fn new(threads: usize) -> Result<Arc<Self>, RowError> {
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(RowError::Config(format!(
                "{threads} pool threads: need 1..={MAX_THREADS}"
            )));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                generation: 0,
                stop: false,
            }),
            ready: Condvar::new(),
            done: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ft-rows-{i}"))
                .spawn(move || worker(&s))
                .map_err(|e| RowError::Config(format!("spawn row pool worker: {e}")))?;
            workers.push(handle);
        }
        Ok(Arc::new(Self {
            shared,
            workers,
            caller: Mutex::new(()),
            threads,
        }))
    }

    /// The process-wide pool, created on first use with
    /// [`crate::settings::ROW_THREADS`] threads (default [`DEFAULT_THREADS`]). The
    /// stores of all layers share it, as they never look up at once.
    pub fn shared() -> Result<Arc<Self>, RowError> {
        if let Some(pool) = SHARED_POOL.get() {
            return pool.clone().map_err(RowError::Config);
        }
        let threads = crate::settings::row_threads(&flashtier_io::settings::Env::process())?;
        SHARED_POOL
            .get_or_init(|| Self::new(threads).map_err(|e| e.to_string()))
            .clone()
            .map_err(RowError::Config)
    }

    /// Threads, the caller included.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run every unit of `task`; returns when all have run. The caller runs
    /// units too. A unit that panics counts as run (the task must treat a
    /// unit with no recorded result as failed).
    pub fn run(&self, task: Arc<dyn PoolTask>, units: usize) {
        if units == 0 {
            return;
        }
        let _serial = self.caller.lock().unwrap_or_else(PoisonError::into_inner);
        let job = Arc::new(Job {
            task,
            units,
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
        });
        if !self.workers.is_empty() {
            let mut g = self.shared.lock();
            g.job = Some(job.clone());
            g.generation = g.generation.wrapping_add(1);
            drop(g);
            self.shared.ready.notify_all();
        }
        drain(&self.shared, &job);
        let mut g = self.shared.lock();
        while job.finished.load(Ordering::Acquire) < units {
            g = self
                .shared
                .done
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
        }
        g.job = None;
    }
}

fn drain(shared: &Shared, job: &Job) {
    loop {
        let unit = job.next.fetch_add(1, Ordering::Relaxed);
        if unit >= job.units {
            return;
        }
        let _ = catch_unwind(AssertUnwindSafe(|| job.task.run(unit)));
        if job.finished.fetch_add(1, Ordering::AcqRel) + 1 == job.units {
            let _g = shared.lock();
            shared.done.notify_all();
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        let job = {
            let mut g = shared.lock();
            while !g.stop && g.generation == seen {
                g = shared.ready.wait(g).unwrap_or_else(PoisonError::into_inner);
            }
            if g.stop {
                return;
            }
            seen = g.generation;
            g.job.clone()
        };
        if let Some(job) = job {
            drain(shared, &job);
        }
    }
}

impl Drop for RowPool {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.ready.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for RowPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowPool")
            .field("threads", &self.threads)
            .finish()
    }
}

/// A backend that reads on the calling thread (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct InlineBackend;

impl StorageBackend for InlineBackend {
    fn name(&self) -> &'static str {
        "inline"
    }

    fn queue_depth(&self) -> usize {
        1
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        let (ticket, done) = Ticket::new(reqs.len());
        for (idx, req) in reqs.into_iter().enumerate() {
            done.complete(idx, read_blocking(req));
        }
        Ok(ticket)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        file.write_all_at(src, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    struct Count {
        hits: Vec<AtomicU64>,
    }

    impl Count {
        /// A task of `units` units, none run yet.
        fn new(units: usize) -> Arc<Self> {
            Arc::new(Self {
                hits: (0..units).map(|_| AtomicU64::new(0)).collect(),
            })
        }

        /// Runs over all units.
        fn total(&self) -> u64 {
            self.hits.iter().map(|h| h.load(Ordering::Relaxed)).sum()
        }
    }

    impl PoolTask for Count {
        fn run(&self, unit: usize) {
            if unit % 97 == 13 {
                panic!("injected panic in unit {unit}");
            }
            self.hits[unit].fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_unit_runs_once_even_across_panics() {
        let pool = RowPool::new(4).expect("pool");
        for units in [0usize, 1, 5, 1000] {
            let task = Count::new(units);
            pool.run(task.clone(), units);
            for (i, h) in task.hits.iter().enumerate() {
                let want = u64::from(i % 97 != 13);
                assert_eq!(h.load(Ordering::Relaxed), want, "unit {i}");
            }
        }
        assert!(RowPool::new(0).is_err() && RowPool::new(257).is_err());
    }

    #[test]
    fn single_thread_pool_is_the_caller() {
        let pool = RowPool::new(1).expect("pool");
        let task = Count::new(10);
        pool.run(task.clone(), 10);
        assert_eq!(task.total(), 10);
    }

    #[test]
    fn concurrent_callers_share_one_pool() {
        let pool = RowPool::new(3).expect("pool");
        std::thread::scope(|s| {
            for _ in 0..4 {
                let pool = pool.clone();
                s.spawn(move || {
                    for _ in 0..20 {
                        let task = Count::new(50);
                        pool.run(task.clone(), 50);
                        assert_eq!(task.total(), 49);
                    }
                });
            }
        });
    }
}
