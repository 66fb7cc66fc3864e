//! Qwen4-Exp's hashed n-gram ids: for every token, the row each PLE head
//! reads from its layer's table, exactly as transformers 5.17 computes them.
//!
//! Per PLE layer `L` (its rank among the PLE layers, from zero):
//! - one odd multiplier per n-gram position, from splitmix64 of
//!   `seed + 10007 L + gamma (i + 1)`, at most `(2^63 - 1) / vocab` (so a
//!   token times its multiplier stays below `2^63`: exact in i64 as in
//!   torch);
//! - `(ngram_size - 1) * heads_per_ngram` heads, head `h` with the
//!   `(L * heads + h + 1)`-th prime at or above `ngram_vocab_size_base` as
//!   its vocabulary, the heads' rows concatenated (offsets) and the table
//!   padded to `make_ngram_vocab_size_divisible_by`;
//! - the n-gram of order `n` ending at a token XORs `token[-s] * mult[s]`
//!   for `s < n`, where a token before the start of the current EOS segment
//!   (or before the sequence) reads as EOS; head id = that value modulo the
//!   head's prime, plus the head's offset.
//!
//! The last `ngram_size - 1` tokens are kept across steps (EOS before the
//! first), so feeding a prompt at once or token by token gives the same ids.
//! Tokens must be below the vocabulary (the engine checks them first).

use flashtier::rows::ngram::primes_from;
use flashtier_format::splitmix::{SPLITMIX64_GAMMA, splitmix64};

use crate::config::qwen4::Ple;

/// Spacing of the PLE layers' seeds.
const LAYER_PRIME: u64 = 10007;

/// The odd multipliers of PLE layer `rank`, one per n-gram position.
pub fn layer_multipliers(vocab: u64, ngram_size: usize, rank: u64, seed: u64) -> Vec<u64> {
    let max = (i64::MAX as u64) / vocab.max(1);
    let half = (max / 2).max(1);
    let base = seed.wrapping_add(LAYER_PRIME.wrapping_mul(rank));
    (0..ngram_size as u64)
        .map(|i| {
            let v = base.wrapping_add(SPLITMIX64_GAMMA.wrapping_mul(i + 1));
            2 * (splitmix64(v) % half) + 1
        })
        .collect()
}

/// The n-gram hashing of one PLE layer of Qwen4-Exp, with its context (not
/// the Engram hash of `flashtier::rows::EngramHasher`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleNgramHasher {
    mults: Vec<u64>,
    sizes: Vec<u64>,
    offsets: Vec<u64>,
    rows: u64,
    heads_per_ngram: usize,
    eos: u64,
    /// The last `ngram_size - 1` tokens seen (EOS before the first).
    context: Vec<u64>,
    /// EOS starts a segment (false only to show the fixture needs it).
    pub(crate) eos_segments: bool,
}

/// What a [`PleNgramHasher`] is built from.
#[derive(Clone, Copy, Debug)]
pub struct NgramSpec {
    /// Token vocabulary.
    pub vocab: u64,
    /// Largest n-gram order (>= 2).
    pub ngram_size: usize,
    /// Hashed heads per order.
    pub heads_per_ngram: usize,
    /// Primes start at this value.
    pub vocab_base: u64,
    /// Table rows padded to a multiple of this.
    pub divisor: u64,
    /// Multiplier seed.
    pub seed: u64,
    /// Segment separator.
    pub eos: u64,
}

impl NgramSpec {
    /// The spec a config's PLE fields give, over a `vocab`-token vocabulary.
    #[must_use]
    pub fn of_config(vocab: usize, p: &Ple) -> Self {
        Self {
            vocab: vocab as u64,
            ngram_size: p.ngram_size,
            heads_per_ngram: p.heads_per_ngram,
            vocab_base: p.vocab_base,
            divisor: p.vocab_divisor,
            seed: p.seed,
            eos: p.eos,
        }
    }
}

impl PleNgramHasher {
    /// The hasher of the PLE layer of rank `rank`.
    pub fn new(spec: NgramSpec, rank: usize) -> Self {
        let heads = (spec.ngram_size - 1) * spec.heads_per_ngram;
        let primes = primes_from(spec.vocab_base, (rank + 1) * heads);
        let sizes = primes[rank * heads..].to_vec();
        let mut offsets = Vec::with_capacity(heads);
        let mut total = 0u64;
        for s in &sizes {
            offsets.push(total);
            total += s;
        }
        let divisor = spec.divisor.max(1);
        Self {
            mults: layer_multipliers(spec.vocab, spec.ngram_size, rank as u64, spec.seed),
            sizes,
            offsets,
            rows: total.div_ceil(divisor) * divisor,
            heads_per_ngram: spec.heads_per_ngram,
            eos: spec.eos,
            context: vec![spec.eos; spec.ngram_size - 1],
            eos_segments: true,
        }
    }

    /// Rows of the layer's (padded) table.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The multipliers (transformers' `layer_multipliers` buffer).
    pub fn multipliers(&self) -> &[u64] {
        &self.mults
    }

    /// Per head, its prime vocabulary (`ngram_heads_vocab_sizes`).
    pub fn head_sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// Per head, its first row (`ngram_heads_offsets`).
    pub fn head_offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// Forget the sequence.
    pub fn reset(&mut self) {
        self.context.iter_mut().for_each(|t| *t = self.eos);
    }

    /// The row ids of every head for each of `tokens` (the next tokens of
    /// the sequence), `[token][head]`; the context moves past them.
    pub fn step(&mut self, tokens: &[u32]) -> Vec<Vec<u64>> {
        let out = self.ids(tokens, self.eos_segments);
        let mut history = std::mem::take(&mut self.context);
        history.extend(tokens.iter().map(|&t| u64::from(t)));
        let keep = self.mults.len() - 1;
        self.context = history.split_off(history.len() - keep);
        out
    }

    /// The ids of `tokens` after the context; `eos_segments` false forgets
    /// that an EOS starts a new segment (only to show the fixture needs it).
    pub(crate) fn ids(&self, tokens: &[u32], eos_segments: bool) -> Vec<Vec<u64>> {
        let history: Vec<u64> = self
            .context
            .iter()
            .copied()
            .chain(tokens.iter().map(|&t| u64::from(t)))
            .collect();
        let first = self.context.len();
        (first..history.len())
            .map(|p| self.ids_at(&history, p, eos_segments))
            .collect()
    }

    /// The heads' ids of the n-grams ending at `history[p]`.
    fn ids_at(&self, history: &[u64], p: usize, eos_segments: bool) -> Vec<u64> {
        // The segment of p starts after the last EOS strictly before it.
        let start = if eos_segments {
            history[..p]
                .iter()
                .rposition(|&t| t == self.eos)
                .map_or(0, |e| e + 1)
        } else {
            0
        };
        let back = |s: usize| {
            if p >= s && p - s >= start {
                history[p - s]
            } else {
                self.eos
            }
        };
        let mut ids = Vec::with_capacity(self.sizes.len());
        let mut mixed = back(0).wrapping_mul(self.mults[0]);
        for (n, m) in self.mults.iter().enumerate().skip(1) {
            mixed ^= back(n).wrapping_mul(*m);
            let heads = (n - 1) * self.heads_per_ngram..n * self.heads_per_ngram;
            for h in heads {
                ids.push(mixed % self.sizes[h] + self.offsets[h]);
            }
        }
        ids
    }
}

#[cfg(test)]
#[path = "ngram_tests.rs"]
mod tests;
