//! Engram addressing: row ids from token ids by multi-head hashing of the
//! n-grams that end at each position (orders 2 and 3).
//!
//! For every order `n` and head `k` there is one table of `M[n][k]` rows
//! (moduli; distinct primes work best, see [`EngramHashConfig::with_primes`]).
//! The tables are laid out back to back in one row store, in order-major
//! order, so table `(n, k)` starts at the sum of the moduli before it. The
//! n-gram `(t[i-n+1], ..., t[i])` maps into table `(n, k)` by a
//! multiplicative-XOR hash: `h = XOR_j (t[i-j] * c[n][k][j])`, finalised by a
//! 64-bit mixer, then `h mod M[n][k]`. The multipliers `c` are odd 64-bit
//! constants derived from `seed` (one seed per layer), so layers hash
//! independently. Positions before the start of the sequence read
//! `pad_token`.
//!
//! Per position the ids come out order-major, head-minor:
//! `[(2,0), (2,1), ..., (3,0), (3,1), ...]`, `ids_per_token()` of them.

use flashtier_format::splitmix::splitmix64_next;

use crate::rows::RowError;

/// Lowest supported n-gram order.
pub const MIN_ORDER: usize = 2;
/// Highest supported n-gram order.
pub const MAX_ORDER: usize = 3;
/// Most heads per order.
pub const MAX_HEADS: usize = 64;

/// The hashing scheme of one Engram layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngramHashConfig {
    /// The n-gram orders, each in 2..=3, strictly increasing.
    pub orders: Vec<usize>,
    /// Heads per order (1..=64).
    pub heads: usize,
    /// One table size per (order, head), order-major.
    pub moduli: Vec<u64>,
    /// Layer seed the multipliers derive from.
    pub seed: u64,
    /// Token id used before the start of the sequence.
    pub pad_token: u64,
}

impl EngramHashConfig {
    /// Orders 2 and 3, `heads` heads each, table sizes the distinct primes
    /// at or above `base_rows` (the Engram paper uses prime-sized tables).
    #[must_use]
    pub fn with_primes(heads: usize, base_rows: u64, seed: u64) -> Self {
        Self {
            orders: vec![2, 3],
            heads,
            moduli: primes_from(base_rows, 2 * heads),
            seed,
            pad_token: 0,
        }
    }
}

/// Whether `n` is prime (trial division by odd numbers up to its root).
/// The hashed n-gram tables are prime-sized: Engram's here, Qwen4-Exp's PLE
/// heads in `flashtier_engine::family::qwen4::ngram`.
#[must_use]
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    if n % 2 == 0 {
        return n == 2;
    }
    let mut d = 3u64;
    while d.saturating_mul(d) <= n {
        if n % d == 0 {
            return false;
        }
        d += 2;
    }
    true
}

/// The first `count` primes at or above `base`, ascending.
#[must_use]
pub fn primes_from(base: u64, count: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(count);
    let mut p = base;
    while out.len() < count {
        if is_prime(p) {
            out.push(p);
        }
        p += 1;
    }
    out
}

