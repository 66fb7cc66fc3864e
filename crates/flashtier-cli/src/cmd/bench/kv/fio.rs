//! fio as the drive's own limit: read one part of a freshly written store
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

/// The bytes of one part of a store's data area that fio reads.
///
/// The data area is `regions` equal regions (one per layer in the per-layer
/// order, one in the block-major order); the part is the slice
/// `[lo, lo + len)` of every region. fio reads exactly those bytes, once,
/// region by region, through its strided zone mode.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    /// File offset of the first region.
    pub data_offset: u64,
    /// Bytes per region.
    pub region_bytes: u64,
    /// Regions in the data area.
    pub regions: u64,
    /// Offset of the part inside each region.
    pub lo: u64,
    /// Bytes of the part inside each region.
    pub len: u64,
}

/// Read `part` of the (already written) `file` sequentially in `bs` ops at
/// queue depth `qd`; the read bandwidth in bytes/s. Tries io_uring, then
/// libaio.
pub fn seq_read_part_bytes_per_sec(file: &Path, part: Part, bs: u64, qd: usize) -> Result<f64> {
    let start = part.data_offset + part.lo;
    let region_end = part.data_offset + part.region_bytes * part.regions;
    let mut last = None;
    for engine in ["io_uring", "libaio"] {
        let mut read = job("kvread", file, "read", bs, region_end - start, qd, engine);
        if engine == "io_uring" {
            // fio's strongest io_uring setup: registered buffers and files,
            // as the restore uses.
            read.extend(["--fixedbufs=1".into(), "--registerfiles=1".into()]);
        }
        read.extend([
            format!("--offset={start}"),
            format!("--io_size={}", part.len * part.regions),
            "--zonemode=strided".into(),
            format!("--zonesize={}", part.len),
            format!("--zonerange={}", part.region_bytes),
        ]);
        match run_fio(&read) {
            Ok(v) => {
                let bw = v["jobs"][0]["read"]["bw_bytes"]
                    .as_f64()
                    .context("fio JSON has no jobs[0].read.bw_bytes")?;
                let io = v["jobs"][0]["read"]["io_bytes"].as_u64().unwrap_or(0);
                if io != part.len * part.regions {
                    bail!("fio read {io} bytes of {}", part.len * part.regions);
                }
                return Ok(bw);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("fio did not run")))
}
