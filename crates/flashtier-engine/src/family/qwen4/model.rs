//! A loaded Qwen4-Exp text model on the CPU, decoding one sequence.
//!
//! Per layer, on `hc_count` residual streams (the embedding repeated into
//! each): the PLE injection (PLE layers), then the attention mixer's input,
//! GatedDeltaNet or sparse attention, its output injected into every
//! stream; then the MoE mixer's input, the routed experts (from the expert
//! tier, summed in ascending id) plus the shared expert scaled by
//! `sigmoid(shared_expert_gate . x)`, injected likewise. The final mixer's
//! output goes to the LM head (there is no final norm).
//!
//! Bounds: a step is at most [`crate::model::PREFILL_CHUNK`] tokens; the
//! sequence at most `max_position_embeddings` positions (refused before
//! the step runs).

use std::path::Path;

use crate::checkpoint::Checkpoint;
use crate::config::Routing;
use crate::config::qwen4::{LayerKind, Qwen4Config, in_scope};
use crate::device::Device;
use crate::device::cpu::experts::{MAX_AHEAD, PoolExperts};
use crate::device::cpu::{CpuDevice, HostAct};
use crate::error::EngineError;
use crate::experts::ExpertStats;
use crate::family::ffn::DenseMlp;
use crate::family::route::{RouteRule, route_row};
use crate::load::{LoadOptions, pool_experts};
use crate::matrix::Matrix;
use crate::model::check_step;

use super::gdn::GatedDeltaNet;
use super::hyper::GatedResidual;
use super::ops::{host_loader, inject, linear};
use super::ple::PleLayer;
use super::qsa::SparseAttention;
use super::rows::{PleRowOptions, PleRowStats};

/// A layer's token mixer.
enum Mixer {
    Linear(GatedDeltaNet),
    Sparse(SparseAttention),
}

/// The MoE block's resident part.
struct Moe {
    router: Matrix,
    shared: DenseMlp<CpuDevice>,
    shared_gate: Matrix,
}

struct Layer {
    ple: Option<PleLayer>,
    attn_hc: GatedResidual,
    mixer: Mixer,
    mlp_hc: GatedResidual,
    moe: Moe,
}

/// A Qwen4-Exp model with its states and expert tier.
pub struct Qwen4Model {
    cfg: Qwen4Config,
    ckpt: Checkpoint,
    embed: Matrix,
    layers: Vec<Layer>,
    mixer: GatedResidual,
    lm_head: Option<Matrix>,
    experts: PoolExperts,
    rule: RouteRule,
    pos: usize,
    /// The batch API's id of the sequence the state is of
    /// ([`crate::engine::Engine::step_batch`]; `None` after a reset).
    owner: Option<u64>,
    /// Leave out stream `s`'s attention injection (only to show the
    /// fixture needs every hyper-connection term).
    pub(crate) drop_inject_stream: Option<usize>,
}

impl std::fmt::Debug for Qwen4Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen4Model")
            .field("layers", &self.layers.len())
            .field("positions", &self.pos)
            .finish_non_exhaustive()
    }
}

impl Qwen4Model {
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
        if cfg.vision_skipped {
            tracing::info!("qwen4_exp: the text model runs; the vision tower is not run");
        }
        // Inside the wrapper, a field is named as `text_config.<field>`.
        let scope = cfg.field_scope();
        let experts = pool_experts(&cfg.expert_view(), ckpt.source(), store, opts)?;
        let mut m = Self::with_experts(ckpt, cfg, experts).map_err(|e| in_scope(e, scope))?;
        if let Some(r) = rows {
            m.use_row_store(r).map_err(|e| in_scope(e, scope))?;
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

    fn with_experts(
        ckpt: Checkpoint,
        cfg: Qwen4Config,
        experts: PoolExperts,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let pre = cfg.prefix.clone();
        let inv_freq = super::ops::inv_freq(cfg.rope_theta, cfg.rope_dim);
        let layers = (0..cfg.layers.len())
            .map(|i| Layer::load(&ckpt, &cfg, i, &inv_freq))
            .collect::<Result<Vec<_>, _>>()?;
        let l = host_loader(&ckpt);
        let embed = l.host_matrix(&format!("{pre}.embed_tokens.weight"), [cfg.vocab_size, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(l.host_matrix("lm_head.weight", [cfg.vocab_size, h])?)
        };
        let mixer =
            GatedResidual::load(&ckpt, &format!("{pre}.hyper_connection_mixer"), &cfg, false)?;
        let rule = RouteRule {
            routing: Routing::Softmax,
            num_experts: cfg.num_experts,
            top_k: cfg.top_k,
            norm_topk_prob: cfg.norm_topk_prob,
        };
        Ok(Self {
            cfg,
            ckpt,
            embed,
            layers,
            mixer,
            lm_head,
            experts,
            rule,
            pos: 0,
            owner: None,
            drop_inject_stream: None,
        })
    }

    /// The config.
    pub fn config(&self) -> &Qwen4Config {
        &self.cfg
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        crate::device::ExpertTier::stats(&self.experts)
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

    /// The batch API's id of the sequence the state is of.
    pub(crate) fn owner(&self) -> Option<u64> {
        self.owner
    }

    /// Name the sequence the state is of (right after a reset).
    pub(crate) fn set_owner(&mut self, id: u64) {
        self.owner = Some(id);
    }

    /// Forget the sequence (the expert tier stays warm).
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            if let Some(p) = &mut l.ple {
                p.reset();
            }
            match &mut l.mixer {
                Mixer::Linear(g) => g.reset(),
                Mixer::Sparse(s) => s.reset(),
            }
        }
        self.pos = 0;
        self.owner = None;
    }

    /// Run `tokens` at the next positions; returns the logits of every
    /// token (`all_logits`) or of the last, `[rows][vocab]` row-major.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>, EngineError> {
        let (x, _) = self.forward_streams(tokens, false)?;
        let n = tokens.len();
        let h = self.cfg.hidden_size;
        let out = self.mixer.forward(&x, n)?.input;
        let (head, rows) = if all_logits {
            (out, n)
        } else {
            (out[(n - 1) * h..].to_vec(), 1)
        };
        linear(self.lm_head.as_ref().unwrap_or(&self.embed), &head, rows)
    }

