//! Synthetic routing traces with documented, seeded parameters.
//!
//! Each layer has its own popularity: expert ranks are a per-layer random
//! permutation and rank `r` (0-based) has weight `1 / (r + 1)^zipf_s`. For
//! each token and layer the generator picks `top_k` distinct experts, each
//! pick drawn in this order of preference:
//!
//! 1. with probability `token_locality`, an expert this layer used at the
//!    previous token (temporal locality between consecutive tokens);
//! 2. else with probability `layer_correlation`, the image under a fixed
//!    per-layer permutation of an expert the previous layer used at this
//!    token (correlation between consecutive layers);
//! 3. else a draw from the layer's popularity distribution.
//!
//! With `drift_every > 0` every layer's permutation is re-drawn each
//! `drift_every` tokens (the popular experts change with the topic).
//!
//! Families ([`TraceFamily`]) fix these parameters to cover the shapes that
//! matter; `synth:<family>` on the command line names them.
//!
//! Bounds: a trace of `tokens * layers * top_k` ids held in memory; at most
//! `64 * top_k` draws per (token, layer) before falling back to the
//! lowest-numbered unused experts.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::trace::{LayerRoute, RoutingTrace, TraceStep};

/// Parameters of a synthetic trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SynthParams {
    /// MoE layers.
    pub layers: u32,
    /// Experts per layer.
    pub experts: u32,
    /// Experts chosen per token per layer.
    pub top_k: u32,
    /// Tokens (steps).
    pub tokens: u32,
    /// Zipf exponent of per-layer popularity (0 = uniform).
    pub zipf_s: f64,
    /// Probability a pick repeats an expert of the previous token.
    pub token_locality: f64,
    /// Probability a pick follows the previous layer's choice.
    pub layer_correlation: f64,
    /// Re-draw popularity every this many tokens (0 = never).
    pub drift_every: u32,
    /// RNG seed.
    pub seed: u64,
}

/// Named trace families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceFamily {
    /// Skewed per-layer popularity only (zipf 1.0).
    Zipf,
    /// Mild skew (zipf 0.6) with strong token locality (0.5).
    Local,
    /// Skew (0.8) with strong layer correlation (0.6).
    Correlated,
    /// Skew (1.0) whose popular experts change every 256 tokens.
    Drift,
    /// A decode-like mix: zipf 0.9, locality 0.3, layer correlation 0.3.
    Decode,
}

impl TraceFamily {
    /// Every family.
    pub const ALL: [Self; 5] = [
        Self::Zipf,
        Self::Local,
        Self::Correlated,
        Self::Drift,
        Self::Decode,
    ];

    /// Name used by `synth:<family>`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Zipf => "zipf",
            Self::Local => "local",
            Self::Correlated => "correlated",
            Self::Drift => "drift",
            Self::Decode => "decode",
        }
    }

    /// The family's parameters for a model shape.
    #[must_use]
    pub fn params(
        self,
        layers: u32,
        experts: u32,
        top_k: u32,
        tokens: u32,
        seed: u64,
    ) -> SynthParams {
        let (zipf_s, token_locality, layer_correlation, drift_every) = match self {
            Self::Zipf => (1.0, 0.0, 0.0, 0),
            Self::Local => (0.6, 0.5, 0.0, 0),
            Self::Correlated => (0.8, 0.0, 0.6, 0),
            Self::Drift => (1.0, 0.1, 0.0, 256),
            Self::Decode => (0.9, 0.3, 0.3, 0),
        };
        SynthParams {
            layers,
            experts,
            top_k,
            tokens,
            zipf_s,
            token_locality,
            layer_correlation,
            drift_every,
            seed,
        }
    }
}

impl std::str::FromStr for TraceFamily {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|f| f.name()).collect();
                format!("unknown trace family {s} ({})", names.join(" | "))
            })
    }
}

/// Invalid generator parameters.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceGenError {
    /// A dimension is zero or `top_k > experts`, or a probability is outside [0, 1].
    #[error("invalid synthetic trace parameters: {0}")]
    Invalid(String),
}

struct LayerDist {
    /// rank -> expert.
    perm: Vec<u32>,
    /// Cumulative weights by rank, last = 1.
    cdf: Vec<f64>,
    /// previous layer's expert -> this layer's expert.
    follow: Vec<u32>,
}

fn validate(p: &SynthParams) -> Result<(), TraceGenError> {
    let probs = [p.token_locality, p.layer_correlation];
    let what = if p.layers == 0 || p.experts == 0 || p.top_k == 0 {
        "layers, experts and top_k must be >= 1".to_string()
    } else if p.top_k > p.experts {
        format!("top_k {} > experts {}", p.top_k, p.experts)
    } else if probs.iter().any(|x| !(0.0..=1.0).contains(x))
        || !(p.zipf_s.is_finite() && p.zipf_s >= 0.0)
    {
        "probabilities must lie in [0, 1] and zipf_s be finite and >= 0".to_string()
    } else {
        return Ok(());
    };
    Err(TraceGenError::Invalid(what))
}

