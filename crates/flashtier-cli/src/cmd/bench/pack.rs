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

use super::median;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context as _;
use flashtier_engine::pack::{PackOptions, plan_experts};
use flashtier_engine::source::Checkpoint;
use flashtier_engine::synth::{SynthArch, SynthSpec};
use flashtier_format::{Dtype, StoreWriterPlan};

use crate::cmd::demo::{Workspace, generate, parse_size};
use crate::cmd::pack::experts::pack_with_progress;

/// Options of `flashtier bench pack`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Size of the synthetic checkpoint.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
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

/// Sequential write of `bytes` to a fresh `path`; bytes per second.
fn reference_write(tool: &str, path: &Path, bytes: u64) -> anyhow::Result<(f64, String)> {
    let _ = std::fs::remove_file(path);
    let out = if tool == "fio" {
        let args = [
            "--name=seqwrite".to_string(),
            format!("--filename={}", path.display()),
            "--rw=write".into(),
            "--bs=4M".into(),
            format!("--size={bytes}"),
            "--direct=1".into(),
            "--ioengine=libaio".into(),
            "--iodepth=4".into(),
            "--end_fsync=1".into(),
        ];
        let v = super::fio::run_json(&args)?;
        let bw = v["jobs"][0]["write"]["bw_bytes"]
            .as_f64()
            .context("fio JSON lacks jobs[0].write.bw_bytes")?;
        (bw, format!("fio {}", args.join(" ")))
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

/// Interleaved repetitions: (reference bytes/s, pack bytes/s, reference command).
fn run_reps(
    args: &Args,
    tool: &str,
    ws: &Workspace,
    file_len: u64,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, String)> {
    let reference = ws.root.join("reference.bin");
    let (mut ref_bw, mut pack_bw, mut cmd) = (Vec::new(), Vec::new(), String::new());
    for rep in 0..args.reps.max(1) {
        let run_pack = || -> anyhow::Result<f64> {
            let out = ws.root.join(format!("bench-{rep}.ftstore"));
            let mut opts = PackOptions::new(&ws.model, &out);
            opts.writers = args.writers.clamp(1, 16);
            let r = pack_with_progress(&opts, false)?;
            let _ = std::fs::remove_file(&out);
            Ok(r.file_len_bytes as f64 / r.elapsed.as_secs_f64())
        };
        let mut run_reference = || -> anyhow::Result<()> {
            let (bw, c) = reference_write(tool, &reference, file_len)?;
            ref_bw.push(bw);
            cmd = c;
            Ok(())
        };
        if rep % 2 == 0 {
            run_reference()?;
            pack_bw.push(run_pack()?);
        } else {
            pack_bw.push(run_pack()?);
            run_reference()?;
        }
        if !args.json {
            let (r, p) = (ref_bw[rep], pack_bw[rep]);
            eprintln!(
                "rep {rep}: {tool} {:.0} MiB/s, pack {:.0} MiB/s ({:.0}%)",
                r / 1048576.0,
                p / 1048576.0,
                100.0 * p / r
            );
        }
    }
    Ok((ref_bw, pack_bw, cmd))
}

/// Run `flashtier bench pack`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let tool = if args.tool == "fio" && !super::fio::available() {
        eprintln!(
            "bench pack: fio is not installed; using dd as the reference (apt-get install fio)"
        );
        "dd"
    } else {
        args.tool.as_str()
    };
    anyhow::ensure!(tool == "fio" || tool == "dd", "--tool must be fio or dd");
    let ws = Workspace::new(args.dir.as_deref(), false)?;
    let spec = SynthSpec::scaled_to(SynthArch::Qwen3Moe, Dtype::Bf16, args.size, 0);
    generate(&spec, &ws, !args.json)?;
    let ckpt = Checkpoint::open(&ws.model)?;
    let file_len = StoreWriterPlan::new(plan_experts(&ckpt)?.1)?.file_len();
    drop(ckpt);
    let (ref_bw, pack_bw, cmd) = run_reps(&args, tool, &ws, file_len)?;
    let (r, p) = (median(&ref_bw), median(&pack_bw));
    let ratio = p / r;
    let pair_ratios: Vec<f64> = pack_bw.iter().zip(&ref_bw).map(|(p, r)| p / r).collect();
    let pair_median = median(&pair_ratios);
    if args.json {
        let out = serde_json::json!({
            "store_bytes": file_len, "checkpoint_bytes": spec.total_bytes(), "reps": ref_bw.len(),
            "reference": { "tool": tool, "command": cmd, "bytes_per_s": ref_bw, "median_bytes_per_s": r },
            "pack": { "bytes_per_s": pack_bw, "median_bytes_per_s": p, "writers": args.writers },
            "ratio": ratio,
            "pair_ratios": pair_ratios,
            "median_pair_ratio": pair_median,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "pack: {:.0} MiB/s median vs {tool} sequential write {:.0} MiB/s median over {} reps of {:.0} MiB: {:.0}% (target >= 80%)",
            p / 1048576.0,
            r / 1048576.0,
            ref_bw.len(),
            file_len as f64 / 1048576.0,
            100.0 * ratio
        );
        println!(
            "median of the per-repetition ratios (pack / {tool} run back to back): {:.0}%",
            100.0 * pair_median
        );
        println!("reference: {cmd}");
    }
    Ok(())
}
