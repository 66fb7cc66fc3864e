//! Routing: from one token's router logits to its chosen experts and their
//! weights, as transformers computes it. This host code is the reference
//! every device's routing is checked against.
//!
//! - [`Routing::Softmax`] (Qwen, Mixtral): softmax over all experts, the
//!   top-k, renormalised to sum to one with `norm_topk_prob` (always for
//!   Mixtral, which equals a softmax over the top-k logits).
//! - [`Routing::SigmoidGroups`] (DeepSeek-V3): sigmoid scores; the choice
//!   ranks score plus correction bias, inside the `topk_group` best of
//!   `n_group` groups (a group scores the sum of its two best choices); the
//!   weights are the scores (renormalised with `norm_topk_prob`) times the
//!   routed scaling factor.
//!
//! Every top-k keeps the set torch's CPU `topk` keeps ([`crate::topk`]),
//! ties included. Exact ties are reachable: two experts with equal router
//! rows (a duplicated or zeroed row in a pruned or merged checkpoint, or
//! a zero hidden state) get equal logits, and near the maximum the
//! softmax's `exp` can round distinct logits to one probability. DeepSeek's
//! group scores tie when two groups' best two choices sum alike. The
//! result is sorted by expert id, the order the experts' outputs are
//! summed in.

use crate::config::{ModelConfig, Routing};
use crate::math::softmax;
use crate::topk::top_k;

/// Everything a device needs to route.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteRule {
    /// The scoring and selection rule.
    pub routing: Routing,
    /// Experts per layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Renormalise the chosen weights.
    pub norm_topk_prob: bool,
}

impl RouteRule {
    /// The rule of `cfg`.
    pub fn of(cfg: &ModelConfig) -> Self {
        Self {
            routing: cfg.routing.clone(),
            num_experts: cfg.num_experts,
            top_k: cfg.top_k,
            norm_topk_prob: cfg.norm_topk_prob,
        }
    }
}

/// The chosen experts of one token and their weights, ascending expert id.
/// `logits` holds `rule.num_experts` values; `bias` (the correction bias
/// of grouped routing) as many, when present.
pub fn route_row(rule: &RouteRule, logits: &[f32], bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let mut chosen = match rule.routing {
        Routing::Softmax => {
            let mut p = logits.to_vec();
            softmax(&mut p);
            let mut chosen = top_k(&p, rule.top_k);
            if rule.norm_topk_prob {
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
        } => sigmoid_groups(
            rule,
            logits,
            bias,
            n_group,
            topk_group,
            routed_scaling_factor,
        ),
    };
    chosen.sort_by_key(|(e, _)| *e);
    chosen
}

fn sigmoid_groups(
    rule: &RouteRule,
    logits: &[f32],
    bias: Option<&[f32]>,
    n_group: usize,
    topk_group: usize,
    scaling: f32,
) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let mut choice: Vec<f32> = scores
        .iter()
        .enumerate()
        .map(|(e, s)| s + bias.and_then(|b| b.get(e)).copied().unwrap_or(0.0))
        .collect();
    let per = (rule.num_experts / n_group.max(1)).max(1);
    // A group scores the sum of its two best choices.
    let group_scores: Vec<f32> = choice
        .chunks(per)
        .map(|g| top_k(g, 2).iter().map(|(_, v)| v).sum())
        .collect();
    let keep: Vec<usize> = top_k(&group_scores, topk_group)
        .into_iter()
        .map(|(g, _)| g)
        .collect();
    for (g, chunk) in choice.chunks_mut(per).enumerate() {
        if !keep.contains(&g) {
            chunk.fill(f32::NEG_INFINITY);
        }
    }
    let mut chosen: Vec<(usize, f32)> = top_k(&choice, rule.top_k)
        .into_iter()
        .map(|(e, _)| (e, scores.get(e).copied().unwrap_or(0.0)))
        .collect();
    if rule.norm_topk_prob {
        let sum: f32 = chosen.iter().map(|(_, w)| w).sum::<f32>() + 1e-20;
        for (_, w) in &mut chosen {
            *w /= sum;
        }
    }
    for (_, w) in &mut chosen {
        *w *= scaling;
    }
    chosen
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn deepseek(experts: usize, n_group: usize, topk_group: usize, top_k: usize) -> RouteRule {
        let v = serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 8, "moe_intermediate_size": 4, "num_hidden_layers": 2,
            "num_attention_heads": 2, "n_routed_experts": experts, "n_shared_experts": 1,
            "num_experts_per_tok": top_k, "n_group": n_group, "topk_group": topk_group,
            "routed_scaling_factor": 2.5, "norm_topk_prob": true, "first_k_dense_replace": 1,
            "q_lora_rank": null, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 2, "v_head_dim": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0
        });
        RouteRule::of(&ModelConfig::from_json(&v).expect("valid config"))
    }

    #[test]
    fn softmax_routing_renormalises_and_sorts_by_id() {
        let rule = RouteRule {
            routing: Routing::Softmax,
            num_experts: 4,
            top_k: 2,
            norm_topk_prob: true,
        };
        let got = route_row(&rule, &[0.1, 2.0, -1.0, 1.0], None);
        assert_eq!(got.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        let total: f32 = got.iter().map(|c| c.1).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(got[0].1 > got[1].1);
    }

    proptest! {
        /// Grouped sigmoid routing: `top_k` distinct experts, all inside the
        /// `topk_group` best groups (a group scores its two best choices),
        /// none of them beaten by an unchosen expert of a kept group, and
        /// weights that are the sigmoids renormalised to the scaling factor.
        #[test]
        fn grouped_routing_invariants(
            shape in prop_oneof![Just((16usize, 4usize, 2usize, 3usize)), Just((8, 1, 1, 2)), Just((12, 3, 2, 4))],
            logits in proptest::collection::vec(-4.0f32..4.0, 16),
            bias in proptest::collection::vec(-0.1f32..0.1, 16),
        ) {
            let (experts, n_group, topk_group, top_k) = shape;
            let rule = deepseek(experts, n_group, topk_group, top_k);
            let (logits, bias) = (&logits[..experts], &bias[..experts]);
            let chosen = route_row(&rule, logits, Some(bias));
            prop_assert_eq!(chosen.len(), top_k);
            let ids: Vec<usize> = chosen.iter().map(|c| c.0).collect();
            prop_assert!(ids.windows(2).all(|w| w[0] < w[1]), "not ascending: {:?}", ids);
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
