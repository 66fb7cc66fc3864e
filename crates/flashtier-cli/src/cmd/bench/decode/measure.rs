//! What `bench decode` holds its runs against, measured in the same run:
//! the device's own limits ([`measure_limits`]: HBM read bandwidth, a
//! device-to-device copy, the pinned host-to-device copy), the roofline of
//! a resident decode step per kernel class ([`profile`]), and the drive's
//! bound on a streamed decode ([`streamed_bound`]).
//!
//! Bounds: the bandwidth probes read 4 GiB (HBM), copy 2 GiB (device to
//! device) and 2 GiB in 8 MiB pieces (host to device); the drive probes
//! read [`PROBE_RECORDS`] whole records each, one before the streamed decode
//! and one after it on records neither the decode nor the first probe read,
//! at the decode's queue depth, so no cache serves them.

use std::path::Path;

use flashtier_engine::Model;
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::device::cuda::experts::TierStats;
use flashtier_engine::device::cuda::profile::ClassTime;
use flashtier_format::Store;
use flashtier_io::probe::{Extent, Refill, read_extents};
use serde::Serialize;

use super::{Args, prompt};

/// One decode mode's result.
#[derive(Debug, Serialize, Default)]
pub(super) struct Run {
    pub(super) mode: String,
    pub(super) budget_hbm_bytes: u64,
    pub(super) budget_ram_bytes: u64,
    pub(super) tokens_per_sec: f64,
    pub(super) decode_steps: u64,
    pub(super) expert_hit_rate: f64,
    pub(super) miss_bytes_per_token: f64,
    pub(super) h2d_bytes_per_token: f64,
    pub(super) stall_fraction: f64,
    /// Share of the decode time the host spent issuing the steps' work
    /// before waiting on each step's token.
    pub(super) issue_fraction: Option<f64>,
    pub(super) tiers: Option<TierStats>,
    pub(super) generated_ids: Vec<u32>,
    /// Kernels one decode step ran (resident mode: one step more after the
    /// timed ones, counted by the launch path), and how many of them ran
    /// inside graph replays.
    pub(super) step_kernels: Option<StepKernels>,
}

/// The kernels of one decode step ([`Run::step_kernels`]).
#[derive(Debug, Clone, Copy, Serialize)]
pub(super) struct StepKernels {
    pub(super) kernels: u64,
    pub(super) in_graphs: u64,
    pub(super) graph_launches: u64,
}

/// The device's own limits.
#[derive(Debug, Serialize)]
pub(super) struct Limits {
    pub(super) gpu: String,
    pub(super) hbm_read_bytes_per_sec: f64,
    pub(super) d2d_copy_bytes_per_sec: f64,
    pub(super) h2d_pinned_bytes_per_sec: f64,
}

/// A resident decode step against the HBM read bound, overall and per
/// kernel class.
#[derive(Debug, Serialize)]
pub(super) struct Roofline {
    pub(super) bytes_per_token: f64,
    roofline_secs_per_token: f64,
    pub(super) measured_secs_per_token: f64,
    pub(super) fraction: f64,
    pub(super) classes: Vec<ClassRow>,
}

/// One kernel class of a [`Roofline`].
#[derive(Debug, Serialize)]
pub(super) struct ClassRow {
    #[serde(flatten)]
    pub(super) time: ClassTime,
    pub(super) secs_per_token: f64,
    pub(super) fraction_of_read_bandwidth: f64,
}

/// A streamed decode against the drive's bound.
#[derive(Debug, Serialize)]
pub(super) struct Streamed {
    pub(super) drive_bytes_per_sec: f64,
    pub(super) drive_before_bytes_per_sec: f64,
    pub(super) drive_after_bytes_per_sec: f64,
    pub(super) drive_probe_reads: usize,
    pub(super) io_bound_tokens_per_sec: f64,
    pub(super) fraction_of_io_bound: f64,
    compute_secs_per_token: f64,
    pub(super) projected_tokens_per_sec_at_14gbps: f64,
}

