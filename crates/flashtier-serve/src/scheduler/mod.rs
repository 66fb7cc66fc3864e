//! The scheduler: one thread owns the engine and runs continuous batching.
//!
//! Requests arrive through a [`Scheduler`] handle. Each step the thread
//! admits waiting requests while fewer than `max_batch` run (taking a kept
//! cache whose prefix the prompt shares, [`PrefixCache`]), then builds one
//! engine step: every running sequence's decode token first, then prompt
//! chunks of the sequences still reading their prompts, up to
//! `step_rows` rows in all (a prompt alone, nothing else live or
//! waiting, takes the engine's larger steps for one sequence,
//! [`Engine::max_step_rows_alone`]). A sequence's first output token is picked from
//! the step that reads its prompt's last token. Each picked token goes to
//! its request's event channel at once.
//!
//! Cancellation: a request whose receiver is gone (the client closed the
//! connection, or the handler stopped at a stop string) leaves the batch
//! before the next step, and its cache is kept for reuse.
//!
//! Bounds: at most `max_queue` requests wait (a submit past it is
//! [`SubmitError::QueueFull`], HTTP 429) and `max_batch` run; a request's
//! channel carries at most `max_tokens + 2` events; a step holds at most
//! `step_rows` rows (a lone prompt's, at most the engine's step for one
//! sequence); each sequence's cache at most `context` positions;
//! kept caches at most `prefix_cache_tokens` positions in memory and, with
//! a spill, its `tokens` positions on the drive ([`crate::prefix::spill`]).
//! A spill's writes run on its own writer thread: the scheduler thread
//! hands a cache leaving memory over and goes on, never waiting for the
//! drive (past the spill's write queue the cache is dropped), and collects
//! finished writes between steps. Restores run on the spill's restore
//! thread too: a request whose reused prefix is on the drive holds a batch
//! slot (at most `max_batch` run or restore) while the other sequences go
//! on stepping, and joins the batch between steps once its cache lands
//! (or computes its prompt whole, if the restore failed).
//!
//! Exactness: a failed step fails the requests in it (their caches are
//! dropped, since some layers may have advanced past others); the other
//! requests go on.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use flashtier_engine::engine::Engine;
use flashtier_engine::sample::{Pick, SamplingParams};
use tokio::sync::mpsc as tmpsc;

use crate::prefix::{PrefixCache, PrefixSpill, SpillConfig};

mod admit;
mod publish;
mod worker;

use worker::Worker;

/// Limits of the scheduler (see the module docs).
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences in one step at most.
    pub max_batch: usize,
    /// Requests waiting at most.
    pub max_queue: usize,
    /// Rows (tokens of all sequences) in one step at most.
    pub step_rows: usize,
    /// Positions of one sequence at most (prompt and output).
    pub context: usize,
    /// Positions the kept caches hold in memory at most (0: no prompt
    /// reuse).
    pub prefix_cache_tokens: usize,
    /// Where kept CPU caches go past `prefix_cache_tokens` (`None`: they
    /// are dropped); see [`crate::prefix::spill`].
    pub prefix_spill: Option<SpillConfig>,
}

/// One generation request.
#[derive(Debug)]
pub struct Job {
    /// The prompt's token ids (not empty).
    pub prompt: Vec<u32>,
    /// How to pick tokens.
    pub params: SamplingParams,
    /// Output tokens at most.
    pub max_tokens: usize,
    /// Tokens that end the output (the model's EOS unless ignored).
    pub stop_ids: Vec<u32>,
}

/// What a request hears.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// It joined the batch; `cached` prompt positions came from a kept
    /// cache.
    Started {
        /// Reused prompt positions.
        cached: usize,
    },
    /// An output token.
    Token(Pick),
    /// The end.
    Done(Finish),
    /// The engine failed; nothing more comes.
    Failed(String),
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token (counted in the output tokens, never shown as text).
    Stop(u32),
    /// `max_tokens` reached, or the sequence's context is full.
    Length,
}

/// Why a request was not taken.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// `max_queue` requests already wait.
    #[error("the server's queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    /// The scheduler has stopped.
    #[error("the server is shutting down")]
    Stopped,
    /// The request cannot run on this model.
    #[error("{0}")]
    Invalid(String),
}

