//! `flashtier bench decode`: the decode engine on the GPU against the
//! device's own limits and against HF transformers, on one checkpoint, in
//! one run.
//!
//! Limits measured in the same run: the HBM read bandwidth (a kernel that
//! reads a buffer once), a device-to-device copy, the pinned host-to-device
//! copy, and the drive (O_DIRECT reads of whole expert records at the
//! pool's queue depth, at offsets the decode did not read, so no cache
//! serves them).
//!
//! Modes:
//! - `resident`: every expert in HBM; tok/s, the roofline fraction (bytes
//!   a step must read / the read bandwidth, over the step time) overall and
//!   per kernel class (a profiled pass), and prefill tok/s.
//! - `streamed`: HBM budget `--stream-hbm-percent` of the experts, no RAM
//!   tier: tok/s against the I/O bound (miss bytes per token / the drive's
//!   bytes/s), and what a faster drive would give from the measured compute
//!   time per token.
//! - `ram`: HBM budget `--ram-hbm`, the rest in the pinned RAM tier: tok/s
//!   and the share of the pinned copy bandwidth the misses use.
//!
//! With `--hf-script`, transformers runs the same prompt on the same
//! checkpoint (fully on the GPU, and offloaded with accelerate under the
//! same GPU budget as `ram`), and the report gives the speed-ups.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, bail};
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::device::cuda::experts::{TierBudgets, TierStats};
use flashtier_engine::device::cuda::profile::ClassTime;
use flashtier_engine::load::{GpuOptions, LoadOptions, load_cuda, resident_weight_bytes};
use flashtier_engine::pack::PackOptions;
use flashtier_engine::synth::{SynthArch, SynthSpec};
use flashtier_engine::{Model, checkpoint::Checkpoint};
use flashtier_format::{Dtype, Store};
use flashtier_io::probe::{Extent, LoggingBackend, Refill, read_extents};
use flashtier_io::{PosixBackend, StorageBackend};
use serde::Serialize;

use crate::kit::{self, parse_bytes};

/// A decode mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Every expert resident in HBM.
    Resident,
    /// A small HBM budget, no RAM tier: experts stream from the drive.
    Streamed,
    /// A fixed HBM budget with the rest of the experts in pinned RAM.
    Ram,
}

impl Mode {
    /// The name the flag and the report use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Resident => "resident",
            Self::Streamed => "streamed",
            Self::Ram => "ram",
        }
    }
}

/// Options of `flashtier bench decode`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder; generated there first with --synth when it holds no config.json.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Generate a synthetic checkpoint in the family's reference shape
    /// (qwen3_moe: Qwen3-30B-A3B; see `flashtier demo --help`) with --layers layers.
    #[arg(long, value_name = "ARCH")]
    pub synth: Option<SynthArch>,
    /// Decoder layers of the synthetic checkpoint.
    #[arg(long, default_value_t = 16)]
    pub layers: u32,
    /// Expert store (packed first when missing) [default: MODEL.ftstore beside the folder].
    #[arg(long, value_name = "FILE")]
    pub store: Option<PathBuf>,
    /// Prompt tokens before the timed decode.
    #[arg(long, default_value_t = 16)]
    pub prompt_len: usize,
    /// Tokens decoded per mode.
    #[arg(long, default_value_t = 32)]
    pub tokens: usize,
    /// Prompt tokens of the prefill measurement (0: none).
    #[arg(long, default_value_t = 512)]
    pub prefill: usize,
    /// Modes to run.
    #[arg(long, value_delimiter = ',', default_value = "resident,streamed,ram")]
    pub modes: Vec<Mode>,
    /// `streamed`: HBM budget as a percentage of the expert bytes.
    #[arg(long, default_value_t = 10)]
    pub stream_hbm_percent: u64,
    /// `ram`: HBM budget for experts (K, M, G, T: powers of 1024).
    #[arg(long, value_parser = parse_bytes, default_value = "4G")]
    pub ram_hbm: u64,
    /// Decode steps of the per-kernel-class profile (resident mode).
    #[arg(long, default_value_t = 4)]
    pub profile_tokens: usize,
    /// Expert reads in flight at most.
    #[arg(long, default_value_t = 16)]
    pub queue_depth: usize,
    /// The transformers script (tools/hf_decode_bench.py) to compare with.
    #[arg(long, value_name = "FILE")]
    pub hf_script: Option<PathBuf>,
    /// Its modes: `gpu` (the whole model on the GPU), `offload` (accelerate,
    /// the GPU budget of `ram`).
    #[arg(long, value_delimiter = ',', default_value = "gpu,offload")]
    pub hf_modes: Vec<String>,
    /// Tokens transformers decodes per mode (offloaded decode is slow).
    #[arg(long, default_value_t = 8)]
    pub hf_tokens: usize,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to FILE.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
}

