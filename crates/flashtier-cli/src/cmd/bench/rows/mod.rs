//! `flashtier bench rows`: row-store lookups against fio on the same file.
//!
//! Phases, interleaved with fio and repeated `--reps` times (medians):
//! 1. **cold**: batches of `--batch` uniform random ids over a table far
//!    larger than the run touches: every id a miss, one 4 KiB read each;
//! 2. **prefill**: deduplicated batches of `--prefill` Zipf ids, cache empty;
//! 3. fio 4 KiB randread, O_DIRECT, at each `--fio-iodepth` (fresh seeds).
//!
//! Each repetition also measures, right after the single-caller cold phase:
//! - fio issuing the same synchronous batches (`--batch` reads submitted
//!   together, all reaped before the next batch): the drive's own limit for
//!   a caller that waits for each whole batch;
//! - with `--lookahead N` (default 1), one caller keeping the next N
//!   batches' prefetches in flight (`RowStore::prefetch_start`) while it
//!   looks up the current one: Engram's order, so the queue never drains;
//! - with `--cold-streams N` (default 2), N callers looking up cold batches
//!   at once (this step's lookup beside the next step's prefetch on another
//!   thread).
//!
//! Then the steady state the options describe (`--batch`, `--cache`,
//! `--zipf`: lookups/s, rows/s, per-batch p50/p99/p999, hit rate) and the
//! hit path against plain copies of the same bytes, twice: 144 rows that
//! stay in the core's caches, and batches drawn from `--dram-pool` cached
//! rows, whose lines come from DRAM. With no `--store` (or a
//! missing one) a synthetic packed shard of `--rows` rows is written first.

mod load;
mod report;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use flashtier::rows::pack::write_synthetic_packed;
use flashtier::rows::{RowGeometry, RowPool, RowStore, RowStoreConfig};
use flashtier_format::row_shard::RowShardHeader;
use load::{Zipf, hit_path, hit_path_dram, timed, timed_ahead};
use report::Interleaved;

use crate::kit::bench::{check_reps, emit};
use crate::kit::fio::{self, Job, Rw};
use crate::kit::{Units, parse_bytes, progress};

/// Options of `flashtier bench rows`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Packed row shard to read (written here first when missing; a
    /// temporary one when not given).
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// Rows of the synthetic table written when the store is missing.
    #[arg(long, default_value_t = 16_000_000)]
    pub rows: u64,
    /// Ids per lookup in the cold and steady-state phases.
    #[arg(long, default_value_t = 144)]
    pub batch: usize,
    /// Cache budget in bytes (K, M, G, T: powers of 1024).
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    pub cache: u64,
    /// Cache ways (1..=16).
    #[arg(long, default_value_t = 4)]
    pub ways: usize,
    /// Zipf exponent of the steady-state and prefill ids (0 = uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Miss-pool threads, the caller included (inline backend), or the
    /// backend's queue depth (uring, posix).
    #[arg(long, default_value_t = 32)]
    pub threads: usize,
    /// How misses are read: `inline` (the shared pool's threads each pread),
    /// `uring` or `posix` (windows submitted to that backend's queue).
    #[arg(long, default_value = "inline")]
    pub backend: String,
    /// Ids in one prefill batch (deduplicated by the store).
    #[arg(long, default_value_t = 32768)]
    pub prefill: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Repetitions of the interleaved cold / prefill / fio measurements.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Callers looking up cold batches at once in the overlapped cold phase
    /// (this step's lookup beside the next step's prefetch, as Engram
    /// issues them); 0 skips the phase.
    #[arg(long, default_value_t = 2)]
    pub cold_streams: usize,
    /// Batches one caller keeps prefetching ahead of its lookups in the
    /// look-ahead cold phase (`RowStore::prefetch_start`, Engram's order:
    /// the next step's rows are known one step early); 0 skips the phase.
    #[arg(long, default_value_t = 1)]
    pub lookahead: usize,
    /// fio queue depths (comma-separated).
    #[arg(long, default_value = "32,64", value_delimiter = ',')]
    pub fio_iodepth: Vec<u32>,
    /// Skip fio.
    #[arg(long)]
    pub no_fio: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Measure only the hit paths (no drive phases, no fio).
    #[arg(long)]
    pub hit_path_only: bool,
    /// Rows cached for the DRAM hit path (batches draw from them at random).
    #[arg(long, default_value_t = 200_000)]
    pub dram_pool: usize,
}

