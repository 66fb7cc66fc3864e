//! The scheduler thread: admission, the step plan, and what each step's
//! rows tell their requests (see the parent module for the bounds).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use flashtier_engine::engine::{Engine, EngineStep, SeqKv};
use flashtier_engine::model::{RowOut, Want};
use flashtier_engine::sample::{Pick, Sampler, SamplingParams};
use tokio::sync::mpsc as tmpsc;

use super::{Counters, Event, Finish, Job, SchedulerConfig, Submitted, publish};
use crate::prefix::PrefixCache;

/// How long the scheduler thread waits for a restore when nothing else
/// runs before it looks for arrivals again.
const RESTORE_POLL: Duration = Duration::from_millis(2);

/// A request whose reused prefix is being read back from the drive: it
/// holds a batch slot and joins the batch when its cache lands.
pub(super) struct Restoring {
    pub(super) ticket: u64,
    pub(super) job: Job,
    pub(super) events: tmpsc::UnboundedSender<Event>,
    pub(super) sampler: Sampler,
    pub(super) id: u64,
}

pub(super) struct Live {
    pub(super) job: Job,
    pub(super) events: tmpsc::UnboundedSender<Event>,
    pub(super) kv: SeqKv,
    pub(super) sampler: Sampler,
    /// Every token the cache holds, then the pending one.
    pub(super) tokens: Vec<u32>,
    /// Prompt tokens the cache holds.
    pub(super) fed: usize,
    /// The picked token not yet fed.
    pub(super) pending: Option<u32>,
    pub(super) generated: usize,
    /// KV tier bytes its cache had written at the last count.
    pub(super) offloaded_seen: u64,
}

pub(super) struct Worker {
    pub(super) engine: Engine,
    pub(super) prefix: PrefixCache,
    pub(super) cfg: SchedulerConfig,
    pub(super) rx: mpsc::Receiver<Submitted>,
    pub(super) waiting: VecDeque<Submitted>,
    pub(super) live: Vec<Live>,
    /// Admitted requests waiting for their prefix from the drive (at most
    /// `max_batch` with `live`).
    pub(super) restoring: Vec<Restoring>,
    pub(super) counters: Arc<Counters>,
    pub(super) next_id: u64,
}

impl Worker {
    pub(super) fn run(&mut self) {
        loop {
            if !self.receive() {
                break;
            }
            self.drop_cancelled();
            // Finished spill writes: their caches' memory goes now.
            self.prefix.settle();
            self.land_restores();
            self.admit();
            if !self.live.is_empty() {
                self.step();
            }
        }
        tracing::debug!("scheduler stopped");
    }

    /// Move arrivals to `waiting`; blocks when there is nothing to do.
    /// False when every handle is gone and nothing is left.
    fn receive(&mut self) -> bool {
        loop {
            match self.rx.try_recv() {
                Ok(s) => self.waiting.push_back(s),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    return !(self.live.is_empty()
                        && self.waiting.is_empty()
                        && self.restoring.is_empty());
                }
            }
        }
        // Nothing to step but restores: wait for one to land (a request
        // waiting for a slot they hold would otherwise spin this loop).
        if self.live.is_empty() && !self.restoring.is_empty() {
            self.prefix.wait_restores(RESTORE_POLL);
        } else if self.live.is_empty() && self.waiting.is_empty() {
            match self.rx.recv_timeout(Duration::from_millis(200)) {
                Ok(s) => self.waiting.push_back(s),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
        true
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.counters.waiting.fetch_sub(gone, Ordering::AcqRel);
            self.counters
                .cancelled
                .fetch_add(gone as u64, Ordering::Relaxed);
            self.counters
                .finished
                .fetch_add(gone as u64, Ordering::Relaxed);
        }
        let mut i = 0;
        while i < self.live.len() {
            if self.live[i].events.is_closed() {
                let l = self.live.swap_remove(i);
                self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
                self.retire(l);
            } else {
                i += 1;
            }
        }
    }

    /// A sequence leaves the batch; its cache is kept for reuse. It counts
    /// as finished once the cache is kept (or spilled), so a reader of
    /// `/metrics` that saw it finish sees the prefix cache after it.
    fn retire(&mut self, l: Live) {
        publish::kv_offloaded(&l.kv, l.offloaded_seen, &self.counters);
        let mut tokens = l.tokens;
        tokens.truncate(l.kv.len());
        if tokens.len() == l.kv.len() {
            self.prefix.put(tokens, l.kv);
        }
        publish::prefix(&self.prefix, &self.counters);
        self.counters.running.fetch_sub(1, Ordering::AcqRel);
        self.counters.finished.fetch_add(1, Ordering::Relaxed);
    }

