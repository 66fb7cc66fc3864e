//! `flashtier demo`: the main job on a built-in synthetic model, no download.
//!
//! 1. generate a synthetic Qwen3-MoE checkpoint in the HF safetensors layout
//!    (about 1 GiB by default, `--size`), shaped so its experts are several
//!    times the expert budget;
//! 2. pack its experts into a store (and, for `--arch qwen4_exp`, its PLE
//!    n-gram tables into row shards); 3. verify every record (and every row
//!    block) and the pairing;
//! 4. replay a synthetic decode routing trace against the store under 25% of
//!    the expert bytes, against LRU and Belady's optimum on the same trace;
//! 5. decode tokens with the experts streamed from the store under the same
//!    budget (and Qwen4-Exp's rows through the row store under
//!    `--rows-percent` of the tables), against the I/O bound measured on the
//!    drive in the same run and against the same decode on the mapped
//!    (page-cache) backing.
//!
//! Each step is a function on a [`Workspace`]; the reports are printed by
//! [`report`].

mod report;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use flashtier::experts::StoreSet;
use flashtier::experts::replay::{
    ReplayConfig, ReplayReport, budget_fraction, replay, synth_trace,
};
use flashtier::experts::tracegen::TraceFamily;
use flashtier::verify::VerifyReport;
use flashtier_engine::engine::Placement;
use flashtier_format::Dtype;
use flashtier_io::{BackendKind, DirectMode, PosixBackend, StorageBackend, open_backend};
use flashtier_pack::demo::{
    DemoModel, DemoOptions, DemoPhase, DemoReport, RowsPacked, run_decode_demo,
};
use flashtier_pack::pack::{PackOptions, PackReport};
use flashtier_pack::synth::{
    Qwen4Spec, SynthArch, SynthReport, SynthSpec, remove_synthetic, write_qwen4_checkpoint,
};

use crate::kit::{self, bytes_bar, count_bar, parse_bytes};
use report::Done;

/// The model family of `--arch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DemoArch {
    /// One of the MoE families of the synthetic checkpoints.
    Moe(SynthArch),
    /// Qwen4-Exp: experts and PLE rows, both streamed.
    Qwen4Exp,
}

impl std::str::FromStr for DemoArch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen4_exp" | "qwen4_exp_text" | "qwen4" => Ok(Self::Qwen4Exp),
            other => other.parse().map(Self::Moe).map_err(|_| {
                format!(
                    "unknown arch `{other}` (qwen3_moe | qwen2_moe | mixtral | deepseek | qwen4_exp)"
                )
            }),
        }
    }
}

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
    /// Model family: qwen3_moe | qwen2_moe | mixtral | deepseek |
    /// qwen4_exp (Qwen4-Exp: 512 experts and PLE n-gram tables, both
    /// streamed; BF16).
    #[arg(long, default_value = "qwen3_moe")]
    pub arch: DemoArch,
    /// Qwen4-Exp: the row-cache budget as a percentage of the PLE tables.
    #[arg(long, default_value_t = 10)]
    pub rows_percent: u64,
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
    /// Qwen4-Exp's packed PLE row shards.
    pub rows: PathBuf,
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
            rows: root.join("rows"),
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
pub fn generate(model: &DemoModel, ws: &Workspace, show: bool) -> anyhow::Result<SynthReport> {
    match model {
        DemoModel::Qwen4 { spec, .. } => {
            remove_synthetic(&ws.model)?;
            // Row shards of an older checkpoint would be refused later.
            if ws.rows.exists() {
                std::fs::remove_dir_all(&ws.rows)
                    .with_context(|| format!("remove {}", ws.rows.display()))?;
            }
            let bar = bytes_bar(spec.total_bytes(), "generating", show);
            let report = write_qwen4_checkpoint(spec, &ws.model, &mut |n| bar.inc(n))?;
            bar.finish_and_clear();
            Ok(report)
        }
        DemoModel::Moe(spec) => kit::synth_with_bar(spec, &ws.model, show),
    }
}

/// Step 2b (Qwen4-Exp): pack the PLE tables into row shards.
pub fn pack_rows(
    model: &DemoModel,
    ws: &Workspace,
    show: bool,
) -> anyhow::Result<Option<RowsPacked>> {
    let DemoModel::Qwen4 {
        spec,
        rows_fraction,
    } = model
    else {
        return Ok(None);
    };
    let bar = count_bar(1, "packing PLE rows", show);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let table = spec.table_bytes();
    let budget = (table as f64 * rows_fraction) as u64;
    let packed =
        flashtier_pack::demo::rows::pack_rows(&ws.model, &ws.store, &ws.rows, table, budget)?;
    bar.finish_and_clear();
    Ok(Some(packed))
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
    let ckpt = flashtier_engine::checkpoint::files::CheckpointFiles::open(&ws.model)?;
    flashtier_engine::store::check_pairing(&store, &ckpt)?;
    Ok(report)
}

