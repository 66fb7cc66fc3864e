//! fio as the drive's own limit: write a fresh file, read it back
//! sequentially with O_DIRECT at the restore's op size and queue depth.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

fn run_fio(args: &[String]) -> Result<serde_json::Value> {
    let out = Command::new("fio")
        .args(args)
        .arg("--output-format=json")
        .output()
        .context("running fio (install it: apt-get install -y fio)")?;
    if !out.status.success() {
        bail!(
            "fio {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notices before the JSON document.
    let start = text.find('{').context("fio printed no JSON")?;
    serde_json::from_str(&text[start..]).context("parsing fio JSON")
}

fn job(
    name: &str,
    file: &Path,
    rw: &str,
    bs: u64,
    size: u64,
    qd: usize,
    engine: &str,
) -> Vec<String> {
    vec![
        format!("--name={name}"),
        format!("--filename={}", file.display()),
        format!("--rw={rw}"),
        format!("--bs={bs}"),
        format!("--size={size}"),
        "--direct=1".into(),
        format!("--ioengine={engine}"),
        format!("--iodepth={qd}"),
        "--numjobs=1".into(),
        "--thread".into(),
    ]
}

/// fio's version string.
pub fn version() -> Result<String> {
    let out = Command::new("fio")
        .arg("--version")
        .output()
        .context("fio not found (apt-get install -y fio)")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Write `size` fresh bytes to `file`, then read them sequentially in `bs`
/// ops at queue depth `qd`; the read bandwidth in bytes/s. Tries io_uring,
/// then libaio.
pub fn seq_read_bytes_per_sec(file: &Path, size: u64, bs: u64, qd: usize) -> Result<f64> {
    let mut last = None;
    for engine in ["io_uring", "libaio"] {
        let write = job("kvfill", file, "write", 1 << 20, size, 16, engine);
        if let Err(e) = run_fio(&write) {
            last = Some(e);
            continue;
        }
        let read = job("kvread", file, "read", bs, size, qd, engine);
        match run_fio(&read) {
            Ok(v) => {
                let bw = v["jobs"][0]["read"]["bw_bytes"]
                    .as_f64()
                    .context("fio JSON has no jobs[0].read.bw_bytes")?;
                return Ok(bw);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("fio did not run")))
}
