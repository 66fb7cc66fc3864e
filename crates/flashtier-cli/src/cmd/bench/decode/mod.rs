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
//! - `kv` (not run by default): KV beyond HBM, a `--kv-context` prompt
//!   under `--kv-budget-hbm` ([`kv`]).
//!
//! With `--hf-script`, transformers runs the same prompt on the same
//! checkpoint (fully on the GPU, and offloaded with accelerate under the
//! same GPU budget as `ram`), and the report gives the speed-ups.
//!
//! A Qwen4-Exp checkpoint runs the resident mode only, with its PLE rows
//! cached ([`qwen4`]).
//!
//! Files: `measure.rs` (the limits and bounds the runs are held against),
//! `report.rs` (the runs, transformers' runs, the speed-ups, the output).

mod kv;
mod measure;
mod qwen4;
mod report;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use flashtier_engine::Model;
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::config::qwen4::Qwen4Config;
use flashtier_engine::device::KvState;
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::engine::Placement;
use flashtier_engine::load::resident_weight_bytes;
use flashtier_format::{Dtype, Store};
use flashtier_io::probe::LoggingBackend;
use flashtier_io::{PosixBackend, StorageBackend};
use flashtier_pack::pack::PackOptions;
use flashtier_pack::session::{SessionOptions, StoreSource};
use flashtier_pack::synth::{SynthArch, SynthSpec};
use serde::Serialize;

use crate::kit::{self, parse_bytes};
use measure::StepKernels;
use measure::{measure_limits, probe_before, profile, streamed_bound};
use report::{Report, emit, hf_runs, mode_run, speedups};

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
    /// Every expert resident; a long context under a KV budget.
    Kv,
}

impl Mode {
    /// The name the flag and the report use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Resident => "resident",
            Self::Streamed => "streamed",
            Self::Ram => "ram",
            Self::Kv => "kv",
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
    /// `kv`: prompt tokens (the context the decode attends over).
    #[arg(long, default_value_t = 8192)]
    pub kv_context: usize,
    /// `kv`: HBM for the KV cache (K, M, G, T: powers of 1024).
    #[arg(long, value_parser = parse_bytes, default_value = "64M")]
    pub kv_budget_hbm: u64,
    /// `kv`: folder of the KV store file [default: the expert store's folder].
    #[arg(long, value_name = "DIR")]
    pub kv_dir: Option<PathBuf>,
    /// Routed experts per layer of the synthetic checkpoint [default: the
    /// reference shape's] (the `kv` mode needs no more than top-k).
    #[arg(long)]
    pub synth_experts: Option<u32>,
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
    /// Time transformers on the GPU before flashtier's modes as well as
    /// after them: its batch-1 decode is bound by the host launching its
    /// kernels, and the host's speed can move within a run. The speed-ups
    /// divide by the faster of its runs.
    #[arg(long)]
    pub hf_bracket: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to FILE.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
}

/// Run `flashtier bench decode`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let show = !args.json;
    prepare(&args, show)?;
    let store = store_path(&args);
    let opened = Store::open(&store).with_context(|| format!("opening {}", store.display()))?;
    let ckpt = Checkpoint::open(&args.model)?;
    if Qwen4Config::is_qwen4(ckpt.source().config()) {
        return qwen4::run(&args, &store, show);
    }
    let weights = resident_weight_bytes(&ckpt);
    drop(ckpt);
    let dev = CudaDevice::open(0).context("bench decode needs a GPU")?;
    let limits = measure_limits(&dev)?;
    drop(dev);
    let mut report = Report::new(&args, &opened, weights, limits);
    let bracket = args.hf_bracket && args.hf_modes.iter().any(|m| m == "gpu");
    if let (Some(script), true) = (&args.hf_script, bracket) {
        report.hf = hf_runs(script, &args, &["gpu".to_owned()], "before")?;
    }
    for &mode in &args.modes {
        run_mode(&args, mode, (&store, &opened), &mut report, show)?;
    }
    if let Some(script) = &args.hf_script {
        let when = if bracket { "after" } else { "" };
        report
            .hf
            .extend(hf_runs(script, &args, &args.hf_modes, when)?);
    }
    report.speedups = speedups(&report);
    emit(&args, &report)
}

/// The prompt of `n` tokens every mode (and transformers) decodes after.
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// `mode`'s expert budgets: HBM (`None`: every expert) and pinned RAM.
fn mode_budgets(args: &Args, mode: Mode, expert_bytes: u64) -> (Option<u64>, u64) {
    match mode {
        Mode::Resident | Mode::Kv => (None, 0),
        Mode::Streamed => (Some(expert_bytes * args.stream_hbm_percent / 100), 0),
        Mode::Ram => (Some(args.ram_hbm), expert_bytes),
    }
}

