//! The forward pass at batch 1 and greedy decoding.
//!
//! One token at a time (the prompt too): embeddings, per layer RMSNorm ->
//! q/k/v -> (Qwen3 qk-norm) -> RoPE -> KV cache -> GQA attention -> o_proj
//! -> residual -> RMSNorm -> dense or sparse SwiGLU MLP -> residual; then
//! the final norm and the LM head. Sparse layers route with a softmax over
//! the router logits, keep the top-k, renormalise when `norm_topk_prob`
//! (always for Mixtral, which equals a softmax over the top-k logits), and
//! sum the experts in ascending expert order, as transformers does.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::attention::{KvCache, KvPrecision};
use super::checkpoint::Checkpoint;
use super::config::ModelConfig;
use super::error::EngineError;
use super::experts::{CheckpointExperts, ExpertSource, ExpertStats, ExpertView};
use super::kernels::{
    MatRef, apply_rope, argmax, matvec, rms_norm, rms_norm_heads, rope_table, silu, softmax, top_k,
};
use super::weights::{DenseMlp, Mlp, ModelWeights};

/// A loaded model with its KV cache and expert source, decoding one sequence.
pub struct Model {
    cfg: ModelConfig,
    weights: ModelWeights,
    experts: Box<dyn ExpertSource>,
    cache: KvCache,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cfg", &self.cfg)
            .field("positions", &self.cache.len())
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
    /// Seconds spent on the prompt.
    pub prefill_secs: f64,
    /// Seconds spent producing the new tokens after the first.
    pub decode_secs: f64,
    /// Forward passes in `decode_secs`.
    pub decode_steps: u64,
    /// Expert counters over the decode steps only.
    pub decode_experts: ExpertStats,
    /// Expert counters over the whole call.
    pub total_experts: ExpertStats,
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

impl Model {
    /// Load `config.json` and the checkpoint in `dir`; experts are read from
    /// the checkpoint under `budget_bytes` (`None`: all experts may stay).
    pub fn load(dir: &Path, budget_bytes: Option<u64>) -> Result<Self, EngineError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Arc::new(Checkpoint::open(dir)?);
        let experts = CheckpointExperts::new(ckpt.clone(), &cfg, budget_bytes.unwrap_or(u64::MAX))?;
        Self::with_experts(&cfg, &ckpt, Box::new(experts))
    }

