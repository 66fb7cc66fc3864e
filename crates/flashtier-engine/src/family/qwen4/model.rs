//! A loaded Qwen4-Exp text model on a device, decoding one sequence.
//!
//! Per layer, on `hc_count` residual streams (the embedding repeated into
//! each): the PLE injection (PLE layers), then the attention mixer's input,
//! GatedDeltaNet or sparse attention, its output injected into every
//! stream; then the MoE mixer's input, the routed experts (from the expert
//! tier, summed in ascending id) plus the shared expert scaled by
//! `sigmoid(shared_expert_gate . x)`, injected likewise. The final mixer's
//! output goes to the LM head (there is no final norm).
//!
//! The decoder is written once over [`HybridOps`]: the CPU and the GPU run
//! this code, with their kernels underneath.
//!
//! Bounds: a step is at most [`crate::model::PREFILL_CHUNK`] tokens; the
//! sequence at most `max_position_embeddings` positions (refused before
//! the step runs).

use std::path::Path;

use crate::checkpoint::Checkpoint;
use crate::config::Routing;
use crate::config::qwen4::{LayerKind, Qwen4Config, in_scope};
use crate::device::cpu::CpuDevice;
use crate::device::hybrid::HybridOps;
use crate::device::{Activation, ExpertTier, HeadCopy};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::route::RouteRule;
use crate::load::weights::Loader;
use crate::load::{LoadOptions, pool_experts};
use crate::model::check_step;

use super::gdn::GatedDeltaNet;
use super::hyper::GatedResidual;
use super::ple::PleLayer;
use super::qsa::SparseAttention;
use super::rows::{PleRowOptions, PleRowStats};

/// A layer's token mixer.
enum Mixer<D: HybridOps> {
    Linear(GatedDeltaNet<D>),
    Sparse(SparseAttention<D>),
}

struct Layer<D: HybridOps> {
    ple: Option<PleLayer<D>>,
    attn_hc: GatedResidual<D>,
    mixer: Mixer<D>,
    mlp_hc: GatedResidual<D>,
    moe: Moe<D>,
}

/// A Qwen4-Exp model with its states and expert tier, on the CPU unless
/// `D` says otherwise.
pub struct Qwen4Model<D: HybridOps = CpuDevice> {
    dev: D,
    cfg: Qwen4Config,
    ckpt: Checkpoint,
    embed: D::Mat,
    layers: Vec<Layer<D>>,
    mixer: GatedResidual<D>,
    lm_head: Option<D::Mat>,
    experts: D::Experts,
    rule: RouteRule,
    /// RoPE over the rotated dims, for every position.
    rope: D::Rope,
    pos: usize,
    /// The batch API's id of the sequence the state is of
    /// ([`crate::engine::Engine::step_batch`]; `None` after a reset).
    owner: Option<u64>,
    /// The prompt's tokens after the next step's, whose PLE rows that step
    /// starts reading (empty: none; taken by the step).
    prompt_next: Vec<u32>,
    /// Leave out stream `s`'s attention injection (only to show the
    /// fixture needs every hyper-connection term).
    pub(crate) drop_inject_stream: Option<usize>,
}

impl<D: HybridOps> std::fmt::Debug for Qwen4Model<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen4Model")
            .field("device", &self.dev.name())
            .field("layers", &self.layers.len())
            .field("positions", &self.pos)
            .finish_non_exhaustive()
    }
}

impl Qwen4Model<CpuDevice> {
    /// Load the Qwen4-Exp checkpoint in `dir` with experts from the store
    /// file `store` (packed from it) under `opts`' budget and backing.
    pub fn open(dir: &Path, store: &Path, opts: &LoadOptions) -> Result<Self, EngineError> {
        Self::open_with_rows(dir, store, opts, None)
    }

    /// [`Self::open`], with the PLE rows from the row store under `rows`
    /// (`None`: read from the checkpoint's shards directly).
    pub fn open_with_rows(
        dir: &Path,
        store: &Path,
        opts: &LoadOptions,
        rows: Option<&PleRowOptions>,
    ) -> Result<Self, EngineError> {
        Self::from_checkpoint(Checkpoint::open(dir)?, store, opts, rows)
    }

    /// [`Self::open_with_rows`] on a checkpoint already opened.
    pub fn from_checkpoint(
        ckpt: Checkpoint,
        store: &Path,
        opts: &LoadOptions,
        rows: Option<&PleRowOptions>,
    ) -> Result<Self, EngineError> {
        let cfg = Qwen4Config::from_json(ckpt.source().config())?;
        let scope = cfg.field_scope();
        let experts = pool_experts(&cfg.expert_view(), ckpt.source(), store, opts)?;
        Self::with_experts(CpuDevice, ckpt, cfg, experts, rows).map_err(|e| in_scope(e, scope))
    }
}

