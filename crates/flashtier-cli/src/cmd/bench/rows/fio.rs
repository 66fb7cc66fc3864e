//! fio as the drive's own limit: 4 KiB O_DIRECT random reads at a given
//! queue depth on the same file, fresh random offsets every run.

use std::path::Path;
use std::process::Command;

use anyhow::Context;

/// Whether fio is installed.
pub fn available() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// IOPS of `fio` 4 KiB randread (libaio, O_DIRECT) at `iodepth` for
/// `seconds` on `path`, offsets seeded by `seed` (never repeated across runs).
pub fn randread_iops(path: &Path, iodepth: u32, seconds: f64, seed: u64) -> anyhow::Result<f64> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .len();
    let runtime_ms = (seconds * 1000.0).max(500.0) as u64;
    let out = Command::new("fio")
        .arg("--name=flashtier-rows")
        .arg(format!("--filename={}", path.display()))
        .args([
            "--rw=randread",
            "--bs=4k",
            "--direct=1",
            "--ioengine=libaio",
            "--time_based",
        ])
        .args(["--randrepeat=0", "--norandommap", "--output-format=json"])
        .arg(format!("--size={}", size / 4096 * 4096))
        .arg(format!("--iodepth={iodepth}"))
        .arg(format!("--runtime={runtime_ms}ms"))
        .arg(format!("--randseed={seed}"))
        .output()
        .context("run fio")?;
    anyhow::ensure!(
        out.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parse fio JSON")?;
    v["jobs"][0]["read"]["iops"]
        .as_f64()
        .context("fio JSON lacks jobs[0].read.iops")
}
