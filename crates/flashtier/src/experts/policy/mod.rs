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
//!
//! Files: one per policy (`lru.rs`, `sieve.rs`, `s3fifo.rs`,
//! `layer_clock.rs`), over the intrusive lists of `list.rs`; this one holds
//! the [`EvictionPolicy`] trait and [`PolicyKind`].

use list::NIL;

mod layer_clock;
mod list;
mod lru;
mod s3fifo;
mod sieve;

pub use layer_clock::LayerClock;
pub use lru::Lru;
pub use s3fifo::S3Fifo;
pub use sieve::Sieve;

/// Most a 2-bit use counter holds (S3-FIFO's main queue, layer-clock).
const FREQ_MAX: u8 = 3;

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
            Self::LayerClock => Box::new(LayerClock::new(layer_of)),
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
                "unknown policy {other} (layer-clock = default | s3-fifo | sieve | lru)"
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

/// A record index as a list id (`NIL` past `u32`).
fn id(rec: usize) -> u32 {
    u32::try_from(rec).unwrap_or(NIL)
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