impl<D: HybridOps> Qwen4Model<D> {
    /// The model on `dev` with experts from `experts`, PLE rows from the
    /// row store under `rows` (`None`: from the checkpoint).
    pub fn with_experts(
        dev: D,
        ckpt: Checkpoint,
        cfg: Qwen4Config,
        experts: D::Experts,
        rows: Option<&PleRowOptions>,
    ) -> Result<Self, EngineError> {
        if cfg.vision_skipped {
            tracing::info!("qwen4_exp: the text model runs; the vision tower is not run");
        }
        let h = cfg.hidden_size;
        let pre = cfg.prefix.clone();
        let inv_freq = super::ops::inv_freq(cfg.rope_theta, cfg.rope_dim);
        let rope = dev.rope_table(&inv_freq, 1.0, cfg.max_positions)?;
        let l = Loader {
            ckpt: &ckpt,
            dev: &dev,
            fp8_block: None,
        };
        let layers = (0..cfg.layers.len())
            .map(|i| Layer::load(&l, &cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let embed = l.matrix(&format!("{pre}.embed_tokens.weight"), [cfg.vocab_size, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(l.matrix("lm_head.weight", [cfg.vocab_size, h])?)
        };
        let mixer = GatedResidual::load(
            &l,
            &format!("{pre}.hyper_connection_mixer"),
            (cfg.hc_count, h, cfg.hc_lowrank),
            cfg.rms_norm_eps,
            false,
        )?;
        let rule = RouteRule {
            routing: Routing::Softmax,
            num_experts: cfg.num_experts,
            top_k: cfg.top_k,
            norm_topk_prob: cfg.norm_topk_prob,
        };
        let mut m = Self {
            dev,
            cfg,
            ckpt,
            embed,
            layers,
            mixer,
            lm_head,
            experts,
            rule,
            rope,
            pos: 0,
            owner: None,
            prompt_next: Vec::new(),
            drop_inject_stream: None,
        };
        if let Some(r) = rows {
            m.use_row_store(r)?;
        }
        Ok(m)
    }

    /// Serve every PLE layer's rows from the row store, the budget split
    /// evenly over all their shards.
    fn use_row_store(&mut self, opts: &PleRowOptions) -> Result<(), EngineError> {
        let shards: usize = self
            .layers
            .iter()
            .filter_map(|l| l.ple.as_ref())
            .map(PleLayer::shard_count)
            .sum();
        let per_shard = opts.budget_bytes / shards.max(1) as u64;
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let Some(p) = &mut l.ple {
                p.use_row_store(&self.ckpt, i, opts, per_shard)?;
            }
        }
        Ok(())
    }

    /// PLE row-store counters so far (`None` when rows come from the
    /// checkpoint).
    pub fn row_stats(&self) -> Option<PleRowStats> {
        let mut all: Option<PleRowStats> = None;
        for s in self
            .layers
            .iter()
            .filter_map(|l| l.ple.as_ref()?.row_stats())
        {
            let t = all.get_or_insert_with(PleRowStats::default);
            t.lookups += s.lookups;
            t.hits += s.hits;
            t.misses += s.misses;
            t.bytes_read += s.bytes_read;
            t.stall_ns += s.stall_ns;
        }
        all
    }

    /// The config.
    pub fn config(&self) -> &Qwen4Config {
        &self.cfg
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The expert tier.
    pub fn experts(&self) -> &D::Experts {
        &self.experts
    }

    /// Blocks the QSA indexer left out over the sequence, summed over layers.
    pub fn blocks_dropped(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Sparse(s) => s.blocks_dropped,
                Mixer::Linear(_) => 0,
            })
            .sum()
    }

    /// PLE table rows read over the model's life.
    pub fn ple_rows_read(&self) -> u64 {
        self.layers
            .iter()
            .filter_map(|l| l.ple.as_ref())
            .map(|p| p.rows_read)
            .sum()
    }

    /// The prompt's tokens after the next step's: that step starts reading
    /// their PLE rows (row store only) while it computes.
    pub(crate) fn set_prompt_ahead(&mut self, next: &[u32]) {
        self.prompt_next.clear();
        self.prompt_next.extend_from_slice(next);
    }

    /// The batch API's id of the sequence the state is of.
    pub(crate) fn owner(&self) -> Option<u64> {
        self.owner
    }

    /// Name the sequence the state is of (right after a reset).
    pub(crate) fn set_owner(&mut self, id: u64) {
        self.owner = Some(id);
    }

    /// Positions held and the most the sequence may hold.
    pub fn positions(&self) -> (usize, usize) {
        (self.pos, self.cfg.max_positions)
    }

    /// Forget the sequence (the expert tier stays warm).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        let dev = &self.dev;
        for l in &mut self.layers {
            if let Some(p) = &mut l.ple {
                p.reset(dev)?;
            }
            match &mut l.mixer {
                Mixer::Linear(g) => g.reset(dev)?,
                Mixer::Sparse(s) => s.reset(dev)?,
            }
        }
        self.pos = 0;
        self.owner = None;
        self.prompt_next.clear();
        Ok(())
    }

