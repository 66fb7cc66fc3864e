//! Expert pool: exact bytes on both backings, lifecycle, errors, prefetch,
//! fault injection through the simulated backend, and proptest invariants.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flashtier::experts::testing::{pattern_byte, write_store};
use flashtier::experts::{
    Backing, ExpertPool, ExpertsError, PolicyKind, PoolConfig, Precision, StoreSet,
};
use flashtier_io::sim::{Fault, OpKind};
use flashtier_io::{FaultPlan, PosixBackend, SimBackend, StorageBackend};
use proptest::prelude::*;

const LAYERS: u32 = 3;
const EXPERTS: u32 = 8;
const PAYLOAD: u64 = 5000; // stride 8192

fn store(dir: &Path) -> PathBuf {
    let p = dir.join("e.ftstore");
    write_store(&p, LAYERS, EXPERTS, PAYLOAD).expect("write store");
    p
}

fn pool(path: &Path, backing: Backing, slots: u64, backend: Arc<dyn StorageBackend>) -> ExpertPool {
    let stores = StoreSet::open(path, backing == Backing::Mapped).expect("open");
    if let Some(m) = &stores.full().map {
        // Cold start: the test just wrote the file, so its pages are cached.
        m.drop_cached(0, m.len_bytes()).expect("fadvise");
    }
    let config = PoolConfig {
        backing,
        budget_bytes: slots * 8192,
        policy: PolicyKind::default(),
    };
    ExpertPool::new(stores, backend, config).expect("pool")
}

fn check_bytes(pool: &mut ExpertPool, layer: u32, expert: u32) {
    let r = pool.index_of(layer, expert).expect("key");
    let bytes = pool.bytes(r).expect("ready");
    assert_eq!(bytes.len(), PAYLOAD as usize);
    assert!(
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern_byte(layer, expert, i)),
        "record ({layer},{expert}) bytes differ"
    );
}

fn step(pool: &mut ExpertPool, layer: u32, experts: &[u32]) -> Result<(), ExpertsError> {
    let recs: Vec<usize> = experts
        .iter()
        .map(|&e| pool.index_of(layer, e).expect("key"))
        .collect();
    let need = pool.acquire(&recs)?;
    let plan = pool.plan(&need)?;
    let run = pool.run(plan);
    if run.is_ok() {
        for &e in experts {
            check_bytes(pool, layer, e);
        }
    }
    let fin = pool.finish();
    run.and(fin)
}

#[test]
fn both_backings_serve_exact_bytes_and_count_hits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    for backing in [Backing::Slots, Backing::Mapped] {
        let mut p = pool(
            &path,
            backing,
            6,
            Arc::new(PosixBackend::new(4).expect("posix")),
        );
        step(&mut p, 0, &[1, 2, 3]).expect("step 1");
        step(&mut p, 1, &[1, 2, 3]).expect("step 2");
        step(&mut p, 0, &[1, 2, 5]).expect("step 3: two hits, one miss evicts");
        let s = p.stats();
        assert_eq!((s.accesses, s.hits), (9, 2), "{backing:?}");
        assert_eq!(s.resident_records, 6);
        p.check_invariants().expect("invariants");
        let r = p.index_of(0, 1).expect("key");
        let a = p.addr(r).expect("ready");
        assert_eq!(
            (a.precision, a.len_bytes),
            (Precision::Full, PAYLOAD as usize)
        );
        if backing == Backing::Slots {
            assert_eq!(s.bytes_read, 7 * 8192);
        }
    }
}