pub(super) fn measure_limits(dev: &CudaDevice) -> anyhow::Result<Limits> {
    let gpu = dev.gpu();
    let hbm = dev.kernels().read_bandwidth(4 << 30, 5)?;
    let d2d = flashtier_cuda::measure::d2d_bytes_per_s(gpu, 2 << 30, 5)?;
    let h2d = flashtier_cuda::measure::h2d_bytes_per_s(gpu, 8 << 20, 16, 2 << 30)?;
    Ok(Limits {
        gpu: gpu.info().name.clone(),
        hbm_read_bytes_per_sec: hbm,
        d2d_copy_bytes_per_sec: d2d,
        h2d_pinned_bytes_per_sec: h2d,
    })
}

/// Per-class device time over `--profile-tokens` decode steps, and the
/// roofline fractions.
pub(super) fn profile(
    m: &mut Model<CudaDevice>,
    args: &Args,
    limits: &Limits,
    tok_s: f64,
) -> anyhow::Result<Roofline> {
    m.reset()?;
    let vocab = m.config().vocab_size;
    m.forward(&prompt(args.prompt_len, vocab), false)?;
    profile_steps(
        m,
        |m| m.device(),
        args.profile_tokens,
        (limits, tok_s, vocab),
        |m, t| {
            m.forward(&[t], false)?;
            Ok(())
        },
    )
}

/// Per-class device time over `n` (at least one) one-token steps of
/// `step` on `m` (whose device `dev` gives), fed pseudo-random tokens of
/// the vocabulary, and the roofline fractions against the measured
/// tokens/s.
pub(super) fn profile_steps<M>(
    m: &mut M,
    dev: impl Fn(&M) -> &CudaDevice,
    n: usize,
    (limits, tok_s, vocab): (&Limits, f64, usize),
    mut step: impl FnMut(&mut M, u32) -> anyhow::Result<()>,
) -> anyhow::Result<Roofline> {
    let n = n.max(1);
    dev(m).profile_start();
    for i in 0..n {
        step(m, ((i * 31 + 7) % vocab.max(1)) as u32)?;
    }
    let classes = dev(m).profile_take()?;
    let bw = limits.hbm_read_bytes_per_sec.max(1.0);
    let bytes: u64 = classes.iter().map(|c| c.bytes).sum();
    let bytes_per_token = bytes as f64 / n as f64;
    let measured = 1.0 / tok_s.max(1e-9);
    let rows = classes
        .into_iter()
        .map(|c| ClassRow {
            secs_per_token: c.secs / n as f64,
            fraction_of_read_bandwidth: c.bytes_per_sec() / bw,
            time: c,
        })
        .collect();
    Ok(Roofline {
        bytes_per_token,
        roofline_secs_per_token: bytes_per_token / bw,
        measured_secs_per_token: measured,
        fraction: bytes_per_token / bw / measured,
        classes: rows,
    })
}

/// Per-class device time of one prefill of `long` (a profiled pass, after
/// the timed one), per prompt token.
pub(super) fn profile_prefill(
    m: &mut Model<CudaDevice>,
    long: &[u32],
    limits: &Limits,
) -> anyhow::Result<Vec<ClassRow>> {
    m.reset()?;
    profile_pass(
        m,
        |m| m.device(),
        (long.len(), limits),
        |m| {
            m.generate(long, 0, &[], false, |_| {})?;
            Ok(())
        },
    )
}

