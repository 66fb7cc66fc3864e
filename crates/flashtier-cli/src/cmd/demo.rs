//! `flashtier demo`: the main job on a built-in synthetic model, no download.
//!
//! 1. generate a synthetic Qwen3-MoE checkpoint in the HF safetensors layout
//!    (about 1 GiB by default, `--size`), shaped so its experts are several
//!    times the expert budget;
//! 2. pack its experts into a store; 3. verify every record and the pairing;
//! 4. replay a synthetic decode routing trace against the store under 25% of
//!    the expert bytes, against LRU and Belady's optimum on the same trace;
//! 5. decode tokens with the experts streamed from the store under the same
//!    budget, against the I/O bound measured on the drive in the same run and
//!    against the same decode on the mapped (page-cache) backing.
//!
//! Each step is a function on a [`Workspace`].

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use flashtier::experts::StoreSet;
use flashtier::experts::replay::{
    ReplayConfig, ReplayReport, budget_fraction, replay, synth_trace,
};
use flashtier::experts::tracegen::TraceFamily;
use flashtier::verify::VerifyReport;
use flashtier_engine::demo::{
    Bound, DecodeRun, DemoOptions, DemoPhase, DemoReport, run_decode_demo,
};
use flashtier_engine::engine::Placement;
use flashtier_engine::pack::{PackOptions, PackReport};
use flashtier_engine::synth::{SynthArch, SynthReport, SynthSpec};
use flashtier_format::Dtype;
use flashtier_io::{BackendKind, DirectMode, StorageBackend, open_backend};

use crate::kit::{self, count_bar, parse_bytes};

/// Options of `flashtier demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Size of the synthetic checkpoint (e.g. 1GiB, 256MiB, 64M; powers of 1024).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub size: u64,
    /// Work in this folder (created; kept afterwards) instead of a temporary one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the temporary folder (checkpoint and store) afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Model family: qwen3_moe | qwen2_moe | mixtral | deepseek.
    #[arg(long, default_value = "qwen3_moe")]
    pub arch: SynthArch,
    /// Matrix dtype: BF16 | F16 | F32 | F8_E4M3.
    #[arg(long, default_value = "BF16", value_parser = parse_dtype)]
    pub dtype: Dtype,
    /// Seed of the synthetic weights. The default's random router spreads
    /// tokens over many experts (expert hit rate about 70% at a 25% budget),
    /// so the decode is bound by the drive; some seeds concentrate routing so
    /// much that the decode becomes compute-bound instead.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Tokens of the synthetic routing trace replayed against the store.
    #[arg(long, default_value_t = 64)]
    pub replay_tokens: u32,
    /// Tokens decoded per streamed run (0 skips the decode).
    #[arg(long, default_value_t = 24)]
    pub tokens: usize,
    /// Expert budget as a percentage of the expert bytes (replay and decode).
    #[arg(long, default_value_t = 25)]
    pub budget_percent: u64,
    /// Where the streamed decode runs: auto (the GPU when there is one) |
    /// cuda | cuda:N | cpu. On a GPU the budget is the HBM expert arena and
    /// misses land NVMe -> pinned staging -> HBM; the CPU engine always runs
    /// the reference decode the GPU's tokens are checked against.
    #[arg(long, default_value = "auto")]
    pub device: Placement,
    /// Print a JSON report on stdout instead of the human one.
    #[arg(long)]
    pub json: bool,
}

/// Parse a dtype by its safetensors name.
pub fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::from_name(&s.to_ascii_uppercase())
        .ok_or_else(|| format!("unknown dtype {s} (BF16, F16, F32, F8_E4M3)"))
}

/// Where the demo works: a checkpoint folder and a store path inside a root
/// that is either the user's `--dir` or a temporary folder.
pub struct Workspace {
    /// Root folder.
    pub root: PathBuf,
    /// The synthetic checkpoint folder.
    pub model: PathBuf,
    /// The expert store.
    pub store: PathBuf,
    temp: Option<tempfile::TempDir>,
}

impl Workspace {
    /// In `dir` (kept), or in a new temporary folder (removed on drop unless `keep`).
    pub fn new(dir: Option<&Path>, keep: bool) -> anyhow::Result<Self> {
        let (root, temp) = match dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
                (d.to_path_buf(), None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("flashtier-demo-")
                    .tempdir()
                    .context("create a temporary folder")?;
                if keep {
                    (t.keep(), None)
                } else {
                    (t.path().to_path_buf(), Some(t))
                }
            }
        };
        Ok(Self {
            model: root.join("model"),
            store: root.join("experts.ftstore"),
            root,
            temp,
        })
    }

    /// Whether the folder stays after the demo.
    pub fn kept(&self) -> bool {
        self.temp.is_none()
    }
}

/// Step 1: write the synthetic checkpoint (replacing an older synthetic
/// one in the folder, never anything else).
pub fn generate(spec: &SynthSpec, ws: &Workspace, show: bool) -> anyhow::Result<SynthReport> {
    kit::synth_with_bar(spec, &ws.model, show)
}

