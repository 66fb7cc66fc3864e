//! `flashtier pack experts`: pack the MoE experts of an HF checkpoint into
//! an expert store, with a progress bar of bytes packed.

use std::path::PathBuf;

use anyhow::Context as _;
use flashtier_io::DirectMode;
use flashtier_io::persist::Wait;
use flashtier_pack::pack::{PackOptions, PackReport};

use crate::kit;

/// Options of `flashtier pack experts`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder: config.json plus model.safetensors or shards with
    /// model.safetensors.index.json.
    #[arg(long)]
    pub model: PathBuf,
    /// Store file to write. An existing OUT is replaced only if it is an
    /// expert store; OUT may not be a file of the checkpoint. Written to a
    /// temp file beside OUT and renamed over it when complete.
    #[arg(long)]
    pub out: PathBuf,
    /// Fail at once if another flashtier process is writing OUT (or a
    /// companion) instead of waiting for it.
    #[arg(long)]
    pub no_wait: bool,
    /// O_DIRECT for the store: prefer | require | off.
    #[arg(long, default_value = "prefer")]
    pub direct: DirectMode,
    /// Record buffers in the read/write pipeline (memory = depth x record).
    #[arg(long, default_value_t = 8)]
    pub depth: usize,
    /// Reader threads (copy tensors into records, checksum them).
    #[arg(long, default_value_t = 2)]
    pub readers: usize,
    /// Read the checkpoint with O_DIRECT too (keeps a checkpoint larger than
    /// memory out of the page cache; slower where read-ahead helps).
    #[arg(long)]
    pub direct_source: bool,
    /// Writer threads (the queue depth of the store writes).
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Also write group-quantized low-bit companions, e.g. `3,2` writes
    /// OUT-stem.q3.ftstore and OUT-stem.q2.ftstore (docs/lowbit-format.md),
    /// each replacing only an older companion.
    #[arg(long, value_delimiter = ',')]
    pub lowbit: Vec<u32>,
    /// Elements per quantization group of the low-bit companions.
    #[arg(long, default_value_t = 64)]
    pub lowbit_group: usize,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Run `flashtier pack experts`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut opts = PackOptions::new(&args.model, &args.out);
    opts.direct = args.direct;
    opts.depth = args.depth.clamp(2, 64);
    opts.readers = args.readers.clamp(1, 16);
    opts.direct_source = args.direct_source;
    opts.writers = args.writers.clamp(1, 16);
    opts.wait = wait(&args);
    check_lowbit_outputs(&args)?;
    let report = kit::pack_with_bar(&opts, !args.json)?;
    let lowbit = write_lowbit(&args, &report)?;
    if args.json {
        let mut v = kit::pack_json(&report);
        v["lowbit"] = serde_json::to_value(&lowbit)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}", kit::pack_line(&report));
        for l in &lowbit {
            println!(
                "wrote {}-bit companion {} ({} bytes/record, relative RMSE {:.4} vs the source)",
                l.spec.bits,
                l.path.display(),
                l.payload_bytes,
                l.error.relative_rmse()
            );
        }
    }
    Ok(())
}

fn wait(args: &Args) -> Wait {
    if args.no_wait {
        Wait::Fail
    } else {
        Wait::Block
    }
}

/// Refuse, before packing, `--lowbit` outputs that exist and are not
/// companions (each is checked again under its lock when written).
fn check_lowbit_outputs(args: &Args) -> anyhow::Result<()> {
    use flashtier::experts::lowbit_pack::{companion_path, existing_store};
    for &bits in &args.lowbit {
        existing_store(&companion_path(&args.out, bits), true)?;
    }
    Ok(())
}

/// Write the `--lowbit` companions of a packed store.
fn write_lowbit(
    args: &Args,
    report: &PackReport,
) -> anyhow::Result<Vec<flashtier::experts::lowbit_pack::LowbitReport>> {
    use flashtier::experts::lowbit::LowbitSpec;
    use flashtier::experts::lowbit_pack::{companion_path, write_companion_with};
    let mut out = Vec::new();
    for &bits in &args.lowbit {
        let spec = LowbitSpec::new(bits, args.lowbit_group)?;
        let path = companion_path(&report.out, bits);
        let bar = kit::count_bar(report.records, &format!("q{bits}"), !args.json);
        let r = write_companion_with(&report.out, &path, spec, wait(args), &mut |done, _| {
            bar.set_position(done)
        })
        .with_context(|| format!("writing {}", path.display()))?;
        bar.finish_and_clear();
        out.push(r);
    }
    Ok(out)
}
