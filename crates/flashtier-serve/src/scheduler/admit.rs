//! Admission: waiting requests join the batch between steps, with a kept
//! cache when their prompt shares a prefix with one; a prompt whose reuse
//! is on the drive holds its batch slot while the spill's restore thread
//! reads it, and joins once it lands (see the parent module).

use std::sync::atomic::Ordering;

use flashtier_engine::sample::Sampler;
use tokio::sync::mpsc as tmpsc;

use super::worker::{Live, Restoring, Worker};
use super::{Event, Job, Submitted, publish};
use crate::prefix::{Reused, Taken};

impl Worker {
    pub(super) fn admit(&mut self) {
        while self.live.len() + self.restoring.len() < self.cfg.max_batch {
            let Some(s) = self.waiting.pop_front() else {
                break;
            };
            self.counters.waiting.fetch_sub(1, Ordering::AcqRel);
            let id = self.next_id;
            self.next_id += 1;
            let Submitted { job, events } = s;
            let vocab = self.engine.vocab_size();
            let sampler = match Sampler::new(job.params.clone(), vocab, &job.prompt) {
                Ok(s) => s,
                Err(e) => {
                    self.fail_one(&events, e.to_string());
                    continue;
                }
            };
            self.counters
                .prompt_tokens
                .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
            // A restoring request holds its batch slot: it counts as running.
            self.counters.running.fetch_add(1, Ordering::AcqRel);
            let (engine, context) = (&self.engine, self.cfg.context);
            let taken = self
                .prefix
                .take(&job.prompt, context, || engine.new_seq(context, id))
                .unwrap_or_else(|e| {
                    // Counted by the spill; the prompt is computed whole.
                    tracing::warn!("prompt reuse from the drive failed, recomputing: {e}");
                    None
                });
            match taken {
                Some(Taken::Restoring { ticket, .. }) => self.restoring.push(Restoring {
                    ticket,
                    job,
                    events,
                    sampler,
                    id,
                }),
                Some(Taken::Ready(r)) => self.start(job, events, sampler, Some(r), id),
                None => self.start(job, events, sampler, None, id),
            }
        }
        publish::prefix(&self.prefix, &self.counters);
    }

    /// Requests whose prefix came back from the drive join the batch; one
    /// whose restore failed computes its prompt whole; one cancelled while
    /// restoring leaves, its cache kept for reuse.
    pub(super) fn land_restores(&mut self) {
        if self.restoring.is_empty() {
            return;
        }
        for (ticket, got) in self.prefix.restores() {
            let Some(at) = self.restoring.iter().position(|r| r.ticket == ticket) else {
                continue;
            };
            let r = self.restoring.swap_remove(at);
            let reused = got
                .map_err(|e| tracing::warn!("prompt reuse from the drive failed, recomputing: {e}"))
                .ok();
            if r.events.is_closed() {
                self.counters.running.fetch_sub(1, Ordering::AcqRel);
                self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
                self.counters.finished.fetch_add(1, Ordering::Relaxed);
                if let Some(u) = reused {
                    self.prefix.put(r.job.prompt[..u.cached].to_vec(), u.kv);
                }
                continue;
            }
            self.start(r.job, r.events, r.sampler, reused, r.id);
        }
        publish::prefix(&self.prefix, &self.counters);
    }

    /// An admitted request joins the batch with `reused` (or a fresh cache:
    /// its prompt computed whole); counted as running already.
    fn start(
        &mut self,
        job: Job,
        events: tmpsc::UnboundedSender<Event>,
        sampler: Sampler,
        reused: Option<Reused>,
        id: u64,
    ) {
        let (kv, cached) = match reused {
            Some(r) => {
                if r.restored {
                    self.counters
                        .cached_restored_tokens
                        .fetch_add(r.cached as u64, Ordering::Relaxed);
                }
                (r.kv, r.cached)
            }
            None => match self.engine.new_seq(self.cfg.context, id) {
                Ok(kv) => (kv, 0),
                Err(e) => {
                    self.counters.running.fetch_sub(1, Ordering::AcqRel);
                    self.fail_one(&events, e.to_string());
                    return;
                }
            },
        };
        self.counters
            .cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        let offloaded_seen = kv.tier_stats().map_or(0, |t| t.offloaded_bytes);
        let _ = events.send(Event::Started { cached });
        self.live.push(Live {
            tokens: job.prompt[..cached].to_vec(),
            fed: cached,
            job,
            events,
            kv,
            sampler,
            pending: None,
            generated: 0,
            offloaded_seen,
        });
    }

    pub(super) fn fail_one(&self, events: &tmpsc::UnboundedSender<Event>, why: String) {
        let _ = events.send(Event::Failed(why));
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        self.counters.finished.fetch_add(1, Ordering::Relaxed);
    }
}
