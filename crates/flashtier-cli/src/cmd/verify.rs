//! `flashtier verify`: check every record or block of a flashtier file
//! against its checksum. The file's kind comes from its magic
//! ([`flashtier::verify::sniff`]); the checks live in the library
//! ([`flashtier::experts::verify`] for expert stores and low-bit companions,
//! [`flashtier::rows::verify`] for row shards, [`flashtier::kv::verify`] for
//! KV stores) and read through the posix backend, O_DIRECT where the file
//! system allows it. This module dispatches, draws the progress bar and
//! prints.

use std::path::{Path, PathBuf};

pub use flashtier::verify::VerifyReport;
use flashtier::verify::{Progress, QUEUE_WINDOWS, sniff};
use flashtier_format::{FileKind, Store};
use flashtier_io::{DirectMode, PosixBackend};

use super::pack::experts::bytes_bar;

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

/// Run `verify` with a progress bar in bytes (hidden unless `show`).
fn with_progress<T>(show: bool, verify: impl FnOnce(Progress<'_>) -> T) -> T {
    let bar = if show {
        bytes_bar(0, "verifying")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let out = verify(&mut progress);
    bar.finish_and_clear();
    out
}

/// Check every record of the record store at `path` (the demo's step 3).
pub fn verify_store(
    path: &Path,
    direct: DirectMode,
    show: bool,
) -> anyhow::Result<(Store, VerifyReport)> {
    let backend = PosixBackend::new(QUEUE_WINDOWS)?;
    Ok(with_progress(show, |p| {
        flashtier::experts::verify::verify_store(path, &backend, direct, p)
    })?)
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
        let (store, report) = verify_store(&args.file, args.direct, !args.json)?;
        if let Some(model) = &args.model {
            let ckpt = flashtier_engine::source::Checkpoint::open(model)?;
            flashtier_engine::pack::check_pairing(&store, &ckpt)?;
        }
        return Ok(report);
    }
    let backend = PosixBackend::new(QUEUE_WINDOWS)?;
    let (path, direct) = (args.file.as_path(), args.direct);
    with_progress(!args.json, |p| match kind {
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
