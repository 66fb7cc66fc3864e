//! The fault matrix: many seeded runs of the expert pool (both backings) over
//! small stores, each run drawing one fault: EIO on reads, short reads, ENOSPC
//! or a torn write of a writer (a fresh store written through the simulator,
//! or the store rewritten in place under the running pool), or the store
//! changed under the pool by direct file manipulation (bytes scribbled in
//! place, truncated, replaced by rename). After every step every byte served
//! must equal the record as written, or the access must have returned a typed
//! error naming the store file: 0 wrong bytes, and 0 signals (a SIGBUS would
//! kill this test process). The tallies prove the faults happened.
//!
//! Replay one run: `FLASHTIER_SIM_SEED=N cargo test -p flashtier --test
//! fault_matrix -- --nocapture` (the seed is printed when a run fails; the
//! simulator takes the same seed from that variable).

use crate::store_faults;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use flashtier::experts::{Backing, ExpertPool, ExpertsError};
use flashtier_io::sim::{Fault as SimFault, OpKind, SEED_ENV};
use flashtier_io::{FaultPlan, IoError, SimBackend};
use rand::rngs::SmallRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use store_faults::{
    EXPERTS, LAYERS, PAYLOAD, RECORDS, file_len, make_cold, open_pool, record, record_offset,
    replace_by_rename, scribble, truncate, write_store, write_through,
};

const RUNS: u64 = 1200;
const BASE_SEED: u64 = 0xFA_0000;
const STEPS: usize = 10;
/// Writes of one store through the simulator: 16 records, tail, header.
const STORE_WRITES: u64 = RECORDS as u64 + 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    None,
    ReadEio,
    ShortRead,
    WriteEnospc,
    WriteTorn,
    Scribble,
    Truncate,
    Rename,
}

const FAULTS: [Fault; 8] = [
    Fault::None,
    Fault::ReadEio,
    Fault::ShortRead,
    Fault::WriteEnospc,
    Fault::WriteTorn,
    Fault::Scribble,
    Fault::Truncate,
    Fault::Rename,
];

/// What one run saw.
#[derive(Default)]
struct Tally {
    runs: u64,
    runs_with_error: u64,
    steps: u64,
    error_steps: u64,
    served_records: u64,
    writer_failed: u64,
    open_failed: u64,
    short_reads: u64,
    errors: BTreeMap<&'static str, u64>,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.runs += o.runs;
        self.runs_with_error += o.runs_with_error;
        self.steps += o.steps;
        self.error_steps += o.error_steps;
        self.served_records += o.served_records;
        self.writer_failed += o.writer_failed;
        self.open_failed += o.open_failed;
        self.short_reads += o.short_reads;
        for (k, v) in &o.errors {
            *self.errors.entry(k).or_default() += v;
        }
    }

    fn error(&self, kind: &str) -> u64 {
        self.errors.get(kind).copied().unwrap_or(0)
    }
}

/// The kind of a typed error, or why it is not acceptable.
fn classify(err: &ExpertsError, file: &str, step_failed: bool) -> Result<&'static str, String> {
    let kind = match err {
        ExpertsError::Read { source, .. } | ExpertsError::Io(source) => match source {
            IoError::Read { .. } => "eio",
            IoError::ShortRead { .. } => "short-read",
            IoError::Truncated { .. } => "truncated",
            IoError::Write { .. } => "write",
            _ => "io-other",
        },
        ExpertsError::Checksum { .. } => "checksum",
        ExpertsError::Format(_) => "format",
        // A record of a failed step may be absent or still in flight.
        ExpertsError::NotResident { .. } | ExpertsError::NotLanded { .. } if step_failed => {
            return Ok("after-failed-step");
        }
        other => return Err(format!("unexpected error: {other}")),
    };
    if !err.to_string().contains(file) {
        return Err(format!("error does not name the store file: {err}"));
    }
    Ok(kind)
}