#[test]
fn a_step_larger_than_the_pool_is_an_error_and_lifecycle_is_enforced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    let mut p = pool(
        &path,
        Backing::Slots,
        2,
        Arc::new(PosixBackend::new(2).expect("posix")),
    );
    let recs: Vec<usize> = (0..3).collect();
    assert!(matches!(
        p.acquire(&recs),
        Err(ExpertsError::PoolTooSmall {
            capacity: 2,
            needed: 3
        })
    ));
    assert!(matches!(
        p.acquire(&[999]),
        Err(ExpertsError::RecordOutOfRange { .. })
    ));
    assert!(matches!(p.finish(), Err(ExpertsError::Lifecycle(_))));
    let need = p.acquire(&[0, 1]).expect("fits");
    assert!(matches!(p.acquire(&[0]), Err(ExpertsError::Lifecycle(_))));
    assert!(
        matches!(p.addr(0), Err(ExpertsError::NotResident { .. })),
        "nothing handed out before the read"
    );
    let plan = p.plan(&need).expect("plan");
    p.run(plan).expect("run");
    p.finish().expect("finish");
}

#[test]
fn tracked_reads_land_before_use_and_slots_are_not_reused_early() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    let sim = SimBackend::new(
        FaultPlan::seeded(3).latency(1.0, Duration::from_millis(5)),
        4,
    )
    .expect("sim");
    let mut p = pool(&path, Backing::Slots, 3, Arc::new(sim));
    let need = p.acquire(&[0, 1, 2]).expect("acquire");
    let plan = p.plan(&need).expect("plan");
    let flags = p.run_tracked(plan).expect("tracked");
    assert_eq!(flags.len(), 3);
    // Leave the step without waiting: the next step must evict these slots,
    // and the pool waits for their reads before reusing them.
    p.finish().expect("finish");
    let need = p
        .acquire(&[3, 4, 5])
        .expect("acquire evicts in-flight records");
    p.check_invariants().expect("invariants");
    let plan = p.plan(&need).expect("plan");
    let flags = p.run_tracked(plan).expect("tracked");
    for (r, _) in &flags {
        p.wait_ready(*r).expect("lands");
    }
    assert!(flags.iter().all(|(_, f)| f.is_landed()));
    for e in 3..6 {
        check_bytes(&mut p, 0, e);
    }
    p.finish().expect("finish");
}

#[test]
fn an_injected_read_failure_leaves_the_record_non_resident() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    for backing in [Backing::Slots, Backing::Mapped] {
        // The second read fails with EIO.
        let plan = FaultPlan::seeded(9).fail_nth(OpKind::Read, 2, Fault::Eio);
        let sim = SimBackend::new(plan, 1).expect("sim");
        let mut p = pool(&path, backing, 4, Arc::new(sim));
        let err = step(&mut p, 1, &[0, 1, 2]).expect_err("one read fails");
        assert!(
            matches!(err, ExpertsError::Read { .. }),
            "{backing:?}: {err}"
        );
        assert!(
            err.to_string().contains("e.ftstore"),
            "error names the file: {err}"
        );
        assert!(
            err.to_string().contains("layer=1"),
            "error names the key: {err}"
        );
        let ready: Vec<bool> = (0..3)
            .map(|e| p.is_ready(p.index_of(1, e).expect("key")))
            .collect();
        assert_eq!(
            ready.iter().filter(|&&r| !r).count(),
            1,
            "{backing:?}: exactly the failed record is absent"
        );
        let failed = p
            .index_of(
                1,
                ready.iter().position(|&r| !r).expect("one failed") as u32,
            )
            .expect("key");
        assert!(matches!(
            p.addr(failed),
            Err(ExpertsError::NotResident { .. })
        ));
        assert!(p.bytes(failed).is_err());
        assert_eq!(p.stats().failed_reads, 1);
        p.check_invariants().expect("invariants");
        // The next step reads it again and gets exact bytes.
        step(&mut p, 1, &[0, 1, 2]).expect("retry succeeds");
    }
}