    /// Build from a parsed config and checkpoint with any expert source.
    pub fn with_experts(
        cfg: &ModelConfig,
        ckpt: &Checkpoint,
        experts: Box<dyn ExpertSource>,
    ) -> Result<Self, EngineError> {
        let weights = ModelWeights::load(ckpt, cfg)?;
        let cache = new_cache(cfg)?;
        Ok(Self {
            cfg: cfg.clone(),
            weights,
            experts,
            cache,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Expert counters so far.
    pub fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }

    /// Forget the sequence (the expert cache stays warm).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        self.cache = new_cache(&self.cfg)?;
        Ok(())
    }

    /// Run one token at the next position; returns its logits `[vocab]`.
    pub fn forward(&mut self, token: u32) -> Result<Vec<f32>, EngineError> {
        let c = self.cfg.clone();
        let id = token as usize;
        if id >= c.vocab_size {
            return Err(EngineError::TokenOutOfRange {
                id: token,
                vocab: c.vocab_size,
            });
        }
        if self.cache.len() >= self.cache.capacity() {
            return Err(EngineError::ContextFull {
                len: self.cache.len() + 1,
                max: self.cache.capacity(),
            });
        }
        let h = c.hidden_size;
        let mut x = self.weights.embed[id * h..(id + 1) * h].to_vec();
        let (cos, sin) = rope_table(self.cache.len(), c.head_dim, c.rope_theta);
        let mut normed = vec![0f32; h];
        for layer in 0..c.num_layers {
            rms_norm(
                &mut normed,
                &x,
                &self.weights.layers[layer].input_norm,
                c.rms_norm_eps,
            );
            let attn = self.attention(layer, &normed, &cos, &sin)?;
            add(&mut x, &attn);
            let lw = &self.weights.layers[layer];
            rms_norm(&mut normed, &x, &lw.post_attention_norm, c.rms_norm_eps);
            let ffn = self.feed_forward(layer, &normed)?;
            add(&mut x, &ffn);
        }
        self.cache.advance();
        rms_norm(&mut normed, &x, &self.weights.norm, self.cfg.rms_norm_eps);
        let mut logits = vec![0f32; self.cfg.vocab_size];
        matvec(&mut logits, MatRef::F32(self.weights.lm_head()), &normed);
        Ok(logits)
    }

    fn attention(
        &mut self,
        layer: usize,
        x: &[f32],
        cos: &[f32],
        sin: &[f32],
    ) -> Result<Vec<f32>, EngineError> {
        let c = &self.cfg;
        let lw = &self.weights.layers[layer];
        let d = c.head_dim;
        let mut q = vec![0f32; c.num_q_heads * d];
        let mut k = vec![0f32; c.num_kv_heads * d];
        let mut v = vec![0f32; c.num_kv_heads * d];
        matvec(&mut q, MatRef::F32(&lw.q_proj), x);
        matvec(&mut k, MatRef::F32(&lw.k_proj), x);
        matvec(&mut v, MatRef::F32(&lw.v_proj), x);
        if let Some([qb, kb, vb]) = &lw.qkv_bias {
            add(&mut q, qb);
            add(&mut k, kb);
            add(&mut v, vb);
        }
        if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
            rms_norm_heads(&mut q, qn, c.rms_norm_eps);
            rms_norm_heads(&mut k, kn, c.rms_norm_eps);
        }
        apply_rope(&mut q, d, cos, sin);
        apply_rope(&mut k, d, cos, sin);
        self.cache.push(layer, &k, &v)?;
        let mut heads = vec![0f32; q.len()];
        self.cache.attend(layer, &q, &mut heads)?;
        let mut out = vec![0f32; c.hidden_size];
        matvec(&mut out, MatRef::F32(&lw.o_proj), &heads);
        Ok(out)
    }

    fn feed_forward(&mut self, layer: usize, x: &[f32]) -> Result<Vec<f32>, EngineError> {
        let h = self.cfg.hidden_size;
        let router = match &self.weights.layers[layer].mlp {
            Mlp::Dense(d) => return Ok(dense_mlp(d, x, h)),
            Mlp::Sparse { router, .. } => router,
        };
        let mut probs = vec![0f32; self.cfg.num_experts];
        matvec(&mut probs, MatRef::F32(router), x);
        softmax(&mut probs);
        let mut chosen = top_k(&probs, self.cfg.top_k);
        if self.cfg.norm_topk_prob {
            let sum: f32 = chosen.iter().map(|(_, w)| w).sum();
            for (_, w) in &mut chosen {
                *w /= sum;
            }
        }
        self.hint_next_layer(layer, x);
        // transformers adds the experts' outputs in ascending expert order.
        chosen.sort_by_key(|(e, _)| *e);
        let ids: Vec<usize> = chosen.iter().map(|(e, _)| *e).collect();
        let inter = self.cfg.expert_intermediate;
        // One output per chosen expert, filled in whatever order the source
        // serves them, summed afterwards in ascending expert order.
        let mut outs = vec![vec![0f32; h]; ids.len()];
        let mut act = vec![0f32; inter];
        let mut up = vec![0f32; inter];
        self.experts.with_experts(layer, &ids, &mut |pos, view| {
            let y = outs.get_mut(pos).ok_or_else(|| {
                EngineError::Experts(format!(
                    "source served request position {pos} of {}",
                    ids.len()
                ))
            })?;
            swiglu(y, &view, x, &mut act, &mut up);
            Ok(())
        })?;
        let mut out = vec![0f32; h];
        for (y, (_, w)) in outs.iter().zip(&chosen) {
            for (o, yi) in out.iter_mut().zip(y) {
                *o += yi * w;
            }
        }
        // Qwen2-MoE: the shared expert, gated by a sigmoid, added after the
        // routed experts' sum (transformers' order).
        if let Mlp::Sparse {
            shared: Some(shared),
            ..
        } = &self.weights.layers[layer].mlp
        {
            let y = dense_mlp(&shared.mlp, x, h);
            let g = sigmoid(dot(&shared.gate, x));
            for (o, yi) in out.iter_mut().zip(&y) {
                *o += g * yi;
            }
        }
        Ok(out)
    }

