//! Synthetic models in real models' proportions: each family's reference
//! model at full size ([`SynthSpec::reference`]), and the same shape scaled
//! to a size ([`SynthSpec::scaled_to`]): one factor `f` scales the widths
//! (hidden, expert and dense widths, attention heads), the layer count and
//! the vocabulary together, while the expert count, top-k, expert groups and
//! head width stay as in the reference, because they decide how routing
//! spreads over the experts and so how a cache behaves.
//!
//! | family | reference | layers | hidden | experts, top-k | expert width | vocab |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | qwen3_moe | Qwen3-30B-A3B | 48 | 2048 | 128, 8 | 768 | 151936 |
//! | qwen2_moe | Qwen1.5-MoE-A2.7B | 24 | 2048 | 60, 4 (+ shared 5632) | 1408 | 151936 |
//! | mixtral | Mixtral-8x7B | 32 | 4096 | 8, 2 | 14336 | 32000 |
//! | deepseek | DeepSeek-V3 (3 dense layers, 8 groups choose 4) | 61 | 7168 | 256, 8 (+ shared) | 2048 | 129280 |

use flashtier_format::Dtype;

use super::{SynthArch, SynthSpec};

/// Smallest widths a scaled model keeps (so every matrix stays a matrix).
const MIN_HIDDEN: u64 = 64;
const MIN_WIDTH: u64 = 32;
const MIN_VOCAB: u64 = 256;

impl SynthSpec {
    /// The family's reference model at full size (see the module table).
    #[must_use]
    pub fn reference(arch: SynthArch, dtype: Dtype, seed: u64) -> Self {
        let base = |layers, hidden, experts, top_k, inter, dense, heads, kv_heads, vocab| Self {
            arch,
            layers,
            experts,
            experts_per_token: top_k,
            hidden,
            intermediate: inter,
            dense_intermediate: dense,
            heads,
            kv_heads,
            head_dim: 128,
            vocab,
            dtype,
            dense_layers: 0,
            expert_groups: [1, 1],
            shards: 1,
            seed,
        };
        let mut s = match arch {
            SynthArch::Qwen3Moe => base(48, 2048, 128, 8, 768, 6144, 32, 4, 151_936),
            SynthArch::Qwen2Moe => base(24, 2048, 60, 4, 1408, 5632, 16, 16, 151_936),
            SynthArch::Mixtral => base(32, 4096, 8, 2, 14336, 14336, 32, 8, 32_000),
            SynthArch::DeepSeek => base(61, 7168, 256, 8, 2048, 18432, 128, 128, 129_280),
        };
        if arch == SynthArch::DeepSeek {
            s.dense_layers = 3;
            s.expert_groups = [8, 4];
        }
        s.shards = s.total_bytes().div_ceil(4 << 30).clamp(1, 4096) as u32;
        s
    }

    /// The reference shape scaled by one factor to about `target_bytes` (at
    /// most; never below the smallest widths), see the module docs.
    #[must_use]
    pub fn scaled_to(arch: SynthArch, dtype: Dtype, target_bytes: u64, seed: u64) -> Self {
        let full = Self::reference(arch, dtype, seed);
        if full.total_bytes() <= target_bytes {
            return full;
        }
        // Bytes grow about as f^3 (layers x hidden x width).
        let mut s = full.scaled(largest_fit(target_bytes, |f| full.scaled(f).total_bytes()));
        s.shards = s.total_bytes().div_ceil(400 << 20).clamp(1, 64) as u32;
        s
    }

    /// The same model with `layers` decoder layers (the GPU benchmark's
    /// full-width models with as many layers as a disk holds).
    #[must_use]
    pub fn with_layers(mut self, layers: u32) -> Self {
        self.layers = layers.max(1);
        self.dense_layers = self.dense_layers.min(self.layers.saturating_sub(1));
        self.shards = self.total_bytes().div_ceil(4 << 30).clamp(1, 4096) as u32;
        self
    }

    /// Every width, the layer count and the vocabulary times `f`.
    fn scaled(&self, f: f64) -> Self {
        let width = |v: u64, step: u64, min: u64| {
            let x = (v as f64 * f / step as f64).round() as u64 * step;
            x.max(min)
        };
        let count = |v: u32, min: u32| ((f64::from(v) * f).round() as u32).max(min);
        let q_per_kv = (self.heads / self.kv_heads.max(1)).max(1);
        let kv_heads = count(self.kv_heads, 1);
        let mut s = self.clone();
        s.hidden = width(self.hidden, 64, MIN_HIDDEN);
        s.intermediate = width(self.intermediate, 32, MIN_WIDTH);
        s.dense_intermediate = width(self.dense_intermediate, 32, MIN_WIDTH);
        s.kv_heads = kv_heads;
        s.heads = kv_heads * q_per_kv;
        s.vocab = width(self.vocab, 256, MIN_VOCAB);
        s.layers = count(self.layers, 2);
        s.dense_layers = if self.dense_layers > 0 {
            count(self.dense_layers, 1).min(s.layers - 1)
        } else {
            0
        };
        s
    }
}

/// The largest scale factor in `[0, 1]` whose model (`bytes(f)`, growing
/// with `f`) fits `target_bytes`, by bisection.
pub(crate) fn largest_fit(target_bytes: u64, bytes: impl Fn(f64) -> u64) -> f64 {
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if bytes(mid) <= target_bytes {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_have_the_real_sizes() {
        // Qwen3-30B-A3B: 30.5B parameters, 61 GB in BF16.
        let q = SynthSpec::reference(SynthArch::Qwen3Moe, Dtype::Bf16, 1);
        let params = q.total_bytes() / 2;
        assert!(
            (30_000_000_000..31_000_000_000).contains(&params),
            "{params}"
        );
        // Mixtral-8x7B: 46.7B parameters.
        let m = SynthSpec::reference(SynthArch::Mixtral, Dtype::Bf16, 1);
        let params = m.total_bytes() / 2;
        assert!(
            (46_000_000_000..47_500_000_000).contains(&params),
            "{params}"
        );
    }

    #[test]
    fn scaled_models_keep_the_proportions() {
        for arch in SynthArch::ALL {
            let full = SynthSpec::reference(arch, Dtype::Bf16, 1);
            let s = SynthSpec::scaled_to(arch, Dtype::Bf16, 1 << 30, 1);
            assert!(s.total_bytes() <= 1 << 30, "{arch:?}: {}", s.total_bytes());
            assert!(s.total_bytes() > 1 << 29, "{arch:?}: {}", s.total_bytes());
            assert_eq!(
                (s.experts, s.experts_per_token),
                (full.experts, full.experts_per_token)
            );
            assert_eq!(s.expert_groups, full.expert_groups);
            // Layers and hidden shrink by about the same factor.
            let fl = f64::from(s.layers) / f64::from(full.layers);
            let fh = s.hidden as f64 / full.hidden as f64;
            assert!(
                (fl / fh - 1.0).abs() < 0.5,
                "{arch:?}: layers x{fl:.3}, hidden x{fh:.3}"
            );
            assert!(s.layers >= 2 && s.heads % s.kv_heads == 0);
            s.check().expect("a valid model");
        }
    }
}
