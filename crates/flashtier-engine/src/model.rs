//! The forward pass at batch 1 and greedy decoding.
//!
//! One token at a time (the prompt too): embeddings, per layer RMSNorm ->
//! q/k/v -> (Qwen3 qk-norm) -> RoPE -> KV cache -> GQA attention -> o_proj
//! -> residual -> RMSNorm -> dense or sparse SwiGLU MLP -> residual; then
//! the final norm and the LM head. Sparse layers route with a softmax over
//! the router logits, keep the top-k, renormalise when `norm_topk_prob`
//! (always for Mixtral, which equals a softmax over the top-k logits), and
//! sum the experts in ascending expert order, as transformers does.
//!
//! DeepSeek-V3 instead runs multi-head latent attention (the query through
//! its low-rank pair, the key/value latent through `kv_a` and its norm, RoPE
//! on the rope parts, the latent expanded per head by `kv_b`; the cache holds
//! the expanded keys and values, the narrower of the two zero-padded, and the
//! query is pre-scaled so the KV tier's `1/sqrt(d)` becomes DeepSeek's
//! softmax scale) and routes with grouped sigmoids (see
//! [`crate::config::Routing`]); shared experts are added after the routed
//! ones.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::attention::{KvCache, KvPrecision};
use crate::checkpoint::Checkpoint;
use crate::config::{Mla, ModelConfig, Routing};
use crate::error::EngineError;
use crate::experts::{CheckpointExperts, ExpertSource, ExpertStats, ExpertView};
use crate::kernels::{
    MatRef, apply_rope, apply_rope_interleaved, argmax, matvec, rms_norm, rms_norm_heads,
    rope_angles, silu, softmax, top_k,
};
use crate::weights::{
    AttnWeights, DenseMlp, GqaWeights, Matrix, MlaWeights, Mlp, ModelWeights, QueryProj,
};

/// A loaded model with its KV cache and expert source, decoding one sequence.
pub struct Model {
    cfg: ModelConfig,
    weights: ModelWeights,
    experts: Box<dyn ExpertSource>,
    cache: KvCache,
    /// RoPE's inverse frequencies (plain or YaRN).
    inv_freq: Vec<f32>,
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
            inv_freq: cfg.rope_inv_freq(),
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
        let mut x = self
            .weights
            .embed
            .row_f32(id)
            .ok_or(EngineError::TokenOutOfRange {
                id: token,
                vocab: self.weights.embed.rows(),
            })?;
        debug_assert_eq!(x.len(), h);
        let (cos, sin) = rope_angles(
            self.cache.len(),
            &self.inv_freq,
            self.cfg.rope_attention_factor(),
        );
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
        matvec(&mut logits, self.weights.lm_head().mat(), &normed);
        Ok(logits)
    }

    fn attention(
        &mut self,
        layer: usize,
        x: &[f32],
        cos: &[f32],
        sin: &[f32],
    ) -> Result<Vec<f32>, EngineError> {
        let mut at = AttnStep {
            cfg: &self.cfg,
            cache: &mut self.cache,
            layer,
            cos,
            sin,
        };
        match &self.weights.layers[layer].attn {
            AttnWeights::Gqa(g) => gqa(&mut at, g, x),
            AttnWeights::Mla(w) => {
                let m = self.cfg.mla.as_ref().ok_or_else(|| {
                    EngineError::Attention("latent attention weights without MLA dims".into())
                })?;
                mla(&mut at, m, w, x)
            }
        }
    }

    fn feed_forward(&mut self, layer: usize, x: &[f32]) -> Result<Vec<f32>, EngineError> {
        let h = self.cfg.hidden_size;
        let mut chosen = match &self.weights.layers[layer].mlp {
            Mlp::Dense(d) => return Ok(dense_mlp(d, x, h)),
            Mlp::Sparse {
                router, score_bias, ..
            } => route(&self.cfg, router, score_bias.as_deref(), x),
        };
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
            let g = shared.gate.as_ref().map_or(1.0, |g| sigmoid(dot(g, x)));
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
        let Mlp::Sparse {
            router, score_bias, ..
        } = &self.weights.layers[next].mlp
        else {
            return;
        };
        let ids: Vec<usize> = route(&self.cfg, router, score_bias.as_deref(), x)
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
    // The hi/lo pairs double the head; past the KV tier's width limit
    // (DeepSeek-V3's 192-wide heads) keys and values are one BF16 each.
    let precision = if 2 * cfg.head_dim <= flashtier::kv::attention::MAX_HEAD_DIM {
        KvPrecision::Bf16x2
    } else {
        KvPrecision::Bf16
    };
    KvCache::new(
        cfg.num_layers,
        cfg.num_q_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        capacity,
        precision,
    )
}

