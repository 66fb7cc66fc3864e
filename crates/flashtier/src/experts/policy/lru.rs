//! Least recently used: one list, hits move to the head, victims come from
//! the tail (skipping pinned records, which sit near the head). The seed's
//! policy. O(1) per operation; eviction skips at most the pinned records.

use super::list::{Ends, Links, NIL};
use super::{EvictionPolicy, PolicyKind, id};

/// Least recently used: one list, hits move to the head, victims come from the
/// tail (skipping pinned records, which sit near the head).
pub struct Lru {
    links: Links,
    list: Ends,
}

impl Lru {
    /// LRU over records `0..records`.
    #[must_use]
    pub fn new(records: usize) -> Self {
        Self {
            links: Links::new(records),
            list: Ends::new(1),
        }
    }
}

impl EvictionPolicy for Lru {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }
    fn on_hit(&mut self, rec: usize) {
        self.links.move_to_front(&mut self.list, id(rec));
    }
    fn on_insert(&mut self, rec: usize) {
        self.links.push_front(&mut self.list, id(rec));
    }
    fn on_remove(&mut self, rec: usize) {
        self.links.remove(&mut self.list, id(rec));
    }
    fn evict(&mut self, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        let mut cur = self.list.tail()?;
        for _ in 0..self.list.len() {
            if !pinned(cur as usize) {
                self.links.remove(&mut self.list, cur);
                return Some(cur as usize);
            }
            cur = self.links.newer(cur);
            if cur == NIL {
                break;
            }
        }
        None
    }
    fn len(&self) -> usize {
        self.list.len()
    }
}
