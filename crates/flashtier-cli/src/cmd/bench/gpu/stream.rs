//! Disk -> pinned -> HBM streaming against the drive and the H2D copy.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use flashtier_cuda::cudarc::driver::DevicePtr;
use flashtier_cuda::measure::h2d_bytes_per_s;
use flashtier_cuda::{Gpu, HbmSink};
use flashtier_io::{
    AlignedBuf, DeviceSink, DirectMode, Landing, PosixBackend, ReadReq, StorageBackend, StoreFile,
};
use serde::Serialize;

use super::{Opts, gbps};
use crate::kit::fio::{self, Job, Rw};
use crate::kit::limit::at_most;
use crate::kit::{Units, median_of, progress};

/// One interleaved repetition.
#[derive(Debug, Serialize)]
pub struct Rep {
    /// Our O_DIRECT posix reads into host memory, bytes/s.
    pub posix_drive_bps: f64,
    /// fio on the same pattern, bytes/s (when fio is installed).
    pub fio_bps: Option<f64>,
    /// Disk -> pinned -> HBM, bytes/s (until the copy stream is synchronised).
    pub pipeline_bps: f64,
    /// Pinned -> HBM copies alone, bytes/s.
    pub h2d_bps: f64,
}

/// The streaming result.
#[derive(Debug, Serialize)]
pub struct Streaming {
    /// Test file.
    pub file: String,
    /// Whether reads bypassed the page cache.
    pub direct: bool,
    /// Bytes per read.
    pub chunk_bytes: usize,
    /// Reads in flight.
    pub queue_depth: usize,
    /// Pinned staging slots of the sink.
    pub staging_slots: usize,
    /// Bytes per pass.
    pub region_bytes: usize,
    /// Every repetition.
    pub reps: Vec<Rep>,
    /// What the drive limit is: `fio` or `posix-odirect` (our own reader).
    pub drive_reference: &'static str,
    /// Median drive limit, bytes/s.
    pub drive_bps: f64,
    /// Median H2D copy, bytes/s.
    pub h2d_bps: f64,
    /// Median disk -> HBM, bytes/s.
    pub pipeline_bps: f64,
    /// pipeline / min(drive, h2d).
    pub ratio_vs_limit: f64,
}

/// Most bytes of one file region or read (`--region-mib`, `--chunk-mib`):
/// a region is allocated in host memory and in HBM.
const MAX_REGION_BYTES: u64 = 64 << 30;

/// Run the streaming comparison.
pub fn run(gpu: &Gpu, args: &Opts) -> anyhow::Result<Streaming> {
    let mib = |flag: &str, n: usize| at_most(flag, &[n as u64, 1 << 20], MAX_REGION_BYTES, "bytes");
    let chunk = mib("--chunk-mib", args.chunk_mib)? as usize;
    let region = mib("--region-mib", args.region_mib)? as usize / chunk.max(1) * chunk;
    anyhow::ensure!(
        region > 0 && args.reps > 0,
        "region and reps must be non-zero"
    );
    let fio = fio::available();
    let per_rep = if fio { 3 } else { 2 };
    let path = args.dir.join("flashtier-bench-gpu.bin");
    let regions = args.reps * per_rep;
    write_file(&path, regions * region, chunk)?;
    let file = StoreFile::open_read(&path, DirectMode::Prefer)?;
    let backend = PosixBackend::new(args.qd)?;
    let slots = 2 * args.qd;
    let sink = HbmSink::new(gpu, slots, chunk)?;
    let mut host_bufs: Vec<AlignedBuf> = (0..region / chunk)
        .map(|_| AlignedBuf::zeroed(chunk))
        .collect();
    let dev = gpu
        .stream()
        .alloc_zeros::<u8>(region)
        .context("allocate HBM target")?;
    sink.order_after(gpu.stream())?;
    let mut reps = Vec::new();
    for r in 0..args.reps {
        let base = (r * per_rep * region) as u64;
        let posix = drive_pass(&backend, &file, base, chunk, &mut host_bufs)?;
        let pipeline = pipeline_pass(
            gpu,
            &backend,
            &file,
            &sink,
            &dev,
            base + region as u64,
            chunk,
            region,
        )?;
        let fio_bps = if fio {
            let job = Job::new("drive", &path, Rw::Read, chunk as u64)
                .queue("libaio", args.qd)
                .span(base + 2 * region as u64, region as u64);
            Some(job.read()?.bytes_per_sec)
        } else {
            None
        };
        let h2d = h2d_bytes_per_s(gpu, chunk, slots, region)?;
        reps.push(Rep {
            posix_drive_bps: posix,
            fio_bps,
            pipeline_bps: pipeline,
            h2d_bps: h2d,
        });
    }
    drop(dev);
    let _ = std::fs::remove_file(&path);
    let med = |f: &dyn Fn(&Rep) -> f64| median_of(&reps, f);
    let (drive_reference, drive_bps) = if fio {
        ("fio", med(&|r| r.fio_bps.unwrap_or(0.0)))
    } else {
        ("posix-odirect", med(&|r| r.posix_drive_bps))
    };
    let h2d_bps = med(&|r| r.h2d_bps);
    let pipeline_bps = med(&|r| r.pipeline_bps);
    Ok(Streaming {
        file: path.display().to_string(),
        direct: file.is_direct(),
        chunk_bytes: chunk,
        queue_depth: args.qd,
        staging_slots: slots,
        region_bytes: region,
        reps,
        drive_reference,
        drive_bps,
        h2d_bps,
        pipeline_bps,
        ratio_vs_limit: pipeline_bps / drive_bps.min(h2d_bps),
    })
}