fn dense_mlp(m: &DenseMlp, x: &[f32], hidden: usize) -> Vec<f32> {
    let inter = m.gate.rows();
    let view = ExpertView {
        gate: m.gate.mat(),
        up: m.up.mat(),
        down: m.down.mat(),
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

/// The chosen experts of one token and their weights.
fn route(
    cfg: &ModelConfig,
    router: &Matrix,
    score_bias: Option<&[f32]>,
    x: &[f32],
) -> Vec<(usize, f32)> {
    let mut logits = vec![0f32; cfg.num_experts];
    matvec(&mut logits, router.mat(), x);
    match cfg.routing {
        Routing::Softmax => {
            softmax(&mut logits);
            let mut chosen = top_k(&logits, cfg.top_k);
            if cfg.norm_topk_prob {
                let sum: f32 = chosen.iter().map(|(_, w)| w).sum();
                for (_, w) in &mut chosen {
                    *w /= sum;
                }
            }
            chosen
        }
        Routing::SigmoidGroups {
            n_group,
            topk_group,
            routed_scaling_factor,
        } => {
            let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
            let mut choice: Vec<f32> = scores
                .iter()
                .enumerate()
                .map(|(e, s)| s + score_bias.and_then(|b| b.get(e)).copied().unwrap_or(0.0))
                .collect();
            let per = cfg.num_experts / n_group.max(1);
            // A group scores the sum of its two best choices.
            let group_scores: Vec<f32> = choice
                .chunks(per.max(1))
                .map(|g| top_k(g, 2).iter().map(|(_, v)| v).sum())
                .collect();
            let keep: Vec<usize> = top_k(&group_scores, topk_group)
                .into_iter()
                .map(|(g, _)| g)
                .collect();
            for (g, chunk) in choice.chunks_mut(per.max(1)).enumerate() {
                if !keep.contains(&g) {
                    chunk.fill(f32::NEG_INFINITY);
                }
            }
            let mut chosen: Vec<(usize, f32)> = top_k(&choice, cfg.top_k)
                .into_iter()
                .map(|(e, _)| (e, scores[e]))
                .collect();
            if cfg.norm_topk_prob {
                let sum: f32 = chosen.iter().map(|(_, w)| w).sum::<f32>() + 1e-20;
                for (_, w) in &mut chosen {
                    *w /= sum;
                }
            }
            for (_, w) in &mut chosen {
                *w *= routed_scaling_factor;
            }
            chosen
        }
    }
}

/// One token's attention at one layer: the config, the KV cache, the layer
/// and the position's RoPE angles.
struct AttnStep<'a> {
    cfg: &'a ModelConfig,
    cache: &'a mut KvCache,
    layer: usize,
    cos: &'a [f32],
    sin: &'a [f32],
}

impl AttnStep<'_> {
    /// Cache this position's keys and values, then attend `q` over every
    /// position the layer holds; the output is shaped like `q`.
    fn attend(&mut self, k: &[f32], v: &[f32], q: &[f32]) -> Result<Vec<f32>, EngineError> {
        self.cache.push(self.layer, k, v)?;
        let mut out = vec![0f32; q.len()];
        self.cache.attend(self.layer, q, &mut out)?;
        Ok(out)
    }
}