    /// Run `tokens` at the next positions; returns the logits of every
    /// token (`all_logits`) or of the last, `[rows][vocab]` row-major.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        let logits = self.logits(tokens, all_logits)?;
        self.dev.to_host(&logits)
    }

    /// One decode step of `token`; the greedy next token, picked where the
    /// logits are (the lowest index of the largest logit, as the host's
    /// argmax picks it): the GPU copies one id instead of the vocabulary.
    pub(crate) fn greedy_next(&mut self, token: u32) -> Result<u32, EngineError> {
        let logits = self.logits(&[token], false)?;
        let picked = self.dev.argmax_rows(&logits)?;
        picked.first().copied().ok_or_else(|| EngineError::Shape {
            op: "greedy pick",
            what: "no row of logits".into(),
        })
    }

    /// [`Self::forward`]'s logits, on the device.
    fn logits(&mut self, tokens: &[u32], all_logits: bool) -> Result<D::Act, EngineError> {
        let x = self.run_layers(tokens, None)?;
        let dev = &self.dev;
        let n = tokens.len();
        let out = self.mixer.forward(dev, &x)?.input;
        let head = if all_logits || n == 1 {
            out
        } else {
            let mut last = dev.zeros(1, self.cfg.hidden_size)?;
            dev.copy_rows(&mut last, 0, &out, n - 1, 1)?;
            last
        };
        let mut logits = dev.zeros(head.rows(), self.cfg.vocab_size)?;
        dev.linear(
            &mut logits,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            &head,
        )?;
        Ok(logits)
    }

    /// The decoder layers over `tokens`: the streams after the last layer,
    /// and (with `trace`) after each layer, on the host.
    #[cfg(test)]
    pub(crate) fn forward_streams(
        &mut self,
        tokens: &[u32],
        trace: bool,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), EngineError> {
        let mut traced = Vec::new();
        let x = self.run_layers(tokens, trace.then_some(&mut traced))?;
        Ok((self.dev.to_host(&x)?, traced))
    }

    /// The streams after every layer for `tokens` (`trace`: each layer's
    /// copied to the host as well).
    fn run_layers(
        &mut self,
        tokens: &[u32],
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<D::Act, EngineError> {
        let n = tokens.len();
        let (vocab, h, hc) = (self.cfg.vocab_size, self.cfg.hidden_size, self.cfg.hc_count);
        check_step(
            tokens,
            vocab,
            (self.pos, self.cfg.max_positions),
            crate::model::PREFILL_CHUNK,
        )?;
        let dev = &self.dev;
        // Every expert resident: the device may record a one-token step's
        // launches (the GPU does), so every PLE layer's rows are read and
        // copied to it before the first kernel, not in the middle.
        let landed = n == 1 && !dev.hints_wanted(&self.experts);
        if landed {
            for p in self.layers.iter_mut().filter_map(|l| l.ple.as_mut()) {
                p.start_step(tokens)?;
            }
            for p in self.layers.iter_mut().filter_map(|l| l.ple.as_mut()) {
                p.land(dev, &self.ckpt, tokens)?;
            }
        }
        let mut e = dev.zeros(n, h)?;
        dev.embed(&mut e, &self.embed, tokens)?;
        let mut x = dev.zeros(n, hc * h)?;
        let every_stream = HeadCopy {
            heads: hc,
            len: h,
            src_stride: 0,
            src_offset: 0,
            dst_stride: h,
            dst_offset: 0,
            scale: 1.0,
        };
        dev.copy_heads(&mut x, &e, every_stream)?;
        // No earlier layer guesses the first layer's experts: its router
        // applied to the MoE input the streams would give without that
        // layer's PLE and attention starts those reads first (the largest
        // of the step's first reads), then the PLE rows' reads start; both
        // land while the first layers compute.
        if n == 1 && dev.hints_wanted(&self.experts) {
            if let Some(first) = self.layers.first() {
                let m = first.mlp_hc.forward(dev, &x)?;
                let guess = dev.router(&first.moe.router, &m.input, &self.rule, None)?;
                dev.read_ahead_now(&mut self.experts, 0, &guess)?;
            }
        }
        // Every PLE layer's rows are known now: start all their reads.
        if !landed {
            for p in self.layers.iter_mut().filter_map(|l| l.ple.as_mut()) {
                p.start_step(tokens)?;
            }
        }
        // Then the next prompt chunk's, behind them.
        let next = std::mem::take(&mut self.prompt_next);
        if !next.is_empty() {
            for p in self.layers.iter_mut().filter_map(|l| l.ple.as_mut()) {
                p.read_ahead(&next)?;
            }
        }
        for i in 0..self.layers.len() {
            self.layer(i, &mut x, tokens)?;
            if let Some(t) = trace.as_deref_mut() {
                t.push(self.dev.to_host(&x)?);
            }
        }
        self.pos += n;
        Ok(x)
    }

    fn layer(&mut self, i: usize, x: &mut D::Act, tokens: &[u32]) -> Result<(), EngineError> {
        let dev = &self.dev;
        let drop = self.drop_inject_stream;
        let (head, tail) = self.layers.split_at_mut(i + 1);
        let layer = &mut head[i];
        if let Some(p) = &mut layer.ple {
            p.forward(dev, &self.ckpt, x, tokens)?;
        }
        let m = layer.attn_hc.forward(dev, x)?;
        let y = match &mut layer.mixer {
            Mixer::Linear(g) => g.forward(dev, &m.input)?,
            Mixer::Sparse(s) => s.forward(dev, &m.input, &self.rope)?,
        };
        let mut w = inject_weights(m.inject, i)?;
        if let Some(s) = drop {
            // A weight the gate maps to zero: 2 sigmoid(-inf) = 0.
            let hc = self.cfg.hc_count;
            let mut host = dev.to_host(&w)?;
            host.iter_mut()
                .skip(s)
                .step_by(hc)
                .for_each(|v| *v = f32::NEG_INFINITY);
            w = dev.upload(w.rows(), w.cols(), &host)?;
        }
        dev.hc_inject(x, &y, &w, layer.attn_hc.inject_gate())?;
        let m = layer.mlp_hc.forward(dev, x)?;
        let next: Vec<&D::Mat> = tail
            .iter()
            .take(dev.hint_depth())
            .map(|l| &l.moe.router)
            .collect();
        let mut ctx = MoeStep {
            dev,
            experts: &mut self.experts,
            rule: &self.rule,
            layer: i,
            hidden: self.cfg.hidden_size,
        };
        let y = layer.moe.forward(&mut ctx, &next, &m.input)?;
        dev.hc_inject(
            x,
            &y,
            &inject_weights(m.inject, i)?,
            layer.mlp_hc.inject_gate(),
        )
    }
}

