//! Replay against a real store, and the policy acceptance check on every
//! synthetic trace family.

use std::sync::Arc;

use flashtier::experts::replay::{ReplayConfig, replay};
use flashtier::experts::sim::{belady, simulate};
use flashtier::experts::testing::write_store;
use flashtier::experts::tracegen::{TraceFamily, generate};
use flashtier::experts::{Backing, PolicyKind, StoreSet};
use flashtier_io::PosixBackend;

#[test]
fn replay_matches_the_policy_simulation_on_both_backings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 4, 16, 4096).expect("store");
    let trace = generate(&TraceFamily::Decode.params(4, 16, 3, 30, 2)).expect("trace");
    for backing in [Backing::Slots, Backing::Mapped] {
        for policy in PolicyKind::ALL {
            let stores = StoreSet::open(&path, backing == Backing::Mapped).expect("open");
            let backend = Arc::new(PosixBackend::new(4).expect("posix"));
            let config = ReplayConfig {
                budget_bytes: 16 * 4096,
                policy,
                backing,
                ..ReplayConfig::default()
            };
            let r = replay(stores, backend, &trace, &config, &mut |_, _| {}).expect("replay");
            assert_eq!(r.capacity_records, 16);
            assert_eq!(r.accesses, 30 * 4 * 3);
            assert!(
                (r.hit_rate - r.policy_sim_hit_rate).abs() < 1e-12,
                "{policy} {backing:?}: pool {} sim {}",
                r.hit_rate,
                r.policy_sim_hit_rate
            );
            assert!(r.hit_rate <= r.belady_hit_rate + 1e-12);
            let misses = r.accesses - (r.hit_rate * r.accesses as f64).round() as u64;
            if backing == Backing::Slots {
                assert_eq!(
                    r.bytes_read,
                    misses * 4096,
                    "{policy}: every miss reads one record"
                );
            } else {
                assert_eq!(r.bytes_read + r.page_cache_records * 4096, misses * 4096);
            }
        }
    }
}

#[test]
fn a_trace_larger_than_the_store_is_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("e.ftstore");
    write_store(&path, 2, 4, 4096).expect("store");
    let trace = generate(&TraceFamily::Zipf.params(3, 4, 1, 3, 1)).expect("trace");
    let stores = StoreSet::open(&path, false).expect("open");
    let backend = Arc::new(PosixBackend::new(2).expect("posix"));
    let err = replay(
        stores,
        backend,
        &trace,
        &ReplayConfig::default(),
        &mut |_, _| {},
    )
    .expect_err("3 layers > 2");
    assert!(err.to_string().contains("layers"), "{err}");
}

/// Acceptance: at a budget of 25% of the expert records, on every family and
/// five model shapes (12 x 16 top-4 is the demo's), the default policy's hit rate is >= LRU's and <=
/// Belady's, and beats LRU by >= 3 points on at least one family.
#[test]
fn default_policy_beats_lru_and_stays_under_belady() {
    let mut best_gain = f64::MIN;
    for (layers, experts, k) in [
        (24u32, 64u32, 8u32),
        (16, 128, 8),
        (32, 32, 4),
        (12, 16, 4),
        (4, 64, 8),
    ] {
        let capacity = (layers * experts / 4) as usize;
        for family in TraceFamily::ALL {
            let t = generate(&family.params(layers, experts, k, 600, 5)).expect("trace");
            let lru = simulate(&t, PolicyKind::Lru, capacity)
                .expect("fits")
                .rate();
            let ours = simulate(&t, PolicyKind::default(), capacity)
                .expect("fits")
                .rate();
            let opt = belady(&t, capacity).expect("fits").rate();
            assert!(
                ours >= lru,
                "{} {layers}x{experts}: default {ours:.3} < LRU {lru:.3}",
                family.name()
            );
            assert!(
                ours <= opt,
                "{}: default {ours:.3} above Belady {opt:.3}",
                family.name()
            );
            best_gain = best_gain.max(ours - lru);
        }
    }
    assert!(best_gain >= 0.03, "best gain over LRU {best_gain:.3}");
}