/// The model loaded for `mode` under budgets (`hbm`, `ram`), reading
/// through a backend that logs its reads.
fn load_mode(
    args: &Args,
    mode: Mode,
    store: &Path,
    (hbm, ram): (Option<u64>, u64),
) -> anyhow::Result<(Model<CudaDevice>, Arc<LoggingBackend>)> {
    let logger = Arc::new(LoggingBackend::new(Arc::new(PosixBackend::new(
        args.queue_depth.max(1),
    )?)));
    let mut opts = SessionOptions::new(&args.model);
    opts.store = StoreSource::File(store.to_path_buf());
    opts.placement = Placement::Cuda(0);
    opts.queue_depth = args.queue_depth;
    opts.backend = Some(logger.clone() as Arc<dyn StorageBackend>);
    (opts.budget_hbm, opts.budget_ram) = (hbm, ram);
    if !args.json {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let hbm_text = hbm.map_or("every expert".to_owned(), |b| format!("{:.2} GiB", gib(b)));
        eprintln!(
            "loading for mode {} (HBM expert budget {hbm_text}, RAM tier {:.2} GiB)",
            mode.name(),
            gib(ram)
        );
    }
    Ok((open_on_gpu(&opts)?, logger))
}

/// One mode's decode, and the measurement only that mode makes, into
/// `report`.
fn run_mode(
    args: &Args,
    mode: Mode,
    (store, opened): (&Path, &Store),
    report: &mut Report,
    show: bool,
) -> anyhow::Result<()> {
    if mode == Mode::Kv {
        report.kv = Some(kv::run(args, store, &report.limits, show)?);
        return Ok(());
    }
    let (hbm, ram) = mode_budgets(args, mode, report.expert_bytes);
    let probe = match mode {
        Mode::Streamed => Some(probe_before(store, opened, args.queue_depth)?),
        _ => None,
    };
    let (mut m, logger) = load_mode(args, mode, store, (hbm, ram))?;
    let cfg = m.config().clone();
    (report.layers, report.experts, report.top_k) = (cfg.num_layers, cfg.num_experts, cfg.top_k);
    let before = logger.reads().len();
    let p = prompt(args.prompt_len, cfg.vocab_size);
    let out = m.generate(&p, args.tokens, &[], false, |_| {})?;
    let mut run = mode_run(&out, &m, hbm.unwrap_or(report.expert_bytes), ram);
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
            // A context already full leaves no room for the counted step:
            // the report then goes without it.
            if m.kv().len() < m.context_limit() {
                run.step_kernels = Some(step_kernels(&mut m, &out.generated_ids)?);
            }
            report.roofline = Some(profile(&mut m, args, &report.limits, run.tokens_per_sec)?);
            if args.prefill > 0 {
                m.reset()?;
                let long = prompt(args.prefill, cfg.vocab_size);
                let o = m.generate(&long, 0, &[], false, |_| {})?;
                report.prefill_tokens_per_sec = Some(long.len() as f64 / o.prefill_secs.max(1e-9));
                report.prefill_classes =
                    Some(measure::profile_prefill(&mut m, &long, &report.limits)?);
            }
        }
        Mode::Streamed => {
            let read = logger.reads();
            let decode_reads = &read[before.min(read.len())..];
            let (before, before_reads) = probe.unwrap_or_default();
            report.streamed = Some(streamed_bound(
                store,
                opened,
                decode_reads,
                (&run, args.queue_depth),
                (before, &before_reads),
            )?);
        }
        Mode::Kv => {}
        Mode::Ram => {
            let used = run.h2d_bytes_per_token * run.tokens_per_sec;
            report.ram_h2d_share = Some(used / report.limits.h2d_pinned_bytes_per_sec.max(1.0));
        }
    }
    run.mode = mode.name().to_owned();
    report.runs.push(run);
    Ok(())
}

/// The kernels of one more decode step after the timed ones, fed the last
/// generated token, as the launch path counted them.
fn step_kernels(m: &mut Model<CudaDevice>, generated: &[u32]) -> anyhow::Result<StepKernels> {
    let last = generated.last().copied().unwrap_or(0);
    count_step_kernels(
        m,
        |m| m.device(),
        |m| {
            m.forward(&[last], false)?;
            Ok(())
        },
    )
}

/// The kernels `step` launched on `m`'s device (`dev`), as its launch path
/// counted them (one by one or inside graphs).
fn count_step_kernels<M>(
    m: &mut M,
    dev: impl Fn(&M) -> &CudaDevice,
    step: impl FnOnce(&mut M) -> anyhow::Result<()>,
) -> anyhow::Result<StepKernels> {
    let before = dev(m).graph_stats();
    step(m)?;
    let after = dev(m).graph_stats();
    let direct = after.direct_kernels - before.direct_kernels;
    let in_graphs = after.graph_kernels - before.graph_kernels;
    Ok(StepKernels {
        kernels: direct + in_graphs,
        in_graphs,
        graph_launches: after.graph_launches - before.graph_launches,
    })
}

/// The session `opts` opened on the GPU it names.
pub(super) fn open_on_gpu(opts: &SessionOptions) -> anyhow::Result<Model<CudaDevice>> {
    opts.open(&|_| {})?
        .engine
        .into_cuda()
        .context("bench decode runs on a GPU")
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
        let mut spec = SynthSpec::reference(arch, Dtype::Bf16, 1).with_layers(args.layers);
        if let Some(n) = args.synth_experts {
            spec.experts = n;
            spec = spec.with_layers(args.layers);
        }
        kit::synth_with_bar(&spec, &args.model, show)?;
        if args.modes.contains(&Mode::Kv) {
            kv::raise_context(&args.model, args.kv_context + args.tokens)?;
        }
    }
    let store = store_path(args);
    if !store.exists() {
        kit::pack_with_bar(&PackOptions::new(&args.model, &store), show)?;
    }
    Ok(())
}