fn finalise(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

/// Engram's addressing: token histories to the row ids of its hashed
/// tables (not Qwen4-Exp's PLE ids, `flashtier_engine`'s `PleNgramHasher`).
#[derive(Clone, Debug)]
pub struct EngramHasher {
    config: EngramHashConfig,
    /// First row of each table.
    bases: Vec<u64>,
    /// `MAX_ORDER` multipliers per table.
    multipliers: Vec<[u64; MAX_ORDER]>,
    total_rows: u64,
}

impl EngramHasher {
    /// Validate `config` and derive the multipliers.
    pub fn new(config: EngramHashConfig) -> Result<Self, RowError> {
        let bad = |m: String| Err(RowError::Config(m));
        if config.orders.is_empty()
            || config
                .orders
                .iter()
                .any(|o| !(MIN_ORDER..=MAX_ORDER).contains(o))
            || config.orders.windows(2).any(|w| w[0] >= w[1])
        {
            return bad(format!(
                "n-gram orders {}: need strictly increasing orders in {MIN_ORDER}..={MAX_ORDER}",
                flashtier_format::text::list(&config.orders)
            ));
        }
        if !(1..=MAX_HEADS).contains(&config.heads) {
            return bad(format!("{} heads: need 1..={MAX_HEADS}", config.heads));
        }
        let tables = config.orders.len() * config.heads;
        if config.moduli.len() != tables || config.moduli.contains(&0) {
            return bad(format!(
                "{} moduli for {tables} tables (orders x heads); each must be non-zero",
                config.moduli.len()
            ));
        }
        let mut bases = Vec::with_capacity(tables);
        let mut total: u64 = 0;
        for &m in &config.moduli {
            bases.push(total);
            total = total
                .checked_add(m)
                .ok_or_else(|| RowError::Config("sum of moduli overflows u64".into()))?;
        }
        let mut state = config.seed;
        let multipliers = (0..tables)
            .map(|_| std::array::from_fn(|_| splitmix64_next(&mut state) | 1))
            .collect();
        Ok(Self {
            config,
            bases,
            multipliers,
            total_rows: total,
        })
    }

    /// Rows of all tables together (the row store's table size).
    #[must_use]
    pub fn total_rows(&self) -> u64 {
        self.total_rows
    }

    /// Row ids per token position.
    #[must_use]
    pub fn ids_per_token(&self) -> usize {
        self.config.orders.len() * self.config.heads
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &EngramHashConfig {
        &self.config
    }

    /// Append the row ids of position `pos` of `tokens` to `out`.
    /// Positions past the end are ignored.
    pub fn ids_at(&self, tokens: &[u64], pos: usize, out: &mut Vec<u64>) {
        if pos >= tokens.len() {
            return;
        }
        let token = |back: usize| {
            pos.checked_sub(back)
                .and_then(|i| tokens.get(i).copied())
                .unwrap_or(self.config.pad_token)
        };
        let window: [u64; MAX_ORDER] = std::array::from_fn(token);
        let mut table = 0;
        for &order in &self.config.orders {
            for _ in 0..self.config.heads {
                let c = &self.multipliers[table];
                let mut h = 0u64;
                for j in 0..order {
                    h ^= window[j].wrapping_mul(c[j]);
                }
                let m = self.config.moduli[table];
                out.push(self.bases[table] + finalise(h) % m);
                table += 1;
            }
        }
    }

    /// Row ids for every position of `tokens`, position-major
    /// (`tokens.len() * ids_per_token()` ids).
    #[must_use]
    pub fn ids(&self, tokens: &[u64]) -> Vec<u64> {
        let mut out = Vec::with_capacity(tokens.len() * self.ids_per_token());
        for pos in 0..tokens.len() {
            self.ids_at(tokens, pos, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_and_determinism() {
        let cfg = EngramHashConfig::with_primes(4, 1000, 11);
        assert_eq!(cfg.moduli.len(), 8);
        assert!(cfg.moduli.iter().all(|&m| is_prime(m) && m >= 1000));
        let h = EngramHasher::new(cfg.clone()).expect("valid");
        let toks = [5u64, 9, 12, 5, 9, 12];
        let ids = h.ids(&toks);
        assert_eq!(ids.len(), 6 * 8);
        assert_eq!(ids, EngramHasher::new(cfg).expect("valid").ids(&toks));
        // The same trigram at positions 2 and 5 gives the same ids.
        assert_eq!(&ids[2 * 8..3 * 8], &ids[5 * 8..6 * 8]);
        // Another seed hashes differently.
        let other = EngramHasher::new(EngramHashConfig::with_primes(4, 1000, 12)).expect("valid");
        assert_ne!(ids, other.ids(&toks));
    }

    #[test]
    fn primes_match_their_definition() {
        assert!(is_prime(2) && is_prime(101) && is_prime(1_000_000_007));
        assert!(!is_prime(0) && !is_prime(1) && !is_prime(100) && !is_prime(1_000_000_007 * 3));
        assert_eq!(primes_from(100, 4), [101, 103, 107, 109]);
        assert_eq!(primes_from(0, 3), [2, 3, 5]);
        assert_eq!(EngramHashConfig::with_primes(2, 0, 0).moduli, [2, 3, 5, 7]);
    }

    #[test]
    fn bad_configs_rejected() {
        let mut c = EngramHashConfig::with_primes(2, 10, 0);
        c.orders = vec![1, 2];
        assert!(EngramHasher::new(c.clone()).is_err());
        c.orders = vec![3, 2];
        assert!(EngramHasher::new(c.clone()).is_err());
        c.orders = vec![2, 3];
        c.moduli.pop();
        assert!(EngramHasher::new(c.clone()).is_err());
        c.moduli.push(0);
        assert!(EngramHasher::new(c).is_err());
    }

    proptest! {
        /// Trial division agrees with a sieve below 5000.
        #[test]
        fn is_prime_agrees_with_a_sieve(n in 0u64..5000) {
            let composite = (2..n).any(|d| n % d == 0);
            prop_assert_eq!(is_prime(n), n >= 2 && !composite);
        }

        #[test]
        fn ids_land_in_their_own_table(toks in proptest::collection::vec(any::<u64>(), 1..40), heads in 1usize..5, base in 1u64..500, seed in any::<u64>()) {
            let h = EngramHasher::new(EngramHashConfig::with_primes(heads, base, seed)).expect("valid");
            let ids = h.ids(&toks);
            prop_assert_eq!(ids.len(), toks.len() * h.ids_per_token());
            for (i, id) in ids.iter().enumerate() {
                let t = i % h.ids_per_token();
                prop_assert!(*id >= h.bases[t] && *id < h.bases[t] + h.config.moduli[t]);
                prop_assert!(*id < h.total_rows());
            }
        }
    }
}