    /// Pre-gating: the next sparse layer's router applied to this layer's
    /// MLP input predicts its experts; the source may prefetch them.
    fn hint_next_layer(&mut self, layer: usize, x: &[f32]) {
        let next = (layer + 1..self.cfg.num_layers).find(|l| self.cfg.sparse_layers[*l]);
        let Some(next) = next else { return };
        let Mlp::Sparse { router, .. } = &self.weights.layers[next].mlp else {
            return;
        };
        let mut logits = vec![0f32; self.cfg.num_experts];
        matvec(&mut logits, MatRef::F32(router), x);
        let ids: Vec<usize> = top_k(&logits, self.cfg.top_k)
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        self.experts.hint(next, &ids);
    }

    /// Greedy decoding at batch 1: run `prompt`, then produce up to
    /// `max_new` tokens, calling `on_token` with each as it comes; stops
    /// early at a token in `stop_ids`. Keeps every prompt position's logits
    /// when `keep_prompt_logits` (`max_new` 0 runs the prompt only).
    pub fn generate(
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
        let start_stats = self.experts.stats();
        let started = Instant::now();
        let mut last = Vec::new();
        for &t in prompt {
            last = self.forward(t)?;
            if keep_prompt_logits {
                out.prompt_logits.push(last.clone());
            }
        }
        out.prefill_secs = started.elapsed().as_secs_f64();
        let decode_stats = self.experts.stats();
        let decode_started = Instant::now();
        let mut next = argmax(&last) as u32;
        for _ in 0..max_new {
            out.generated_ids.push(next);
            on_token(next);
            if out.generated_ids.len() >= max_new || stop_ids.contains(&next) {
                break;
            }
            last = self.forward(next)?;
            out.decode_steps += 1;
            next = argmax(&last) as u32;
        }
        out.decode_secs = decode_started.elapsed().as_secs_f64();
        let now = self.experts.stats();
        out.decode_experts = now.since(&decode_stats);
        out.total_experts = now.since(&start_stats);
        Ok(out)
    }
}

/// The KV cache for `cfg`: up to `max_position_embeddings` positions, or the
/// sliding window when smaller (so no position ever leaves the window).
fn new_cache(cfg: &ModelConfig) -> Result<KvCache, EngineError> {
    let capacity = cfg
        .sliding_window
        .map_or(cfg.max_positions, |w| w.min(cfg.max_positions));
    KvCache::new(
        cfg.num_layers,
        cfg.num_q_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        capacity,
        KvPrecision::default(),
    )
}

fn dense_mlp(m: &DenseMlp, x: &[f32], hidden: usize) -> Vec<f32> {
    let inter = m.gate.len() / hidden;
    let view = ExpertView {
        gate: MatRef::F32(&m.gate),
        up: MatRef::F32(&m.up),
        down: MatRef::F32(&m.down),
    };
    let mut out = vec![0f32; hidden];
    swiglu(
        &mut out,
        &view,
        x,
        &mut vec![0f32; inter],
        &mut vec![0f32; inter],
    );
    out
}

/// `out = down(silu(gate x) * up x)`; `act` and `up` are scratch of the intermediate width.
fn swiglu(out: &mut [f32], m: &ExpertView<'_>, x: &[f32], act: &mut [f32], up: &mut [f32]) {
    matvec(act, m.gate, x);
    matvec(up, m.up, x);
    for (a, u) in act.iter_mut().zip(up.iter()) {
        *a = silu(*a) * u;
    }
    matvec(out, m.down, act);
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut y = [0f32; 1];
    matvec(&mut y, MatRef::F32(a), b);
    y[0]
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
