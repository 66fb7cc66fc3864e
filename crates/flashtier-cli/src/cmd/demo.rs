//! `flashtier demo`: the main job on a built-in synthetic model, no download.
//!
//! Today: generate a synthetic Qwen3-MoE checkpoint in the HF safetensors
//! layout (about 1 GiB by default), pack its experts into a store, verify
//! every record, and say what was done and where. Each step is a function
//! ([`generate`], [`pack`], [`verify`]) on a [`Workspace`] so later issues
//! add steps (replay, decode) after these.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use flashtier::pack::{PackOptions, PackReport};
use flashtier::synth::{SynthArch, SynthReport, SynthSpec, write_checkpoint};
use flashtier_format::Dtype;
use flashtier_io::DirectMode;

use super::pack::experts::{bytes_bar, pack_with_progress, report_json, report_line};
use super::verify::{VerifyReport, verify_store};

/// Options of `flashtier demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Size of the synthetic checkpoint (e.g. 1GiB, 256MiB, 64M).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
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
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print a JSON report on stdout instead of the human one.
    #[arg(long)]
    pub json: bool,
}

/// Parse a byte size: a number with an optional K/M/G/T suffix (powers of
/// 1024; `KiB`, `MB`, `GiB`... all accepted).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad size {s:?} (e.g. 1GiB, 512M, 4096)"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit.trim_end_matches('b').trim_end_matches('i');
    let mult: u64 = match unit {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => return Err(format!("bad size unit in {s:?} (K, M, G, T)")),
    };
    let bytes = n * mult as f64;
    if !(1.0..=(1u64 << 50) as f64).contains(&bytes) {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(bytes as u64)
}

/// Parse a dtype by its safetensors name.
pub fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::from_name(&s.to_ascii_uppercase())
        .ok_or_else(|| format!("unknown dtype {s:?} (BF16, F16, F32, F8_E4M3)"))
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

/// Step 1: write the synthetic checkpoint.
pub fn generate(spec: &SynthSpec, ws: &Workspace, show: bool) -> anyhow::Result<SynthReport> {
    if ws.model.exists() {
        std::fs::remove_dir_all(&ws.model)
            .with_context(|| format!("clear {}", ws.model.display()))?;
    }
    let bar = if show {
        bytes_bar(spec.total_bytes(), "generating")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let report = write_checkpoint(spec, &ws.model, &mut |n| bar.inc(n))?;
    bar.finish_and_clear();
    Ok(report)
}

/// Step 2: pack the experts.
pub fn pack(ws: &Workspace, show: bool) -> anyhow::Result<PackReport> {
    pack_with_progress(&PackOptions::new(&ws.model, &ws.store), show)
}

/// Step 3: verify every record and the pairing with the checkpoint.
pub fn verify(ws: &Workspace, show: bool) -> anyhow::Result<VerifyReport> {
    let (store, report) = verify_store(&ws.store, DirectMode::Prefer, show)?;
    if let Some(first) = report.bad.first() {
        anyhow::bail!(
            "verification failed: record {} ({}): {}",
            first.index,
            first.key,
            first.error
        );
    }
    let ckpt = flashtier::checkpoint::Checkpoint::open(&ws.model)?;
    flashtier::pack::check_pairing(&store, &ckpt)?;
    Ok(report)
}

fn human(
    spec: &SynthSpec,
    ws: &Workspace,
    synth: &SynthReport,
    packed: &PackReport,
    checked: &VerifyReport,
) {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "1. generated a synthetic {} checkpoint: {} layers x {} experts, hidden {}, expert intermediate {}, {} ({:.1} MiB in {} files)\n   {}",
        spec.arch.model_type(),
        spec.layers,
        spec.experts,
        spec.hidden,
        spec.intermediate,
        spec.dtype,
        mib(synth.bytes),
        synth.files.len(),
        ws.model.display()
    );
    println!("2. {}", report_line(packed));
    println!(
        "3. verified all {} records ({:.1} MiB, checksums and padding) and the pairing with the checkpoint",
        checked.records,
        mib(checked.bytes)
    );
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

/// Run the demo.
pub fn run(args: Args) -> anyhow::Result<()> {
    let spec = SynthSpec::for_target_bytes(args.arch, args.dtype, args.size, args.seed);
    let ws = Workspace::new(args.dir.as_deref(), args.keep)?;
    let show = !args.json;
    let synth = generate(&spec, &ws, show)?;
    let packed = pack(&ws, show)?;
    let checked = verify(&ws, show)?;
    if args.json {
        let out = serde_json::json!({
            "dir": ws.root,
            "kept": ws.kept(),
            "checkpoint": { "path": ws.model, "arch": spec.arch.model_type(), "dtype": spec.dtype.name(), "layers": spec.layers,
                "experts": spec.experts, "hidden": spec.hidden, "expert_intermediate": spec.intermediate,
                "bytes": synth.bytes, "files": synth.files.len(), "seed": spec.seed },
            "pack": report_json(&packed),
            "verify": checked.to_json(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        human(&spec, &ws, &synth, &packed, &checked);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("64mb"), Ok(64 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn a_small_demo_runs_end_to_end() -> anyhow::Result<()> {
        let spec = SynthSpec::for_target_bytes(SynthArch::Qwen3Moe, Dtype::Bf16, 4 << 20, 5);
        let ws = Workspace::new(None, false)?;
        let synth = generate(&spec, &ws, false)?;
        let packed = pack(&ws, false)?;
        let checked = verify(&ws, false)?;
        assert!(synth.bytes > 0 && synth.bytes <= 4 << 20);
        assert_eq!(packed.records, checked.records);
        assert!(checked.bad.is_empty());
        Ok(())
    }
}
