//! `flashtier bench experts`: expert-pool miss streaming (slots backing,
//! every record a miss, read once) against fio reading the same number of
//! fresh records of the same size at the same queue depth, interleaved and
//! repeated; medians and the ratio.
//!
//! Each repetition writes two fresh files of the same size (O_DIRECT, so not
//! in the page cache): an expert store for the pool and a plain file for fio.
//! fio reads every block of its file once in random order (random map on,
//! `io_size` = file); the pool reads every record of its store once in
//! random order, `qd` records per step (acquire, plan, run, finish), with
//! each record's checksum verified. Both files are deleted afterwards.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use flashtier::experts::testing::write_random_store;
use flashtier::experts::{Backing, ExpertPool, PolicyKind, PoolConfig, StoreSet};
use flashtier_io::{BackendKind, open_backend};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::Serialize;

use crate::kit::bench::{check_reps, emit, interleaved, ratio};
use crate::kit::fio::{Job, Rw};
use crate::kit::{Units, median_of, parse_bytes, progress};

/// Options of `flashtier bench experts`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Folder for the fresh files (on the drive to measure).
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Payload bytes per expert record (K, M, G, T: powers of 1024).
    #[arg(long, default_value = "2M", value_parser = parse_bytes)]
    pub record: u64,
    /// Records per file.
    #[arg(long, default_value_t = 256)]
    pub records: u32,
    /// Reads in flight: the pool's records per step and fio's iodepth.
    #[arg(long, default_value_t = 16)]
    pub qd: usize,
    /// I/O backend of the pool: uring (fio io_uring) | posix (fio psync with qd jobs).
    #[arg(long, default_value = "uring")]
    pub backend: BackendKind,
    /// Repetitions (interleaved, fresh files each).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Run {
    bytes_per_sec: f64,
    lat_us_p50: f64,
    lat_us_p99: f64,
    lat_us_p999: f64,
}

fn fio(file: &Path, size: u64, bs: u64, qd: usize, engine: &str) -> anyhow::Result<Run> {
    // Every block of the file once, in random order (random map on).
    let r = Job::new("flashtier-bench-experts", file, Rw::RandRead, bs)
        .queue(engine, qd)
        .span(0, size)
        .io_total(size)
        .read()?;
    Ok(Run {
        bytes_per_sec: r.bytes_per_sec,
        lat_us_p50: r.lat_us_p50,
        lat_us_p99: r.lat_us_p99,
        lat_us_p999: r.lat_us_p999,
    })
}

fn pool_run(args: &Args, store: &Path, seed: u64) -> anyhow::Result<Run> {
    let stores = StoreSet::open(store, false)?;
    let stride = stores.full().read_bytes() as u64;
    let backend: Arc<dyn flashtier_io::StorageBackend> =
        open_backend(args.backend, args.qd)?.into();
    let config = PoolConfig {
        backing: Backing::Slots,
        budget_bytes: stride * args.qd as u64,
        policy: PolicyKind::Lru,
    };
    let mut pool = ExpertPool::new(stores, backend, config)?;
    let mut order: Vec<usize> = (0..args.records as usize).collect();
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
    let started = Instant::now();
    for step in order.chunks(args.qd) {
        let need = pool.acquire(step)?;
        let plan = pool.plan(&need)?;
        pool.run(plan)?;
        pool.finish()?;
    }
    let secs = started.elapsed().as_secs_f64();
    let s = pool.stats();
    if s.hits != 0 || s.bytes_read != stride * u64::from(args.records) {
        bail!(
            "pool bench read {} bytes with {} hits: not a pure miss stream",
            s.bytes_read,
            s.hits
        );
    }
    let q = |p| {
        pool.tracker()
            .latency_ns_quantile(flashtier::experts::ReadSource::Disk, p) as f64
            / 1e3
    };
    Ok(Run {
        bytes_per_sec: s.bytes_read as f64 / secs,
        lat_us_p50: q(0.5),
        lat_us_p99: q(0.99),
        lat_us_p999: q(0.999),
    })
}