    /// The decoder layers over `tokens`: the streams after the last layer,
    /// and (with `trace`) after each layer.
    pub(crate) fn forward_streams(
        &mut self,
        tokens: &[u32],
        trace: bool,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), EngineError> {
        let n = tokens.len();
        let (vocab, h, hc) = (self.cfg.vocab_size, self.cfg.hidden_size, self.cfg.hc_count);
        check_step(
            tokens,
            vocab,
            (self.pos, self.cfg.max_positions),
            crate::model::PREFILL_CHUNK,
        )?;
        let mut x = Vec::with_capacity(n * hc * h);
        for &t in tokens {
            let row = self
                .embed
                .row_f32(t as usize)
                .ok_or(EngineError::TokenOutOfRange { id: t, vocab })?;
            for _ in 0..hc {
                x.extend_from_slice(&row);
            }
        }
        // No earlier layer guesses the first layer's experts: its router
        // applied to the MoE input the streams would give without that
        // layer's PLE and attention starts those reads first (the largest
        // of the step's first reads), then the PLE rows' reads start; both
        // land while the first layers compute.
        if n == 1 && CpuDevice.hints_wanted(&self.experts) {
            if let Some(first) = self.layers.first() {
                let m = first.mlp_hc.forward(&x, n)?;
                let guess = Moe::guess(&first.moe.router, &self.rule, &m.input)?;
                self.experts.read_ahead_now(0, &guess)?;
            }
        }
        // Every PLE layer's rows are known now: start all their reads.
        for l in &mut self.layers {
            if let Some(p) = &mut l.ple {
                p.start_step(tokens)?;
            }
        }
        let mut traced = Vec::new();
        for i in 0..self.layers.len() {
            self.layer(i, &mut x, tokens)?;
            if trace {
                traced.push(x.clone());
            }
        }
        self.pos += n;
        Ok((x, traced))
    }

    fn layer(&mut self, i: usize, x: &mut [f32], tokens: &[u32]) -> Result<(), EngineError> {
        let (n, h, first) = (tokens.len(), self.cfg.hidden_size, self.pos);
        let drop = self.drop_inject_stream;
        let (head, tail) = self.layers.split_at_mut(i + 1);
        let layer = &mut head[i];
        if let Some(p) = &mut layer.ple {
            p.forward(&self.ckpt, x, tokens)?;
        }
        let m = layer.attn_hc.forward(x, n)?;
        let y = match &mut layer.mixer {
            Mixer::Linear(g) => g.forward(&m.input, n)?,
            Mixer::Sparse(s) => s.forward(&m.input, n, first)?,
        };
        let mut w = m.inject;
        if let Some(s) = drop {
            w.iter_mut()
                .skip(s)
                .step_by(self.cfg.hc_count)
                .for_each(|v| *v = 0.0);
        }
        inject(x, &y, &w, h);
        let m = layer.mlp_hc.forward(x, n)?;
        let mut ctx = MoeStep {
            experts: &mut self.experts,
            rule: &self.rule,
            layer: i,
            rows: n,
            hidden: h,
        };
        let next: Vec<&Matrix> = tail.iter().take(MAX_AHEAD).map(|l| &l.moe.router).collect();
        let y = layer.moe.forward(&mut ctx, &next, m.input)?;
        inject(x, &y, &m.inject, h);
        Ok(())
    }
}