fn plan_for(fault: Fault, seed: u64, rng: &mut SmallRng) -> FaultPlan {
    let plan = FaultPlan::seeded(seed);
    match fault {
        Fault::ReadEio => plan.read_eio(rng.random_range(0.05..0.5)),
        Fault::ShortRead => plan.short_reads(1.0),
        // Some countdowns go past the last write: those runs must be clean.
        Fault::WriteEnospc => plan.fail_nth(
            OpKind::Write,
            rng.random_range(1..=STORE_WRITES + 4),
            SimFault::Enospc,
        ),
        Fault::WriteTorn => plan.fail_nth(
            OpKind::Write,
            rng.random_range(1..=STORE_WRITES + 4),
            SimFault::Torn,
        ),
        _ => plan,
    }
}

/// One seeded run.
struct Run {
    rng: SmallRng,
    fault: Fault,
    backing: Backing,
    sim: Arc<SimBackend>,
    path: std::path::PathBuf,
    file: String,
    tally: Tally,
}

impl Run {
    fn new(seed: u64, dir: &Path) -> Result<Self, String> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let fault = FAULTS[rng.random_range(0..FAULTS.len())];
        let backing = if rng.random_bool(0.5) {
            Backing::Mapped
        } else {
            Backing::Slots
        };
        let plan = plan_for(fault, seed, &mut rng);
        let sim = Arc::new(SimBackend::new(plan, 2).map_err(|e| e.to_string())?);
        let file = format!("run-{seed}.ftstore");
        Ok(Self {
            rng,
            fault,
            backing,
            sim,
            path: dir.join(&file),
            file,
            tally: Tally {
                runs: 1,
                ..Tally::default()
            },
        })
    }

    fn note(&mut self, err: &ExpertsError, step_failed: bool) -> Result<(), String> {
        let kind = classify(err, &self.file, step_failed)?;
        *self.tally.errors.entry(kind).or_default() += 1;
        Ok(())
    }

    /// Write the store; `None` when the run ends there (a failed fresh write
    /// must leave a store that does not open).
    fn open(&mut self) -> Result<Option<ExpertPool>, String> {
        let writer = matches!(self.fault, Fault::WriteEnospc | Fault::WriteTorn);
        let fresh = writer && self.rng.random_bool(0.5);
        let mut write_failed = false;
        if fresh {
            if let Err(e) = write_through(self.sim.as_ref(), &self.path, 1) {
                self.note_write(&e)?;
                write_failed = true;
            }
        } else {
            write_store(&self.path, 1);
        }
        let capacity = self.rng.random_range(3..=6);
        match open_pool(&self.path, self.backing, capacity, self.sim.clone()) {
            Ok(_) if write_failed => Err("a store whose write failed opened".into()),
            Ok(pool) => Ok(Some(pool)),
            Err(e) if write_failed => {
                self.tally.open_failed += 1;
                self.note(&e, false)?;
                Ok(None)
            }
            Err(e) => Err(format!("a complete store failed to open: {e}")),
        }
    }

    fn note_write(&mut self, e: &IoError) -> Result<(), String> {
        if !matches!(e, IoError::Write { .. }) || !e.to_string().contains(&self.file) {
            return Err(format!("writer error is not a typed write error: {e}"));
        }
        self.tally.writer_failed += 1;
        Ok(())
    }

    /// Change the store under the pool (the fault's moment).
    fn change(&mut self, pool: &ExpertPool) -> Result<(), String> {
        match self.fault {
            Fault::Scribble => {
                let ready: Vec<usize> = (0..RECORDS).filter(|&r| pool.is_ready(r)).collect();
                let r = if !ready.is_empty() && self.rng.random_bool(0.7) {
                    ready[self.rng.random_range(0..ready.len())]
                } else {
                    self.rng.random_range(0..RECORDS)
                };
                let len = self.rng.random_range(1..=64);
                let at = self.rng.random_range(0..PAYLOAD - len) as u64;
                scribble(&self.path, record_offset(r) + at, len);
            }
            Fault::Truncate => truncate(&self.path, self.rng.random_range(0..file_len())),
            Fault::Rename => replace_by_rename(&self.path, 2),
            Fault::WriteEnospc | Fault::WriteTorn => {
                if let Err(e) = write_through(self.sim.as_ref(), &self.path, 2) {
                    self.note_write(&e)?;
                }
            }
            Fault::None | Fault::ReadEio | Fault::ShortRead => {}
        }
        Ok(())
    }

    /// One step over random experts of a random layer, blocking or tracked,
    /// sometimes with a prefetch.
    fn step(&mut self, pool: &mut ExpertPool) -> Result<Vec<usize>, ExpertsError> {
        let layer = self.rng.random_range(0..LAYERS);
        let k = self.rng.random_range(1..=3);
        let recs: Vec<usize> = sample(&mut self.rng, EXPERTS as usize, k)
            .iter()
            .map(|e| pool.index_of(layer, e as u32))
            .collect::<Result<_, _>>()?;
        let tracked = self.rng.random_bool(0.5);
        let prefetch = self.rng.random_bool(0.3).then(|| (layer + 1) % LAYERS);
        let need = pool.acquire(&recs)?;
        let run = run_step(pool, &recs, &need, tracked, prefetch);
        let fin = pool.finish();
        run.and(fin).map(|()| recs)
    }

    /// Every record the pool serves now is exact, or a typed error; after a
    /// clean step its records are served.
    fn check_served(
        &mut self,
        pool: &mut ExpertPool,
        clean: Option<&[usize]>,
    ) -> Result<(), String> {
        for r in 0..RECORDS {
            let in_step = clean.is_some_and(|recs| recs.contains(&r));
            if !in_step && !pool.is_ready(r) {
                continue;
            }
            match pool.bytes(r) {
                Ok(bytes) => {
                    let truth = record(1, r);
                    let wrong = bytes.iter().zip(&truth).filter(|(a, b)| a != b).count();
                    if wrong > 0 || bytes.len() != truth.len() {
                        return Err(format!("record {r}: {wrong} wrong bytes served"));
                    }
                    self.tally.served_records += 1;
                }
                Err(e) if in_step => {
                    return Err(format!("record {r} of a clean step is not served: {e}"));
                }
                Err(e) => self.note(&e, false)?,
            }
        }
        pool.check_invariants()
    }

    fn go(mut self) -> Result<Tally, String> {
        let Some(mut pool) = self.open()? else {
            return Ok(self.tally);
        };
        let cold =
            matches!(self.fault, Fault::ReadEio | Fault::ShortRead) || self.rng.random_bool(0.5);
        if self.backing == Backing::Mapped && cold {
            make_cold(&self.path, &pool);
        }
        let change_at = self.rng.random_range(1..STEPS);
        for s in 0..STEPS {
            if s == change_at {
                self.change(&pool)?;
            }
            self.tally.steps += 1;
            let clean = match self.step(&mut pool) {
                Ok(recs) => Some(recs),
                Err(e) => {
                    self.tally.error_steps += 1;
                    self.note(&e, true)?;
                    None
                }
            };
            self.check_served(&mut pool, clean.as_deref())
                .map_err(|e| format!("step {s}: {e}"))?;
        }
        self.tally.short_reads = self.sim.stats().short_reads;
        if self.tally.error_steps > 0 {
            self.tally.runs_with_error = 1;
        }
        Ok(self.tally)
    }
}