/// Counters, read by `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests taken.
    pub requests: AtomicU64,
    /// Requests refused at the queue limit.
    pub rejected: AtomicU64,
    /// Requests finished (any way).
    pub finished: AtomicU64,
    /// Requests failed by the engine.
    pub failed: AtomicU64,
    /// Requests cancelled by their client.
    pub cancelled: AtomicU64,
    /// Requests waiting now.
    pub waiting: AtomicUsize,
    /// Requests running now.
    pub running: AtomicUsize,
    /// Prompt tokens taken.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens reused from kept caches.
    pub cached_tokens: AtomicU64,
    /// Output tokens picked.
    pub generated_tokens: AtomicU64,
    /// Engine steps run.
    pub steps: AtomicU64,
    /// Rows over all steps.
    pub step_rows: AtomicU64,
    /// Nanoseconds in engine steps.
    pub step_ns: AtomicU64,
    /// Expert bytes read from the store so far.
    pub expert_bytes_read: AtomicU64,
    /// Expert hits and misses so far.
    pub expert_hits: AtomicU64,
    /// Expert misses so far.
    pub expert_misses: AtomicU64,
    /// Positions in kept caches now.
    pub prefix_cache_tokens: AtomicUsize,
    /// Nanoseconds the engine waited for expert reads so far.
    pub expert_stall_ns: AtomicU64,
    /// Expert records the steps used (each once per step and layer).
    pub expert_records_used: AtomicU64,
    /// Steps of decode rows only (no prompt chunk), their rows, their
    /// nanoseconds and the expert records they used.
    pub decode_steps: AtomicU64,
    /// Rows of decode-only steps.
    pub decode_rows: AtomicU64,
    /// Nanoseconds of decode-only steps.
    pub decode_step_ns: AtomicU64,
    /// Expert records decode-only steps used.
    pub decode_records: AtomicU64,
    /// Prompt tokens reused from kept caches restored from the drive.
    pub cached_restored_tokens: AtomicU64,
    /// Positions in kept caches on the drive now.
    pub prefix_spill_tokens: AtomicUsize,
    /// The prefix spill's counters so far ([`crate::prefix::SpillStats`]).
    pub prefix_spill: SpillCounters,
    /// KV bytes the sequences' own caches wrote to the KV tier (a GPU
    /// cache past its HBM budget).
    pub kv_seq_offloaded_bytes: AtomicU64,
    /// Row-store counters so far (models with PLE rows in a row store).
    pub rows: RowCounters,
}

/// [`crate::prefix::SpillStats`] as `/metrics` reads them.
#[derive(Debug, Default)]
pub struct SpillCounters {
    /// Entries written to the drive.
    pub spilled: AtomicU64,
    /// Entries whose write failed.
    pub spill_failures: AtomicU64,
    /// Entries restored for a prompt.
    pub restored: AtomicU64,
    /// Restores that failed (the prompt was recomputed).
    pub restore_failures: AtomicU64,
    /// Entries dropped from the drive, or too large for it.
    pub dropped: AtomicU64,
    /// Entries dropped because the spill's write queue was full.
    pub queue_full: AtomicU64,
    /// Entries taken from memory while their write was in flight.
    pub taken_writing: AtomicU64,
    /// Bytes written.
    pub bytes_written: AtomicU64,
    /// Bytes read back and verified.
    pub bytes_read: AtomicU64,
}

/// Row-store counters as `/metrics` reads them.
#[derive(Debug, Default)]
pub struct RowCounters {
    /// Rows looked up.
    pub lookups: AtomicU64,
    /// Lookups served from the cache.
    pub hits: AtomicU64,
    /// Distinct rows read from the shards.
    pub misses: AtomicU64,
    /// Bytes read from the shards.
    pub bytes_read: AtomicU64,
}

struct Submitted {
    job: Job,
    events: tmpsc::UnboundedSender<Event>,
}

/// The handle requests are submitted through; dropping every handle (and
/// [`Scheduler::stop`]) ends the thread once the running requests finish.
#[derive(Clone)]
pub struct Scheduler {
    tx: mpsc::Sender<Submitted>,
    counters: Arc<Counters>,
    max_queue: usize,
    vocab: usize,
    context: usize,
    stopping: Arc<AtomicBool>,
}

/// The running thread; join it after the last handle is gone.
pub struct SchedulerThread {
    join: JoinHandle<()>,
    cfg: SchedulerConfig,
}

impl SchedulerThread {
    /// The limits in force (the requested ones, clamped to the engine's).
    #[must_use]
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Wait for the thread to end.
    pub fn join(self) {
        let _ = self.join.join();
    }
}