/// Grouped-query attention of one token.
fn gqa(at: &mut AttnStep<'_>, lw: &GqaWeights, x: &[f32]) -> Result<Vec<f32>, EngineError> {
    let c = at.cfg;
    let d = c.head_dim;
    let mut q = vec![0f32; c.num_q_heads * d];
    let mut k = vec![0f32; c.num_kv_heads * d];
    let mut v = vec![0f32; c.num_kv_heads * d];
    matvec(&mut q, lw.q_proj.mat(), x);
    matvec(&mut k, lw.k_proj.mat(), x);
    matvec(&mut v, lw.v_proj.mat(), x);
    if let Some([qb, kb, vb]) = &lw.qkv_bias {
        add(&mut q, qb);
        add(&mut k, kb);
        add(&mut v, vb);
    }
    if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
        rms_norm_heads(&mut q, qn, c.rms_norm_eps);
        rms_norm_heads(&mut k, kn, c.rms_norm_eps);
    }
    apply_rope(&mut q, d, at.cos, at.sin);
    apply_rope(&mut k, d, at.cos, at.sin);
    let heads = at.attend(&k, &v, &q)?;
    let mut out = vec![0f32; c.hidden_size];
    matvec(&mut out, lw.o_proj.mat(), &heads);
    Ok(out)
}

