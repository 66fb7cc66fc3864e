//! Greedy decoding of a [`Qwen4Model`]: the shared loop
//! ([`crate::model::greedy`]: the prompt in chunks of at most
//! [`crate::model::PREFILL_CHUNK`] tokens, then one token a step) over
//! this model's step, with its expert and row-store counters split into
//! prefill and decode.

use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::model::{Decoder, Generation, greedy};

use super::{PleRowStats, Qwen4Model};
use crate::device::hybrid::HybridOps;

impl<D: HybridOps> Qwen4Model<D> {
    /// Greedy decoding at batch 1 (see [`crate::model::Model::generate`]):
    /// the prompt, then up to `max_new` tokens, stopping at one in
    /// `stop_ids`; a request past the context limit is refused first.
    /// ([`crate::engine::Engine::generate`] also streams each token.)
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        keep_prompt_logits: bool,
    ) -> Result<Generation, EngineError> {
        greedy(self, prompt, max_new, stop_ids, keep_prompt_logits, |_| {})
    }
}

impl<D: HybridOps> Decoder for Qwen4Model<D> {
    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    fn positions(&self) -> (usize, usize) {
        (self.pos, self.cfg.max_positions)
    }

    fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        self.forward(tokens, all_logits)
    }

    fn greedy_step(&mut self, token: u32) -> Result<u32, EngineError> {
        self.greedy_next(token)
    }

    fn prompt_ahead(&mut self, next: &[u32]) {
        self.set_prompt_ahead(next);
    }

    fn expert_stats(&self) -> ExpertStats {
        Qwen4Model::expert_stats(self)
    }

    fn row_stats(&self) -> Option<PleRowStats> {
        Qwen4Model::row_stats(self)
    }
}
