//! Policy-only simulation of a routing trace, and Belady's MIN on the same
//! trace and capacity: the yardsticks `flashtier replay` reports beside the
//! real pool's hit rate.
//!
//! A pool step is one (token, layer): that layer's experts are pinned while
//! they are brought in, exactly as [`super::ExpertPool::acquire`] pins them.
//! Belady's MIN (evict the resident record whose next use is farthest) does
//! not need pins: it is optimal for demand paging with equal-sized records,
//! so it bounds every policy, pinned or not.
//!
//! Bounds: O(records) state for the policy; MIN keeps a next-use array of one
//! `u32` per access and a heap of at most (capacity + accesses) entries.

use std::collections::BinaryHeap;

use super::policy::PolicyKind;
use super::trace::RoutingTrace;

/// Hits over accesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct HitCount {
    /// Record uses.
    pub accesses: u64,
    /// Uses that found the record resident.
    pub hits: u64,
}

impl HitCount {
    /// `hits / accesses` (0 for an empty trace).
    #[must_use]
    pub fn rate(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.hits as f64 / self.accesses as f64
        }
    }
}

/// A simulation that cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// One step needs more records than the capacity.
    #[error("capacity of {capacity} records is too small for one step of {needed}")]
    TooSmall {
        /// Capacity in records.
        capacity: usize,
        /// Records the step needs.
        needed: usize,
    },
}

/// Record index of `(layer, expert)` in a trace's own numbering.
#[must_use]
pub fn trace_index(experts: u32, layer: usize, expert: u32) -> usize {
    layer * experts as usize + expert as usize
}

/// The layer of every record index of a trace.
#[must_use]
pub fn trace_layers(trace: &RoutingTrace) -> Vec<u32> {
    (0..trace.layers)
        .flat_map(|l| std::iter::repeat_n(l, trace.experts as usize))
        .collect()
}

/// Every access of the trace in order, as (step number, record index).
fn accesses(trace: &RoutingTrace) -> impl Iterator<Item = (usize, usize)> + '_ {
    let layers = trace.layers as usize;
    trace.steps.iter().enumerate().flat_map(move |(t, s)| {
        s.layers.iter().enumerate().flat_map(move |(l, r)| {
            r.ids
                .iter()
                .map(move |&e| (t * layers + l, trace_index(trace.experts, l, e)))
        })
    })
}

fn check_steps(trace: &RoutingTrace, capacity: usize) -> Result<(), SimError> {
    let widest = trace
        .steps
        .iter()
        .flat_map(|s| s.layers.iter().map(|l| l.ids.len()))
        .max()
        .unwrap_or(0);
    if widest > capacity || capacity == 0 {
        return Err(SimError::TooSmall {
            capacity,
            needed: widest.max(1),
        });
    }
    Ok(())
}

/// Run `policy` over the trace with room for `capacity` records.
pub fn simulate(
    trace: &RoutingTrace,
    policy: PolicyKind,
    capacity: usize,
) -> Result<HitCount, SimError> {
    check_steps(trace, capacity)?;
    let records = trace.layers as usize * trace.experts as usize;
    let mut p = policy.build(&trace_layers(trace), capacity);
    let mut resident = vec![false; records];
    let mut pinned_step = vec![usize::MAX; records];
    let mut count = HitCount::default();
    let mut pinned_upto = usize::MAX;
    let all: Vec<(usize, usize)> = accesses(trace).collect();
    for (i, &(step, rec)) in all.iter().enumerate() {
        // Pin the whole step before its first record, as the pool does.
        if pinned_upto != step {
            pinned_upto = step;
            let step_recs: Vec<usize> = all
                .get(i..)
                .unwrap_or_default()
                .iter()
                .take_while(|(s, _)| *s == step)
                .map(|&(_, r)| r)
                .collect();
            for &r in &step_recs {
                pinned_step[r] = step;
            }
            p.on_step(&step_recs);
        }
        count.accesses += 1;
        if resident[rec] {
            count.hits += 1;
            p.on_hit(rec);
            continue;
        }
        if p.len() >= capacity {
            let victim =
                p.evict(&|r| pinned_step.get(r) == Some(&step))
                    .ok_or(SimError::TooSmall {
                        capacity,
                        needed: capacity + 1,
                    })?;
            resident[victim] = false;
        }
        p.on_insert(rec);
        resident[rec] = true;
    }
    Ok(count)
}

