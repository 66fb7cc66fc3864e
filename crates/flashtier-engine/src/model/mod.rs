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

use std::time::Instant;

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::device::cuda::kv::tier::KvTierStats;
use crate::device::{Activation, Device, ExpertTier, KvPrecision, KvSpec, KvState, PickTicket};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::qwen4::PleRowStats;
use crate::family::route::RouteRule;
use crate::family::{Step, Weights, decoder_layers};

/// Most prompt tokens in one forward step.
pub const PREFILL_CHUNK: usize = 256;

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
    /// [`PREFILL_CHUNK`]). Returns the logits of every token (`all_logits`)
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
                check_step(tokens, vocab, first, self.kv.capacity())?;
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
        let mut st = Step {
            dev,
            cfg: &self.cfg,
            rule: &self.rule,
            rope: &self.rope,
            kv: &mut self.kv,
            experts: &mut self.experts,
            rows: n,
            first,
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
            dev.copy_row(&mut last, &normed, n - 1)?;
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
/// prompt in chunks of at most [`PREFILL_CHUNK`] tokens, then one token a
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
    let chunks = prompt.len().div_ceil(PREFILL_CHUNK);
    for (c, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
        // Only the last chunk's last row picks the first new token.
        let head = match (keep_prompt_logits, c + 1 == chunks) {
            (true, _) => Head::Every,
            (false, true) => Head::Last,
            (false, false) => Head::None,
        };
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

/// Refuse a step of no tokens or more than [`PREFILL_CHUNK`], a token
/// outside `vocab`, or one that would take the positions past `capacity`
/// (`used` taken).
pub(crate) fn check_step(
    tokens: &[u32],
    vocab: usize,
    used: usize,
    capacity: usize,
) -> Result<(), EngineError> {
    let n = tokens.len();
    if n == 0 || n > PREFILL_CHUNK {
        return Err(EngineError::Shape {
            op: "forward",
            what: format!("{n} tokens in one step (1..={PREFILL_CHUNK})"),
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