/// Multi-head latent attention of one token (DeepSeek-V3).
fn mla(at: &mut AttnStep<'_>, m: &Mla, w: &MlaWeights, x: &[f32]) -> Result<Vec<f32>, EngineError> {
    let (c, cos, sin) = (at.cfg, at.cos, at.sin);
    let (heads, d) = (c.num_q_heads, c.head_dim);
    let (nope, rope, vd) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
    let qk = nope + rope;
    let mut q = vec![0f32; heads * qk];
    match &w.q {
        QueryProj::Plain(p) => matvec(&mut q, p.mat(), x),
        QueryProj::LowRank { a, norm, b } => {
            let r = norm.len();
            let mut low = vec![0f32; r];
            matvec(&mut low, a.mat(), x);
            let mut normed = vec![0f32; r];
            rms_norm(&mut normed, &low, norm, c.rms_norm_eps);
            matvec(&mut q, b.mat(), &normed);
        }
    }
    let mut latent = vec![0f32; m.kv_lora_rank + rope];
    matvec(&mut latent, w.kv_a.mat(), x);
    let (kv_nope, k_rot) = latent.split_at_mut(m.kv_lora_rank);
    let mut kv_normed = vec![0f32; m.kv_lora_rank];
    rms_norm(&mut kv_normed, kv_nope, &w.kv_a_norm, c.rms_norm_eps);
    let mut kv = vec![0f32; heads * (nope + vd)];
    matvec(&mut kv, w.kv_b.mat(), &kv_normed);
    let rotate = |v: &mut [f32]| {
        if m.rope_interleave {
            apply_rope_interleaved(v, rope, cos, sin);
        } else {
            apply_rope(v, rope, cos, sin);
        }
    };
    rotate(k_rot);
    // Query heads `[nope | rope]` padded to `d`, pre-scaled so the tier's
    // `1/sqrt(d)` becomes the model's softmax scale; keys `[k_nope | k_rot]`
    // and values padded to `d`.
    let q_scale = (c.attention_scale() * (d as f64).sqrt()) as f32;
    let mut qs = vec![0f32; heads * d];
    let mut ks = vec![0f32; heads * d];
    let mut vs = vec![0f32; heads * d];
    for hd in 0..heads {
        let qh = &mut q[hd * qk..(hd + 1) * qk];
        rotate(&mut qh[nope..]);
        for (dst, src) in qs[hd * d..hd * d + qk].iter_mut().zip(qh.iter()) {
            *dst = src * q_scale;
        }
        let kvh = &kv[hd * (nope + vd)..(hd + 1) * (nope + vd)];
        ks[hd * d..hd * d + nope].copy_from_slice(&kvh[..nope]);
        ks[hd * d + nope..hd * d + qk].copy_from_slice(k_rot);
        vs[hd * d..hd * d + vd].copy_from_slice(&kvh[nope..]);
    }
    let attended = at.attend(&ks, &vs, &qs)?;
    let values: Vec<f32> = attended
        .chunks_exact(d)
        .flat_map(|h| h[..vd].iter().copied())
        .collect();
    let mut out = vec![0f32; c.hidden_size];
    matvec(&mut out, w.o_proj.mat(), &values);
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn deepseek(experts: usize, n_group: usize, topk_group: usize, top_k: usize) -> ModelConfig {
        let v = serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 8, "moe_intermediate_size": 4, "num_hidden_layers": 2,
            "num_attention_heads": 2, "n_routed_experts": experts, "n_shared_experts": 1,
            "num_experts_per_tok": top_k, "n_group": n_group, "topk_group": topk_group,
            "routed_scaling_factor": 2.5, "norm_topk_prob": true, "first_k_dense_replace": 1,
            "q_lora_rank": null, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 2, "v_head_dim": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0
        });
        ModelConfig::from_json(&v).expect("valid config")
    }

    proptest! {
        /// Grouped sigmoid routing: `top_k` distinct experts, all inside the
        /// `topk_group` best groups (a group scores its two best choices),
        /// none of them beaten by an unchosen expert of a kept group, and
        /// weights that are the sigmoids renormalised to the scaling factor.
        #[test]
        fn grouped_routing_invariants(
            shape in prop_oneof![Just((16usize, 4usize, 2usize, 3usize)), Just((8, 1, 1, 2)), Just((12, 3, 2, 4))],
            w in proptest::collection::vec(-1.0f32..1.0, 16 * 8),
            x in proptest::collection::vec(-1.0f32..1.0, 8),
            bias in proptest::collection::vec(-0.1f32..0.1, 16),
        ) {
            let (experts, n_group, topk_group, top_k) = shape;
            let cfg = deepseek(experts, n_group, topk_group, top_k);
            let router = Matrix::from_f32(experts, 8, &w[..experts * 8]).expect("matrix");
            let bias = &bias[..experts];
            let chosen = route(&cfg, &router, Some(bias), &x);
            prop_assert_eq!(chosen.len(), top_k);
            let mut ids: Vec<usize> = chosen.iter().map(|c| c.0).collect();
            ids.sort_unstable();
            ids.dedup();
            prop_assert_eq!(ids.len(), top_k);
            // Reference scores, computed plainly.
            let logits: Vec<f32> = (0..experts)
                .map(|e| w[e * 8..(e + 1) * 8].iter().zip(&x).map(|(a, b)| a * b).sum())
                .collect();
            let score: Vec<f32> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
            let choice: Vec<f32> = score.iter().zip(bias).map(|(s, b)| s + b).collect();
            let per = experts / n_group;
            let group_score: Vec<f32> = choice
                .chunks(per)
                .map(|g| {
                    let mut v = g.to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    v[0] + v[1]
                })
                .collect();
            let mut order: Vec<usize> = (0..n_group).collect();
            order.sort_by(|a, b| group_score[*b].total_cmp(&group_score[*a]));
            let kept = &order[..topk_group];
            for &e in &ids {
                prop_assert!(kept.contains(&(e / per)), "expert {} outside the kept groups", e);
            }
            let worst_chosen = ids.iter().map(|&e| choice[e]).fold(f32::INFINITY, f32::min);
            for e in (0..experts).filter(|e| kept.contains(&(e / per)) && !ids.contains(e)) {
                prop_assert!(choice[e] <= worst_chosen + 1e-6, "unchosen {} beats a chosen one", e);
            }
            let total: f32 = chosen.iter().map(|c| c.1).sum();
            prop_assert!((total - 2.5).abs() < 1e-4, "weights sum to {}", total);
            let denom: f32 = ids.iter().map(|&e| score[e]).sum();
            for (e, wgt) in &chosen {
                prop_assert!((wgt - score[*e] / denom * 2.5).abs() < 1e-4);
            }
        }
    }
}
