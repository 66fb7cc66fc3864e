//! `flashtier bench kv`: offload N GiB of synthetic KV, restore it cold while
//! tiled decode attention consumes the tiles, and compare against fio.
//!
//! Per block order (per-layer, block-major) and repetition, side by side:
//! one pass writes a fresh store holding three times the measured KV, in
//! three equal parts. fio reads one part sequentially with O_DIRECT at the
//! restore's op size and queue depth (io_uring with registered buffers and
//! files, as the restore uses); the restore reads another with no consumer
//! ("restore alone"). The two run as `--chunks` interleaved pairs of chunks,
//! who goes first alternating (ABBA), so both see the same moments of the
//! shared disk. The third part is restored while attention runs over every
//! tile ("pipelined"); attention then runs over the same tiles from memory
//! ("attention alone"). The parts rotate between repetitions, so both sides
//! read bytes of the same file written by the same pass. Nothing is
//! read twice, so the host's cache of the virtio disk never serves a
//! re-read. Medians are reported, and every repetition's sample is in
//! `--json`.

mod bounds;
mod fio;
mod work;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use flashtier_format::kv::BlockOrder;
use flashtier_io::{BackendKind, DirectMode, StorageBackend, open_backend};
use serde::Serialize;

use crate::kit::bench::{check_reps, emit};
use crate::kit::{Units, median_of, progress};
use work::{Bench, Sample};

/// Options of `flashtier bench kv`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Directory for the store and fio files (on the drive under test).
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// GiB of KV to offload and restore per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub gib: f64,
    /// Transformer layers (at most 4096).
    #[arg(long, default_value_t = 32)]
    pub layers: u32,
    /// KV heads.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u32,
    /// Query heads (a multiple of --kv-heads).
    #[arg(long, default_value_t = 32)]
    pub q_heads: u32,
    /// Elements per head (<= 256).
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// Tokens per KV block (at most 4096; a block's K and V at most 16 MiB).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// Blocks (of every layer) per restore tile.
    #[arg(long, default_value_t = 2)]
    pub tile_blocks: u32,
    /// Tiles in the restore ring (scratch: ring x tile bytes). More tiles
    /// than --qd keep reads queued in the backend, so the drive never waits
    /// for the in-order consumer.
    #[arg(long, default_value_t = 32)]
    pub ring: usize,
    /// fio and the restore alone run as this many interleaved pairs of
    /// chunks (who goes first alternates), so both see the same moments of
    /// a shared, noisy disk.
    #[arg(long, default_value_t = 4)]
    pub chunks: usize,
    /// Backend queue depth.
    #[arg(long, default_value_t = 16)]
    pub qd: usize,
    /// Backend: uring | posix.
    #[arg(long, default_value = "uring")]
    pub backend: BackendKind,
    /// Block order to measure: per-layer | block-major | both.
    #[arg(long, default_value = "both")]
    pub order: String,
    /// Repetitions (medians reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// O_DIRECT policy: require | prefer | off.
    #[arg(long, default_value = "require")]
    pub direct: DirectMode,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Medians of one block order.
#[derive(Serialize, Debug, Clone)]
struct OrderReport {
    order: String,
    op_bytes: u64,
    ops_in_flight: usize,
    bytes: u64,
    restore_bytes_per_sec: f64,
    fio_bytes_per_sec: f64,
    fio_ratio: f64,
    restore_alone_s: f64,
    attention_alone_s: f64,
    pipelined_s: f64,
    pipeline_ratio: f64,
    overlap_fraction: f64,
    overlap_of_hideable: f64,
    verify_s: f64,
    reps: usize,
    samples: Vec<Sample>,
}

#[derive(Serialize, Debug)]
struct Report {
    backend: String,
    fio_version: String,
    gib: f64,
    default_order: String,
    restore_bytes_per_sec: f64,
    fio_ratio: f64,
    overlap_fraction: f64,
    pipeline_ratio: f64,
    orders: Vec<OrderReport>,
}