fn write_file(path: &Path, len: usize, chunk: usize) -> anyhow::Result<()> {
    let file = StoreFile::open_rw(path, DirectMode::Prefer, true)?;
    let mut buf = AlignedBuf::zeroed(chunk);
    let bar = progress(Units::Bytes, len as u64, "writing", true);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for off in (0..len).step_by(chunk) {
        for w in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        file.write_all_at(&buf, off as u64)?;
        bar.inc(chunk as u64);
    }
    file.sync_data()?;
    bar.finish_and_clear();
    Ok(())
}

fn drive_pass(
    backend: &PosixBackend,
    file: &Arc<StoreFile>,
    base: u64,
    chunk: usize,
    bufs: &mut Vec<AlignedBuf>,
) -> anyhow::Result<f64> {
    let n = bufs.len();
    let reqs: Vec<ReadReq> = bufs
        .drain(..)
        .enumerate()
        .map(|(i, b)| ReadReq {
            file: file.clone(),
            offset: base + (i * chunk) as u64,
            len: chunk,
            landing: Landing::Host(b),
            tag: i as u64,
        })
        .collect();
    let t0 = Instant::now();
    let landed = backend.read(reqs)?;
    let secs = t0.elapsed().as_secs_f64();
    bufs.extend(landed.into_iter().filter_map(|l| l.buf));
    Ok((n * chunk) as f64 / secs)
}

#[expect(
    clippy::too_many_arguments,
    reason = "one pass of the benchmark, all inputs explicit"
)]
fn pipeline_pass(
    gpu: &Gpu,
    backend: &PosixBackend,
    file: &Arc<StoreFile>,
    sink: &Arc<HbmSink>,
    dev: &flashtier_cuda::cudarc::driver::CudaSlice<u8>,
    base: u64,
    chunk: usize,
    region: usize,
) -> anyhow::Result<f64> {
    let (dst, _sync) = dev.device_ptr(gpu.stream());
    let reqs: Vec<ReadReq> = (0..region / chunk)
        .map(|i| ReadReq {
            file: file.clone(),
            offset: base + (i * chunk) as u64,
            len: chunk,
            landing: Landing::Device {
                sink: sink.clone() as Arc<dyn DeviceSink>,
                dst: dst + (i * chunk) as u64,
            },
            tag: i as u64,
        })
        .collect();
    let t0 = Instant::now();
    backend.read(reqs)?;
    sink.flush().map_err(anyhow::Error::msg)?;
    Ok(region as f64 / t0.elapsed().as_secs_f64())
}

/// Print the streaming table.
pub fn print(s: &Streaming) {
    println!(
        "\n## disk -> pinned -> HBM ({} MiB reads, qd {}, {} staging slots, direct {})",
        s.chunk_bytes >> 20,
        s.queue_depth,
        s.staging_slots,
        s.direct
    );
    println!(
        "{:>4} {:>14} {:>14} {:>14} {:>14}",
        "rep", "posix drive", "fio", "h2d copy", "disk->HBM"
    );
    for (i, r) in s.reps.iter().enumerate() {
        let fio = r.fio_bps.map_or_else(|| "-".to_string(), gbps);
        println!(
            "{i:>4} {:>14} {fio:>14} {:>14} {:>14}",
            gbps(r.posix_drive_bps),
            gbps(r.h2d_bps),
            gbps(r.pipeline_bps)
        );
    }
    println!(
        "median: drive ({}) {}, h2d {}, disk->HBM {} = {:.1}% of the slower",
        s.drive_reference,
        gbps(s.drive_bps),
        gbps(s.h2d_bps),
        gbps(s.pipeline_bps),
        100.0 * s.ratio_vs_limit
    );
}