fn write_plain(path: &Path, size: u64, seed: u64) -> anyhow::Result<()> {
    // A store file is as good as any: fio only needs fresh, real blocks.
    let records = u32::try_from(size / (1 << 20)).context("file size")?;
    write_random_store(path, 1, records, 1 << 20, seed, &mut |_| {})?;
    Ok(())
}

fn median_run(runs: &[Run]) -> Run {
    Run {
        bytes_per_sec: median_of(runs, |r| r.bytes_per_sec),
        lat_us_p50: median_of(runs, |r| r.lat_us_p50),
        lat_us_p99: median_of(runs, |r| r.lat_us_p99),
        lat_us_p999: median_of(runs, |r| r.lat_us_p999),
    }
}

/// What `flashtier bench experts` reports.
#[derive(Debug, Serialize)]
struct Report {
    record_bytes: u64,
    stride_bytes: u64,
    records: u32,
    qd: usize,
    backend: &'static str,
    fio_engine: &'static str,
    reps: usize,
    /// Medians of the pool's runs and of fio's.
    pool: Run,
    fio: Run,
    /// Median pool bytes/s over median fio bytes/s.
    ratio: f64,
    pool_runs: Vec<Run>,
    fio_runs: Vec<Run>,
}

/// Run `flashtier bench experts`.
pub fn run(args: Args) -> anyhow::Result<()> {
    check_reps(args.reps)?;
    if args.qd == 0 || args.records as usize <= args.qd {
        bail!("need --qd >= 1 and --records > --qd");
    }
    let engine = match args.backend {
        BackendKind::Posix => "psync",
        _ => "io_uring",
    };
    let stride = args.record.div_ceil(4096) * 4096;
    let size = stride * u64::from(args.records);
    let bar = progress(Units::Steps, args.reps as u64, "", !args.json);
    let store = |rep: usize| {
        args.dir
            .join(format!("flashtier-bench-experts-{rep}.ftstore"))
    };
    let plain = |rep: usize| args.dir.join(format!("flashtier-bench-experts-{rep}.fio"));
    let seed = rand::random::<u64>();
    let (ours, theirs) = interleaved(
        args.reps,
        |rep| {
            bar.set_message(format!("rep {} pool", rep + 1));
            write_random_store(
                &store(rep),
                1,
                args.records,
                args.record,
                seed ^ rep as u64,
                &mut |_| {},
            )?;
            let run = pool_run(&args, &store(rep), seed ^ rep as u64);
            let _ = std::fs::remove_file(store(rep));
            run
        },
        |rep| {
            bar.set_message(format!("rep {} fio", rep + 1));
            write_plain(&plain(rep), size, seed ^ rep as u64 ^ 0x5555)?;
            let run = fio(&plain(rep), size, stride, args.qd, engine);
            let _ = std::fs::remove_file(plain(rep));
            bar.inc(1);
            run
        },
    )?;
    bar.finish_and_clear();
    let (o, f) = (median_run(&ours), median_run(&theirs));
    let report = Report {
        record_bytes: args.record,
        stride_bytes: stride,
        records: args.records,
        qd: args.qd,
        backend: args.backend.as_str(),
        fio_engine: engine,
        reps: args.reps,
        pool: o,
        fio: f,
        ratio: ratio(o.bytes_per_sec, f.bytes_per_sec),
        pool_runs: ours,
        fio_runs: theirs,
    };
    emit(&report, args.json, print_report)
}

fn print_report(r: &Report) {
    let line = |who: &str, run: &Run| {
        println!(
            "{who:<6} {:>9.1} MiB/s  lat p50 {:>8.0} us  p99 {:>8.0} us  p999 {:>8.0} us",
            run.bytes_per_sec / f64::from(1 << 20),
            run.lat_us_p50,
            run.lat_us_p99,
            run.lat_us_p999
        );
    };
    println!(
        "expert miss streaming: {} records of {} bytes, qd {}, median of {} reps",
        r.records, r.record_bytes, r.qd, r.reps
    );
    line("pool", &r.pool);
    line("fio", &r.fio);
    println!("ratio pool / fio: {:.2}", r.ratio);
}