/// Per-class device time of `pass` on `m`'s device (`dev`), per one of
/// its `tokens`.
pub(super) fn profile_pass<M>(
    m: &mut M,
    dev: impl Fn(&M) -> &CudaDevice,
    (tokens, limits): (usize, &Limits),
    pass: impl FnOnce(&mut M) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<ClassRow>> {
    dev(m).profile_start();
    pass(m)?;
    let classes = dev(m).profile_take()?;
    let bw = limits.hbm_read_bytes_per_sec.max(1.0);
    let n = tokens.max(1) as f64;
    Ok(classes
        .into_iter()
        .map(|c| ClassRow {
            secs_per_token: c.secs / n,
            fraction_of_read_bandwidth: c.bytes_per_sec() / bw,
            time: c,
        })
        .collect())
}

/// `want` records (whole strides) of `opened` whose offsets are not in
/// `exclude`, spread over the store.
pub(super) fn fresh_extents(
    opened: &Store,
    exclude: &std::collections::HashSet<u64>,
    want: usize,
) -> anyhow::Result<Vec<Extent>> {
    let len = opened.stride_bytes() as usize;
    let mut fresh = Vec::with_capacity(want);
    let records = opened.record_count();
    for i in 0..records {
        let r = (i.wrapping_mul(0x9E37_79B9) + 7) % records;
        let offset = opened.record_offset(r)?;
        if !exclude.contains(&offset) && fresh.iter().all(|e: &Extent| e.offset != offset) {
            fresh.push(Extent { offset, len });
        }
        if fresh.len() >= want {
            break;
        }
    }
    Ok(fresh)
}

/// Records the drive probes read on each side of the streamed decode.
pub(super) const PROBE_RECORDS: usize = 256;

/// The drive read `PROBE_RECORDS` records at the pool's queue depth: the
/// probe before the streamed decode (records from the end of the probe
/// order, which the decode's pool has not read yet).
pub(super) fn probe_before(
    store: &Path,
    opened: &Store,
    qd: usize,
) -> anyhow::Result<(f64, Vec<Extent>)> {
    let all = fresh_extents(opened, &Default::default(), 2 * PROBE_RECORDS)?;
    let mine = all[all.len().saturating_sub(PROBE_RECORDS)..].to_vec();
    let probe = read_extents(store, &mine, qd, Refill::Sliding, &mut |_| {})?;
    Ok((probe.bytes_per_sec(), mine))
}

/// The drive on records neither the decode nor the first probe read, as
/// many as the first probe, at the same queue depth, right after the
/// decode; the I/O bound from the mean of the two probes (the drive's rate
/// around the decode), and a faster drive's projection.
pub(super) fn streamed_bound(
    store: &Path,
    opened: &Store,
    decode: &[Extent],
    (run, qd): (&Run, usize),
    (before, before_reads): (f64, &[Extent]),
) -> anyhow::Result<Streamed> {
    let mut exclude: std::collections::HashSet<u64> = decode.iter().map(|e| e.offset).collect();
    exclude.extend(before_reads.iter().map(|e| e.offset));
    let fresh = fresh_extents(opened, &exclude, before_reads.len().max(16))?;
    let probe = read_extents(store, &fresh, qd, Refill::Sliding, &mut |_| {})?;
    let after = probe.bytes_per_sec();
    let drive = if before > 0.0 {
        (before + after) / 2.0
    } else {
        after
    };
    let bound = if run.miss_bytes_per_token > 0.0 {
        drive / run.miss_bytes_per_token
    } else {
        f64::INFINITY
    };
    let secs = 1.0 / run.tokens_per_sec.max(1e-9);
    let compute = secs * (1.0 - run.stall_fraction);
    let at_fast = 1.0 / (compute.max(run.miss_bytes_per_token / 14e9));
    Ok(Streamed {
        drive_bytes_per_sec: drive,
        drive_before_bytes_per_sec: before,
        drive_after_bytes_per_sec: after,
        drive_probe_reads: fresh.len(),
        io_bound_tokens_per_sec: bound,
        fraction_of_io_bound: run.tokens_per_sec / bound,
        compute_secs_per_token: compute,
        projected_tokens_per_sec_at_14gbps: at_fast,
    })
}
