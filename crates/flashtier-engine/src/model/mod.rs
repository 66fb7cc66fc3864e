//! A loaded model on a device, decoding one sequence: [`Model::forward`]
//! runs a step of tokens through the family's decoder, and
//! [`Model::generate`] decodes greedily at batch 1.
//!
//! Bounds: a prompt runs in chunks of at most [`PREFILL_CHUNK`] tokens (the
//! activations of a step are `chunk x widest layer` f32, the logits `chunk x
//! vocab` only when every prompt position's logits are kept, and a chunk
//! before the prompt's last runs no LM head unless they are); the KV cache
//! holds at most the context limit, checked for the whole request before
//! the first token runs.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::device::cuda::kv::tier::KvTierStats;
use crate::device::{Activation, Device, ExpertTier, KvPrecision, KvSpec, KvState, PickTicket};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::qwen4::PleRowStats;
use crate::family::route::RouteRule;
use crate::family::{SeqRows, Step, Weights, decoder_layers};

mod batch;
mod greedy;

pub use batch::{RowOut, SeqStep, Want};
pub(crate) use greedy::{Decoder, greedy};

pub use crate::config::bounds::PREFILL_CHUNK;

/// A loaded model with its KV cache and expert tier, decoding one sequence.
pub struct Model<D: Device> {
    dev: D,
    cfg: ModelConfig,
    rule: RouteRule,
    weights: Weights<D>,
    experts: D::Experts,
    kv: D::Kv,
    rope: D::Rope,
    /// Nanoseconds greedy steps spent issuing their work before they asked
    /// the device for the token (see [`Generation::decode_issue_secs`]).
    issue_ns: u64,
    /// The pick the last chained step left on the device.
    pick: Option<PickTicket>,
}

/// The tokens a step runs: ids on the host, or the pick the step before
/// left on the device (one token).
#[derive(Clone, Copy)]
enum StepInput<'a> {
    Host(&'a [u32]),
    Picked(PickTicket),
}

impl<D: Device> std::fmt::Debug for Model<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("device", &self.dev.name())
            .field("arch", &self.cfg.arch)
            .field("positions", &self.kv.len())
            .finish()
    }
}

/// What [`Model::generate`] produced.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// Logits at every prompt position (`[prompt_len][vocab]`), when asked for.
    pub prompt_logits: Vec<Vec<f32>>,
    /// New tokens, in order.
    pub generated_ids: Vec<u32>,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Seconds spent on the prompt.
    pub prefill_secs: f64,
    /// Seconds spent producing the new tokens after the first.
    pub decode_secs: f64,
    /// Forward passes in `decode_secs`.
    pub decode_steps: u64,
    /// Expert counters over the prompt only.
    pub prefill_experts: ExpertStats,
    /// Expert counters over the decode steps only.
    pub decode_experts: ExpertStats,
    /// Expert counters over the whole call.
    pub total_experts: ExpertStats,
    /// Row-store counters over the decode steps (Qwen4-Exp's PLE rows,
    /// when they come from the row store).
    pub decode_rows: Option<PleRowStats>,
    /// KV tier counters over the prompt (offloads, restores), when a KV
    /// budget sends positions to the KV store.
    pub prefill_kv: Option<KvTierStats>,
    /// KV tier counters over the decode steps.
    pub decode_kv: Option<KvTierStats>,
    /// Of `decode_secs`, the seconds the host spent issuing the steps'
    /// work before waiting on the device for each step's token (`None`
    /// where the step is not split so: the CPU computes as it issues). The
    /// rest is the wait; a device idles at least while a step's first
    /// launches are recorded.
    pub decode_issue_secs: Option<f64>,
}

impl Generation {
    /// Decoded tokens per second (forward passes after the prompt).
    pub fn tokens_per_sec(&self) -> f64 {
        if self.decode_secs > 0.0 {
            self.decode_steps as f64 / self.decode_secs
        } else {
            0.0
        }
    }
}