/// The device's own limits.
#[derive(Debug, Serialize)]
struct Limits {
    gpu: String,
    hbm_read_bytes_per_sec: f64,
    d2d_copy_bytes_per_sec: f64,
    h2d_pinned_bytes_per_sec: f64,
}

/// One decode mode's result.
#[derive(Debug, Serialize, Default)]
struct Run {
    mode: String,
    budget_hbm_bytes: u64,
    budget_ram_bytes: u64,
    tokens_per_sec: f64,
    decode_steps: u64,
    expert_hit_rate: f64,
    miss_bytes_per_token: f64,
    h2d_bytes_per_token: f64,
    stall_fraction: f64,
    tiers: Option<TierStats>,
    generated_ids: Vec<u32>,
}

#[derive(Debug, Serialize)]
struct Roofline {
    bytes_per_token: f64,
    roofline_secs_per_token: f64,
    measured_secs_per_token: f64,
    fraction: f64,
    classes: Vec<ClassRow>,
}

#[derive(Debug, Serialize)]
struct ClassRow {
    #[serde(flatten)]
    time: ClassTime,
    secs_per_token: f64,
    fraction_of_read_bandwidth: f64,
}

#[derive(Debug, Serialize)]
struct Streamed {
    drive_bytes_per_sec: f64,
    drive_probe_reads: usize,
    io_bound_tokens_per_sec: f64,
    fraction_of_io_bound: f64,
    compute_secs_per_token: f64,
    projected_tokens_per_sec_at_14gbps: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    model: PathBuf,
    layers: usize,
    experts: usize,
    top_k: usize,
    record_bytes: u64,
    expert_bytes: u64,
    resident_weight_bytes: u64,
    limits: Limits,
    runs: Vec<Run>,
    roofline: Option<Roofline>,
    prefill_tokens: usize,
    prefill_tokens_per_sec: Option<f64>,
    streamed: Option<Streamed>,
    ram_h2d_share: Option<f64>,
    hf: Vec<serde_json::Value>,
    speedups: serde_json::Value,
}

