//! Spill writes on the writer thread: an entry taken while its write is
//! queued or running comes back from memory byte for byte, a failed write
//! drops its entry, the write queue keeps its bound, dropping the cache
//! with writes queued joins the thread and removes the store, and random
//! puts and takes always give back what was put.
//!
//! A write in flight is made by a [`Gate`]: its block writes wait until the
//! test opens it, so the writer thread is inside a write (or has not
//! started a job) by construction, not by timing.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use flashtier_io::{IoError, ReadReq, StorageBackend, StoreFile, Ticket};
use proptest::prelude::*;

use super::*;

/// A simulated backend whose writes wait at a gate; reads pass.
struct Gate {
    inner: SimBackend,
    /// Whether it is open, and how many writes wait at it.
    state: Mutex<(bool, usize)>,
    moved: Condvar,
}

impl Gate {
    fn shut(seed: u64) -> Arc<Self> {
        Arc::new(Self {
            inner: SimBackend::new(FaultPlan::seeded(seed), 2).unwrap(),
            state: Mutex::new((false, 0)),
            moved: Condvar::new(),
        })
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = true;
        self.moved.notify_all();
    }

    /// Block until a write waits at the gate (the 30 s limit only turns a
    /// hang into a failure).
    fn wait_parked(&self) {
        let t0 = Instant::now();
        let mut st = self.state.lock().unwrap();
        while st.1 == 0 {
            assert!(t0.elapsed() < Duration::from_secs(30), "no write came");
            st = self
                .moved
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }
}

impl StorageBackend for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    fn read_async(&self, reqs: Vec<ReadReq>) -> Result<Ticket, IoError> {
        self.inner.read_async(reqs)
    }

    fn write(&self, file: &StoreFile, offset: u64, src: &[u8]) -> Result<(), IoError> {
        let mut st = self.state.lock().unwrap();
        st.1 += 1;
        self.moved.notify_all();
        while !st.0 {
            st = self.moved.wait(st).unwrap();
        }
        st.1 -= 1;
        drop(st);
        self.inner.write(file, offset, src)
    }
}

/// A cache of memory budget 10 (every test cache goes straight to the
/// writer) spilling through `gate`: 256 positions, 16 block numbers.
fn gated(dir: &std::path::Path, gate: &Arc<Gate>, write_queue: usize) -> PrefixCache {
    let mut cfg = SpillConfig::new(dir, 256);
    cfg.backend = Some(gate.clone());
    cfg.write_queue = write_queue;
    PrefixCache::with_spill(10, Some(PrefixSpill::new(cfg).unwrap()))
}

fn cut(n: usize, seed: u32, to: usize) -> SeqKv {
    let mut kv = cache(n, seed);
    kv.truncate(to).unwrap();
    kv
}

#[test]
fn an_entry_taken_while_its_write_is_in_flight_comes_back_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Gate::shut(31);
    let mut p = gated(dir.path(), &gate, 4);
    // Seed 1 (3 block numbers) is being written: the writer waits inside
    // its first block number's write. Seed 2 (3) is queued behind it.
    p.put(tokens(37, 1), cache(37, 1));
    gate.wait_parked();
    p.put(tokens(40, 2), cache(40, 2));
    let spill = p.spill().unwrap();
    assert_eq!(
        (p.spilled(), spill.writing(), spill.free_blocks()),
        (77, 2, 10)
    );

    // The running write's entry: a copy from memory, never the drive.
    let r = p
        .take_now(&prompt_over(37, 1), CAPACITY, empty)
        .unwrap()
        .unwrap();
    assert!(!r.restored);
    assert_eq!((r.cached, r.kv.len()), (37, 37));
    assert_eq!(bytes(&r.kv), bytes(&cache(37, 1)));
    // Its block numbers stay held until the thread is done with them.
    assert_eq!(p.spill().unwrap().free_blocks(), 10);

    // The queued write's entry: its own cache, cut back to 21; its block
    // numbers are free at once.
    let mut shared = tokens(21, 2);
    shared.push(7);
    let r2 = p.take_now(&shared, CAPACITY, empty).unwrap().unwrap();
    assert!(!r2.restored);
    assert_eq!((r2.cached, r2.kv.len()), (21, 21));
    assert_eq!(bytes(&r2.kv), bytes(&cut(40, 2, 21)));
    assert_eq!(p.spill().unwrap().free_blocks(), 13);
    assert_eq!((p.len(), p.spilled()), (0, 0));

    gate.open();
    p.flush();
    let spill = p.spill().unwrap();
    let s = spill.stats();
    assert_eq!((s.spilled, s.spill_failures, s.taken_writing), (0, 0, 2));
    assert_eq!((spill.writing(), spill.free_blocks()), (0, 16));
    // The running write stopped after the block number it was in: 3
    // layers of one block number.
    assert_eq!(s.bytes_written, 3 * 16384);

    // The freed block numbers take the next spill, which comes back from
    // the drive.
    p.put(tokens(37, 1), r.kv);
    p.flush();
    let back = p
        .take_now(&prompt_over(37, 1), CAPACITY, empty)
        .unwrap()
        .unwrap();
    assert!(back.restored);
    assert_eq!(bytes(&back.kv), bytes(&cache(37, 1)));
}