fn run_step(
    pool: &mut ExpertPool,
    recs: &[usize],
    need: &[usize],
    tracked: bool,
    prefetch: Option<u32>,
) -> Result<(), ExpertsError> {
    if let Some(layer) = prefetch {
        pool.prefetch(layer, &[0, 3, 6])?;
    }
    let plan = pool.plan(need)?;
    if tracked {
        pool.run_tracked(plan)?;
        for &r in recs {
            pool.wait_ready(r)?;
        }
        Ok(())
    } else {
        pool.run(plan)
    }
}

/// Tallies by fault and backing.
type Tallies = BTreeMap<(Fault, &'static str), Tally>;

fn backing_name(b: Backing) -> &'static str {
    match b {
        Backing::Mapped => "mapped",
        _ => "slots",
    }
}

fn check_tallies(by: &Tallies, total: &Tally) {
    let mut by_fault: BTreeMap<Fault, Tally> = BTreeMap::new();
    for ((f, _), t) in by {
        by_fault.entry(*f).or_default().add(t);
    }
    let get = |f: Fault| by_fault.get(&f).expect("every fault drawn");
    assert!(total.runs >= 1000, "{} runs", total.runs);
    for (key, t) in by {
        assert!(t.runs >= 30, "{key:?}: only {} runs", t.runs);
    }
    assert_eq!(by.len(), 2 * FAULTS.len(), "every fault on both backings");
    // The store changed under a mapped pool: refused by checksum, and a
    // truncation is a typed error (the test process is alive: no SIGBUS).
    let mapped = |f: Fault| by.get(&(f, "mapped")).expect("drawn");
    assert!(mapped(Fault::Scribble).error("checksum") > 0);
    assert!(mapped(Fault::Truncate).error("truncated") > 0);
    assert!(mapped(Fault::WriteTorn).error("checksum") > 0);
    for f in [Fault::None, Fault::ShortRead, Fault::Rename] {
        assert_eq!(get(f).runs_with_error, 0, "{f:?} runs serve exact bytes");
    }
    assert!(
        get(Fault::ShortRead).short_reads > 0,
        "short reads injected"
    );
    let eio = get(Fault::ReadEio);
    assert!(eio.runs_with_error * 2 >= eio.runs && eio.error("eio") > 0);
    for f in [Fault::WriteEnospc, Fault::WriteTorn] {
        let w = get(f);
        assert!(w.writer_failed * 2 >= w.runs, "{f:?}: writers failed");
        assert!(w.open_failed > 0 && w.error("checksum") > 0, "{f:?}");
    }
    let s = get(Fault::Scribble);
    assert!(s.runs_with_error * 5 >= s.runs && s.error("checksum") > 0);
    let t = get(Fault::Truncate);
    assert!(t.runs_with_error * 2 >= t.runs);
    assert!(t.error("truncated") > 0 && t.error("short-read") > 0);
}