/// Run `flashtier bench decode`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let show = !args.json;
    prepare(&args, show)?;
    let store = store_path(&args);
    let opened = Store::open(&store).with_context(|| format!("opening {}", store.display()))?;
    let stride = opened.stride_bytes();
    let expert_bytes = stride * opened.record_count();
    let ckpt = Checkpoint::open(&args.model)?;
    let weights = resident_weight_bytes(&ckpt);
    drop(ckpt);
    let dev = CudaDevice::open(0).context("bench decode needs a GPU")?;
    let limits = measure_limits(&dev)?;
    drop(dev);
    let prompt = |n: usize, vocab: usize| -> Vec<u32> {
        (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
    };
    let mut report = Report {
        model: args.model.clone(),
        layers: 0,
        experts: 0,
        top_k: 0,
        record_bytes: stride,
        expert_bytes,
        resident_weight_bytes: weights,
        limits,
        runs: Vec::new(),
        roofline: None,
        prefill_tokens: args.prefill,
        prefill_tokens_per_sec: None,
        streamed: None,
        ram_h2d_share: None,
        hf: Vec::new(),
        speedups: serde_json::Value::Null,
    };
    for &mode in &args.modes {
        let (hbm, ram) = match mode {
            Mode::Resident => (None, 0),
            Mode::Streamed => (Some(expert_bytes * args.stream_hbm_percent / 100), 0),
            Mode::Ram => (Some(args.ram_hbm), expert_bytes),
        };
        let logger = Arc::new(LoggingBackend::new(Arc::new(PosixBackend::new(
            args.queue_depth.max(1),
        )?)));
        let mut opts = LoadOptions::store(&store);
        opts.queue_depth = args.queue_depth;
        opts.backend = Some(logger.clone() as Arc<dyn StorageBackend>);
        let gpu = GpuOptions {
            ordinal: 0,
            budgets: TierBudgets {
                hbm_bytes: hbm,
                ram_bytes: ram,
                in_place: false,
            },
        };
        if show {
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            let hbm_text = hbm.map_or("every expert".to_owned(), |b| format!("{:.2} GiB", gib(b)));
            eprintln!(
                "loading for mode {} (HBM expert budget {hbm_text}, RAM tier {:.2} GiB)",
                mode.name(),
                gib(ram)
            );
        }
        let mut m = load_cuda(&args.model, &opts, &gpu)?;
        let cfg = m.config().clone();
        (report.layers, report.experts, report.top_k) =
            (cfg.num_layers, cfg.num_experts, cfg.top_k);
        let before = logger.reads().len();
        let p = prompt(args.prompt_len, cfg.vocab_size);
        let out = m.generate(&p, args.tokens, &[], false, |_| {})?;
        let mut run = mode_run(mode, &out, &m, hbm.unwrap_or(expert_bytes), ram);
        if show {
            eprintln!(
                "{}: {:.1} tok/s, hit rate {:.3}",
                mode.name(),
                run.tokens_per_sec,
                run.expert_hit_rate
            );
        }
        match mode {
            Mode::Resident => {
                report.roofline = Some(profile(&mut m, &args, &report.limits, run.tokens_per_sec)?);
                if args.prefill > 0 {
                    m.reset()?;
                    let long = prompt(args.prefill, cfg.vocab_size);
                    let o = m.generate(&long, 0, &[], false, |_| {})?;
                    report.prefill_tokens_per_sec =
                        Some(long.len() as f64 / o.prefill_secs.max(1e-9));
                }
            }
            Mode::Streamed => {
                let read = logger.reads();
                let decode_reads = &read[before.min(read.len())..];
                report.streamed = Some(streamed_bound(
                    &store,
                    &opened,
                    decode_reads,
                    &run,
                    args.queue_depth,
                )?);
            }
            Mode::Ram => {
                let used = run.h2d_bytes_per_token * run.tokens_per_sec;
                report.ram_h2d_share = Some(used / report.limits.h2d_pinned_bytes_per_sec.max(1.0));
            }
        }
        run.mode = mode.name().to_owned();
        report.runs.push(run);
        drop(m);
    }
    if let Some(script) = &args.hf_script {
        report.hf = hf_runs(script, &args)?;
    }
    report.speedups = speedups(&report);
    emit(&args, &report)
}

fn store_path(args: &Args) -> PathBuf {
    args.store
        .clone()
        .unwrap_or_else(|| args.model.with_extension("ftstore"))
}

/// Generate the synthetic checkpoint and pack the store when missing.
fn prepare(args: &Args, show: bool) -> anyhow::Result<()> {
    if !args.model.join("config.json").exists() {
        let Some(arch) = args.synth else {
            bail!(
                "{} holds no config.json (give --synth to generate one)",
                args.model.display()
            );
        };
        let spec = SynthSpec::reference(arch, Dtype::Bf16, 1).with_layers(args.layers);
        kit::synth_with_bar(&spec, &args.model, show)?;
    }
    let store = store_path(args);
    if !store.exists() {
        kit::pack_with_bar(&PackOptions::new(&args.model, &store), show)?;
    }
    Ok(())
}

fn measure_limits(dev: &CudaDevice) -> anyhow::Result<Limits> {
    let gpu = dev.gpu();
    let hbm = dev.kernels().read_bandwidth(4 << 30, 5)?;
    let d2d = flashtier_cuda::measure::d2d_bytes_per_s(gpu, 2 << 30, 5)?;
    let h2d = flashtier_cuda::measure::h2d_bytes_per_s(gpu, 8 << 20, 16, 2 << 30)?;
    Ok(Limits {
        gpu: gpu.info().name.clone(),
        hbm_read_bytes_per_sec: hbm,
        d2d_copy_bytes_per_sec: d2d,
        h2d_pinned_bytes_per_sec: h2d,
    })
}