    /// Each running cache's KV tier bytes since the last count.
    fn count_offloads(&mut self) {
        for l in &mut self.live {
            l.offloaded_seen = publish::kv_offloaded(&l.kv, l.offloaded_seen, &self.counters);
        }
    }

    /// One greedy sequence decoding alone, nothing waiting: its steps
    /// chained on the device (the GPU engine), until it ends or a request
    /// arrives to batch with. False when the engine does not chain (then
    /// nothing was done).
    fn step_alone(&mut self) -> bool {
        let Worker {
            engine,
            live,
            rx,
            waiting,
            restoring,
            counters,
            ..
        } = self;
        // A restore landing has a sequence to batch with: step by step.
        if live.len() != 1 || !waiting.is_empty() || !restoring.is_empty() {
            return false;
        }
        let l = &mut live[0];
        let Some(first) = l.pending else {
            return false;
        };
        if !l.job.params.is_plain_greedy() {
            return false;
        }
        let max_new = l.job.max_tokens.saturating_sub(l.generated);
        let (events, stop_ids) = (l.events.clone(), l.job.stop_ids.clone());
        let mut taken: Vec<u32> = Vec::new();
        let mut finish = None;
        let t0 = Instant::now();
        let mut take = |t: u32| -> bool {
            taken.push(t);
            if stop_ids.contains(&t) {
                finish = Some(Finish::Stop(t));
                return true;
            }
            let _ = events.send(Event::Token(Pick {
                token: t,
                logprob: None,
                top: Vec::new(),
            }));
            if taken.len() >= max_new {
                finish = Some(Finish::Length);
                return true;
            }
            if events.is_closed() {
                return true;
            }
            // A new request: stop here to batch with it.
            match rx.try_recv() {
                Ok(s) => {
                    waiting.push_back(s);
                    true
                }
                Err(_) => false,
            }
        };
        let result = engine.decode_chained(&mut l.kv, first, max_new, &mut take);
        let ns = t0.elapsed().as_nanos() as u64;
        let n = match result {
            Ok(None) => return false,
            Ok(Some(n)) => n as u64,
            Err(e) => {
                let why = format!("engine step failed: {e}");
                tracing::error!("{why}");
                let l = live.swap_remove(0);
                counters.running.fetch_sub(1, Ordering::AcqRel);
                let _ = l.events.send(Event::Failed(why));
                counters.failed.fetch_add(1, Ordering::Relaxed);
                counters.finished.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        };
        for c in [
            &counters.steps,
            &counters.step_rows,
            &counters.decode_steps,
            &counters.decode_rows,
        ] {
            c.fetch_add(n, Ordering::Relaxed);
        }
        for c in [&counters.step_ns, &counters.decode_step_ns] {
            c.fetch_add(ns, Ordering::Relaxed);
        }
        counters
            .generated_tokens
            .fetch_add(taken.len() as u64, Ordering::Relaxed);
        // Every chained step is decode only: its expert records count there.
        let before_records = counters.expert_records_used.load(Ordering::Relaxed);
        publish::engine(engine, counters);
        let records = counters.expert_records_used.load(Ordering::Relaxed);
        counters
            .decode_records
            .fetch_add(records.saturating_sub(before_records), Ordering::Relaxed);
        l.offloaded_seen = publish::kv_offloaded(&l.kv, l.offloaded_seen, counters);
        let fed = taken.len().saturating_sub(1);
        l.tokens.push(first);
        l.tokens.extend_from_slice(&taken[..fed]);
        l.generated += taken.len();
        l.pending = taken.last().copied();
        if finish.is_none() && l.kv.len() + 1 > l.kv.capacity() {
            finish = Some(Finish::Length);
        }
        if let Some(f) = finish {
            let _ = l.events.send(Event::Done(f));
            let l = self.live.swap_remove(0);
            self.retire(l);
        }
        true
    }

    fn step(&mut self) {
        if self.step_alone() {
            return;
        }
        // Decode rows first, then prompt chunks in arrival order. A prompt
        // alone (nothing else live or waiting: no decode waits on it) runs
        // in the device's prompt steps, which may be larger.
        let budget = match self.live.as_slice() {
            [l] if self.waiting.is_empty() && l.pending.is_none() => self
                .cfg
                .step_rows
                .max(self.engine.max_step_rows_alone(l.job.prompt.len())),
            _ => self.cfg.step_rows,
        };
        let mut rows_left = budget;
        let mut plan: Vec<(usize, Vec<u32>, Want)> = Vec::new();
        for (i, l) in self.live.iter().enumerate() {
            if let Some(t) = l.pending
                && rows_left > 0
            {
                plan.push((i, vec![t], want_of(&l.job.params)));
                rows_left -= 1;
            }
        }
        for (i, l) in self.live.iter().enumerate() {
            if l.fed < l.job.prompt.len() && rows_left > 0 {
                let end = (l.fed + rows_left).min(l.job.prompt.len());
                let want = if end == l.job.prompt.len() {
                    want_of(&l.job.params)
                } else {
                    Want::Nothing
                };
                plan.push((i, l.job.prompt[l.fed..end].to_vec(), want));
                rows_left -= end - l.fed;
            }
        }
        if plan.is_empty() {
            return;
        }
        let rows = budget - rows_left;
        let decode_only = plan.iter().all(|(i, _, _)| self.live[*i].pending.is_some());
        let t0 = Instant::now();
        let result = {
            let mut kvs: Vec<Option<&mut SeqKv>> =
                self.live.iter_mut().map(|l| Some(&mut l.kv)).collect();
            let mut steps: Vec<EngineStep<'_>> = plan
                .iter()
                .filter_map(|(i, tokens, want)| {
                    Some(EngineStep {
                        kv: kvs[*i].take()?,
                        tokens,
                        want: *want,
                    })
                })
                .collect();
            self.engine.step_batch(&mut steps)
        };
        let c = &self.counters;
        c.steps.fetch_add(1, Ordering::Relaxed);
        c.step_rows.fetch_add(rows as u64, Ordering::Relaxed);
        c.step_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let before_records = c.expert_records_used.load(Ordering::Relaxed);
        publish::engine(&self.engine, c);
        let records = c.expert_records_used.load(Ordering::Relaxed);
        if decode_only {
            c.decode_steps.fetch_add(1, Ordering::Relaxed);
            c.decode_rows.fetch_add(rows as u64, Ordering::Relaxed);
            c.decode_step_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            c.decode_records
                .fetch_add(records.saturating_sub(before_records), Ordering::Relaxed);
        }
        self.count_offloads();
        let outs = match result {
            Ok(o) => o,
            Err(e) => {
                // Every sequence of the step fails; its cache is dropped.
                let why = format!("engine step failed: {e}");
                tracing::error!("{why}");
                let mut failed: Vec<usize> = plan.iter().map(|p| p.0).collect();
                failed.sort_unstable();
                for &i in failed.iter().rev() {
                    let l = self.live.swap_remove(i);
                    self.counters.running.fetch_sub(1, Ordering::AcqRel);
                    self.fail_one(&l.events, why.clone());
                }
                return;
            }
        };
        let mut done: Vec<usize> = Vec::new();
        for ((i, tokens, _), out) in plan.iter().zip(outs) {
            let l = &mut self.live[*i];
            if l.pending.take().is_some() {
                l.tokens.extend_from_slice(tokens);
            } else {
                l.fed += tokens.len();
                l.tokens.extend_from_slice(tokens);
            }
            let pick = match out {
                RowOut::Nothing => continue,
                RowOut::Token(t) => {
                    l.sampler.accept(t);
                    Pick {
                        token: t,
                        logprob: None,
                        top: Vec::new(),
                    }
                }
                RowOut::Logits(z) => match l.sampler.pick(&z) {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = l.events.send(Event::Failed(e.to_string()));
                        done.push(*i);
                        continue;
                    }
                },
            };
            l.generated += 1;
            self.counters
                .generated_tokens
                .fetch_add(1, Ordering::Relaxed);
            let token = pick.token;
            let finish = if l.job.stop_ids.contains(&token) {
                Some(Finish::Stop(token))
            } else {
                let _ = l.events.send(Event::Token(pick));
                (l.generated >= l.job.max_tokens || l.kv.len() + 1 > l.kv.capacity())
                    .then_some(Finish::Length)
            };
            match finish {
                Some(f) => {
                    let _ = l.events.send(Event::Done(f));
                    done.push(*i);
                }
                None => l.pending = Some(token),
            }
        }
        done.sort_unstable();
        done.dedup();
        for &i in done.iter().rev() {
            let l = self.live.swap_remove(i);
            self.retire(l);
        }
    }
}

/// What a sequence asks of its last row: the device's argmax when no
/// sampling, bias, penalty or logprobs needs the logits.
fn want_of(p: &SamplingParams) -> Want {
    if p.is_plain_greedy() {
        Want::Greedy
    } else {
        Want::Logits
    }
}