/// Step 2: pack the experts.
pub fn pack(ws: &Workspace, show: bool) -> anyhow::Result<PackReport> {
    kit::pack_with_bar(&PackOptions::new(&ws.model, &ws.store), show)
}

/// Step 3: verify every record and the pairing with the checkpoint.
pub fn verify(ws: &Workspace, show: bool) -> anyhow::Result<VerifyReport> {
    let (store, report) = kit::verify_with_bar(&ws.store, DirectMode::Prefer, show)?;
    if let Some(first) = report.first_bad() {
        anyhow::bail!(
            "verification failed: record {} ({}): {}",
            first.index,
            first.key,
            first.error
        );
    }
    let ckpt = flashtier_engine::source::CheckpointFiles::open(&ws.model)?;
    flashtier_engine::pack::check_pairing(&store, &ckpt)?;
    Ok(report)
}

/// The demo's model: the family's reference model (Qwen3-30B-A3B,
/// Qwen1.5-MoE-A2.7B, Mixtral-8x7B, DeepSeek-V3) scaled to `--size`, widths,
/// layers and vocabulary by one factor, expert count and top-k as the real
/// model's.
pub fn demo_spec(args: &Args) -> SynthSpec {
    SynthSpec::scaled_to(args.arch, args.dtype, args.size, args.seed)
}

/// Step 4: replay a synthetic decode routing trace under the budget.
pub fn replay_trace(ws: &Workspace, args: &Args, show: bool) -> anyhow::Result<ReplayReport> {
    let stores = StoreSet::open(&ws.store, false)?;
    let trace = synth_trace(&stores, TraceFamily::Decode, args.replay_tokens, args.seed)?;
    let config = ReplayConfig {
        budget_bytes: budget_fraction(&stores, args.budget_percent),
        ..ReplayConfig::default()
    };
    let backend: std::sync::Arc<dyn StorageBackend> = open_backend(BackendKind::Uring, 32)?.into();
    let bar = count_bar(u64::from(args.replay_tokens), "replaying trace", show);
    let report = replay(stores, backend, &trace, &config, &mut |done, _| {
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    Ok(report)
}

/// Step 5: decode with the experts streamed from the store, then on the
/// mapped backing, against the drive measured in the same run.
pub fn decode(
    ws: &Workspace,
    spec: &SynthSpec,
    args: &Args,
    show: bool,
) -> anyhow::Result<DemoReport> {
    let mut opts = DemoOptions::new(&ws.root);
    opts.spec = spec.clone();
    opts.tokens = args.tokens;
    opts.budget_fraction = args.budget_percent as f64 / 100.0;
    opts.placement = args.device;
    let bar = count_bar(1, "decoding", show);
    let report = run_decode_demo(&opts, &|p| {
        let what = match p.phase {
            DemoPhase::Generate => "generating",
            DemoPhase::Pack => "packing",
            DemoPhase::Drive => "measuring the drive",
            DemoPhase::Streamed => "decoding, experts streamed",
            DemoPhase::Mapped => "CPU reference, mapped",
            _ => "working",
        };
        bar.set_message(what);
        bar.set_length(p.total.max(1));
        bar.set_position(p.done);
    })?;
    bar.finish_and_clear();
    Ok(report)
}

struct Done {
    synth: SynthReport,
    packed: PackReport,
    checked: VerifyReport,
    replayed: ReplayReport,
    decoded: Result<DemoReport, String>,
}

fn human(spec: &SynthSpec, ws: &Workspace, d: &Done) {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "1. generated a synthetic {} checkpoint: {} layers x {} experts (top-{}), hidden {}, expert intermediate {}, {} ({:.1} MiB in {} files)\n   {}",
        spec.arch.model_type(),
        spec.layers,
        spec.experts,
        spec.experts_per_token,
        spec.hidden,
        spec.intermediate,
        spec.dtype,
        mib(d.synth.bytes),
        d.synth.files.len(),
        ws.model.display()
    );
    println!("2. {}", kit::pack_line(&d.packed));
    println!(
        "3. verified all {} records ({:.1} MiB, checksums and padding) and the pairing with the checkpoint",
        d.checked.units,
        mib(d.checked.bytes)
    );
    let r = &d.replayed;
    println!(
        "4. replayed {} tokens of a synthetic decode trace under a {:.0} MiB budget ({} records, {}):\n   hit rate {:.1}%  (LRU {:.1}%, Belady optimum {:.1}%), read {:.1} MiB at {:.0} MiB/s",
        r.tokens,
        mib(r.budget_bytes),
        r.capacity_records,
        r.policy,
        100.0 * r.hit_rate,
        100.0 * r.lru_hit_rate,
        100.0 * r.belady_hit_rate,
        mib(r.bytes_read),
        r.bytes_per_sec / f64::from(1 << 20)
    );
    match &d.decoded {
        Ok(x) => human_decode(x),
        Err(why) => println!("5. decode skipped: {why}"),
    }
    if ws.kept() {
        println!(
            "kept: {}  (try `flashtier inspect {}`)",
            ws.root.display(),
            ws.store.display()
        );
    } else {
        println!(
            "removed the temporary folder {} (use --keep or --dir to keep it)",
            ws.root.display()
        );
    }
}

fn where_ran(r: &DecodeRun) -> String {
    match (&r.gpu_name, &r.fallback) {
        (Some(gpu), _) => format!(
            "on the GPU ({gpu}; HBM expert slots under the budget, misses NVMe -> pinned -> HBM)"
        ),
        (None, Some(why)) => format!("on the CPU (no GPU: {why})"),
        (None, None) => "on the CPU".to_owned(),
    }
}

fn human_decode(x: &DemoReport) {
    let mib = |b: f64| b / f64::from(1 << 20);
    let s = &x.streamed;
    println!(
        "5. decoded {} tokens {} with experts streamed under a {:.0} MiB budget ({:.0} MiB of experts):\n   {:.1} tok/s, expert hit rate {:.1}%, {:.1} MiB read per token, stall {:.0}%",
        s.steps,
        where_ran(s),
        mib(x.budget_bytes as f64),
        mib(x.expert_bytes as f64),
        s.tokens_per_sec,
        100.0 * s.expert_hit_rate,
        mib(s.miss_bytes_per_token),
        100.0 * s.stall_fraction
    );
    let drive = format!(
        "the drive read records of the same size at the same queue depth at {:.0} MiB/s in this run",
        mib(x.drive_bytes_per_sec)
    );
    match x.bound {
        Bound::Measured { fraction } => println!(
            "   I/O bound {:.1} tok/s ({drive}): {:.0}% of the bound",
            x.io_bound_tokens_per_sec,
            100.0 * fraction
        ),
        Bound::Unmeasurable { ratio } => println!(
            "   no drive bound on this machine: the decode ran {ratio:.1}x faster than {drive}, so memory (a virtual disk's host cache) served some reads; replaying the decode's own reads gave {:.0} MiB/s",
            mib(x.replay_bytes_per_sec)
        ),
        Bound::NoReads => println!("   every expert use hit memory: nothing read, no I/O bound"),
    }
    println!(
        "   CPU reference (mapped page-cache backing): {:.1} tok/s, hit rate {:.1}%; same tokens: {}",
        x.mapped.tokens_per_sec,
        100.0 * x.mapped.expert_hit_rate,
        if x.same_tokens { "yes" } else { "NO" }
    );
}

/// Run the demo.
pub fn run(args: Args) -> anyhow::Result<()> {
    let ws = Workspace::new(args.dir.as_deref(), args.keep)?;
    let spec = demo_spec(&args);
    let show = !args.json;
    let synth = generate(&spec, &ws, show)?;
    let packed = pack(&ws, show)?;
    let checked = verify(&ws, show)?;
    let replayed = replay_trace(&ws, &args, show)?;
    let decoded = if args.tokens == 0 {
        Err("--tokens 0".to_owned())
    } else {
        Ok(decode(&ws, &spec, &args, show)?)
    };
    if let Ok(x) = &decoded {
        anyhow::ensure!(
            x.same_tokens,
            "the streamed decode and the CPU reference produced different tokens"
        );
    }
    let done = Done {
        synth,
        packed,
        checked,
        replayed,
        decoded,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&spec, &ws, &done))?
        );
    } else {
        human(&spec, &ws, &done);
    }
    Ok(())
}