fn mode_run(
    mode: Mode,
    out: &flashtier_engine::Generation,
    m: &Model<CudaDevice>,
    hbm: u64,
    ram: u64,
) -> Run {
    let steps = out.decode_steps.max(1) as f64;
    let e = out.decode_experts;
    let tiers = m.experts().tier_stats();
    let _ = mode;
    Run {
        mode: String::new(),
        budget_hbm_bytes: hbm,
        budget_ram_bytes: ram,
        tokens_per_sec: out.tokens_per_sec(),
        decode_steps: out.decode_steps,
        expert_hit_rate: e.hit_rate(),
        miss_bytes_per_token: e.bytes_read as f64 / steps,
        h2d_bytes_per_token: tiers.h2d_bytes as f64
            / (out.decode_steps + out.prompt_tokens as u64).max(1) as f64,
        stall_fraction: if out.decode_secs > 0.0 {
            e.stall_ns as f64 / 1e9 / out.decode_secs
        } else {
            0.0
        },
        tiers: Some(tiers),
        generated_ids: out.generated_ids.clone(),
    }
}

/// Per-class device time over `--profile-tokens` decode steps, and the
/// roofline fractions.
fn profile(
    m: &mut Model<CudaDevice>,
    args: &Args,
    limits: &Limits,
    tok_s: f64,
) -> anyhow::Result<Roofline> {
    let n = args.profile_tokens.max(1);
    m.reset()?;
    let vocab = m.config().vocab_size;
    let p: Vec<u32> = (0..args.prompt_len)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    m.forward(&p, false)?;
    m.device().profile_start();
    for i in 0..n {
        m.forward(&[((i * 31 + 7) % vocab) as u32], false)?;
    }
    let classes = m.device().profile_take()?;
    let bw = limits.hbm_read_bytes_per_sec.max(1.0);
    let bytes: u64 = classes.iter().map(|c| c.bytes).sum();
    let bytes_per_token = bytes as f64 / n as f64;
    let measured = 1.0 / tok_s.max(1e-9);
    let rows = classes
        .into_iter()
        .map(|c| ClassRow {
            secs_per_token: c.secs / n as f64,
            fraction_of_read_bandwidth: c.bytes_per_sec() / bw,
            time: c,
        })
        .collect();
    Ok(Roofline {
        bytes_per_token,
        roofline_secs_per_token: bytes_per_token / bw,
        measured_secs_per_token: measured,
        fraction: bytes_per_token / bw / measured,
        classes: rows,
    })
}

/// The drive on records the decode did not read, as many as it read, at
/// the same queue depth; the I/O bound and a faster drive's projection.
fn streamed_bound(
    store: &Path,
    opened: &Store,
    decode: &[Extent],
    run: &Run,
    qd: usize,
) -> anyhow::Result<Streamed> {
    let read: std::collections::HashSet<u64> = decode.iter().map(|e| e.offset).collect();
    let len = opened.stride_bytes() as usize;
    let want = decode.len().clamp(16, 4096);
    let mut fresh = Vec::with_capacity(want);
    let records = opened.record_count();
    for i in 0..records {
        let r = (i.wrapping_mul(0x9E37_79B9) + 7) % records;
        let offset = opened.record_offset(r)?;
        if !read.contains(&offset) && fresh.iter().all(|e: &Extent| e.offset != offset) {
            fresh.push(Extent { offset, len });
        }
        if fresh.len() >= want {
            break;
        }
    }
    let probe = read_extents(store, &fresh, qd, Refill::Sliding, &mut |_| {})?;
    let drive = probe.bytes_per_sec();
    let bound = if run.miss_bytes_per_token > 0.0 {
        drive / run.miss_bytes_per_token
    } else {
        f64::INFINITY
    };
    let secs = 1.0 / run.tokens_per_sec.max(1e-9);
    let compute = secs * (1.0 - run.stall_fraction);
    let at_fast = 1.0 / (compute.max(run.miss_bytes_per_token / 14e9));
    Ok(Streamed {
        drive_bytes_per_sec: drive,
        drive_probe_reads: fresh.len(),
        io_bound_tokens_per_sec: bound,
        fraction_of_io_bound: run.tokens_per_sec / bound,
        compute_secs_per_token: compute,
        projected_tokens_per_sec_at_14gbps: at_fast,
    })
}