#[test]
fn a_corrupt_record_fails_its_checksum_and_is_not_served() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    let store = flashtier_format::Store::open(&path).expect("store");
    let idx = store
        .index_of(flashtier_format::RecordKey::new(2, 4))
        .expect("key");
    let off = store.record_offset(idx).expect("offset") as usize;
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[off + 17] ^= 0x40;
    std::fs::write(&path, bytes).expect("write");
    for backing in [Backing::Slots, Backing::Mapped] {
        let mut p = pool(
            &path,
            backing,
            4,
            Arc::new(PosixBackend::new(2).expect("posix")),
        );
        let err = step(&mut p, 2, &[3, 4]).expect_err("checksum");
        assert!(matches!(err, ExpertsError::Checksum { .. }), "{err}");
        assert!(!p.is_ready(idx as usize));
        check_bytes(&mut p, 2, 3);
        p.check_invariants().expect("invariants");
    }
}

#[test]
fn prefetch_counts_bytes_never_evicts_the_step_and_can_be_cancelled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    let mut p = pool(
        &path,
        Backing::Slots,
        4,
        Arc::new(PosixBackend::new(2).expect("posix")),
    );
    let step_recs = [
        p.index_of(0, 0).expect("k"),
        p.index_of(0, 1).expect("k"),
        p.index_of(0, 2).expect("k"),
    ];
    let need = p.acquire(&step_recs).expect("acquire");
    // Room for one more record: the prefetch may take it but never a pinned record.
    let started = p.prefetch(1, &[5, 6, 7]).expect("prefetch");
    assert_eq!(started, 1);
    let plan = p.plan(&need).expect("plan");
    p.run(plan).expect("run");
    p.check_invariants().expect("invariants");
    assert!(step_recs.iter().all(|&r| p.is_ready(r)));
    p.finish().expect("finish");
    step(&mut p, 1, &[5]).expect("uses the prefetched record");
    let s = p.stats();
    assert_eq!((s.prefetch_bytes, s.prefetch_used_bytes), (8192, 8192));
    // Cancel: an unused prefetch in flight is dropped when it lands.
    let slow = SimBackend::new(
        FaultPlan::seeded(1).latency(1.0, Duration::from_millis(20)),
        2,
    )
    .expect("sim");
    let mut p = pool(&path, Backing::Slots, 4, Arc::new(slow));
    assert_eq!(p.prefetch(2, &[0, 1]).expect("prefetch"), 2);
    assert_eq!(p.cancel_prefetch(), 2);
    for e in [0, 1] {
        let r = p.index_of(2, e).expect("k");
        assert!(
            matches!(p.wait_ready(r), Err(ExpertsError::NotResident { .. })),
            "cancelled prefetch dropped on landing"
        );
    }
    assert_eq!(p.stats().resident_records, 0);
    p.check_invariants().expect("invariants");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]

    /// Random steps, tracked and blocking, under random latency: no slot owned
    /// twice, no eviction of a current-step record, every read landed before
    /// its slot is reused (the slot table refuses a second read, which would
    /// surface as an error), bytes exact.
    #[test]
    fn pool_invariants_hold(
        steps in proptest::collection::vec((0..LAYERS, proptest::collection::btree_set(0..EXPERTS, 1..4), any::<bool>(), any::<bool>()), 1..16),
        capacity in 3u64..8,
        policy in prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Sieve), Just(PolicyKind::S3Fifo)],
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = store(dir.path());
        let sim = SimBackend::new(FaultPlan::seeded(seed).latency(0.3, Duration::from_micros(300)), 3).expect("sim");
        let stores = StoreSet::open(&path, false).expect("open");
        let config = PoolConfig { backing: Backing::Slots, budget_bytes: capacity * 8192, policy };
        let mut p = ExpertPool::new(stores, Arc::new(sim), config).expect("pool");
        for (layer, experts, tracked, prefetch) in steps {
            let recs: Vec<usize> = experts.iter().map(|&e| p.index_of(layer, e).expect("k")).collect();
            let need = p.acquire(&recs).expect("acquire");
            p.check_invariants().map_err(TestCaseError::fail)?;
            if prefetch {
                p.prefetch((layer + 1) % LAYERS, &[0, 1]).expect("prefetch");
                p.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert!(recs.iter().all(|&r| p.addr(r).is_ok() || need.contains(&r)), "a pinned record was evicted");
            }
            let plan = p.plan(&need).expect("plan");
            if tracked {
                let flags = p.run_tracked(plan).expect("tracked");
                // Use only some records, leave the rest in flight.
                if let Some((r, _)) = flags.first() {
                    p.wait_ready(*r).expect("lands");
                }
            } else {
                p.run(plan).expect("run");
                for &e in &experts {
                    check_bytes(&mut p, layer, e);
                }
            }
            p.check_invariants().map_err(TestCaseError::fail)?;
            p.finish().expect("finish");
            p.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}

