//! How a tile is cut into splits (flash-decoding): enough CTAs to fill every
//! resident slot of the device once, with the tile's 16-token sub-tiles
//! dealt out evenly (every split gets the floor or the ceiling of
//! `sub_total / splits`), so that all CTAs of the wave stream the same bytes
//! and finish together.
//!
//! Bound: at most [`MAX_SPLITS`] splits per (sequence, head) (the partial
//! buffers are sized for it).

/// Warps per split CTA (matches `WARPS` in attention_ptx.cu).
pub const WARPS: usize = 4;
/// Tokens per warp sub-tile (matches `SUB`).
pub const SUB: usize = 16;
/// Most splits per (sequence, head).
pub const MAX_SPLITS: usize = 256;

/// A split plan: split `s` covers sub-tiles `[s * sub_total / splits,
/// (s + 1) * sub_total / splits)` (the kernel's formula).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Splits per (sequence, kv-head group).
    pub splits: usize,
    /// Sub-tiles of the longest sequence of the tile.
    pub sub_total: usize,
}

impl SplitPlan {
    /// Sub-tiles `[first, end)` of split `s`.
    #[must_use]
    pub fn range(&self, s: usize) -> (usize, usize) {
        let at = |i: usize| i * self.sub_total / self.splits.max(1);
        (at(s), at(s + 1))
    }
}

/// Plan splits for a tile of at most `max_tokens` tokens per sequence, with
/// `pairs` (sequence, kv-head group) CTAs per split and `slots` resident CTAs
/// on the device. `want`, if given, overrides the number of splits (tuning),
/// still clamped into the valid range.
#[must_use]
pub fn plan_splits(
    max_tokens: usize,
    pairs: usize,
    slots: usize,
    want: Option<usize>,
) -> SplitPlan {
    let sub_total = max_tokens.div_ceil(SUB);
    let per_pair = want.unwrap_or((slots / pairs.max(1)).max(1));
    // At least one sub-tile per warp of every split.
    let most = sub_total.div_ceil(WARPS).clamp(1, MAX_SPLITS);
    SplitPlan {
        splits: per_pair.clamp(1, most),
        sub_total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn h200_shapes() {
        // 132 SMs x 2 CTAs; batch 1, 4 kv heads, 64K tokens: 66 splits x 4
        // = every slot, 62 or 63 sub-tiles each.
        let p = plan_splits(65_536, 4, 264, None);
        assert_eq!(
            p,
            SplitPlan {
                splits: 66,
                sub_total: 4096
            }
        );
        assert_eq!(p.range(0), (0, 62));
        assert_eq!(p.range(65), (4033, 4096));
        let p = plan_splits(4096, 64, 264, None);
        assert_eq!(p.splits * 64, 256);
        assert_eq!(plan_splits(65_536, 4, 264, Some(64)).splits, 64);
        assert_eq!(plan_splits(64, 4, 264, None).splits, 1);
    }

    proptest! {
        #[test]
        fn covers_every_token_evenly(max_tokens in 0usize..2_000_000, pairs in 1usize..5000,
                                     slots in 1usize..2000, want in proptest::option::of(0usize..1000)) {
            let p = plan_splits(max_tokens, pairs, slots, want);
            prop_assert!(p.splits >= 1 && p.splits <= MAX_SPLITS);
            prop_assert_eq!(p.sub_total * SUB >= max_tokens, true);
            let (lo, hi) = (p.sub_total / p.splits, p.sub_total.div_ceil(p.splits));
            let mut next = 0;
            for s in 0..p.splits {
                let (a, b) = p.range(s);
                prop_assert_eq!(a, next);
                prop_assert!(b - a >= lo && b - a <= hi);
                // No split is wholly empty except the single split of an empty tile.
                prop_assert!(max_tokens == 0 || b > a);
                next = b;
            }
            prop_assert_eq!(next, p.sub_total);
        }
    }
}