/// Step 3b (Qwen4-Exp): verify every block of every row shard.
pub fn verify_rows(packed: &RowsPacked, show: bool) -> anyhow::Result<RowsVerified> {
    let backend = PosixBackend::new(flashtier::verify::QUEUE_WINDOWS)?;
    let mut done = RowsVerified::default();
    for path in &packed.files {
        let report = kit::with_verify_bar(show, |p| {
            flashtier::rows::verify::verify_shard(path, &backend, DirectMode::Prefer, p)
        })?
        .1;
        if let Some(first) = report.first_bad() {
            anyhow::bail!(
                "verification failed: {}: {} ({}): {}",
                path.display(),
                first.index,
                first.key,
                first.error
            );
        }
        done.files += 1;
        done.blocks += report.units;
        done.bytes += report.bytes;
    }
    Ok(done)
}

/// What [`verify_rows`] checked.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct RowsVerified {
    /// Shard files.
    pub files: usize,
    /// Row blocks.
    pub blocks: u64,
    /// Bytes.
    pub bytes: u64,
}

/// The demo's model: the family's reference model (Qwen3-30B-A3B,
/// Qwen1.5-MoE-A2.7B, Mixtral-8x7B, DeepSeek-V3, Qwen4-Exp) scaled to
/// `--size`, widths, layers and vocabulary by one factor (Qwen4-Exp's
/// vocabulary and n-gram tables by its square, so its LM head and tables
/// keep their shares of the bytes), expert count and top-k as the real
/// model's.
pub fn demo_model(args: &Args) -> anyhow::Result<DemoModel> {
    Ok(match args.arch {
        DemoArch::Moe(arch) => {
            DemoModel::Moe(SynthSpec::scaled_to(arch, args.dtype, args.size, args.seed))
        }
        DemoArch::Qwen4Exp => {
            anyhow::ensure!(
                args.dtype == Dtype::Bf16,
                "the synthetic Qwen4-Exp is BF16 only (got --dtype {})",
                args.dtype
            );
            anyhow::ensure!(
                (1..=100).contains(&args.rows_percent),
                "--rows-percent {} (1 to 100)",
                args.rows_percent
            );
            DemoModel::Qwen4 {
                spec: Qwen4Spec::scaled_to(args.size, args.seed),
                rows_fraction: args.rows_percent as f64 / 100.0,
            }
        }
    })
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
    model: &DemoModel,
    args: &Args,
    show: bool,
) -> anyhow::Result<DemoReport> {
    let mut opts = DemoOptions::new(&ws.root);
    opts.model = model.clone();
    opts.tokens = args.tokens;
    opts.budget_fraction = args.budget_percent as f64 / 100.0;
    opts.placement = args.device;
    let bar = count_bar(1, "decoding", show);
    let report = run_decode_demo(&opts, &|p| {
        let what = match p.phase {
            DemoPhase::Generate => "generating",
            DemoPhase::Pack => "packing",
            DemoPhase::PackRows => "packing PLE rows",
            DemoPhase::Drive => "measuring the drive",
            DemoPhase::Streamed => "decoding, streamed",
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

/// Run the demo.
pub fn run(args: Args) -> anyhow::Result<()> {
    let model = demo_model(&args)?;
    let ws = Workspace::new(args.dir.as_deref(), args.keep)?;
    let show = !args.json;
    let synth = generate(&model, &ws, show)?;
    let packed = pack(&ws, show)?;
    let rows = pack_rows(&model, &ws, show)?;
    let checked = verify(&ws, show)?;
    let rows_checked = rows.as_ref().map(|r| verify_rows(r, show)).transpose()?;
    let replayed = replay_trace(&ws, &args, show)?;
    let decoded = if args.tokens == 0 {
        Err("--tokens 0".to_owned())
    } else {
        Ok(decode(&ws, &model, &args, show)?)
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
        rows: rows.zip(rows_checked),
        checked,
        replayed,
        decoded,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report::to_json(&model, &ws, &done))?
        );
    } else {
        report::human(&model, &ws, &done);
    }
    Ok(())
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
    fn arch_names_parse_with_qwen4_exp_among_them() {
        assert_eq!("qwen4_exp".parse::<DemoArch>(), Ok(DemoArch::Qwen4Exp));
        assert_eq!(
            "mixtral".parse::<DemoArch>(),
            Ok(DemoArch::Moe(SynthArch::Mixtral))
        );
        let err = "llama".parse::<DemoArch>().unwrap_err();
        assert!(
            err.contains("qwen4_exp") && err.contains("`llama`"),
            "{err}"
        );
    }

    #[test]
    fn a_small_demo_runs_end_to_end() -> anyhow::Result<()> {
        let ws = Workspace::new(None, false)?;
        let spec = SynthSpec::scaled_to(SynthArch::Qwen3Moe, Dtype::Bf16, 4 << 20, 5);
        let synth = generate(&DemoModel::Moe(spec), &ws, false)?;
        let packed = pack(&ws, false)?;
        let checked = verify(&ws, false)?;
        assert!(synth.bytes > 0 && synth.bytes <= 4 << 20);
        assert_eq!(packed.records, checked.units);
        assert!(checked.ok());
        Ok(())
    }
}