/// A layer mixer's injection weights (every mixer but the final one has them).
fn inject_weights<A>(w: Option<A>, layer: usize) -> Result<A, EngineError> {
    w.ok_or_else(|| EngineError::Layout {
        what: format!("hyper-connection mixer of layer {layer}"),
        reason: "it gave no injection weights".to_string(),
    })
}

impl<D: HybridOps> Layer<D> {
    /// Load decoder layer `i` (`{prefix}.layers.{i}.*`).
    fn load(l: &Loader<'_, D>, cfg: &Qwen4Config, i: usize) -> Result<Self, EngineError> {
        let p = format!("{}.layers.{i}", cfg.prefix);
        let rank = cfg
            .ple
            .as_ref()
            .and_then(|pl| pl.layers.iter().position(|&l| l == i));
        let ple = rank.map(|r| PleLayer::load(l, cfg, &p, r)).transpose()?;
        let mixer = match cfg.layers.get(i) {
            Some(LayerKind::Sparse) => Mixer::Sparse(SparseAttention::load(l, cfg, &p)?),
            _ => Mixer::Linear(GatedDeltaNet::load(l, cfg, &p)?),
        };
        let shape = (cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank);
        let hc = |name: &str| {
            GatedResidual::load(l, &format!("{p}.{name}"), shape, cfg.rms_norm_eps, true)
        };
        Ok(Self {
            ple,
            attn_hc: hc("attn_hyper_connection")?,
            mixer,
            mlp_hc: hc("mlp_hyper_connection")?,
            moe: load_moe(l, cfg, &p)?,
        })
    }
}

#[path = "moe.rs"]
mod moe;
use moe::{Moe, MoeStep, load_moe};

#[path = "generate.rs"]
mod generate;

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
