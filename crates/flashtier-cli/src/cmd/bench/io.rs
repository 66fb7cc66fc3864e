//! `flashtier bench io`: raw backend reads (IOPS, bytes/s, latency
//! p50/p99/p999) on a direct-I/O file, optionally side by side with fio on
//! the same file, same pattern, in the same run.
//!
//! The host may cache the disk: every repetition draws fresh random offsets
//! (and a fresh sequential start), fio draws its own (`--randrepeat=0`), and
//! with `--fio` the two alternate, repetition by repetition, so both see the
//! same cache and the same neighbours; medians are reported.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use flashtier_io::loadgen::{LoadReport, LoadSpec, Pattern, run_load};
use flashtier_io::{AlignedBuf, BackendKind, DirectMode, StoreFile, open_backend};
use serde::Serialize;

use crate::kit::bench::{check_reps, emit, ours_first, ratio};
use crate::kit::fio::{Job, Rw};
use crate::kit::{Units, median, median_of, parse_bytes, progress};

/// Options of `flashtier bench io`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// File to read; created with real (non-sparse) data when missing.
    #[arg(long)]
    pub file: PathBuf,
    /// Bytes of the file to range over (and to create): 4G, 512M, 64K...
    /// (K, M, G, T: powers of 1024).
    #[arg(long, default_value = "4G", value_parser = parse_bytes)]
    pub size: u64,
    /// Bytes per read: 4K, 64K, 1M... (K, M, G, T: powers of 1024).
    #[arg(long, default_value = "4K", value_parser = parse_bytes)]
    pub bs: u64,
    /// Reads kept in flight (1..=256).
    #[arg(long, default_value_t = 32)]
    pub qd: usize,
    /// Backend: uring | uring-local | posix | sim.
    #[arg(long, default_value = "uring")]
    pub backend: String,
    /// Offset pattern: rand | seq.
    #[arg(long, default_value = "rand")]
    pub pattern: String,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Reads queued in the backend beyond --qd so freed slots refill at once
    /// (0..=256; default max(qd, 8)). The device never sees more than --qd.
    #[arg(long)]
    pub backlog: Option<usize>,
    /// Repetitions (medians are reported).
    #[arg(long, default_value_t = 1)]
    pub reps: usize,
    /// Also run fio with the same pattern on the same file, interleaved.
    #[arg(long)]
    pub fio: bool,
    /// fio's engine for --fio: io_uring | libaio | psync (psync runs `qd` jobs).
    #[arg(long, default_value = "io_uring")]
    pub fio_engine: String,
    /// O_DIRECT policy: prefer | require | off.
    #[arg(long, default_value = "prefer")]
    pub direct: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One measurement, of flashtier or fio.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Measure {
    /// Reads per second.
    pub iops: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Median latency, microseconds.
    pub lat_us_p50: f64,
    /// 99th percentile latency, microseconds.
    pub lat_us_p99: f64,
    /// 99.9th percentile latency, microseconds.
    pub lat_us_p999: f64,
    /// 99th percentile turnaround (queueing in the backend included),
    /// microseconds; flashtier only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turnaround_us_p99: Option<f64>,
}

impl From<&LoadReport> for Measure {
    fn from(r: &LoadReport) -> Self {
        Self {
            iops: r.iops(),
            bytes_per_sec: r.bytes_per_sec(),
            lat_us_p50: r.latency_us(0.50),
            lat_us_p99: r.latency_us(0.99),
            lat_us_p999: r.latency_us(0.999),
            turnaround_us_p99: Some(r.turnaround_ns.value_at_quantile(0.99) as f64 / 1000.0),
        }
    }
}

#[derive(Serialize)]
struct Output {
    backend: &'static str,
    file: String,
    span_bytes: u64,
    bs_bytes: u64,
    qd: usize,
    backlog: usize,
    pattern: String,
    seconds: f64,
    reps: usize,
    direct: bool,
    /// Medians of `runs` (`iops`, `bytes_per_sec`, `lat_us_p50`...).
    #[serde(flatten)]
    median: Measure,
    runs: Vec<Measure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fio: Option<FioOutput>,
}

#[derive(Serialize)]
struct FioOutput {
    engine: String,
    median: Measure,
    runs: Vec<Measure>,
    ratio_iops: f64,
    ratio_bytes_per_sec: f64,
}