/// Belady's MIN hit count with room for `capacity` records.
pub fn belady(trace: &RoutingTrace, capacity: usize) -> Result<HitCount, SimError> {
    check_steps(trace, capacity)?;
    let records = trace.layers as usize * trace.experts as usize;
    let seq: Vec<usize> = accesses(trace).map(|(_, r)| r).collect();
    let never = seq.len();
    let mut next_use = vec![never; seq.len()];
    let mut last_seen = vec![never; records];
    for (i, &r) in seq.iter().enumerate().rev() {
        next_use[i] = last_seen[r];
        last_seen[r] = i;
    }
    // Max-heap of (next use, record); entries whose next use no longer matches
    // `resident_next[record]` are stale and skipped.
    let mut heap: BinaryHeap<(usize, usize)> = BinaryHeap::new();
    let mut resident_next: Vec<Option<usize>> = vec![None; records];
    let mut live = 0usize;
    let mut count = HitCount::default();
    for (i, &r) in seq.iter().enumerate() {
        count.accesses += 1;
        if resident_next[r].is_some() {
            count.hits += 1;
        } else {
            if live >= capacity {
                while let Some((nu, victim)) = heap.pop() {
                    if resident_next[victim] == Some(nu) {
                        resident_next[victim] = None;
                        live -= 1;
                        break;
                    }
                }
            }
            live += 1;
        }
        resident_next[r] = Some(next_use[i]);
        heap.push((next_use[i], r));
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::tracegen::{TraceFamily, generate};

    #[test]
    fn belady_bounds_every_policy_on_every_family() {
        for f in TraceFamily::ALL {
            let t = generate(&f.params(6, 32, 4, 300, 11)).expect("valid");
            let cap = 48;
            let opt = belady(&t, cap).expect("fits");
            for p in PolicyKind::ALL {
                let h = simulate(&t, p, cap).expect("fits");
                assert_eq!(h.accesses, opt.accesses);
                assert!(
                    h.hits <= opt.hits,
                    "{} on {}: {} > MIN {}",
                    p,
                    f.name(),
                    h.hits,
                    opt.hits
                );
            }
        }
    }

    #[test]
    fn belady_on_a_known_sequence() {
        // One layer, capacity 2: 0 1 2 0 1 3 0. MIN keeps 0 and 2 at the third
        // access (1 is used later than 0), so it hits the fourth and last: 2 hits.
        let text = "{\"format\":\"flashtier-trace\",\"version\":1,\"layers\":1,\"experts\":4}\n\
            {\"ids\":[[0]]}\n{\"ids\":[[1]]}\n{\"ids\":[[2]]}\n{\"ids\":[[0]]}\n{\"ids\":[[1]]}\n{\"ids\":[[3]]}\n{\"ids\":[[0]]}\n";
        let t = RoutingTrace::parse_str(text).expect("valid");
        let opt = belady(&t, 2).expect("fits");
        assert_eq!((opt.hits, opt.accesses), (2, 7));
        let lru = simulate(&t, PolicyKind::Lru, 2).expect("fits");
        assert_eq!(lru.hits, 0);
    }

    #[test]
    fn a_step_wider_than_the_capacity_is_an_error() {
        let t = generate(&TraceFamily::Zipf.params(2, 16, 8, 5, 1)).expect("valid");
        assert!(matches!(
            simulate(&t, PolicyKind::Lru, 7),
            Err(SimError::TooSmall { .. })
        ));
        assert!(belady(&t, 7).is_err());
        assert!(simulate(&t, PolicyKind::S3Fifo, 8).is_ok());
    }
}

#[cfg(test)]
mod sweep {
    use super::*;
    use crate::experts::tracegen::{TraceFamily, generate};

    #[test]
    #[ignore = "prints a table for choosing the default policy"]
    fn policy_sweep() {
        for (layers, experts, k) in [
            (24u32, 64u32, 8u32),
            (16, 128, 8),
            (32, 32, 4),
            (12, 16, 4),
            (4, 64, 8),
            (48, 128, 8),
        ] {
            for frac in [0.1, 0.25, 0.5] {
                let cap = ((layers * experts) as f64 * frac) as usize;
                if cap < k as usize {
                    continue;
                }
                for f in TraceFamily::ALL {
                    let t = generate(&f.params(layers, experts, k, 2000, 5)).expect("valid");
                    let opt = belady(&t, cap).expect("fits").rate();
                    let rates: Vec<String> = PolicyKind::ALL
                        .iter()
                        .map(|&p| {
                            format!("{}={:.3}", p, simulate(&t, p, cap).expect("fits").rate())
                        })
                        .collect();
                    println!(
                        "{layers}x{experts}k{k} {frac} {:<10} min={opt:.3} {}",
                        f.name(),
                        rates.join(" ")
                    );
                }
            }
        }
    }
}