/// The spill of `cfg`, for an engine whose caches it can hold: a GPU
/// engine's stay in memory (said once), Qwen4-Exp's are never kept.
fn open_spill(engine: &Engine, cfg: Option<SpillConfig>) -> Result<Option<PrefixSpill>, String> {
    let Some(cfg) = cfg else {
        return Ok(None);
    };
    match engine {
        Engine::Cpu(_) => {
            let dir = cfg.dir.clone();
            PrefixSpill::new(cfg)
                .map(Some)
                .map_err(|e| format!("the prefix spill in {}: {e}", dir.display()))
        }
        Engine::Cuda(_) => {
            tracing::warn!(
                "prefix spill: GPU caches stay in memory (the CUDA cache has no path back from \
                 host memory); --prefix-spill-dir is not used"
            );
            Ok(None)
        }
        Engine::Qwen4(_) => Ok(None),
    }
}

impl Scheduler {
    /// Start the thread that owns the engine: `open` runs on it (a GPU
    /// engine's context belongs to the thread that made it) and its error,
    /// if any, is returned here.
    pub fn start<E: std::fmt::Display>(
        open: impl FnOnce() -> Result<Engine, E> + Send + 'static,
        cfg: SchedulerConfig,
    ) -> Result<(Scheduler, SchedulerThread), String> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let thread_counters = counters.clone();
        let join = std::thread::Builder::new()
            .name("flashtier-scheduler".into())
            .spawn(move || {
                let engine = match open() {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let cfg = SchedulerConfig {
                    max_batch: cfg.max_batch.clamp(1, engine.max_batch()),
                    step_rows: cfg.step_rows.clamp(1, engine.max_step_rows()),
                    context: cfg.context.clamp(2, engine.context_limit().max(2)),
                    ..cfg
                };
                let spill = match open_spill(&engine, cfg.prefix_spill.clone()) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // The limits in force say whether a spill runs.
                let cfg = SchedulerConfig {
                    prefix_spill: cfg.prefix_spill.filter(|_| spill.is_some()),
                    ..cfg
                };
                let _ = ready_tx.send(Ok((engine.vocab_size(), cfg.clone())));
                let mut worker = Worker {
                    engine,
                    prefix: PrefixCache::with_spill(cfg.prefix_cache_tokens, spill),
                    cfg,
                    rx,
                    waiting: VecDeque::new(),
                    live: Vec::new(),
                    restoring: Vec::new(),
                    counters: thread_counters,
                    next_id: 0,
                };
                worker.run();
            })
            .map_err(|e| format!("starting the scheduler thread: {e}"))?;
        let (vocab, cfg) = match ready_rx.recv() {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                let _ = join.join();
                return Err(e);
            }
            Err(_) => {
                let _ = join.join();
                return Err("the scheduler thread ended while opening the engine".into());
            }
        };
        let handle = Scheduler {
            tx,
            counters,
            max_queue: cfg.max_queue,
            vocab,
            context: cfg.context,
            stopping,
        };
        Ok((handle, SchedulerThread { join, cfg }))
    }

    /// Queue `job`; its events come on the returned receiver (dropping it
    /// cancels the request).
    pub fn submit(&self, job: Job) -> Result<tmpsc::UnboundedReceiver<Event>, SubmitError> {
        if self.stopping.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        self.check(&job)?;
        let waiting = &self.counters.waiting;
        if waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_queue).then_some(n + 1)
            })
            .is_err()
        {
            self.counters.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(SubmitError::QueueFull(self.max_queue));
        }
        let (events, rx) = tmpsc::unbounded_channel();
        if self.tx.send(Submitted { job, events }).is_err() {
            waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::Stopped);
        }
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        Ok(rx)
    }

    fn check(&self, job: &Job) -> Result<(), SubmitError> {
        let invalid = |s: String| Err(SubmitError::Invalid(s));
        if job.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Some(&t) = job.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return invalid(format!(
                "prompt token {t} is past the vocabulary of {}",
                self.vocab
            ));
        }
        if job.prompt.len() >= self.context {
            return invalid(format!(
                "the prompt has {} tokens; this server's context is {} (prompt and output)",
                job.prompt.len(),
                self.context
            ));
        }
        if job.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        job.params
            .validate(self.vocab)
            .map_err(|e| SubmitError::Invalid(e.to_string()))
    }

    /// The counters.
    #[must_use]
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Positions of one sequence at most.
    #[must_use]
    pub fn context(&self) -> usize {
        self.context
    }

    /// Refuse new requests; the running and waiting ones finish.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }
}
