//! Eviction policies: which resident record leaves when a miss needs room.
//!
//! Every policy is O(1) per operation (amortised for the clock-like ones):
//! intrusive lists over record indices, no scan of the budget per miss. The
//! pool tells a policy which records are pinned (used by the current step);
//! a policy never returns a pinned record, and returns `None` when every
//! resident record is pinned (the pool turns that into an error).
//!
//! - [`PolicyKind::Lru`]: least recently used, the seed's policy.
//! - [`PolicyKind::Sieve`]: SIEVE (a FIFO with a visited bit and a moving hand).
//! - [`PolicyKind::S3Fifo`]: S3-FIFO (a small probation FIFO, a main FIFO with
//!   2-bit frequency counters, and a ghost FIFO of recently evicted ids).
//! - [`PolicyKind::LayerClock`]: layer-aware and frequency-aware (one CLOCK
//!   queue with 2-bit counters per layer, victims from the layer just used,
//!   whose next use is farthest in the layer cycle); the default, chosen by
//!   measurement on every synthetic family and budget (docs/benchmarks.md,
//!   `## Expert tier`): it is never below LRU there, where S3-FIFO is on
//!   traces with strong token locality.
//!
//! Bounds: per-record state is 10 bytes for every record of the store,
//! allocated once; the ghost queue holds at most the main queue's capacity.

use super::list::{Ends, Links, NIL};

/// Which policy to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum PolicyKind {
    /// Least recently used.
    Lru,
    /// SIEVE.
    Sieve,
    /// S3-FIFO.
    S3Fifo,
    /// Per-layer CLOCK queues, victims from the layer just used (default).
    #[default]
    LayerClock,
}

impl PolicyKind {
    /// Every policy, for sweeps.
    pub const ALL: [Self; 4] = [Self::Lru, Self::Sieve, Self::S3Fifo, Self::LayerClock];

    /// Short name (`lru`, `sieve`, `s3-fifo`, `layer-clock`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Sieve => "sieve",
            Self::S3Fifo => "s3-fifo",
            Self::LayerClock => "layer-clock",
        }
    }

    /// A policy over records whose layers are `layer_of` (one entry per
    /// record) holding at most `capacity` of them.
    #[must_use]
    pub fn build(self, layer_of: &[u32], capacity: usize) -> Box<dyn EvictionPolicy> {
        let records = layer_of.len();
        match self {
            Self::Lru => Box::new(Lru::new(records)),
            Self::Sieve => Box::new(Sieve::new(records)),
            Self::S3Fifo => Box::new(S3Fifo::new(records, capacity)),
            Self::LayerClock => Box::new(super::layered::LayerClock::new(layer_of)),
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "sieve" => Ok(Self::Sieve),
            "s3-fifo" | "s3fifo" => Ok(Self::S3Fifo),
            "layer-clock" | "layerclock" => Ok(Self::LayerClock),
            "default" => Ok(Self::default()),
            other => Err(format!(
                "unknown policy {other:?} (layer-clock = default | s3-fifo | sieve | lru)"
            )),
        }
    }
}

/// A replacement policy over record indices. The caller guarantees that
/// `on_hit` and `on_remove` name resident records and `on_insert` a
/// non-resident one.
pub trait EvictionPolicy: Send {
    /// The policy's name.
    fn kind(&self) -> PolicyKind;
    /// A step begins with these records (before their hits and inserts).
    fn on_step(&mut self, records: &[usize]) {
        let _ = records;
    }
    /// A resident record was used.
    fn on_hit(&mut self, rec: usize);
    /// A record became resident (after a miss or a prefetch).
    fn on_insert(&mut self, rec: usize);
    /// A resident record left for a reason of the caller's (failed read,
    /// cancelled prefetch).
    fn on_remove(&mut self, rec: usize);
    /// Choose a resident record with `pinned(rec) == false`, forget it and
    /// return it; `None` when every resident record is pinned.
    fn evict(&mut self, pinned: &dyn Fn(usize) -> bool) -> Option<usize>;
    /// Resident records the policy tracks.
    fn len(&self) -> usize;
    /// Whether no record is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn id(rec: usize) -> u32 {
    u32::try_from(rec).unwrap_or(NIL)
}

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

const SMALL: u16 = 1;
const MAIN: u16 = 2;
const GHOST: u16 = 3;
const FREQ_MAX: u8 = 3;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_default_is_layer_clock() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
        }
        assert_eq!("default".parse::<PolicyKind>(), Ok(PolicyKind::LayerClock));
        assert!("mru".parse::<PolicyKind>().is_err());
    }

    #[test]
    fn every_policy_refuses_to_evict_pinned_records() {
        let layers = vec![0u32; 6];
        for k in PolicyKind::ALL {
            let mut p = k.build(&layers, 4);
            p.on_step(&[0, 1, 2, 3]);
            for r in 0..4 {
                p.on_insert(r);
            }
            p.on_hit(2);
            assert_eq!(p.evict(&|_| true), None, "{k}: all pinned");
            let v = p.evict(&|r| r != 1).expect("one unpinned");
            assert_eq!(v, 1, "{k}");
            assert_eq!(p.len(), 3);
        }
    }
}
