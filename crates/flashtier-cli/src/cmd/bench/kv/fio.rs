//! fio as the drive's own limit: read one part of a freshly written store
//! sequentially with O_DIRECT at the restore's op size and queue depth.

use std::path::Path;

use anyhow::{Result, bail};

use crate::kit::fio::{Job, Rw};

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
/// queue depth `qd`; the read bandwidth in bytes/s. Tries io_uring (with
/// registered buffers and files, as the restore uses), then libaio.
pub fn seq_read_part_bytes_per_sec(file: &Path, part: Part, bs: u64, qd: usize) -> Result<f64> {
    let start = part.data_offset + part.lo;
    let region_end = part.data_offset + part.region_bytes * part.regions;
    let want = part.len * part.regions;
    let mut last = None;
    for engine in ["io_uring", "libaio"] {
        let mut job = Job::new("kvread", file, Rw::Read, bs)
            .queue(engine, qd)
            .span(start, region_end - start)
            .io_total(want)
            .arg("--thread")
            .arg("--zonemode=strided")
            .arg(format!("--zonesize={}", part.len))
            .arg(format!("--zonerange={}", part.region_bytes));
        if engine == "io_uring" {
            job = job.arg("--fixedbufs=1").arg("--registerfiles=1");
        }
        match job.read() {
            Ok(r) if r.io_bytes != want => bail!("fio read {} bytes of {want}", r.io_bytes),
            Ok(r) => return Ok(r.bytes_per_sec),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("fio did not run")))
}