/// The KV cache `cfg` needs: up to `max_position_embeddings` positions, or
/// the sliding window when smaller (so no position ever leaves the window).
pub fn kv_spec(cfg: &ModelConfig) -> KvSpec {
    let capacity = cfg
        .sliding_window
        .map_or(cfg.max_positions, |w| w.min(cfg.max_positions));
    // The hi/lo pairs double the head; past the KV tier's width limit
    // (DeepSeek-V3's 192-wide heads) keys and values are one BF16 each.
    let precision = if 2 * cfg.head_dim <= flashtier::kv::attention::MAX_HEAD_DIM {
        KvPrecision::Bf16x2
    } else {
        KvPrecision::Bf16
    };
    KvSpec {
        layers: cfg.num_layers,
        q_heads: cfg.num_q_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        capacity,
        precision,
    }
}

impl<D: Device> Model<D> {
    /// Load the resident weights of `ckpt` onto `dev`; experts come from
    /// `experts`. The config's counts are first held against the
    /// checkpoint's tensors ([`crate::config::bounds::check`]).
    pub fn new(
        dev: D,
        cfg: &ModelConfig,
        ckpt: &Checkpoint,
        experts: D::Experts,
    ) -> Result<Self, EngineError> {
        crate::config::bounds::check(cfg, ckpt)?;
        // The cache checks its limits before the weights take any memory.
        let spec = kv_spec(cfg);
        let kv = dev.kv_cache(&spec)?;
        let rope = dev.rope_table(
            &cfg.rope_inv_freq(),
            cfg.rope_attention_factor(),
            spec.capacity,
        )?;
        let weights = Weights::load(&dev, ckpt, cfg)?;
        Ok(Self {
            rule: RouteRule::of(cfg),
            cfg: cfg.clone(),
            dev,
            weights,
            experts,
            kv,
            rope,
            issue_ns: 0,
            pick: None,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The expert tier.
    pub fn experts(&self) -> &D::Experts {
        &self.experts
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }

    /// The KV cache.
    pub fn kv(&self) -> &D::Kv {
        &self.kv
    }

    /// What the KV tier did so far (`None` without a KV budget that
    /// offloads).
    pub fn kv_stats(&self) -> Option<KvTierStats> {
        self.kv.tier_stats()
    }

    /// Most prompt rows one step takes for a sequence that will hold
    /// `len` positions after it: the device's choice ([`Device::prompt_rows`])
    /// in whole [`PREFILL_CHUNK`]s, within the widest activation's bound
    /// ([`crate::config::bounds::step_rows`]); at least one chunk.
    #[must_use]
    pub fn prompt_rows(&self, len: usize) -> usize {
        let most = self.dev.prompt_rows(&kv_spec(&self.cfg), len);
        crate::config::bounds::step_rows(&self.cfg, most)
    }

    /// The most rows a step of `n` rows for one sequence may take, ending
    /// at `len` positions: one chunk needs no look at the device (every
    /// device takes it), more asks [`Self::prompt_rows`].
    pub(crate) fn step_limit(&self, len: usize, n: usize) -> usize {
        if n <= PREFILL_CHUNK {
            PREFILL_CHUNK
        } else {
            self.prompt_rows(len)
        }
    }

    /// Positions the KV cache can hold.
    pub fn context_limit(&self) -> usize {
        self.kv.capacity()
    }

    /// Forget the sequence (the expert tier stays warm).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        self.kv = self.dev.kv_cache(&kv_spec(&self.cfg))?;
        Ok(())
    }

    /// Run `tokens` at the next positions (one step; at most
    /// [`Self::prompt_rows`] of the positions after it). Returns the logits of every token (`all_logits`)
    /// or of the last one, row-major `[rows][vocab]` on the host.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        let head = if all_logits { Head::Every } else { Head::Last };
        self.run_step(tokens, head)
    }

    /// [`Self::forward`] with the LM head on the rows `head` names (none:
    /// an empty vector, for a prompt chunk whose logits nobody reads).
    fn run_step(&mut self, tokens: &[u32], head: Head) -> Result<Vec<f32>, EngineError> {
        match self.head_step(StepInput::Host(tokens), head)? {
            Some(logits) => self.dev.to_host(&logits),
            None => Ok(Vec::new()),
        }
    }

    /// One step of `tokens`; the logits of the rows `head` names, left on
    /// the device (`None` for [`Head::None`]).
    fn head_step(
        &mut self,
        input: StepInput<'_>,
        head: Head,
    ) -> Result<Option<D::Act>, EngineError> {
        let (vocab, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let first = self.kv.len();
        let n = match input {
            StepInput::Host(tokens) => {
                let most = self.step_limit(first + tokens.len(), tokens.len());
                check_step(tokens, vocab, (first, self.kv.capacity()), most)?;
                tokens.len()
            }
            StepInput::Picked(_) => {
                check_room(first, 1, self.kv.capacity())?;
                1
            }
        };
        let dev = &self.dev;
        let mut x = dev.zeros(n, h)?;
        match input {
            StepInput::Host(tokens) => dev.embed(&mut x, &self.weights.embed, tokens)?,
            StepInput::Picked(t) => dev.embed_picked(&mut x, &self.weights.embed, t)?,
        }
        let seq = SeqRows {
            kv: &mut self.kv,
            first,
            start: 0,
            rows: n,
        };
        let mut st = Step {
            dev,
            cfg: &self.cfg,
            rule: &self.rule,
            rope: &self.rope,
            seqs: vec![seq],
            experts: &mut self.experts,
            rows: n,
        };
        let normed = decoder_layers(&self.weights, &mut st, &mut x)?;
        self.kv.advance(n);
        if head == Head::None {
            return Ok(None);
        }
        let head = if head == Head::Every || n == 1 {
            normed
        } else {
            let mut last = dev.zeros(1, h)?;
            dev.copy_rows(&mut last, 0, &normed, n - 1, 1)?;
            last
        };
        let mut logits = dev.zeros(head.rows(), vocab)?;
        dev.linear(&mut logits, self.weights.lm_head(), &head)?;
        Ok(Some(logits))
    }

    /// Greedy decoding at batch 1: run `prompt`, then produce up to
    /// `max_new` tokens, calling `on_token` with each as it comes; stops
    /// early at a token in `stop_ids`. Keeps every prompt position's logits
    /// when `keep_prompt_logits` (`max_new` 0 runs the prompt only). A
    /// request longer than the context limit is refused before anything runs.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        keep_prompt_logits: bool,
        on_token: impl FnMut(u32),
    ) -> Result<Generation, EngineError> {
        greedy(
            self,
            prompt,
            max_new,
            stop_ids,
            keep_prompt_logits,
            on_token,
        )
    }
}

/// Refuse a step of no tokens or more than `most`, a token outside
/// `vocab`, or one that would take the positions past `capacity` (`used`
/// taken).
pub(crate) fn check_step(
    tokens: &[u32],
    vocab: usize,
    (used, capacity): (usize, usize),
    most: usize,
) -> Result<(), EngineError> {
    let n = tokens.len();
    if n == 0 || n > most {
        return Err(EngineError::Shape {
            op: "forward",
            what: format!("{n} tokens in one step (1..={most})"),
        });
    }
    if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::TokenOutOfRange { id, vocab });
    }
    check_room(used, n, capacity)
}

/// Refuse `n` more positions past `capacity` (`used` taken).
fn check_room(used: usize, n: usize, capacity: usize) -> Result<(), EngineError> {
    if used + n > capacity {
        return Err(EngineError::ContextFull {
            len: used + n,
            max: capacity,
        });
    }
    Ok(())
}

/// Which rows of a step go through the LM head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Head {
    Every,
    Last,
    None,
}

/// A step that should have produced logits produced none.
fn no_logits() -> EngineError {
    EngineError::Shape {
        op: "greedy step",
        what: "no logits row".into(),
    }
}

/// The greedy token of the last row of `logits`.
fn last_argmax(logits: &[f32], vocab: usize) -> u32 {
    let row = logits.len().saturating_sub(vocab);
    crate::device::cpu::kernels::argmax(logits.get(row..).unwrap_or(&[])) as u32
}
