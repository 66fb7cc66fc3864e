//! Layer-aware eviction: decode walks the layers in a cycle, so the record
//! whose next use is farthest away is, most of the time, one of the layer
//! just used. Global LRU gets this backwards (the oldest records belong to the
//! layer about to run); this policy keeps one queue per layer and takes the
//! victim from the layer of the most recent use, then the layer before it,
//! and so on around the cycle.
//!
//! Within a layer it is a CLOCK with a 2-bit use counter (frequency-aware):
//! the tail record is evicted when its counter is zero, else the counter is
//! decremented and the record goes back to the head.
//!
//! O(1) amortised: victims come from a queue tail; each counter decrement
//! pays for an earlier hit; pinned records are skipped at most once per
//! eviction per queue; the walk over layers stops at the first layer with an
//! unpinned record (bounded by the number of layers).
//! Bounds: per-record links + counter + layer (16 bytes), one queue per layer.

use super::list::{Ends, Links};
use super::{EvictionPolicy, FREQ_MAX, PolicyKind};

/// Per-layer CLOCK queues with layer-cycle-aware victim selection.
pub struct LayerClock {
    links: Links,
    queues: Vec<Ends>,
    layer_of: Vec<u16>,
    freq: Vec<u8>,
    current: usize,
    len: usize,
}

impl LayerClock {
    /// A policy over records whose layer is `layer_of[record]` (layers are
    /// renumbered densely; at most 65535).
    #[must_use]
    pub fn new(layer_of: &[u32]) -> Self {
        let mut layers: Vec<u32> = layer_of.to_vec();
        layers.sort_unstable();
        layers.dedup();
        let dense: Vec<u16> = layer_of
            .iter()
            .map(|l| {
                layers
                    .binary_search(l)
                    .map_or(0, |i| u16::try_from(i).unwrap_or(u16::MAX - 1))
            })
            .collect();
        let queues = (0..layers.len().max(1))
            .map(|i| Ends::new(u16::try_from(i + 1).unwrap_or(u16::MAX)))
            .collect();
        Self {
            links: Links::new(layer_of.len()),
            queues,
            layer_of: dense,
            freq: vec![0; layer_of.len()],
            current: 0,
            len: 0,
        }
    }

    fn queue_of(&self, rec: usize) -> usize {
        self.layer_of
            .get(rec)
            .map_or(0, |&l| l as usize)
            .min(self.queues.len() - 1)
    }

    /// Try to evict from queue `q`; `None` when every record there is pinned.
    fn evict_from(&mut self, q: usize, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        let n = self.queues[q].len();
        // Pinned records passed since the last counter decrement: a whole
        // lap of them means nothing here can go.
        let mut pinned_run = 0;
        for _ in 0..(FREQ_MAX as usize + 2) * n + 1 {
            let t = self.queues[q].tail()?;
            let u = t as usize;
            if pinned(u) {
                pinned_run += 1;
                if pinned_run >= n {
                    return None;
                }
                self.links.move_to_front(&mut self.queues[q], t);
            } else if self.freq[u] > 0 {
                pinned_run = 0;
                self.freq[u] -= 1;
                self.links.move_to_front(&mut self.queues[q], t);
            } else {
                self.links.remove(&mut self.queues[q], t);
                self.len -= 1;
                return Some(u);
            }
        }
        None
    }
}

impl EvictionPolicy for LayerClock {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LayerClock
    }
    fn on_step(&mut self, records: &[usize]) {
        if let Some(&r) = records.first() {
            self.current = self.queue_of(r);
        }
    }
    fn on_hit(&mut self, rec: usize) {
        if let Some(f) = self.freq.get_mut(rec) {
            *f = (*f + 1).min(FREQ_MAX);
        }
    }
    fn on_insert(&mut self, rec: usize) {
        let q = self.queue_of(rec);
        self.links.push_front(&mut self.queues[q], rec as u32);
        self.freq[rec] = 0;
        self.len += 1;
    }
    fn on_remove(&mut self, rec: usize) {
        let q = self.queue_of(rec);
        self.links.remove(&mut self.queues[q], rec as u32);
        self.len -= 1;
    }
    fn evict(&mut self, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        let layers = self.queues.len();
        (0..layers).find_map(|back| {
            let q = (self.current + layers - back) % layers;
            self.evict_from(q, pinned)
        })
    }
    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn victims_come_from_the_layer_just_used_and_skip_pinned() {
        // Records 0..4 in layer 0, 4..8 in layer 1.
        let layers: Vec<u32> = (0..8).map(|r| r / 4).collect();
        let mut p = LayerClock::new(&layers);
        for r in [0, 1, 4, 5] {
            p.on_insert(r);
        }
        p.on_step(&[4]); // layer 1 is current
        p.on_hit(4); // record 4 has a use count
        let none = |_: usize| false;
        assert_eq!(
            p.evict(&none),
            Some(5),
            "layer 1's unused record goes first"
        );
        assert_eq!(
            p.evict(&|r| r == 4 || r == 0),
            Some(1),
            "layer 1 pinned: fall back to layer 0"
        );
        assert_eq!(
            p.evict(&|r| r == 4 || r == 0),
            None,
            "everything left is pinned"
        );
        assert_eq!(p.len(), 2);
        p.on_remove(0);
        assert_eq!(
            p.evict(&none),
            Some(4),
            "a counter buys one more pass, not immunity"
        );
        assert!(p.is_empty());
    }
}
