//! fio as the drive's own limit: 4 KiB O_DIRECT random reads at a given
//! queue depth on the same file, fresh random offsets every run.

use std::path::Path;

use anyhow::Context;

pub use crate::cmd::bench::fio::available;
use crate::cmd::bench::fio::{read_stats, run_json};

/// IOPS of `fio` 4 KiB randread (libaio, O_DIRECT) at `iodepth` for
/// `seconds` on `path`; offsets are drawn afresh every run (`--randrepeat=0`).
pub fn randread_iops(path: &Path, iodepth: u32, seconds: f64) -> anyhow::Result<f64> {
    randread(path, iodepth, seconds, &[])
}

/// IOPS of fio issuing synchronous batches of `batch` 4 KiB random reads:
/// all `batch` submitted at once, then every one of them reaped before the
/// next batch goes in (`--iodepth_batch_submit` and
/// `--iodepth_batch_complete_min` equal to the depth). The drive's own
/// limit for a caller that waits for each whole batch, drain included.
pub fn batched_randread_iops(path: &Path, batch: u32, seconds: f64) -> anyhow::Result<f64> {
    randread(
        path,
        batch,
        seconds,
        &[
            format!("--iodepth_batch_submit={batch}"),
            format!("--iodepth_batch_complete_min={batch}"),
        ],
    )
}

fn randread(path: &Path, iodepth: u32, seconds: f64, extra: &[String]) -> anyhow::Result<f64> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .len();
    let runtime_ms = (seconds * 1000.0).max(500.0) as u64;
    let report = run_json(
        [
            "--name=flashtier-rows".to_string(),
            format!("--filename={}", path.display()),
            "--rw=randread".into(),
            "--bs=4k".into(),
            "--direct=1".into(),
            "--ioengine=libaio".into(),
            "--time_based".into(),
            "--randrepeat=0".into(),
            "--norandommap".into(),
            format!("--size={}", size / 4096 * 4096),
            format!("--iodepth={iodepth}"),
            format!("--runtime={runtime_ms}ms"),
        ]
        .into_iter()
        .chain(extra.iter().cloned()),
    )?;
    Ok(read_stats(&report)?.iops)
}
