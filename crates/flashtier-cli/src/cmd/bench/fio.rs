//! fio, the drive's own limit in every bench: the one place that runs it and
//! reads its JSON report. Each bench builds its own job (pattern, span, queue
//! depth); random jobs must pass `--randrepeat=0`, since fio 3.33 ignores
//! `--randseed` otherwise and re-reads its previous run's (host-cached)
//! offsets.

use std::ffi::OsStr;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// fio's version string.
pub fn version() -> Result<String> {
    let out = Command::new("fio")
        .arg("--version")
        .output()
        .context("fio not found (apt-get install -y fio)")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether fio is installed.
pub fn available() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Run fio with `args` and `--output-format=json`; its report (notices fio
/// prints before the JSON are skipped).
pub fn run_json<I, S>(args: I) -> Result<serde_json::Value>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let out = Command::new("fio")
        .args(&args)
        .arg("--output-format=json")
        .output()
        .context("running fio (install it: apt-get install -y fio)")?;
    if !out.status.success() {
        let shown: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
        bail!(
            "fio {} failed: {}",
            shown.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').context("fio printed no JSON")?;
    serde_json::from_str(&text[start..]).context("parsing fio JSON")
}

/// The read side of a report's first job (with `--group_reporting`, all
/// jobs together).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadStats {
    /// Reads per second.
    pub iops: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Bytes read.
    pub io_bytes: u64,
    /// Completion latency percentiles (fio's `clat`), microseconds.
    pub lat_us_p50: f64,
    /// 99th percentile.
    pub lat_us_p99: f64,
    /// 99.9th percentile.
    pub lat_us_p999: f64,
}

/// [`ReadStats`] of `report`; an error when it has no read side.
pub fn read_stats(report: &serde_json::Value) -> Result<ReadStats> {
    let read = &report["jobs"][0]["read"];
    let bytes_per_sec = read["bw_bytes"]
        .as_f64()
        .context("fio JSON has no jobs[0].read.bw_bytes")?;
    let pct = |k: &str| read["clat_ns"]["percentile"][k].as_f64().unwrap_or(0.0) / 1e3;
    Ok(ReadStats {
        iops: read["iops"].as_f64().unwrap_or(0.0),
        bytes_per_sec,
        io_bytes: read["io_bytes"].as_u64().unwrap_or(0),
        lat_us_p50: pct("50.000000"),
        lat_us_p99: pct("99.000000"),
        lat_us_p999: pct("99.900000"),
    })
}