fn cdf(experts: u32, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (0..experts)
        .map(|r| 1.0 / f64::from(r + 1).powf(s))
        .collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    w.iter()
        .map(|x| {
            acc += x / total;
            acc
        })
        .collect()
}

fn shuffled(n: u32, rng: &mut SmallRng) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    v.shuffle(rng);
    v
}

/// Generate a trace (with router scores) from `p`.
pub fn generate(p: &SynthParams) -> Result<RoutingTrace, TraceGenError> {
    validate(p)?;
    let mut rng = SmallRng::seed_from_u64(p.seed);
    let cdf = cdf(p.experts, p.zipf_s);
    let mut dists: Vec<LayerDist> = (0..p.layers)
        .map(|_| LayerDist {
            perm: shuffled(p.experts, &mut rng),
            cdf: cdf.clone(),
            follow: shuffled(p.experts, &mut rng),
        })
        .collect();
    let mut steps = Vec::with_capacity(p.tokens as usize);
    let mut prev_token: Vec<Vec<u32>> = vec![Vec::new(); p.layers as usize];
    for t in 0..p.tokens {
        if p.drift_every > 0 && t > 0 && t % p.drift_every == 0 {
            for d in &mut dists {
                d.perm = shuffled(p.experts, &mut rng);
            }
        }
        let mut step = TraceStep::default();
        let mut prev_layer: Vec<u32> = Vec::new();
        for (l, d) in dists.iter().enumerate() {
            let ids = pick_layer(p, d, &prev_token[l], &prev_layer, &mut rng);
            let scores = router_scores(ids.len(), &mut rng);
            prev_token[l].clone_from(&ids);
            prev_layer.clone_from(&ids);
            step.layers.push(LayerRoute {
                ids,
                scores: Some(scores),
            });
        }
        steps.push(step);
    }
    Ok(RoutingTrace {
        layers: p.layers,
        experts: p.experts,
        steps,
    })
}

fn pick_layer(
    p: &SynthParams,
    d: &LayerDist,
    prev_token: &[u32],
    prev_layer: &[u32],
    rng: &mut SmallRng,
) -> Vec<u32> {
    let k = p.top_k as usize;
    let mut ids: Vec<u32> = Vec::with_capacity(k);
    for _ in 0..64 * k {
        if ids.len() == k {
            break;
        }
        let cand = if !prev_token.is_empty() && rng.random_bool(p.token_locality) {
            prev_token[rng.random_range(0..prev_token.len())]
        } else if !prev_layer.is_empty() && rng.random_bool(p.layer_correlation) {
            d.follow[prev_layer[rng.random_range(0..prev_layer.len())] as usize]
        } else {
            let u: f64 = rng.random();
            let rank = d.cdf.partition_point(|&c| c < u).min(d.perm.len() - 1);
            d.perm[rank]
        };
        if !ids.contains(&cand) {
            ids.push(cand);
        }
    }
    let mut fill = 0u32;
    while ids.len() < k {
        if !ids.contains(&fill) {
            ids.push(fill);
        }
        fill += 1;
    }
    ids
}

fn router_scores(k: usize, rng: &mut SmallRng) -> Vec<f32> {
    let raw: Vec<f32> = (0..k)
        .map(|i| rng.random::<f32>() / (i as f32 + 1.0))
        .collect();
    let total: f32 = raw.iter().sum::<f32>().max(f32::MIN_POSITIVE);
    raw.iter().map(|x| x / total).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_makes_valid_distinct_routes() {
        for f in TraceFamily::ALL {
            let t = generate(&f.params(4, 16, 4, 50, 7)).expect("valid params");
            assert_eq!(t.steps.len(), 50);
            for s in &t.steps {
                assert_eq!(s.layers.len(), 4);
                for l in &s.layers {
                    assert_eq!(l.ids.len(), 4);
                    let mut sorted = l.ids.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    assert_eq!(sorted.len(), 4, "{}: duplicate id", f.name());
                    assert!(l.ids.iter().all(|&i| i < 16));
                }
            }
            assert_eq!(f.name().parse::<TraceFamily>().ok(), Some(f));
        }
    }

    #[test]
    fn same_seed_same_trace_and_bad_params_rejected() {
        let p = TraceFamily::Decode.params(3, 8, 2, 20, 1);
        assert_eq!(generate(&p).ok(), generate(&p).ok());
        let mut bad = p.clone();
        bad.top_k = 9;
        assert!(generate(&bad).is_err());
        bad = p;
        bad.token_locality = 1.5;
        assert!(generate(&bad).is_err());
    }

    #[test]
    fn skew_makes_popular_experts_popular() {
        let t = generate(&TraceFamily::Zipf.params(1, 64, 1, 4000, 3)).expect("valid");
        let mut count = vec![0u32; 64];
        for s in &t.steps {
            count[s.layers[0].ids[0] as usize] += 1;
        }
        count.sort_unstable_by(|a, b| b.cmp(a));
        // Rank 0 of zipf(1.0) over 64 has probability ~0.21; uniform would be ~0.016.
        assert!(count[0] > 400, "top expert drawn {} times", count[0]);
    }
}
