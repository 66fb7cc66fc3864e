//! S3-FIFO: a small probation FIFO, a main FIFO with 2-bit frequency
//! counters, and a ghost FIFO of recently evicted ids. O(1) amortised (the
//! bound of [`S3Fifo`]'s eviction loop is in its comment); the ghost queue
//! holds at most the main queue's capacity.

use super::list::{Ends, Links};
use super::{EvictionPolicy, FREQ_MAX, PolicyKind, id};

const SMALL: u16 = 1;
const MAIN: u16 = 2;
const GHOST: u16 = 3;

/// S3-FIFO: new records enter a small FIFO (a fifth of the capacity: the
/// paper's tenth is too short to see an expert reused at the next token, which
/// measured worse than LRU on decode-like traces); a record
/// used again while there moves to the main FIFO when it reaches the tail,
/// otherwise it is evicted and its id remembered in the ghost FIFO. A miss on
/// a ghost id enters the main FIFO directly. The main FIFO reinserts records
/// whose 2-bit counter is non-zero (decrementing it): a CLOCK with frequency.
pub struct S3Fifo {
    links: Links,
    small: Ends,
    main: Ends,
    ghost: Ends,
    freq: Vec<u8>,
    small_target: usize,
    ghost_cap: usize,
}

impl S3Fifo {
    /// S3-FIFO over records `0..records` with room for `capacity`.
    #[must_use]
    pub fn new(records: usize, capacity: usize) -> Self {
        Self::with_small(records, capacity, capacity / 5)
    }

    /// S3-FIFO whose small queue holds `small_target` records (clamped to
    /// `1..capacity`).
    #[must_use]
    pub fn with_small(records: usize, capacity: usize, small_target: usize) -> Self {
        let small_target = small_target.clamp(1, capacity.saturating_sub(1).max(1));
        Self {
            links: Links::new(records),
            small: Ends::new(SMALL),
            main: Ends::new(MAIN),
            ghost: Ends::new(GHOST),
            freq: vec![0; records],
            small_target,
            ghost_cap: capacity.saturating_sub(small_target).max(1),
        }
    }

    fn remember_ghost(&mut self, r: u32) {
        self.links.push_front(&mut self.ghost, r);
        while self.ghost.len() > self.ghost_cap {
            let _ = self.links.pop_back(&mut self.ghost);
        }
    }

    /// One step at the small queue's tail: `Some(victim)`, or `None` after
    /// promoting or skipping the tail record.
    fn step_small(&mut self, t: u32, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        let u = t as usize;
        if self.freq[u] > 0 {
            self.links.remove(&mut self.small, t);
            self.links.push_front(&mut self.main, t);
            self.freq[u] = 0;
            None
        } else if pinned(u) {
            self.links.move_to_front(&mut self.small, t);
            None
        } else {
            self.links.remove(&mut self.small, t);
            self.remember_ghost(t);
            Some(u)
        }
    }

    fn step_main(&mut self, t: u32, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        let u = t as usize;
        if self.freq[u] > 0 || pinned(u) {
            self.freq[u] = self.freq[u].saturating_sub(1);
            self.links.move_to_front(&mut self.main, t);
            None
        } else {
            self.links.remove(&mut self.main, t);
            Some(u)
        }
    }
}

impl EvictionPolicy for S3Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::S3Fifo
    }
    fn on_hit(&mut self, rec: usize) {
        if let Some(f) = self.freq.get_mut(rec) {
            *f = (*f + 1).min(FREQ_MAX);
        }
    }
    fn on_insert(&mut self, rec: usize) {
        let r = id(rec);
        if self.links.list_of(r) == GHOST {
            self.links.remove(&mut self.ghost, r);
            self.links.push_front(&mut self.main, r);
        } else {
            self.links.push_front(&mut self.small, r);
        }
        self.freq[rec] = 0;
    }
    fn on_remove(&mut self, rec: usize) {
        let r = id(rec);
        match self.links.list_of(r) {
            SMALL => self.links.remove(&mut self.small, r),
            MAIN => self.links.remove(&mut self.main, r),
            _ => {}
        }
    }
    fn evict(&mut self, pinned: &dyn Fn(usize) -> bool) -> Option<usize> {
        // Skips per queue are bounded by its length (pinned records rotate
        // once), promotions by the small queue's length, decrements by
        // FREQ_MAX per main record: the loop ends within this bound.
        let bound = (FREQ_MAX as usize + 3) * (self.small.len() + self.main.len()) + 2;
        let (mut small_skips, mut main_skips) = (0usize, 0usize);
        for _ in 0..bound {
            let small_ok = small_skips <= self.small.len();
            let main_ok = main_skips <= (FREQ_MAX as usize + 1) * self.main.len();
            let use_small = small_ok
                && self.small.len() > 0
                && (self.small.len() >= self.small_target || self.main.len() == 0 || !main_ok);
            if use_small {
                let t = self.small.tail()?;
                match self.step_small(t, pinned) {
                    Some(v) => return Some(v),
                    None => small_skips += 1,
                }
            } else if main_ok && self.main.len() > 0 {
                let t = self.main.tail()?;
                match self.step_main(t, pinned) {
                    Some(v) => return Some(v),
                    None => main_skips += 1,
                }
            } else {
                return None;
            }
        }
        None
    }
    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
}