/// Create (or extend) `path` to `size` bytes of pseudo-random data, written
/// directly so the file is real (not sparse) and not left in the page cache.
fn create_file(path: &Path, size: u64, mode: DirectMode, quiet: bool) -> anyhow::Result<()> {
    const CHUNK: usize = 1 << 20;
    let file = StoreFile::open_rw(path, mode, true)?;
    let have = file.len_bytes()? / CHUNK as u64 * CHUNK as u64;
    let size = size.div_ceil(CHUNK as u64) * CHUNK as u64;
    if have >= size {
        return Ok(());
    }
    let pb = progress(Units::Bytes, size - have, "writing", !quiet);
    let mut buf = AlignedBuf::zeroed(CHUNK);
    let mut state = rand::random::<u64>() | 1;
    let mut offset = have;
    while offset < size {
        for word in buf.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        file.write_all_at(&buf, offset)?;
        offset += CHUNK as u64;
        pb.inc(CHUNK as u64);
    }
    file.sync_data()?;
    pb.finish_and_clear();
    Ok(())
}

fn median_run(runs: &[Measure]) -> Measure {
    Measure {
        iops: median_of(runs, |r| r.iops),
        bytes_per_sec: median_of(runs, |r| r.bytes_per_sec),
        lat_us_p50: median_of(runs, |r| r.lat_us_p50),
        lat_us_p99: median_of(runs, |r| r.lat_us_p99),
        lat_us_p999: median_of(runs, |r| r.lat_us_p999),
        turnaround_us_p99: runs
            .iter()
            .map(|r| r.turnaround_us_p99)
            .collect::<Option<Vec<f64>>>()
            .map(|v| median(&v)),
    }
}

/// Run fio once with the same pattern over the same span; parse its JSON.
fn run_fio(args: &Args, span: u64, pattern: Pattern, seed: u64) -> anyhow::Result<Measure> {
    // A fresh sequential start, as flashtier's: fio would otherwise start
    // at offset 0 every time and read what the host cached last run.
    let start = match pattern {
        Pattern::Random => 0,
        Pattern::Sequential => seed % (span / args.bs / 2).max(1) * args.bs,
    };
    let rw = match pattern {
        Pattern::Random => Rw::RandRead,
        Pattern::Sequential => Rw::Read,
    };
    let r = Job::new("flashtier-bench-io", &args.file, rw, args.bs)
        .queue(&args.fio_engine, args.qd)
        .span(start, span - start)
        .time_based(args.seconds)
        .read()?;
    Ok(Measure {
        iops: r.iops,
        bytes_per_sec: r.bytes_per_sec,
        lat_us_p50: r.lat_us_p50,
        lat_us_p99: r.lat_us_p99,
        lat_us_p999: r.lat_us_p999,
        turnaround_us_p99: None,
    })
}

fn run_flashtier(
    args: &Args,
    kind: BackendKind,
    spec: &LoadSpec,
    rep: usize,
) -> anyhow::Result<(LoadReport, &'static str)> {
    let backend = open_backend(kind, args.qd)?;
    let ticks = (args.seconds * 10.0).ceil() as u64;
    let pb = progress(Units::Steps, ticks, "", !args.json);
    let name = backend.name();
    let report = run_load(backend.as_ref(), spec, |p| {
        let iops = p.ops as f64 / p.elapsed.as_secs_f64().max(1e-9);
        pb.set_position((p.elapsed.as_millis() / 100) as u64);
        pb.set_message(format!("{name} rep {} {:.0} IOPS", rep + 1, iops));
    })?;
    pb.finish_and_clear();
    Ok((report, name))
}

fn print_line(who: &str, m: &Measure) {
    println!(
        "{who:<14} IOPS {:>10.0}  {:>9.1} MiB/s  lat p50 {:>8.1} us  p99 {:>8.1} us  p999 {:>8.1} us",
        m.iops,
        m.bytes_per_sec / (1 << 20) as f64,
        m.lat_us_p50,
        m.lat_us_p99,
        m.lat_us_p999
    );
}

