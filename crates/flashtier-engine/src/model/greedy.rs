//! Greedy decoding at batch 1, written once over [`Decoder`] (each
//! family's model implements it): the prompt in chunks of the model's
//! prompt step ([`PREFILL_CHUNK`] tokens, or more where the device takes
//! them), then one token a step, chained where the device can leave its
//! pick on itself.

use std::time::Instant;

use super::{Generation, Head, Model, PREFILL_CHUNK, StepInput, last_argmax, no_logits};
use crate::device::cuda::kv::tier::KvTierStats;
use crate::device::{Device, ExpertTier, KvState, PickTicket};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::qwen4::PleRowStats;

impl<D: Device> Decoder for Model<D> {
    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    fn positions(&self) -> (usize, usize) {
        (self.kv.len(), self.kv.capacity())
    }

    fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        self.forward(tokens, all_logits)
    }

    fn prompt_step(&mut self, tokens: &[u32], head: Head) -> Result<Vec<f32>, EngineError> {
        self.run_step(tokens, head)
    }

    fn prompt_chunk(&self, len: usize) -> usize {
        self.prompt_rows(len)
    }

    /// The logits stay on the device; the device's argmax (the host's
    /// rule: the lowest index of the largest) sends back one id.
    fn greedy_step(&mut self, token: u32) -> Result<u32, EngineError> {
        let started = Instant::now();
        let Some(logits) = self.head_step(StepInput::Host(&[token]), Head::Last)? else {
            return Err(no_logits());
        };
        self.issue_ns += u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let ids = self.dev.argmax_rows(&logits)?;
        ids.first().copied().ok_or_else(no_logits)
    }

    /// The device keeps its picks and the cache takes a position back (a
    /// step issued ahead whose input was a stop token is undone). Every
    /// pick is an embedding row: the loader holds the LM head and the
    /// embedding to `vocab x hidden` (and the device checks it again).
    fn chains(&self) -> bool {
        self.dev.picks_ahead() && self.kv.rewinds()
    }

    fn chain_step(&mut self, from: Option<u32>) -> Result<PickTicket, EngineError> {
        let started = Instant::now();
        let host = from.map(|t| [t]);
        let input = match (&host, self.pick) {
            (Some(token), _) => StepInput::Host(token),
            (None, Some(t)) => StepInput::Picked(t),
            (None, None) => {
                return Err(EngineError::Shape {
                    op: "chain_step",
                    what: "a step of the last pick before any pick".to_string(),
                });
            }
        };
        // The pick is the device's latest only until this step picks.
        self.pick = None;
        let Some(logits) = self.head_step(input, Head::Last)? else {
            return Err(no_logits());
        };
        let t = self.dev.pick_ahead(&logits)?;
        self.pick = Some(t);
        self.issue_ns += u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Ok(t)
    }

    fn chain_token(&mut self, t: PickTicket) -> Result<u32, EngineError> {
        self.dev.picked(t)
    }

    fn chain_undo(&mut self) -> Result<(), EngineError> {
        self.pick = None;
        self.kv.rewind(1)
    }

    fn issue_ns(&self) -> Option<u64> {
        self.dev.issues_async().then_some(self.issue_ns)
    }

    fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }

    fn kv_stats(&self) -> Option<KvTierStats> {
        self.kv.tier_stats()
    }
}

/// What [`greedy`] needs of a model: its forward step, its context and
/// its counters (each family's model implements it once).
pub(crate) trait Decoder {
    /// Logits per row.
    fn vocab(&self) -> usize;
    /// Positions taken, and the most the model holds.
    fn positions(&self) -> (usize, usize);
    /// One forward step of at most [`PREFILL_CHUNK`] tokens (see
    /// [`Model::forward`]).
    fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError>;
    /// A prompt chunk, with the LM head over the rows `head` names (a
    /// model that cannot leave rows out computes the last row's logits or
    /// more; the loop reads only what `head` names).
    fn prompt_step(&mut self, tokens: &[u32], head: Head) -> Result<Vec<f32>, EngineError> {
        self.step(tokens, head == Head::Every)
    }
    /// The prompt's tokens after the next [`Self::prompt_step`]'s (empty
    /// at its last chunk): a model may start reading what they need while
    /// that step computes. Changes reads, never results.
    fn prompt_ahead(&mut self, next: &[u32]) {
        let _ = next;
    }
    /// Prompt tokens per [`Self::prompt_step`] for a sequence that will
    /// hold `len` positions after its prompt.
    fn prompt_chunk(&self, len: usize) -> usize {
        let _ = len;
        PREFILL_CHUNK
    }
    /// One decode step of `token` at the next position; the greedy next
    /// token (the lowest index of the largest logit, as [`last_argmax`]
    /// picks it from [`Self::step`]'s logits; a device may pick it without
    /// copying the logits).
    fn greedy_step(&mut self, token: u32) -> Result<u32, EngineError> {
        let logits = self.step(&[token], false)?;
        Ok(last_argmax(&logits, self.vocab()))
    }
    /// Whether greedy steps can be chained: [`Self::chain_step`] issues a
    /// step whose token stays on the device, so the next step can be
    /// issued before the host reads it ([`Self::chain_token`]).
    fn chains(&self) -> bool {
        false
    }
    /// Issue one decode step of `from` (`None`: the token the last chained
    /// step picked, still on the device) at the next position; its greedy
    /// pick stays on the device.
    fn chain_step(&mut self, from: Option<u32>) -> Result<PickTicket, EngineError> {
        let _ = from;
        Err(no_chain())
    }
    /// The token a chained step picked (waits for that step only).
    fn chain_token(&mut self, t: PickTicket) -> Result<u32, EngineError> {
        let _ = t;
        Err(no_chain())
    }
    /// Undo the last chained step (its input was a token that ends the
    /// decode): its position is taken back.
    fn chain_undo(&mut self) -> Result<(), EngineError> {
        Err(no_chain())
    }
    /// Nanoseconds greedy steps spent issuing work before waiting on the
    /// device for their tokens, where the device runs what was issued
    /// while the host goes on (`None` otherwise).
    fn issue_ns(&self) -> Option<u64> {
        None
    }
    /// Expert counters so far.
    fn expert_stats(&self) -> ExpertStats;
    /// Row-store counters so far (`None` when no row store serves the model).
    fn row_stats(&self) -> Option<PleRowStats> {
        None
    }
    /// KV tier counters so far (`None` when no KV budget offloads).
    fn kv_stats(&self) -> Option<KvTierStats> {
        None
    }
}

