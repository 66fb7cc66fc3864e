//! `flashtier bench pack`: packing throughput against the drive's own
//! sequential write bandwidth, measured by fio (or dd) in the same run.
//!
//! One synthetic checkpoint is generated (the source then sits in the page
//! cache, so the pack measures writing, which is what the store costs).
//! Each repetition writes a fresh file of the store's size with fio
//! (`--rw=write --bs=4M --direct=1 --ioengine=libaio --iodepth=4
//! --end_fsync=1`) and packs into a fresh store, alternating which goes
//! first; both files are deleted after each repetition. The report gives
//! every repetition, the medians, the ratio of medians and the median of the
//! per-repetition ratios (robust when the drive is shared and its speed
//! drifts between repetitions).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context as _;
use flashtier_engine::checkpoint::files::CheckpointFiles;
use flashtier_format::{Dtype, StoreWriterPlan};
use flashtier_pack::pack::{PackOptions, plan_experts};
use flashtier_pack::synth::{SynthArch, SynthSpec};
use serde::Serialize;

use crate::kit::bench::{check_reps, emit, interleaved, paired_ratio, ratio};
use crate::kit::fio::{self, Job, Rw};
use crate::kit::{median, pack_with_bar, parse_bytes, synth_with_bar};

/// Options of `flashtier bench pack`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Size of the synthetic checkpoint (K, M, G, T: powers of 1024).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    pub size: u64,
    /// Folder on the drive to measure (default: a temporary folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Repetitions (interleaved with the reference writes).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Reference tool: fio | dd (fio falls back to dd when not installed).
    #[arg(long, default_value = "fio")]
    pub tool: String,
    /// Writer threads of the packer (queue depth; fio runs at 4).
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Print JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Sequential write of `bytes` to a fresh `path`; bytes per second and the
/// command that measured it.
fn reference_write(tool: &str, path: &Path, bytes: u64) -> anyhow::Result<(f64, String)> {
    let _ = std::fs::remove_file(path);
    let out = if tool == "fio" {
        let job = Job::new("seqwrite", path, Rw::Write, 4 << 20)
            .queue("libaio", 4)
            .span(0, bytes);
        (job.write()?.bytes_per_sec, job.command_line())
    } else {
        let count = bytes.div_ceil(4 << 20);
        let args = [
            "if=/dev/zero".to_string(),
            format!("of={}", path.display()),
            "bs=4M".into(),
            format!("count={count}"),
            "oflag=direct".into(),
            "conv=fsync".into(),
            "status=none".into(),
        ];
        let t0 = Instant::now();
        let o = Command::new("dd").args(&args).output().context("run dd")?;
        anyhow::ensure!(
            o.status.success(),
            "dd failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        (
            (count * (4 << 20)) as f64 / t0.elapsed().as_secs_f64(),
            format!("dd {}", args.join(" ")),
        )
    };
    let _ = std::fs::remove_file(path);
    Ok(out)
}

/// The reference's side of the report.
#[derive(Debug, Serialize)]
struct Reference {
    tool: String,
    command: String,
    bytes_per_s: Vec<f64>,
    median_bytes_per_s: f64,
}

/// The packer's side of the report.
#[derive(Debug, Serialize)]
struct Packing {
    bytes_per_s: Vec<f64>,
    median_bytes_per_s: f64,
    writers: usize,
}

/// What `flashtier bench pack` reports.
#[derive(Debug, Serialize)]
struct Report {
    store_bytes: u64,
    checkpoint_bytes: u64,
    reps: usize,
    reference: Reference,
    pack: Packing,
    /// Median pack bytes/s over the reference's median.
    ratio: f64,
    pair_ratios: Vec<f64>,
    /// Median of the per-repetition ratios (robust to drift).
    median_pair_ratio: f64,
}

/// Run `flashtier bench pack`.
pub fn run(args: Args) -> anyhow::Result<()> {
    check_reps(args.reps)?;
    let tool = if args.tool == "fio" && !fio::available() {
        eprintln!(
            "bench pack: fio is not installed; using dd as the reference (apt-get install fio)"
        );
        "dd"
    } else {
        args.tool.as_str()
    };
    anyhow::ensure!(tool == "fio" || tool == "dd", "--tool must be fio or dd");
    let temp = tempfile::Builder::new()
        .prefix("flashtier-bench-pack-")
        .tempdir()
        .context("creating a temporary folder")?;
    let root = args
        .dir
        .clone()
        .unwrap_or_else(|| temp.path().to_path_buf());
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let model = root.join("model");
    let spec = SynthSpec::scaled_to(SynthArch::Qwen3Moe, Dtype::Bf16, args.size, 0);
    synth_with_bar(&spec, &model, !args.json)?;
    let file_len =
        StoreWriterPlan::new(plan_experts(&CheckpointFiles::open(&model)?)?.1)?.file_len();
    let mut command = String::new();
    let reference = root.join("reference.bin");
    let (pack_bw, ref_bw) = interleaved(
        args.reps,
        |rep| {
            let out = root.join(format!("bench-{rep}.ftstore"));
            let mut opts = PackOptions::new(&model, &out);
            opts.writers = args.writers.clamp(1, 16);
            let r = pack_with_bar(&opts, false)?;
            let _ = std::fs::remove_file(&out);
            Ok(r.file_len_bytes as f64 / r.elapsed.as_secs_f64())
        },
        |_| {
            let (bw, c) = reference_write(tool, &reference, file_len)?;
            command = c;
            Ok(bw)
        },
    )?;
    if !args.json {
        for (rep, (p, r)) in pack_bw.iter().zip(&ref_bw).enumerate() {
            eprintln!(
                "rep {rep}: {tool} {:.0} MiB/s, pack {:.0} MiB/s ({:.0}%)",
                r / 1048576.0,
                p / 1048576.0,
                100.0 * p / r
            );
        }
    }
    let (r, p) = (median(&ref_bw), median(&pack_bw));
    let pair_ratios: Vec<f64> = pack_bw
        .iter()
        .zip(&ref_bw)
        .map(|(p, r)| ratio(*p, *r))
        .collect();
    let report = Report {
        store_bytes: file_len,
        checkpoint_bytes: spec.total_bytes(),
        reps: ref_bw.len(),
        ratio: ratio(p, r),
        median_pair_ratio: paired_ratio(&pack_bw, &ref_bw).unwrap_or(0.0),
        pair_ratios,
        reference: Reference {
            tool: tool.to_string(),
            command,
            bytes_per_s: ref_bw,
            median_bytes_per_s: r,
        },
        pack: Packing {
            bytes_per_s: pack_bw,
            median_bytes_per_s: p,
            writers: args.writers,
        },
    };
    emit(&report, args.json, print_report)
}

fn print_report(r: &Report) {
    let tool = &r.reference.tool;
    println!(
        "pack: {:.0} MiB/s median vs {tool} sequential write {:.0} MiB/s median over {} reps of {:.0} MiB: {:.0}% (target >= 80%)",
        r.pack.median_bytes_per_s / 1048576.0,
        r.reference.median_bytes_per_s / 1048576.0,
        r.reps,
        r.store_bytes as f64 / 1048576.0,
        100.0 * r.ratio
    );
    println!(
        "median of the per-repetition ratios (pack / {tool} run back to back): {:.0}%",
        100.0 * r.median_pair_ratio
    );
    println!("reference: {}", r.reference.command);
}