fn write_store(path: &Path, rows: u64, quiet: bool) -> anyhow::Result<()> {
    let g = RowGeometry::ENGRAM;
    let header = RowShardHeader::new(0, 0, rows, rows, g.weight_bytes, g.scale_bytes)?;
    let bar = progress(Units::Items, rows, "rows", !quiet);
    write_synthetic_packed(path, header, 0xB0B, &mut |d| bar.set_position(d))
        .with_context(|| format!("write {}", path.display()))?;
    bar.finish_and_clear();
    Ok(())
}

struct Bench {
    path: PathBuf,
    pool: Arc<RowPool>,
    cfg: RowStoreConfig,
}

impl Bench {
    /// A fresh store (empty cache) over the shard.
    fn open(&self, cache_bytes: u64) -> anyhow::Result<RowStore> {
        let cfg = RowStoreConfig {
            cache_bytes,
            pool: Some(self.pool.clone()),
            ..self.cfg.clone()
        };
        Ok(RowStore::open_packed(&self.path, cfg)?)
    }
}

/// IOPS of fio's 4 KiB O_DIRECT random reads (libaio) at `iodepth` for
/// `seconds` on `path`, fresh offsets every run; with `batched`, all
/// `iodepth` reads are submitted at once and every one reaped before the
/// next batch (`--iodepth_batch_submit` and `--iodepth_batch_complete_min`
/// equal to the depth): the drive's own limit for a caller that waits for
/// each whole batch, drain included.
fn fio_iops(path: &Path, iodepth: u32, seconds: f64, batched: bool) -> anyhow::Result<f64> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .len();
    let mut job = Job::new("flashtier-rows", path, Rw::RandRead, 4096)
        .queue("libaio", iodepth as usize)
        .span(0, size / 4096 * 4096)
        .time_based(seconds.max(0.5));
    if batched {
        job = job
            .arg(format!("--iodepth_batch_submit={iodepth}"))
            .arg(format!("--iodepth_batch_complete_min={iodepth}"));
    }
    Ok(job.read()?.iops)
}

fn interleaved(b: &Bench, a: &Args, rows: u64) -> anyhow::Result<Interleaved> {
    let mut r = Interleaved {
        fio_iops: a.fio_iodepth.iter().map(|&q| (q, Vec::new())).collect(),
        ..Default::default()
    };
    let fio_on = !a.no_fio && fio::available();
    for rep in 0..a.reps {
        let seed = 0x5EED_0000 + rep as u64 * 7919 + std::process::id() as u64;
        if fio_on {
            if let Some((q, v)) = r.fio_iops.get_mut(0) {
                v.push(fio_iops(&b.path, *q, a.seconds, false)?);
            }
        }
        let store = b.open(a.cache)?;
        let mut uni = Zipf::new(rows, 0.0, seed ^ 1);
        let cold = timed(&store, a.seconds, || uni.batch(a.batch))?;
        r.cold_iops.push(cold.read_iops());
        r.cold_p50_us.push(cold.batch_us_p50);
        r.cold_p99_us.push(cold.batch_us_p99);
        if fio_on {
            let batch = u32::try_from(a.batch).unwrap_or(u32::MAX);
            r.fio_batched_iops
                .push(fio_iops(&b.path, batch, a.seconds, true)?);
        }
        if a.lookahead > 0 {
            let store = b.open(a.cache)?;
            let mut ids = Zipf::new(rows, 0.0, seed ^ 3);
            let ahead = timed_ahead(&store, a.seconds, a.lookahead, || ids.batch(a.batch))?;
            r.ahead_iops.push(ahead.read_iops());
            r.ahead_p50_us.push(ahead.batch_us_p50);
            r.ahead_p99_us.push(ahead.batch_us_p99);
        }
        if a.cold_streams > 0 {
            let store = b.open(a.cache)?;
            r.overlapped_iops.push(overlapped(&store, a, rows, seed)?);
        }
        if fio_on {
            for (q, v) in r.fio_iops.iter_mut().skip(1) {
                v.push(fio_iops(&b.path, *q, a.seconds, false)?);
            }
        }
        let store = b.open(a.cache)?;
        let mut z = Zipf::new(rows, a.zipf, seed ^ 2);
        let pre = timed(&store, a.seconds, || z.batch(a.prefill))?;
        r.prefill_iops.push(pre.read_iops());
        r.prefill_unique_rows
            .push(pre.misses as f64 / pre.batches.max(1) as f64);
        r.prefill_batch_ms.push(pre.batch_us_p50 / 1e3);
        if !a.json {
            eprintln!(
                "rep {rep}: cold {:.0} IOPS, look-ahead {:.0} IOPS, prefill {:.0} IOPS, fio batched {:.0}{}",
                cold.read_iops(),
                r.ahead_iops.last().copied().unwrap_or(0.0),
                pre.read_iops(),
                r.fio_batched_iops.last().copied().unwrap_or(0.0),
                r.fio_iops
                    .iter()
                    .filter_map(|(q, v)| v.last().map(|x| format!(", fio QD{q} {x:.0}")))
                    .collect::<String>()
            );
        }
    }
    Ok(r)
}