fn hf_runs(script: &Path, args: &Args) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for mode in &args.hf_modes {
        let gpu_mem = format!("{}MiB", args.ram_hbm >> 20);
        let tokens = if mode == "gpu" {
            args.tokens
        } else {
            args.hf_tokens
        };
        let prefill = if mode == "gpu" { args.prefill } else { 0 };
        let o = Command::new("python3")
            .arg(script)
            .args([
                "--model",
                &args.model.to_string_lossy(),
                "--mode",
                mode,
                "--gpu-mem",
                &gpu_mem,
            ])
            .args([
                "--prompt-len",
                &args.prompt_len.to_string(),
                "--tokens",
                &tokens.to_string(),
            ])
            .args([
                "--prefill",
                &prefill.to_string(),
                "--reps",
                if mode == "gpu" { "3" } else { "1" },
            ])
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        let text = String::from_utf8_lossy(&o.stdout);
        match text.lines().last().and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
            Some(v) if o.status.success() => out.push(v),
            _ => out.push(serde_json::json!({
                "mode": mode,
                "error": String::from_utf8_lossy(&o.stderr).lines().rev().take(8).collect::<Vec<_>>(),
            })),
        }
    }
    Ok(out)
}

fn speedups(r: &Report) -> serde_json::Value {
    let ours = |mode: &str| {
        r.runs
            .iter()
            .find(|x| x.mode == mode)
            .map(|x| x.tokens_per_sec)
    };
    let hf = |mode: &str, key: &str| {
        r.hf.iter()
            .find(|v| v["mode"] == mode)
            .and_then(|v| v[key].as_f64())
    };
    let div = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    serde_json::json!({
        "resident_vs_transformers_gpu": div(ours("resident"), hf("gpu", "decode_tokens_per_sec")),
        "ram_vs_transformers_offload": div(ours("ram"), hf("offload", "decode_tokens_per_sec")),
        "prefill_vs_transformers_gpu": div(r.prefill_tokens_per_sec, hf("gpu", "prefill_tokens_per_sec")),
    })
}

fn emit(args: &Args, r: &Report) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(r)?;
    if let Some(path) = &args.json_out {
        flashtier_io::persist::write_file(path, text.as_bytes(), flashtier_io::Wait::Block)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{text}");
        return Ok(());
    }
    let gb = |b: f64| b / 1e9;
    println!(
        "{}: HBM read {:.0} GB/s, d2d copy {:.0} GB/s, pinned h2d {:.1} GB/s",
        r.limits.gpu,
        gb(r.limits.hbm_read_bytes_per_sec),
        gb(r.limits.d2d_copy_bytes_per_sec),
        gb(r.limits.h2d_pinned_bytes_per_sec)
    );
    for x in &r.runs {
        println!(
            "{:>9}: {:7.1} tok/s, hit rate {:.3}, {:.1} MB read/token, {:.1} MB h2d/token, stall {:.0}%",
            x.mode,
            x.tokens_per_sec,
            x.expert_hit_rate,
            x.miss_bytes_per_token / 1e6,
            x.h2d_bytes_per_token / 1e6,
            100.0 * x.stall_fraction
        );
    }
    if let Some(rf) = &r.roofline {
        println!(
            "roofline: {:.1}% of the HBM read bound ({:.2} GB/token)",
            100.0 * rf.fraction,
            gb(rf.bytes_per_token)
        );
        for c in &rf.classes {
            println!(
                "  {:>12?}: {:8.1} us/token, {:5.1}% of read bandwidth",
                c.time.class,
                c.secs_per_token * 1e6,
                100.0 * c.fraction_of_read_bandwidth
            );
        }
    }
    if let Some(s) = &r.streamed {
        println!(
            "streamed: drive {:.2} GB/s, I/O bound {:.2} tok/s, {:.0}% of it; at 14 GB/s: {:.1} tok/s",
            gb(s.drive_bytes_per_sec),
            s.io_bound_tokens_per_sec,
            100.0 * s.fraction_of_io_bound,
            s.projected_tokens_per_sec_at_14gbps
        );
    }
    println!("speed-ups: {}", r.speedups);
    Ok(())
}
