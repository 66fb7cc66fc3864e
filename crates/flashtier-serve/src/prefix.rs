//! Prompt reuse: the KV caches of finished sequences, kept so that a later
//! prompt sharing their first tokens skips computing them.
//!
//! An entry is one finished sequence's cache and the tokens it holds. A new
//! prompt takes the entry with the longest common prefix (exact token
//! comparison: no hash can alias two prompts), the cache is cut back to
//! that prefix ([`SeqKv::truncate`]), and only the rest of the prompt is
//! computed. At least the prompt's last token is always computed, since
//! its logits pick the first output token. An entry is taken, not copied:
//! two prompts running at once that share a prefix reuse it once.
//!
//! Bound: the entries hold at most `budget` positions in all (the KV bytes
//! are `budget x` the model's bytes per position); the least recently used
//! go first. A cache that cannot be cut back (one with chunks offloaded to
//! a drive) is reused only whole; Qwen4-Exp's, whose state the model holds
//! for one sequence at a time, is never kept.

use flashtier_engine::engine::SeqKv;

/// Kept caches of finished sequences.
#[derive(Debug)]
pub struct PrefixCache {
    entries: Vec<Entry>,
    budget: usize,
    held: usize,
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    kv: SeqKv,
    used: u64,
}

/// A cache taken for a prompt, with how many of its positions it reuses.
#[derive(Debug)]
pub struct Reused {
    /// The cache, cut back to `cached` positions.
    pub kv: SeqKv,
    /// Positions of the prompt it already holds.
    pub cached: usize,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// An empty cache holding at most `budget` positions (0: no reuse).
    #[must_use]
    pub fn new(budget: usize) -> Self {
        Self {
            entries: Vec::new(),
            budget,
            held: 0,
            clock: 0,
        }
    }

    /// Positions held now.
    #[must_use]
    pub fn held(&self) -> usize {
        self.held
    }

    /// Entries held now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Take the entry sharing the longest prefix with `prompt` whose cache
    /// can hold `capacity` positions, cut back to the reused prefix (at
    /// most `prompt.len() - 1` positions). `None` when no entry shares a
    /// first token.
    pub fn take(&mut self, prompt: &[u32], capacity: usize) -> Option<Reused> {
        let limit = prompt.len().saturating_sub(1);
        let (best, reuse) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.kv.capacity() >= capacity)
            .map(|(i, e)| {
                let n = common_prefix(&e.tokens, prompt).min(limit);
                // A cache that cannot be cut back is reused only whole.
                let n = if e.kv.rewinds() || n == e.tokens.len() {
                    n
                } else {
                    0
                };
                (i, n)
            })
            .max_by_key(|&(i, n)| (n, self.entries[i].used))?;
        if reuse == 0 {
            return None;
        }
        let mut e = self.entries.swap_remove(best);
        self.held -= e.tokens.len();
        if e.kv.truncate(reuse).is_err() {
            return None;
        }
        e.tokens.truncate(reuse);
        Some(Reused {
            kv: e.kv,
            cached: reuse,
        })
    }

    /// Keep a finished sequence's cache, which holds `tokens`; the least
    /// recently used entries make room. A sequence longer than the whole
    /// budget is dropped.
    pub fn put(&mut self, tokens: Vec<u32>, kv: SeqKv) {
        debug_assert_eq!(tokens.len(), kv.len());
        // Qwen4-Exp's state lives in the model, which the next sequence
        // takes over: nothing of it can be kept.
        let state_in_model = matches!(kv, SeqKv::Qwen4 { .. });
        if state_in_model
            || tokens.is_empty()
            || tokens.len() != kv.len()
            || tokens.len() > self.budget
        {
            return;
        }
        while self.held + tokens.len() > self.budget {
            let Some((oldest, _)) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.used)
            else {
                break;
            };
            let e = self.entries.swap_remove(oldest);
            self.held -= e.tokens.len();
        }
        self.clock += 1;
        self.held += tokens.len();
        self.entries.push(Entry {
            tokens,
            kv,
            used: self.clock,
        });
    }
}