fn print_tallies(by: &Tallies, total: &Tally, secs: f64) {
    eprintln!(
        "fault matrix: {} runs, {} steps, {} error steps, {} records served exactly, 0 wrong bytes, {secs:.1} s",
        total.runs, total.steps, total.error_steps, total.served_records
    );
    for ((f, b), t) in by {
        eprintln!(
            "  {f:?} {b}: runs {} (with errors {}), steps {} (errors {}), served {}, writer failed {}, open failed {}, short reads {}, errors {:?}",
            t.runs,
            t.runs_with_error,
            t.steps,
            t.error_steps,
            t.served_records,
            t.writer_failed,
            t.open_failed,
            t.short_reads,
            t.errors
        );
    }
}

#[test]
fn every_byte_served_is_exact_or_a_typed_error() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let replay = flashtier_io::settings::Env::process()
        .sim_seed()
        .unwrap_or_else(|e| panic!("{e}"));
    let seeds: Vec<u64> = match replay {
        Some(s) => vec![s],
        None => (BASE_SEED..BASE_SEED + RUNS).collect(),
    };
    let mut by: Tallies = BTreeMap::new();
    let mut total = Tally::default();
    for seed in seeds {
        let run = Run::new(seed, dir.path()).unwrap_or_else(|e| panic!("seed={seed}: {e}"));
        let (fault, backing, path) = (run.fault, run.backing, run.path.clone());
        match run.go() {
            Ok(t) => {
                total.add(&t);
                by.entry((fault, backing_name(backing)))
                    .or_default()
                    .add(&t);
            }
            Err(e) => panic!(
                "fault matrix run seed={seed} ({fault:?}, {backing:?}) failed: {e}; replay with {SEED_ENV}={seed} cargo test -p flashtier --test suite fault_matrix:: -- --nocapture"
            ),
        }
        let _ = std::fs::remove_file(path);
    }
    print_tallies(&by, &total, started.elapsed().as_secs_f64());
    if replay.is_none() {
        check_tallies(&by, &total);
    }
}