/// A backend whose read-ahead lane never has room.
struct NoRoomAhead(PosixBackend);

impl StorageBackend for NoRoomAhead {
    fn name(&self) -> &'static str {
        "no-room-ahead"
    }
    fn queue_depth(&self) -> usize {
        self.0.queue_depth()
    }
    fn read_async(
        &self,
        reqs: Vec<flashtier_io::ReadReq>,
    ) -> Result<flashtier_io::Ticket, flashtier_io::IoError> {
        self.0.read_async(reqs)
    }
    fn read_ahead(
        &self,
        _reqs: Vec<flashtier_io::ReadReq>,
    ) -> Result<Option<flashtier_io::Ticket>, flashtier_io::IoError> {
        Ok(None)
    }
    fn write(
        &self,
        file: &flashtier_io::StoreFile,
        offset: u64,
        src: &[u8],
    ) -> Result<(), flashtier_io::IoError> {
        self.0.write(file, offset, src)
    }
}

#[test]
fn a_prefetch_the_backend_refuses_leaves_no_record_or_slot_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    let backend = NoRoomAhead(PosixBackend::new(2).expect("posix"));
    let mut p = pool(&path, Backing::Slots, 4, Arc::new(backend));
    assert_eq!(p.prefetch(1, &[0, 1, 2]).expect("prefetch"), 0);
    assert_eq!(p.stats().resident_records, 0);
    assert_eq!(p.stats().prefetch_bytes, 0);
    p.check_invariants().expect("invariants");
    // Every slot is still free for a step that needs them all.
    step(&mut p, 1, &[0, 1, 2, 3]).expect("a step of the whole capacity");
    p.check_invariants().expect("invariants");
}

#[test]
fn demand_reads_overtake_queued_read_ahead_and_a_full_lane_refuses_the_rest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = store(dir.path());
    // One reader, 50 ms a read (a margin for a loaded CI machine): a
    // read-ahead lane of 4 behind it.
    let slow = SimBackend::new(
        FaultPlan::seeded(3).latency(1.0, Duration::from_millis(50)),
        1,
    )
    .expect("sim");
    let mut p = pool(&path, Backing::Slots, 12, Arc::new(slow));
    let started = p.prefetch(2, &[0, 1, 2, 3, 4, 5, 6, 7]).expect("prefetch");
    // The lane holds 4; the reader may have taken the first one already.
    assert!((4..=5).contains(&started), "{started} read-ahead started");
    assert_eq!(p.stats().resident_records, started);
    p.check_invariants().expect("invariants");
    step(&mut p, 0, &[3]).expect("demand step");
    // The demand read went before the queued read-ahead: most of it is
    // still queued or in flight when the step's read has landed.
    let mut in_flight = 0;
    for e in 0..started as u32 {
        let r = p.index_of(2, e).expect("k");
        // `addr` collects a landed read; a read still queued or reading
        // is `NotLanded`.
        match p.addr(r) {
            Err(ExpertsError::NotLanded { .. }) => in_flight += 1,
            Ok(_) => {}
            Err(err) => panic!("read-ahead of expert {e}: {err:?}"),
        }
    }
    assert!(
        in_flight >= 2,
        "{in_flight} of {started} read-ahead still in flight"
    );
    // And every read-ahead lands with exact bytes.
    step(&mut p, 2, &(0..started as u32).collect::<Vec<_>>()).expect("guessed step");
    p.check_invariants().expect("invariants");
}
