//! SIEVE: a FIFO with a visited bit and a moving hand. O(1) amortised: the
//! hand passes each record at most twice per eviction (once clearing its
//! bit, once skipping it as pinned).

use super::list::{Ends, Links, NIL};
use super::{EvictionPolicy, PolicyKind, id};

/// SIEVE: insertion-ordered list, a visited bit set on hit, and a hand that
/// moves from the tail towards the head clearing visited bits and evicting the
/// first unvisited, unpinned record.
pub struct Sieve {
    links: Links,
    list: Ends,
    visited: Vec<bool>,
    hand: u32,
}

impl Sieve {
    /// SIEVE over records `0..records`.
    #[must_use]
    pub fn new(records: usize) -> Self {
        Self {
            links: Links::new(records),
            list: Ends::new(1),
            visited: vec![false; records],
            hand: NIL,
        }
    }
}

impl EvictionPolicy for Sieve {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Sieve
    }
    fn on_hit(&mut self, rec: usize) {
        if let Some(v) = self.visited.get_mut(rec) {
            *v = true;
        }
    }
    fn on_insert(&mut self, rec: usize) {
        self.links.push_front(&mut self.list, id(rec));
        if let Some(v) = self.visited.get_mut(rec) {
            *v = false;
        }
    }
    fn on_remove(&mut self, rec: usize) {
        let r = id(rec);
        if self.hand == r {
            self.hand = self.links.newer(r);
        }
        self.links.remove(&mut self.list, r);
    }
    fn evict(&mut self, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        // Each record is passed at most twice (once clearing its bit, once
        // skipped as pinned) before the hand has gone all the way round.
        for _ in 0..=2 * self.list.len() {
            let cur = if self.hand == NIL {
                self.list.tail()?
            } else {
                self.hand
            };
            let u = cur as usize;
            self.hand = self.links.newer(cur);
            if self.visited.get(u).copied().unwrap_or(false) {
                self.visited[u] = false;
            } else if !pinned(u) {
                self.links.remove(&mut self.list, cur);
                return Some(u);
            }
        }
        None
    }
    fn len(&self) -> usize {
        self.list.len()
    }
}
