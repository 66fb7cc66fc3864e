//! The steps the commands chain (synthesize a checkpoint, pack its
//! experts, verify a store), each with its progress bar, and the pack
//! report's two renderings.

use std::path::Path;

use anyhow::Context as _;
use flashtier::verify::{Progress, QUEUE_WINDOWS, VerifyReport};
use flashtier_format::Store;
use flashtier_io::{DirectMode, PosixBackend};
use flashtier_pack::pack::{PackOptions, PackReport, pack_experts, plan_experts, planned_bytes};
use flashtier_pack::synth::{SynthReport, SynthSpec, remove_synthetic, write_checkpoint};

use super::bytes_bar;

/// Write the synthetic checkpoint `spec` into `dir` with a byte bar,
/// replacing an older synthetic checkpoint there (never anything else:
/// [`remove_synthetic`] refuses a folder that is not one).
pub fn synth_with_bar(spec: &SynthSpec, dir: &Path, show: bool) -> anyhow::Result<SynthReport> {
    remove_synthetic(dir)?;
    let bar = bytes_bar(spec.total_bytes(), "generating", show);
    let report = write_checkpoint(spec, dir, &mut |n| bar.inc(n))?;
    bar.finish_and_clear();
    Ok(report)
}

/// Pack the experts `opts` names with a byte bar of the planned bytes.
pub fn pack_with_bar(opts: &PackOptions, show: bool) -> anyhow::Result<PackReport> {
    let ckpt = flashtier_engine::checkpoint::files::CheckpointFiles::open(&opts.model_dir)
        .with_context(|| format!("opening {}", opts.model_dir.display()))?;
    let (_, manifest) = plan_experts(&ckpt)?;
    drop(ckpt);
    let bar = bytes_bar(planned_bytes(&manifest), "packing", show);
    let report = pack_experts(opts, &|n| bar.inc(n)).with_context(|| {
        format!(
            "packing {} into {}",
            opts.model_dir.display(),
            opts.out.display()
        )
    })?;
    bar.finish_and_clear();
    Ok(report)
}

/// Run `verify` with a progress bar in bytes (hidden unless `show`).
pub fn with_verify_bar<T>(show: bool, verify: impl FnOnce(Progress<'_>) -> T) -> T {
    let bar = bytes_bar(0, "verifying", show);
    let mut progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let out = verify(&mut progress);
    bar.finish_and_clear();
    out
}

/// Check every record of the record store at `path` with a byte bar.
pub fn verify_with_bar(
    path: &Path,
    direct: DirectMode,
    show: bool,
) -> anyhow::Result<(Store, VerifyReport)> {
    let backend = PosixBackend::new(QUEUE_WINDOWS)?;
    Ok(with_verify_bar(show, |p| {
        flashtier::experts::verify::verify_store(path, &backend, direct, p)
    })?)
}

/// A pack report as JSON.
pub fn pack_json(r: &PackReport) -> serde_json::Value {
    serde_json::json!({
        "out": r.out,
        "layout": r.family.name(),
        "dtype": r.dtype.name(),
        "records": r.records,
        "payload_bytes": r.payload_bytes,
        "record_stride_bytes": r.stride_bytes,
        "file_len_bytes": r.file_len_bytes,
        "direct": r.direct,
        "reused": r.reused,
        "elapsed_s": r.elapsed.as_secs_f64(),
        "write_bytes_per_s": r.file_len_bytes as f64 / r.elapsed.as_secs_f64().max(1e-9),
    })
}

/// One-line human summary of a pack.
pub fn pack_line(r: &PackReport) -> String {
    if r.reused {
        return format!(
            "using {}: another writer packed it ({} experts, {}, {})",
            r.out.display(),
            r.records,
            r.family.name(),
            r.dtype
        );
    }
    let secs = r.elapsed.as_secs_f64().max(1e-9);
    format!(
        "packed {} experts ({}, {}) into {}: {:.1} MiB in {:.2} s ({:.0} MiB/s, {})",
        r.records,
        r.family.name(),
        r.dtype,
        r.out.display(),
        r.file_len_bytes as f64 / f64::from(1 << 20),
        secs,
        r.file_len_bytes as f64 / f64::from(1 << 20) / secs,
        if r.direct { "O_DIRECT" } else { "buffered" },
    )
}