/// Run `flashtier bench io`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let kind: BackendKind = args.backend.parse()?;
    let pattern: Pattern = args.pattern.parse()?;
    let mode: DirectMode = args.direct.parse().map_err(anyhow::Error::msg)?;
    let bs = usize::try_from(args.bs).context("--bs too large")?;
    if bs == 0 || bs % 512 != 0 {
        bail!("--bs {bs} must be a positive multiple of 512");
    }
    if !args.seconds.is_finite() || args.seconds <= 0.0 {
        bail!("--seconds must be > 0");
    }
    check_reps(args.reps)?;
    if !args.file.exists() {
        create_file(&args.file, args.size, mode, args.json)?;
    }
    let file: Arc<StoreFile> = StoreFile::open_read(&args.file, mode)?;
    let span = args.size.min(file.len_bytes()?) / args.bs * args.bs;
    if span < args.size && !args.json {
        eprintln!(
            "flashtier: {} holds {span} bytes, less than --size; using {span}",
            args.file.display()
        );
    }
    let backlog = args.backlog.unwrap_or(args.qd.max(8));
    let mut runs = Vec::new();
    let mut fio_runs = Vec::new();
    let mut backend_name = kind.as_str();
    for rep in 0..args.reps {
        // Alternate who goes first so neither always inherits the other's cache.
        let fio_first = args.fio && !ours_first(rep);
        if fio_first {
            fio_runs.push(run_fio(&args, span, pattern, rand::random::<u32>().into())?);
        }
        let spec = LoadSpec {
            file: file.clone(),
            span_bytes: span,
            block_bytes: bs,
            pattern,
            duration: Duration::from_secs_f64(args.seconds),
            seed: rand::random(),
            backlog,
        };
        let (report, name) = run_flashtier(&args, kind, &spec, rep)?;
        backend_name = name;
        let m = Measure::from(&report);
        if !args.json {
            print_line(&format!("{name} rep {}", rep + 1), &m);
        }
        runs.push(m);
        if args.fio && !fio_first {
            fio_runs.push(run_fio(&args, span, pattern, rand::random::<u32>().into())?);
        }
        if let (false, Some(f)) = (args.json, fio_runs.last()) {
            print_line(&format!("fio rep {}", rep + 1), f);
        }
    }
    let med = median_run(&runs);
    let fio = args.fio.then(|| {
        let fm = median_run(&fio_runs);
        FioOutput {
            engine: args.fio_engine.clone(),
            median: fm,
            runs: fio_runs.clone(),
            ratio_iops: ratio(med.iops, fm.iops),
            ratio_bytes_per_sec: ratio(med.bytes_per_sec, fm.bytes_per_sec),
        }
    });
    let out = Output {
        backend: backend_name,
        file: args.file.display().to_string(),
        span_bytes: span,
        bs_bytes: args.bs,
        qd: args.qd,
        backlog,
        pattern: args.pattern.clone(),
        seconds: args.seconds,
        reps: args.reps,
        direct: file.is_direct(),
        median: med,
        runs,
        fio,
    };
    emit(&out, args.json, print_summary)
}

fn print_summary(out: &Output) {
    println!(
        "{} {} bs={} qd={} backlog={} span={} direct={} median of {}:",
        out.backend,
        out.pattern,
        out.bs_bytes,
        out.qd,
        out.backlog,
        out.span_bytes,
        out.direct,
        out.reps
    );
    print_line(out.backend, &out.median);
    if let Some(f) = &out.fio {
        print_line(&format!("fio {}", f.engine), &f.median);
        println!(
            "ratio flashtier/fio: IOPS {:.3}  bytes/s {:.3}",
            f.ratio_iops, f.ratio_bytes_per_sec
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_the_file_and_measures() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("bench.bin");
        for backend in ["posix", "sim", "uring"] {
            run(Args {
                file: file.clone(),
                size: 4 << 20,
                bs: 4096,
                qd: 4,
                backend: backend.into(),
                pattern: "rand".into(),
                seconds: 0.05,
                backlog: None,
                reps: 1,
                fio: false,
                fio_engine: "io_uring".into(),
                direct: "prefer".into(),
                json: true,
            })?;
        }
        assert_eq!(std::fs::metadata(&file)?.len(), 4 << 20);
        let bytes = std::fs::read(&file)?;
        assert!(bytes.iter().any(|&b| b != 0), "created file must hold data");
        Ok(())
    }
}
