//! Several sequences in one forward step: the continuous batching a
//! server runs. Each sequence has its own KV cache ([`Model::new_kv`]);
//! a step takes any mix of prompt chunks and decode tokens, one entry per
//! sequence ([`SeqStep`]), runs every row through the dense products,
//! norms and the LM head together, routes each row, and runs each routed
//! expert once over every row routed to it (so the union of the rows'
//! experts is read once); only RoPE and attention run per sequence, over
//! that sequence's cache ([`crate::family::Step::per_sequence`]).
//!
//! Exactness: every operation computes each row on its own, in an order
//! fixed by the shapes; on the CPU a row's result does not depend on the
//! rows beside it either (see [`crate::device::cpu`]), so a sequence
//! decoded in a batch gets the bits it gets decoded alone. On the GPU the
//! products of a multi-row step may take another kernel (tiles, grouped
//! experts) than a one-row step, whose sums run in another order: the
//! outputs then agree to f32 rounding (tests pin the bound), not bit for
//! bit.
//!
//! Bounds: a step of several sequences holds at most [`PREFILL_CHUNK`]
//! rows in all, a step of one sequence at most [`Model::prompt_rows`]
//! (both within the activations the config bounds check allows for); each
//! entry at most its cache's remaining room. A step that fails part-way leaves its
//! entries' caches with some layers ahead of the others: drop them.

use crate::device::{Activation, Device, KvState};
use crate::error::EngineError;
use crate::family::{SeqRows, Step, decoder_layers};

use super::{Model, PREFILL_CHUNK, check_step, kv_spec};

/// What a sequence wants of its last row in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Nothing (a prompt chunk before the prompt's last).
    Nothing,
    /// The greedy token (the lowest index of the largest logit), picked
    /// on the device.
    Greedy,
    /// The logits, on the host.
    Logits,
}

/// What a step gives a sequence, as its [`Want`] asked.
#[derive(Clone, Debug, PartialEq)]
pub enum RowOut {
    /// Nothing was asked.
    Nothing,
    /// The greedy token.
    Token(u32),
    /// The last row's logits (`vocab` values).
    Logits(Vec<f32>),
}

/// One sequence's part of a step: `tokens` at the next positions of `kv`.
pub struct SeqStep<'a, D: Device> {
    /// The sequence's KV cache.
    pub kv: &'a mut D::Kv,
    /// Its tokens this step (a prompt chunk, or one decode token).
    pub tokens: &'a [u32],
    /// What it wants of its last row.
    pub want: Want,
}

impl<D: Device> Model<D> {
    /// An empty KV cache for a sequence of at most `capacity` positions
    /// (at most [`Model::context_limit`]; smaller caches take less memory
    /// as they grow, and none is taken before the first position).
    pub fn new_kv(&self, capacity: usize) -> Result<D::Kv, EngineError> {
        let mut spec = kv_spec(&self.cfg);
        if capacity == 0 || capacity > spec.capacity {
            return Err(EngineError::ContextFull {
                len: capacity,
                max: spec.capacity,
            });
        }
        spec.capacity = capacity;
        self.dev.kv_cache(&spec)
    }

