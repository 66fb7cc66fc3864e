//! Greedy decoding of a [`Qwen4Model`]: the prompt in chunks of at most
//! [`PREFILL_CHUNK`] tokens, then one token a step, with the expert and
//! row-store counters split into prefill and decode.

use std::time::Instant;

use crate::device::cpu::kernels;
use crate::error::EngineError;
use crate::model::{Generation, PREFILL_CHUNK};

use super::Qwen4Model;

impl Qwen4Model {
    /// Greedy decoding at batch 1 (see [`crate::model::Model::generate`]):
    /// the prompt, then up to `max_new` tokens, stopping at one in
    /// `stop_ids`; a request past the context limit is refused first.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        keep_prompt_logits: bool,
    ) -> Result<Generation, EngineError> {
        self.generate_with(prompt, max_new, stop_ids, keep_prompt_logits, |_| {})
    }

    /// [`Self::generate`], calling `on_token` with each new token as it
    /// is chosen.
    pub fn generate_with(
        &mut self,
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
        let vocab = self.cfg.vocab_size;
        let need = (self.pos + prompt.len()).saturating_add(max_new.saturating_sub(1));
        if need > self.cfg.max_positions {
            return Err(EngineError::ContextFull {
                len: need,
                max: self.cfg.max_positions,
            });
        }
        let start = self.expert_stats();
        let started = Instant::now();
        let mut last = Vec::new();
        for chunk in prompt.chunks(PREFILL_CHUNK) {
            last = self.forward(chunk, keep_prompt_logits)?;
            if keep_prompt_logits {
                out.prompt_logits
                    .extend(last.chunks_exact(vocab).map(<[f32]>::to_vec));
            }
        }
        out.prefill_secs = started.elapsed().as_secs_f64();
        out.prompt_tokens = prompt.len();
        let decode_start = self.expert_stats();
        let rows_start = self.row_stats();
        let decode_started = Instant::now();
        let argmax = |l: &[f32]| kernels::argmax(&l[l.len().saturating_sub(vocab)..]) as u32;
        let mut next = argmax(&last);
        for _ in 0..max_new {
            out.generated_ids.push(next);
            on_token(next);
            if out.generated_ids.len() >= max_new || stop_ids.contains(&next) {
                break;
            }
            last = self.forward(&[next], false)?;
            out.decode_steps += 1;
            next = argmax(&last);
        }
        out.decode_secs = decode_started.elapsed().as_secs_f64();
        let now = self.expert_stats();
        out.prefill_experts = decode_start.since(&start);
        out.decode_experts = now.since(&decode_start);
        out.total_experts = now.since(&start);
        out.decode_rows = self
            .row_stats()
            .zip(rows_start)
            .map(|(now, was)| now.since(&was));
        Ok(out)
    }
}