impl Layer {
    /// Load decoder layer `i` (`{prefix}.layers.{i}.*`).
    fn load(
        ckpt: &Checkpoint,
        cfg: &Qwen4Config,
        i: usize,
        inv_freq: &[f32],
    ) -> Result<Self, EngineError> {
        let p = format!("{}.layers.{i}", cfg.prefix);
        let rank = cfg
            .ple
            .as_ref()
            .and_then(|pl| pl.layers.iter().position(|&l| l == i));
        let ple = rank.map(|r| PleLayer::load(ckpt, cfg, &p, r)).transpose()?;
        let mixer = match cfg.layers.get(i) {
            Some(LayerKind::Sparse) => {
                Mixer::Sparse(SparseAttention::load(ckpt, cfg, &p, inv_freq)?)
            }
            _ => Mixer::Linear(GatedDeltaNet::load(ckpt, cfg, &p)?),
        };
        let hc = |name: &str| GatedResidual::load(ckpt, &format!("{p}.{name}"), cfg, true);
        Ok(Self {
            ple,
            attn_hc: hc("attn_hyper_connection")?,
            mixer,
            mlp_hc: hc("mlp_hyper_connection")?,
            moe: load_moe(ckpt, cfg, &p)?,
        })
    }
}

fn load_moe(ckpt: &Checkpoint, cfg: &Qwen4Config, p: &str) -> Result<Moe, EngineError> {
    let l = host_loader(ckpt);
    let h = cfg.hidden_size;
    Ok(Moe {
        router: l.host_matrix(&format!("{p}.mlp.gate.weight"), [cfg.num_experts, h])?,
        shared: DenseMlp::load(
            &l,
            &format!("{p}.mlp.shared_expert"),
            cfg.shared_intermediate,
            h,
        )?,
        shared_gate: l.matrix_f32(&format!("{p}.mlp.shared_expert_gate.weight"), [1, h])?,
    })
}

/// What one layer's MoE step needs besides its weights.
struct MoeStep<'a> {
    experts: &'a mut PoolExperts,
    rule: &'a RouteRule,
    layer: usize,
    rows: usize,
    hidden: usize,
}

impl Moe {
    /// The block's output for the step's rows of `x`. Before the routed
    /// experts run, the next layers' routers (`next`, nearest first) are
    /// applied to `x` and their guesses hinted to the tier (pre-gating: it
    /// changes reads, never results); the shared expert runs while the
    /// routed experts' misses are read.
    fn forward(
        &self,
        st: &mut MoeStep<'_>,
        next: &[&Matrix],
        x: Vec<f32>,
    ) -> Result<Vec<f32>, EngineError> {
        let dev = CpuDevice;
        let (rows, h) = (st.rows, st.hidden);
        let routes = self.route(&self.router, st.rule, &x, rows)?;
        if rows == 1 && dev.hints_wanted(st.experts) {
            for (d, r) in next.iter().enumerate() {
                let guess = Self::guess(r, st.rule, &x)?;
                st.experts.hint_ahead(d + 1, st.layer + d + 1, &guess);
            }
        }
        let xa = HostAct::from_vec(rows, h, x)?;
        let mut out = dev.zeros(rows, h)?;
        let mut shared = None;
        dev.moe_meanwhile(st.experts, st.layer, &xa, &routes, &mut out, &mut || {
            let y = self.shared.forward(&dev, &xa, rows, h)?;
            let mut gate = dev.zeros(rows, 1)?;
            dev.linear(&mut gate, &self.shared_gate, &xa)?;
            shared = Some((y, gate));
            Ok(())
        })?;
        let (y, gate) = shared.ok_or_else(|| EngineError::Layout {
            what: format!("shared expert of layer {}", st.layer),
            reason: "the MoE step never ran it".to_string(),
        })?;
        dev.add_gated(&mut out, &y, &gate)?;
        Ok(out.into_vec())
    }

    /// The experts `router` chooses for the one row `x`, strongest first
    /// (a guess for the tier to read ahead).
    fn guess(router: &Matrix, rule: &RouteRule, x: &[f32]) -> Result<Vec<usize>, EngineError> {
        let logits = linear(router, x, 1)?;
        Ok(crate::hint::ranked(route_row(rule, &logits, None)))
    }

    /// Each row's chosen experts by `router`.
    fn route(
        &self,
        router: &Matrix,
        rule: &RouteRule,
        x: &[f32],
        rows: usize,
    ) -> Result<Vec<Vec<(usize, f32)>>, EngineError> {
        let logits = linear(router, x, rows)?;
        Ok(logits
            .chunks_exact(rule.num_experts)
            .map(|row| route_row(rule, row, None))
            .collect())
    }
}

#[path = "generate.rs"]
mod generate;

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