fn to_json(spec: &SynthSpec, ws: &Workspace, d: &Done) -> serde_json::Value {
    serde_json::json!({
        "dir": ws.root,
        "kept": ws.kept(),
        "checkpoint": { "path": ws.model, "arch": spec.arch.model_type(), "dtype": spec.dtype.name(), "layers": spec.layers,
            "experts": spec.experts, "experts_per_token": spec.experts_per_token, "hidden": spec.hidden,
            "expert_intermediate": spec.intermediate, "bytes": d.synth.bytes, "files": d.synth.files.len(), "seed": spec.seed },
        "pack": kit::pack_json(&d.packed),
        "verify": d.checked.to_json(),
        "replay": d.replayed,
        "decode": match &d.decoded {
            Ok(x) => serde_json::to_value(x).unwrap_or(serde_json::Value::Null),
            Err(why) => serde_json::json!({ "skipped": why }),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_dtype_is_named_as_typed() {
        assert_eq!(
            parse_dtype("q4").map(|_| ()),
            Err("unknown dtype q4 (BF16, F16, F32, F8_E4M3)".to_string())
        );
    }

    #[test]
    fn a_small_demo_runs_end_to_end() -> anyhow::Result<()> {
        let ws = Workspace::new(None, false)?;
        let spec = SynthSpec::scaled_to(SynthArch::Qwen3Moe, Dtype::Bf16, 4 << 20, 5);
        let synth = generate(&spec, &ws, false)?;
        let packed = pack(&ws, false)?;
        let checked = verify(&ws, false)?;
        assert!(synth.bytes > 0 && synth.bytes <= 4 << 20);
        assert_eq!(packed.records, checked.units);
        assert!(checked.ok());
        Ok(())
    }
}