fn summarise(order: BlockOrder, bench: &Bench, samples: &[Sample]) -> OrderReport {
    let m = |f: fn(&Sample) -> f64| median_of(samples, f);
    let restore_s = m(|s| s.restore_s);
    let attention_s = m(|s| s.attention_s);
    let pipelined_s = m(|s| s.pipelined_s);
    let hidden = (restore_s + attention_s - pipelined_s).max(0.0);
    OrderReport {
        order: order.to_string(),
        op_bytes: bench.op_bytes,
        ops_in_flight: bench.ops_in_flight,
        bytes: bench.data_bytes,
        restore_bytes_per_sec: m(|s| s.restore_bps),
        fio_bytes_per_sec: m(|s| s.fio_bps),
        fio_ratio: m(|s| s.restore_bps / s.fio_bps),
        restore_alone_s: restore_s,
        attention_alone_s: attention_s,
        pipelined_s,
        pipeline_ratio: m(|s| s.pipelined_s / s.restore_s.max(s.attention_s)),
        overlap_fraction: (hidden / restore_s).min(1.0),
        overlap_of_hideable: (hidden / restore_s.min(attention_s)).min(1.0),
        verify_s: m(|s| s.verify_s),
        reps: samples.len(),
        samples: samples.to_vec(),
    }
}

fn orders(arg: &str) -> Result<Vec<BlockOrder>> {
    Ok(match arg {
        "both" => vec![BlockOrder::PerLayer, BlockOrder::BlockMajor],
        one => vec![one.parse::<BlockOrder>().map_err(anyhow::Error::msg)?],
    })
}

/// Run `flashtier bench kv`.
pub fn run(args: Args) -> Result<()> {
    check_reps(args.reps)?;
    if args.gib.is_nan() || args.gib <= 0.0 {
        bail!("--gib must be positive");
    }
    bounds::check_bounds(&args)?;
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let fio_version = crate::kit::fio::version()?;
    let backend: Arc<dyn StorageBackend> =
        Arc::from(open_backend(args.backend, args.qd).context("opening the backend")?);
    let orders = orders(&args.order)?;
    let pb = progress(
        Units::Steps,
        (orders.len() * args.reps * 4) as u64,
        "",
        true,
    );
    let mut reports = Vec::new();
    for &order in &orders {
        let bench = Bench::new(&args, order, backend.clone())?;
        let mut samples = Vec::new();
        for rep in 0..args.reps {
            samples.push(bench.sample(rep, &pb)?);
        }
        reports.push(summarise(order, &bench, &samples));
    }
    pb.finish_and_clear();
    let best = reports
        .iter()
        .max_by(|a, b| a.restore_bytes_per_sec.total_cmp(&b.restore_bytes_per_sec))
        .cloned()
        .context("no order measured")?;
    let report = Report {
        backend: backend.name().to_string(),
        fio_version,
        gib: args.gib,
        default_order: best.order.clone(),
        restore_bytes_per_sec: best.restore_bytes_per_sec,
        fio_ratio: best.fio_ratio,
        overlap_fraction: best.overlap_fraction,
        pipeline_ratio: best.pipeline_ratio,
        orders: reports,
    };
    emit(&report, args.json, print_table)
}

fn print_table(r: &Report) {
    println!(
        "flashtier bench kv: backend {}, {} GiB per run, {}",
        r.backend, r.gib, r.fio_version
    );
    println!(
        "{:<12} {:>9} {:>4} {:>11} {:>11} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "order",
        "op",
        "qd",
        "restore/s",
        "fio/s",
        "ratio",
        "restore",
        "attn",
        "piped",
        "piped/mx",
        "overlap"
    );
    for o in &r.orders {
        println!(
            "{:<12} {:>8}K {:>4} {:>9.2}GB {:>9.2}GB {:>6.3} {:>8.3}s {:>8.3}s {:>8.3}s {:>8.3} {:>8.3}",
            o.order,
            o.op_bytes / 1024,
            o.ops_in_flight,
            o.restore_bytes_per_sec / 1e9,
            o.fio_bytes_per_sec / 1e9,
            o.fio_ratio,
            o.restore_alone_s,
            o.attention_alone_s,
            o.pipelined_s,
            o.pipeline_ratio,
            o.overlap_fraction,
        );
    }
    println!(
        "default order (fastest restore): {}; acceptance: fio_ratio {:.3} (>= 0.90), pipelined / max(restore, attention) {:.3} (<= 1.15)",
        r.default_order, r.fio_ratio, r.pipeline_ratio
    );
}