/// Greedy decoding of `m` at batch 1 (see [`Model::generate`]): the
/// prompt in chunks of [`Decoder::prompt_chunk`] tokens, then one token a
/// step, the counters split into prefill and decode.
pub(crate) fn greedy<M: Decoder>(
    m: &mut M,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    keep_prompt_logits: bool,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, EngineError> {
    let mut out = Generation::default();
    if prompt.is_empty() {
        return Ok(out);
    }
    // The last new token is never fed back, so it takes no position.
    let (used, capacity) = m.positions();
    let need = (used + prompt.len()).saturating_add(max_new.saturating_sub(1));
    if need > capacity {
        return Err(EngineError::ContextFull {
            len: need,
            max: capacity,
        });
    }
    let vocab = m.vocab();
    let start_stats = m.expert_stats();
    let kv_start = m.kv_stats();
    let started = Instant::now();
    let mut last = Vec::new();
    let rows = m.prompt_chunk(used + prompt.len()).max(1);
    let chunks = prompt.len().div_ceil(rows);
    for (c, chunk) in prompt.chunks(rows).enumerate() {
        // Only the last chunk's last row picks the first new token.
        let head = match (keep_prompt_logits, c + 1 == chunks) {
            (true, _) => Head::Every,
            (false, true) => Head::Last,
            (false, false) => Head::None,
        };
        m.prompt_ahead(
            prompt
                .get((c + 1) * rows..)
                .map_or(&[][..], |r| &r[..r.len().min(rows)]),
        );
        last = m.prompt_step(chunk, head)?;
        if keep_prompt_logits {
            out.prompt_logits
                .extend(last.chunks_exact(vocab).map(<[f32]>::to_vec));
        }
    }
    out.prefill_secs = started.elapsed().as_secs_f64();
    out.prompt_tokens = prompt.len();
    let decode_stats = m.expert_stats();
    let rows_start = m.row_stats();
    let kv_decode = m.kv_stats();
    let issue_start = m.issue_ns();
    let decode_started = Instant::now();
    // Take a new token; whether the decode ends with it.
    let mut take = |out: &mut Generation, token: u32| {
        out.generated_ids.push(token);
        on_token(token);
        out.generated_ids.len() >= max_new || stop_ids.contains(&token)
    };
    let first = last_argmax(&last, vocab);
    if max_new > 0 && !take(&mut out, first) {
        if m.chains() {
            chained(m, first, max_new, &mut out, &mut take)?;
        } else {
            let mut next = first;
            loop {
                next = m.greedy_step(next)?;
                out.decode_steps += 1;
                if take(&mut out, next) {
                    break;
                }
            }
        }
    }
    out.decode_secs = decode_started.elapsed().as_secs_f64();
    out.decode_issue_secs = m
        .issue_ns()
        .zip(issue_start)
        .map(|(now, was)| now.saturating_sub(was) as f64 / 1e9);
    let now = m.expert_stats();
    out.prefill_experts = decode_stats.since(&start_stats);
    out.decode_experts = now.since(&decode_stats);
    out.total_experts = now.since(&start_stats);
    out.decode_rows = m
        .row_stats()
        .zip(rows_start)
        .map(|(now, was)| now.since(&was));
    out.prefill_kv = kv_decode.zip(kv_start).map(|(now, was)| now.since(&was));
    out.decode_kv = m
        .kv_stats()
        .zip(kv_decode)
        .map(|(now, was)| now.since(&was));
    Ok(out)
}

/// The decode loop of [`greedy`] with chained steps, after `first` was
/// taken: the step after a token is issued before the host reads that
/// token, so the device never waits for the host between steps. When the
/// token read ends the decode (a stop id), the step issued on it is
/// undone. The tokens are [`Decoder::greedy_step`]'s: the same kernels
/// pick them.
fn chained<M: Decoder>(
    m: &mut M,
    first: u32,
    max_new: usize,
    out: &mut Generation,
    take: &mut impl FnMut(&mut Generation, u32) -> bool,
) -> Result<(), EngineError> {
    let mut pending = m.chain_step(Some(first))?;
    out.decode_steps += 1;
    loop {
        // The token `pending` holds is wanted; a step on it only while a
        // token after it may be.
        let ahead = if out.generated_ids.len() + 1 < max_new {
            Some(m.chain_step(None)?)
        } else {
            None
        };
        let token = m.chain_token(pending)?;
        let done = take(out, token);
        match ahead {
            Some(_) if done => return m.chain_undo(),
            Some(t) => {
                pending = t;
                out.decode_steps += 1;
            }
            None => return Ok(()),
        }
    }
}

fn no_chain() -> EngineError {
    EngineError::Shape {
        op: "chain_step",
        what: "this model reads every token back before the next step".to_string(),
    }
}