#[test]
fn writes_past_the_queue_bound_are_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Gate::shut(32);
    let mut p = gated(dir.path(), &gate, 2);
    // Five caches of 2 block numbers each leave memory while no write can
    // finish: two are writing, three find the queue full.
    for seed in 1..=5 {
        p.put(tokens(20, seed), cache(20, seed));
    }
    let spill = p.spill().unwrap();
    assert_eq!(spill.stats().queue_full, 3);
    assert_eq!((spill.writing(), spill.free_blocks()), (2, 12));
    assert_eq!((p.len(), p.spilled()), (2, 40));

    gate.open();
    p.flush();
    let s = p.spill().unwrap().stats();
    assert_eq!((s.spilled, s.queue_full, s.dropped), (2, 3, 0));
    assert_eq!(p.spill().unwrap().writing(), 0);
    for seed in 1..=2 {
        let r = p
            .take_now(&prompt_over(20, seed), CAPACITY, empty)
            .unwrap()
            .unwrap();
        assert!(r.restored);
        assert_eq!(bytes(&r.kv), bytes(&cache(20, seed)));
    }
    for seed in 3..=5 {
        let r = p.take_now(&prompt_over(20, seed), CAPACITY, empty).unwrap();
        assert!(r.is_none(), "seed {seed} was dropped");
    }
}

#[test]
fn a_failed_write_drops_the_entry_and_the_prompt_is_computed_whole() {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::seeded(33).fail_from_nth(OpKind::Write, 1, Fault::Eio);
    let mut p = PrefixCache::with_spill(10, Some(spill_in(dir.path(), 256, Some(plan))));
    p.put(tokens(37, 1), cache(37, 1));
    p.put(tokens(20, 2), cache(20, 2));
    p.flush();
    let spill = p.spill().unwrap();
    let s = spill.stats();
    assert_eq!((s.spilled, s.spill_failures), (0, 2));
    assert_eq!((spill.writing(), spill.free_blocks()), (0, 16));
    assert_eq!((p.len(), p.spilled()), (0, 0));
    for (n, seed) in [(37, 1), (20, 2)] {
        let r = p.take_now(&prompt_over(n, seed), CAPACITY, empty).unwrap();
        assert!(r.is_none(), "nothing kept of seed {seed}");
    }
}

#[test]
fn dropping_the_cache_with_writes_queued_joins_the_writer_and_removes_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Gate::shut(34);
    let mut p = gated(dir.path(), &gate, 4);
    for seed in 1..=4 {
        p.put(tokens(20, seed), cache(20, seed));
    }
    gate.wait_parked();
    let path = p.spill().unwrap().path().to_path_buf();
    assert!(path.exists(), "made before the first write");
    assert_eq!(p.spill().unwrap().writing(), 4);
    // The drop stops the writer, which leaves the write it waits in only
    // when the gate opens: opening it a little later makes the drop meet
    // queued writes. Whenever it opens, what is checked below holds.
    let opener = {
        let g = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            g.open();
        })
    };
    drop(p);
    opener.join().unwrap();
    assert!(!path.exists(), "the store goes with the cache");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // The thread and the store are gone: nothing else holds the backend.
    assert_eq!(Arc::strong_count(&gate), 1);
}

#[derive(Clone, Debug)]
enum Op {
    Put(u32, usize),
    Take(u32, usize),
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u32..6, 1usize..70).prop_map(|(s, n)| Op::Put(s, n)),
        4 => (1u32..6, 1usize..70).prop_map(|(s, n)| Op::Take(s, n)),
        1 => Just(Op::Flush),
    ]
}

/// After a flush every entry is in memory or on the drive, and every block
/// number is free or one drive entry's.
fn settled_books(p: &PrefixCache) -> Result<(), TestCaseError> {
    let spill = p.spill().unwrap();
    prop_assert_eq!(spill.writing(), 0);
    let (mut held, mut spilled, mut blocks) = (0, 0, 0);
    for e in &p.entries {
        match &e.kept {
            Kept::Memory(_) => held += e.tokens.len(),
            Kept::Drive(_) => {
                spilled += e.tokens.len();
                blocks += blocks_for(e.tokens.len());
            }
            Kept::Writing(_) => prop_assert!(false, "writing after a flush"),
        }
    }
    prop_assert_eq!((p.held(), p.spilled()), (held, spilled));
    prop_assert_eq!(spill.free_blocks() + blocks, spill.blocks());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the writer thread's pace, a taken cache holds exactly the
    /// positions its prompt shares with what was put (an entry of seed `s`
    /// cut back to `n` holds what `cache(n, s)` holds).
    #[test]
    fn random_puts_and_takes_give_back_what_was_put(
        ops in proptest::collection::vec(op(), 1..40),
        memory in 1usize..80,
        write_queue in 1usize..4,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = SpillConfig::new(dir.path(), 128);
        cfg.write_queue = write_queue;
        let mut p = PrefixCache::with_spill(memory, Some(PrefixSpill::new(cfg).unwrap()));
        for op in ops {
            match op {
                Op::Put(seed, n) => p.put(tokens(n, seed), cache(n, seed)),
                Op::Take(seed, n) => {
                    if let Some(r) = p.take_now(&prompt_over(n, seed), CAPACITY, empty).unwrap() {
                        prop_assert!(r.cached > 0 && r.cached <= n);
                        prop_assert_eq!(r.kv.len(), r.cached);
                        prop_assert!(bytes(&r.kv) == bytes(&cache(r.cached, seed)));
                    }
                }
                Op::Flush => {
                    p.flush();
                    settled_books(&p)?;
                }
            }
            prop_assert!(p.held() <= memory);
            prop_assert!(p.spill().unwrap().writing() <= write_queue);
        }
        p.flush();
        settled_books(&p)?;
    }
}
