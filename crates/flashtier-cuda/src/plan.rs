//! How a tile is cut into splits (flash-decoding): enough CTAs to fill every
//! multiprocessor once, each split a whole number of warp sub-tiles.
//!
//! Bound: at most [`MAX_SPLITS`] splits per (sequence, head) (the partial
//! buffers and the merge kernel's shared weights are sized for it).

/// Warps per split CTA (matches `WARPS` in attention.cu).
pub const WARPS: usize = 4;
/// Tokens per warp sub-tile (matches `SUB`).
pub const SUB: usize = 16;
/// Most splits per (sequence, head) (matches `MAX_SPLITS`).
pub const MAX_SPLITS: usize = 256;

/// A split plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Splits per (sequence, kv-head group).
    pub splits: usize,
    /// Tokens each split covers (a multiple of `WARPS * SUB`).
    pub tokens_per_split: usize,
}

/// Plan splits for a tile of at most `max_tokens` tokens per sequence, with
/// `pairs` (sequence, kv-head group) CTAs per split and `slots` resident CTAs
/// on the device.
#[must_use]
pub fn plan_splits(max_tokens: usize, pairs: usize, slots: usize) -> SplitPlan {
    let unit = WARPS * SUB;
    let per_pair = (slots / pairs.max(1)).max(1);
    let want = per_pair.min(max_tokens.div_ceil(unit)).clamp(1, MAX_SPLITS);
    let tokens_per_split = max_tokens.div_ceil(want).div_ceil(unit).max(1) * unit;
    let splits = max_tokens.div_ceil(tokens_per_split).max(1);
    SplitPlan {
        splits,
        tokens_per_split,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn h200_shapes() {
        // 132 SMs x 2 CTAs; batch 1, 4 kv heads, 64K tokens: one full wave.
        let p = plan_splits(65_536, 4, 264);
        assert_eq!(
            p,
            SplitPlan {
                splits: 64,
                tokens_per_split: 1024
            }
        );
        let p = plan_splits(4096, 64, 264);
        assert_eq!(p.splits * 64, 256);
    }

    proptest! {
        #[test]
        fn covers_every_token(max_tokens in 0usize..2_000_000, pairs in 1usize..5000, slots in 1usize..2000) {
            let p = plan_splits(max_tokens, pairs, slots);
            prop_assert!(p.splits >= 1 && p.splits <= MAX_SPLITS);
            prop_assert_eq!(p.tokens_per_split % (WARPS * SUB), 0);
            prop_assert!(p.splits * p.tokens_per_split >= max_tokens);
            // No split is wholly empty except the single split of an empty tile.
            prop_assert!(max_tokens == 0 || (p.splits - 1) * p.tokens_per_split < max_tokens);
        }
    }
}
