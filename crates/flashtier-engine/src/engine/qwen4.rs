//! Qwen4-Exp on whichever device runs it: [`Qwen4Engine`] holds the one
//! decoder ([`Qwen4Model`]) on the CPU or on a GPU and forwards to it.
//!
//! On a GPU the resident weights (everything but the routed experts and
//! the PLE tables) go to HBM, the experts come through the GPU's tiers
//! (HBM slots, pinned RAM, the store), and each step's PLE rows are read
//! (from the checkpoint or the row store, as on the CPU) and copied to
//! HBM before the PLE layer runs.

use crate::config::qwen4::Qwen4Config;
use crate::device::cpu::CpuDevice;
use crate::device::cuda::CudaDevice;
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::qwen4::{PleRowStats, Qwen4Model};
use crate::model::{Decoder, Generation, Head, greedy};

/// A Qwen4-Exp model on its device.
#[expect(
    clippy::large_enum_variant,
    reason = "held boxed ([`crate::engine::Engine::Qwen4`]); one model per engine"
)]
pub enum Qwen4Engine {
    /// On the CPU.
    Cpu(Qwen4Model<CpuDevice>),
    /// On a GPU.
    Cuda(Qwen4Model<CudaDevice>),
}

impl std::fmt::Debug for Qwen4Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu(m) => m.fmt(f),
            Self::Cuda(m) => m.fmt(f),
        }
    }
}

/// `$body` with `$m` the model, whichever device holds it.
macro_rules! each {
    ($self:expr, $m:ident => $body:expr) => {
        match $self {
            Qwen4Engine::Cpu($m) => $body,
            Qwen4Engine::Cuda($m) => $body,
        }
    };
}

impl Qwen4Engine {
    /// The config.
    pub fn config(&self) -> &Qwen4Config {
        each!(self, m => m.config())
    }

    /// `cpu` or `cuda`.
    pub fn device_name(&self) -> &'static str {
        match self {
            Self::Cpu(_) => "cpu",
            Self::Cuda(_) => "cuda",
        }
    }

    /// Positions held and the most the sequence may hold.
    pub fn positions(&self) -> (usize, usize) {
        each!(self, m => m.positions())
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        each!(self, m => m.expert_stats())
    }

    /// PLE row-store counters so far (`None` when rows come from the
    /// checkpoint).
    pub fn row_stats(&self) -> Option<PleRowStats> {
        each!(self, m => m.row_stats())
    }

    /// Forget the sequence (the expert tier stays warm).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        each!(self, m => m.reset())
    }

    /// The batch API's id of the sequence the state is of.
    pub(crate) fn owner(&self) -> Option<u64> {
        each!(self, m => m.owner())
    }

    /// Name the sequence the state is of (right after a reset).
    pub(crate) fn set_owner(&mut self, id: u64) {
        each!(self, m => m.set_owner(id));
    }

    /// One forward step; the logits of every token (`all_logits`) or of the
    /// last. The CPU's steps run on a pool worker (see
    /// [`crate::engine::Engine::generate`]).
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        match self {
            Self::Cpu(m) => rayon::scope(|_| m.forward(tokens, all_logits)),
            Self::Cuda(m) => m.forward(tokens, all_logits),
        }
    }

    /// Greedy decoding (see [`crate::model::Model::generate`]).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        keep_prompt_logits: bool,
        on_token: impl FnMut(u32) + Send,
    ) -> Result<Generation, EngineError> {
        match self {
            // On a pool worker, as for the CPU engine: the parallel matrix
            // products then run without waking the pool from outside for
            // each call (a fifth of a decode step otherwise).
            Self::Cpu(m) => {
                rayon::scope(|_| greedy(m, prompt, max_new, stop_ids, keep_prompt_logits, on_token))
            }
            Self::Cuda(m) => greedy(m, prompt, max_new, stop_ids, keep_prompt_logits, on_token),
        }
    }
}

impl Decoder for Qwen4Engine {
    fn vocab(&self) -> usize {
        self.config().vocab_size
    }

    fn positions(&self) -> (usize, usize) {
        Qwen4Engine::positions(self)
    }

    fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        self.forward(tokens, all_logits)
    }

    fn prompt_step(&mut self, tokens: &[u32], head: Head) -> Result<Vec<f32>, EngineError> {
        self.forward(tokens, head == Head::Every)
    }

    fn expert_stats(&self) -> ExpertStats {
        Qwen4Engine::expert_stats(self)
    }

    fn row_stats(&self) -> Option<PleRowStats> {
        Qwen4Engine::row_stats(self)
    }
}