    /// One forward step of every entry of `batch` (see the module docs);
    /// returns, per entry in order, what its [`Want`] asked for. Each
    /// entry's cache advances by its tokens.
    pub fn step_batch(&mut self, batch: &mut [SeqStep<'_, D>]) -> Result<Vec<RowOut>, EngineError> {
        let (vocab, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let n: usize = batch.iter().map(|e| e.tokens.len()).sum();
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        // One sequence alone takes the device's prompt step
        // ([`Model::prompt_rows`]); sequences together, one chunk.
        let most = match &*batch {
            [one] => self.step_limit(one.kv.len() + one.tokens.len(), n),
            _ => PREFILL_CHUNK,
        };
        if n > most {
            return Err(EngineError::Shape {
                op: "step_batch",
                what: format!("{n} rows in one step (at most {most})"),
            });
        }
        for e in batch.iter() {
            check_step(e.tokens, vocab, (e.kv.len(), e.kv.capacity()), most)?;
        }
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|e| e.tokens.iter().copied())
            .collect();
        let dev = &self.dev;
        let mut x = dev.zeros(n, h)?;
        dev.embed(&mut x, &self.weights.embed, &ids)?;
        let mut seqs = Vec::with_capacity(batch.len());
        let mut start = 0;
        for e in batch.iter_mut() {
            let rows = e.tokens.len();
            seqs.push(SeqRows {
                first: e.kv.len(),
                kv: &mut *e.kv,
                start,
                rows,
            });
            start += rows;
        }
        let mut st = Step {
            dev,
            cfg: &self.cfg,
            rule: &self.rule,
            rope: &self.rope,
            seqs,
            experts: &mut self.experts,
            rows: n,
        };
        let normed = decoder_layers(&self.weights, &mut st, &mut x)?;
        drop(st);
        for e in batch.iter_mut() {
            e.kv.advance(e.tokens.len());
        }
        self.heads(batch, &normed)
    }

    /// The LM head over the last row of every entry that wants one, and
    /// each entry's answer.
    fn heads(&self, batch: &[SeqStep<'_, D>], normed: &D::Act) -> Result<Vec<RowOut>, EngineError> {
        let (dev, vocab) = (&self.dev, self.cfg.vocab_size);
        let mut rows = Vec::with_capacity(batch.len());
        let mut end = 0;
        for e in batch {
            end += e.tokens.len();
            if e.want != Want::Nothing {
                rows.push(end - 1);
            }
        }
        if rows.is_empty() {
            return Ok(vec![RowOut::Nothing; batch.len()]);
        }
        let every = rows.len() == normed.rows();
        let gathered;
        let head = if every {
            normed
        } else {
            let mut g = dev.zeros(rows.len(), normed.cols())?;
            for (i, &r) in rows.iter().enumerate() {
                dev.copy_rows(&mut g, i, normed, r, 1)?;
            }
            gathered = g;
            &gathered
        };
        let mut logits = dev.zeros(rows.len(), vocab)?;
        dev.linear(&mut logits, self.weights.lm_head(), head)?;
        let on_host = batch.iter().any(|e| e.want == Want::Logits);
        let (host, picks) = if on_host {
            (dev.to_host(&logits)?, Vec::new())
        } else {
            (Vec::new(), dev.argmax_rows(&logits)?)
        };
        let mut outs = Vec::with_capacity(batch.len());
        let mut i = 0;
        for e in batch {
            let out = match e.want {
                Want::Nothing => RowOut::Nothing,
                Want::Greedy if on_host => {
                    let row = host.get(i * vocab..(i + 1) * vocab).unwrap_or(&[]);
                    RowOut::Token(crate::device::cpu::kernels::argmax(row) as u32)
                }
                Want::Greedy => RowOut::Token(picks.get(i).copied().ok_or_else(no_row)?),
                Want::Logits => {
                    let row = host.get(i * vocab..(i + 1) * vocab).ok_or_else(no_row)?;
                    RowOut::Logits(row.to_vec())
                }
            };
            if e.want != Want::Nothing {
                i += 1;
            }
            outs.push(out);
        }
        Ok(outs)
    }
}

fn no_row() -> EngineError {
    EngineError::Shape {
        op: "step_batch",
        what: "the LM head gave fewer rows than were asked for".to_string(),
    }
}

impl<D: Device> Model<D> {
    /// Greedy decode steps of one sequence whose cache is `kv`, chained on
    /// the device as [`Model::generate`]'s are (the step after a token is
    /// issued before the host reads it): feeds `first` (picked, not yet
    /// fed), then hands each picked token to `take` until it returns true
    /// or `max_new` tokens were taken; the step issued on the last taken
    /// token is undone, so `kv` ends holding `first` and the tokens before
    /// the last one taken (the last is the caller's next input). The same
    /// tokens as [`Model::step_batch`] with [`Want::Greedy`]: the same
    /// kernels pick them. Returns the tokens taken, or `None` (nothing
    /// done) where steps do not chain (the CPU; a cache with offloaded
    /// chunks).
    pub fn decode_chained(
        &mut self,
        kv: &mut D::Kv,
        first: u32,
        max_new: usize,
        take: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<usize>, EngineError> {
        use super::greedy::Decoder;
        let room = kv.capacity().saturating_sub(kv.len() + 1);
        let max_new = max_new.min(room);
        if max_new == 0 {
            return Ok(None);
        }
        std::mem::swap(&mut self.kv, kv);
        let run = (|| {
            if !self.chains() {
                return Ok(None);
            }
            let mut pending = self.chain_step(Some(first))?;
            let mut n = 0;
            loop {
                let ahead = if n + 1 < max_new {
                    Some(self.chain_step(None)?)
                } else {
                    None
                };
                let token = self.chain_token(pending)?;
                n += 1;
                let done = take(token);
                match ahead {
                    Some(_) if done => {
                        self.chain_undo()?;
                        return Ok(Some(n));
                    }
                    Some(t) => pending = t,
                    None => return Ok(Some(n)),
                }
            }
        })();
        self.pick = None;
        std::mem::swap(&mut self.kv, kv);
        run
    }
}
