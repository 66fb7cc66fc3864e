//! Which ranks of a router guess are worth reading ahead.
//!
//! The engine guesses a sparse layer's experts one layer early (the next
//! router applied to this layer's input) and hands the guess, strongest
//! first, to the expert tier to prefetch. A wrong guess is a whole record
//! read for nothing, and on a drive-bound decode those reads are the step
//! time. [`HintTracker`] scores every guess against the experts the layer
//! then really routes to, per rank (the strongest guessed expert, the
//! second, ...), and lets through only the ranks whose measured precision
//! is at least [`MIN_PRECISION`]. Every guess is scored, read ahead or not,
//! so a rank left out can come back. A rank starts with a prior of
//! [`PRIOR`] right guesses out of [`PRIOR`], so every rank is read ahead
//! until it has been wrong twice; counts halve past [`WINDOW`] guesses, so
//! the filter follows routing that changes.
//!
//! The threshold is high because the cost is asymmetric on a drive-bound
//! decode: a right guess read early saves little (its read would have
//! overlapped the layer's other experts anyway), a wrong one costs a whole
//! record. Measured on the walk checkpoint under a 6 GiB limit (docs/benchmarks.md):
//! thresholds 0.5, 0.7 and 0.85 cut the bytes read per token from 414 MB
//! to 355, 292 and 264 MB.
//!
//! Bounds: one pending guess per layer (at most `top_k` ids each) and two
//! counters per rank.

/// Least precision (right guesses over guesses, with the prior) for a rank
/// to be read ahead.
pub const MIN_PRECISION: f64 = 0.8;

/// Right guesses (out of as many) a rank starts with.
pub const PRIOR: u32 = 4;

/// Guesses of one rank after which its counts halve.
pub const WINDOW: u32 = 512;

/// A guess's experts strongest first (ties to the lower id), from
/// (expert, routing weight) pairs.
pub fn ranked<E: Copy + Ord>(guess: impl IntoIterator<Item = (E, f32)>) -> Vec<E> {
    let mut pairs: Vec<(E, f32)> = guess.into_iter().collect();
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    pairs.into_iter().map(|(e, _)| e).collect()
}

/// Precision per guess rank, from scored guesses.
#[derive(Debug, Default)]
pub struct HintTracker {
    /// Per layer, the last guess not scored yet, strongest first.
    pending: Vec<Vec<u32>>,
    /// Per rank: (right, scored).
    ranks: Vec<(u32, u32)>,
}

impl HintTracker {
    /// A guess of `layer`'s experts, strongest first; returns those worth
    /// reading ahead, in the same order.
    pub fn guessed(&mut self, layer: usize, ranked: &[u32]) -> Vec<u32> {
        if self.pending.len() <= layer {
            self.pending.resize(layer + 1, Vec::new());
        }
        self.pending[layer] = ranked.to_vec();
        ranked
            .iter()
            .enumerate()
            .filter(|(rank, _)| self.precision(*rank) >= MIN_PRECISION)
            .map(|(_, e)| *e)
            .collect()
    }

    /// `layer` routed to `chosen`: score its pending guess, if any.
    pub fn served(&mut self, layer: usize, chosen: &[u32]) {
        let Some(guess) = self.pending.get_mut(layer).map(std::mem::take) else {
            return;
        };
        if self.ranks.len() < guess.len() {
            self.ranks.resize(guess.len(), (0, 0));
        }
        for (rank, e) in guess.iter().enumerate() {
            let (right, scored) = &mut self.ranks[rank];
            *right += u32::from(chosen.contains(e));
            *scored += 1;
            if *scored >= WINDOW {
                *right /= 2;
                *scored /= 2;
            }
        }
    }

    /// Measured precision of `rank`, with the [`PRIOR`].
    pub fn precision(&self, rank: usize) -> f64 {
        let (right, scored) = self.ranks.get(rank).copied().unwrap_or((0, 0));
        f64::from(right + PRIOR) / f64::from(scored + PRIOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_rank_by_weight_then_id() {
        assert_eq!(ranked([(3u32, 0.2), (1, 0.5), (2, 0.2)]), vec![1, 2, 3]);
    }

    #[test]
    fn every_rank_is_tried_until_it_proves_wrong() {
        let mut t = HintTracker::default();
        assert_eq!(t.guessed(3, &[7, 1, 9]), vec![7, 1, 9]);
        // Rank 0 right, ranks 1 and 2 wrong, many times.
        for _ in 0..50 {
            t.guessed(3, &[7, 1, 9]);
            t.served(3, &[7, 2, 4]);
        }
        assert!(t.precision(0) > 0.9 && t.precision(1) < 0.1);
        assert_eq!(t.guessed(3, &[5, 6, 8]), vec![5]);
    }

    #[test]
    fn only_pending_guesses_are_scored_and_counts_follow_change() {
        let mut t = HintTracker::default();
        // A layer served with no guess pending changes nothing.
        t.served(0, &[1]);
        assert_eq!(t.precision(0), 1.0);
        t.guessed(0, &[1]);
        t.served(0, &[2]);
        t.served(0, &[1]); // scored once only
        assert_eq!(t.precision(0), 0.8);
        assert_eq!(t.guessed(0, &[1]), vec![1], "wrong once: still read");
        t.served(0, &[2]);
        assert!(t.guessed(0, &[1]).is_empty(), "wrong twice: left out");
        t.served(0, &[2]);
        // Wrong for a long time, then right: the window lets it back in.
        for _ in 0..2000 {
            t.guessed(0, &[1]);
            t.served(0, &[2]);
        }
        assert!(t.guessed(0, &[1]).is_empty());
        for _ in 0..(3 * WINDOW) {
            t.guessed(0, &[1]);
            t.served(0, &[1]);
        }
        assert_eq!(t.guessed(0, &[1]), vec![1]);
    }
}
