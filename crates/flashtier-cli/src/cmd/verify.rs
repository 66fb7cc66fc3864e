//! `flashtier verify`: check every record or block of a flashtier file
//! against its checksum. The file's kind comes from its magic
//! ([`flashtier::verify::sniff`]); the checks live in the library
//! ([`flashtier::experts::verify`] for expert stores and low-bit companions,
//! [`flashtier::rows::verify`] for row shards, [`flashtier::kv::verify`] for
//! KV stores) and read through the posix backend, O_DIRECT where the file
//! system allows it. This module dispatches, draws the progress bar and
//! prints.

use std::path::PathBuf;

pub use flashtier::verify::VerifyReport;
use flashtier::verify::{QUEUE_WINDOWS, sniff};
use flashtier_format::FileKind;
use flashtier_io::{DirectMode, PosixBackend};

use crate::kit;

/// Options of `flashtier verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The file: an expert store, a low-bit companion, a packed row shard
    /// or a KV store.
    pub file: PathBuf,
    /// Also check an expert store against this checkpoint folder: its
    /// files, and every record's keys, tensor names, dtypes and shapes.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// O_DIRECT for reading records: prefer | require | off.
    #[arg(long, default_value = "prefer")]
    pub direct: DirectMode,
    /// Print the result as JSON on stdout (still exits non-zero when bad).
    #[arg(long)]
    pub json: bool,
}

/// Verify `args.file` by its kind; the pairing with `--model` for stores.
fn verify_any(args: &Args) -> anyhow::Result<VerifyReport> {
    let kind = sniff(&args.file)?;
    if args.model.is_some() && kind != FileKind::Store {
        anyhow::bail!(
            "{}: --model applies to expert stores; this file is a {}",
            args.file.display(),
            kind.name()
        );
    }
    if kind == FileKind::Store {
        let (store, report) = kit::verify_with_bar(&args.file, args.direct, !args.json)?;
        if let Some(model) = &args.model {
            let ckpt = flashtier_engine::checkpoint::files::CheckpointFiles::open(model)?;
            flashtier_engine::store::check_pairing(&store, &ckpt)?;
        }
        return Ok(report);
    }
    let backend = PosixBackend::new(QUEUE_WINDOWS)?;
    let (path, direct) = (args.file.as_path(), args.direct);
    kit::with_verify_bar(!args.json, |p| match kind {
        FileKind::RowShard => {
            Ok(flashtier::rows::verify::verify_shard(path, &backend, direct, p)?.1)
        }
        FileKind::KvStore => Ok(flashtier::kv::verify::verify_kv(path, &backend, direct, p)?.1),
        other => anyhow::bail!("{}: cannot verify a {}", path.display(), other.name()),
    })
}

/// Run `flashtier verify`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let report = verify_any(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    }
    if let Some(first) = report.first_bad() {
        anyhow::bail!(
            "{} of {} {}s bad; first bad {} {} ({}) at offset {} length {}: {}",
            report.bad_count,
            report.units,
            report.unit,
            report.unit,
            first.index,
            first.key,
            first.offset,
            first.len_bytes,
            first.error
        );
    }
    if !args.json {
        let secs = report.elapsed.as_secs_f64().max(1e-9);
        let mib = report.bytes as f64 / f64::from(1 << 20);
        println!(
            "ok: {} {}s of {} ({}) verified ({mib:.1} MiB at {:.0} MiB/s, {})",
            report.units,
            report.unit,
            args.file.display(),
            report.kind,
            mib / secs,
            if report.direct {
                "O_DIRECT"
            } else {
                "buffered"
            }
        );
    }
    Ok(())
}