/// Read IOPS of `--cold-streams` callers each looking up cold uniform
/// batches of `--batch` ids on `store` for `--seconds`.
fn overlapped(store: &RowStore, a: &Args, rows: u64, seed: u64) -> anyhow::Result<f64> {
    let before = store.stats().reads;
    let t0 = std::time::Instant::now();
    std::thread::scope(|sc| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..a.cold_streams)
            .map(|k| {
                let mut ids = Zipf::new(rows, 0.0, seed ^ (0x100 + k as u64));
                sc.spawn(move || timed(store, a.seconds, || ids.batch(a.batch)).map(|_| ()))
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("an overlapped cold stream panicked"))??;
        }
        Ok(())
    })?;
    let secs = t0.elapsed().as_secs_f64();
    Ok((store.stats().reads - before) as f64 / secs)
}

/// Run `flashtier bench rows`.
pub fn run(a: Args) -> anyhow::Result<()> {
    check_reps(a.reps)?;
    anyhow::ensure!(
        a.batch > 0 && a.prefill > 0,
        "--batch and --prefill must be positive"
    );
    let tmp = tempfile::Builder::new()
        .prefix("flashtier-bench-rows")
        .tempdir_in(".")?;
    let path = a
        .store
        .clone()
        .unwrap_or_else(|| tmp.path().join("bench.rows"));
    if !path.exists() {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        write_store(&path, a.rows, a.json)?;
    }
    let backend: Option<Arc<dyn flashtier_io::StorageBackend>> = match a.backend.as_str() {
        "inline" => None,
        other => Some(Arc::from(flashtier_io::open_backend(
            other.parse()?,
            a.threads,
        )?)),
    };
    let b = Bench {
        path,
        pool: RowPool::new(a.threads)?,
        cfg: RowStoreConfig {
            ways: a.ways,
            backend,
            ..Default::default()
        },
    };
    let probe = b.open(0)?;
    let rows = probe.rows();
    let direct = probe.stats().direct;
    if !direct {
        eprintln!(
            "warning: {} is read through the page cache (no O_DIRECT): cold numbers are not drive numbers",
            b.path.display()
        );
    }
    drop(probe);
    if a.hit_path_only {
        let h = hit_path(&b.open(a.cache.max(64 << 20))?, a.batch, 43)?;
        let dram = hit_path_dram(&b.open(a.cache.max(64 << 20))?, a.batch, a.dram_pool, 44)?;
        let v = serde_json::json!({ "hit_path": h, "hit_path_dram": dram });
        return emit(&v, a.json, |_| report::print_hit_paths(&h, &dram));
    }
    let inter = interleaved(&b, &a, rows)?;
    let store = b.open(a.cache)?;
    let mut z = Zipf::new(rows, a.zipf, 42);
    timed(&store, a.seconds, || z.batch(a.batch))?; // warm-up
    let steady = timed(&store, a.seconds, || z.batch(a.batch))?;
    let hits = hit_path(&b.open(a.cache.max(64 << 20))?, a.batch, 43)?;
    let dram = hit_path_dram(&b.open(a.cache.max(64 << 20))?, a.batch, a.dram_pool, 44)?;
    let r = report::build(&a, (rows, direct), inter, &steady, (hits, dram));
    emit(&r, a.json, report::print)
}
