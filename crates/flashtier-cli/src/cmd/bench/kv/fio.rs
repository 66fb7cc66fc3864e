//! fio as the drive's own limit: read one part of a freshly written store
//! sequentially with O_DIRECT at the restore's op size and queue depth.

use std::path::Path;

use anyhow::{Result, bail};

use crate::cmd::bench::fio::{read_stats, run_json};

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
        match run_json(&read) {
            Ok(v) => {
                let r = read_stats(&v)?;
                if r.io_bytes != part.len * part.regions {
                    bail!(
                        "fio read {} bytes of {}",
                        r.io_bytes,
                        part.len * part.regions
                    );
                }
                return Ok(r.bytes_per_sec);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("fio did not run")))
}
