//! What the demo reports: each decode, the bound it is held against, the
//! whole report `--json` prints.

use super::*;

/// One decode of the demo.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeRun {
    /// `cpu` or `cuda`.
    pub device: String,
    /// The GPU's name, on a GPU.
    pub gpu_name: Option<String>,
    /// Why `auto` stayed on the CPU, when it did.
    pub fallback: Option<String>,
    /// Backing of the expert pool (`slots`, `mapped`; `hbm` on a GPU).
    pub backing: String,
    /// Generated token ids.
    pub generated_ids: Vec<u32>,
    /// Decode steps timed.
    pub steps: u64,
    /// Tokens per second over the decode steps.
    pub tokens_per_sec: f64,
    /// Expert uses served resident.
    pub expert_hit_rate: f64,
    /// Bytes read from the drive per decode step (misses and prefetches).
    pub miss_bytes_per_token: f64,
    /// Of those, bytes read ahead on the engine's pre-gating hint.
    pub prefetch_bytes_per_token: f64,
    /// Of the read-ahead bytes, those of records then used.
    pub prefetch_used_bytes_per_token: f64,
    /// Share of decode time spent waiting for expert reads.
    pub stall_fraction: f64,
    /// Bytes copied host -> device per decode step (GPU tiers; 0 on the CPU).
    pub h2d_bytes_per_token: f64,
    /// PLE row lookups served by the row cache (rows from the row store).
    pub row_hit_rate: Option<f64>,
    /// Bytes of row-shard blocks read per decode step.
    pub row_bytes_read_per_token: Option<f64>,
    /// Share of decode time the forward pass spent on rows (starting their
    /// prefetch, waiting for it, looking up).
    pub row_stall_fraction: Option<f64>,
    /// Share of the decode with at least one expert read in flight (where
    /// the backend meters its reads: posix, sim; see
    /// [`flashtier_io::activity`]). The drive has nothing to do for the
    /// rest: for Qwen4-Exp, chiefly while the LM head runs.
    pub drive_busy_share: Option<f64>,
    /// Expert reads in flight on average while any was (at most the queue
    /// depth the drive probes use).
    pub reads_in_flight_while_busy: Option<f64>,
}

/// How the streamed decode compares with the drive.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Bound {
    /// The decode reached `fraction` of the I/O bound (at most about 1).
    Measured {
        /// Streamed tokens/s over the bound from the median probe.
        fraction: f64,
    },
    /// The decode read faster than the drive did on records of the same
    /// size at the same queue depth: the machine (a virtual disk's host
    /// cache, most likely) served reads from memory, so no drive bound can
    /// be measured here.
    Unmeasurable {
        /// Streamed tokens/s over the probe's bound (above 1).
        ratio: f64,
    },
    /// Every expert use hit memory: no reads, no bound.
    NoReads,
}

/// Above this ratio to the probe's bound the decode cannot have been served
/// by the drive alone (probe noise stays well inside 10%).
const CACHED_ABOVE: f64 = 1.1;

impl Bound {
    pub(super) fn of(tokens_per_sec: f64, bound: f64) -> Self {
        if !bound.is_finite() {
            return Self::NoReads;
        }
        let f = tokens_per_sec / bound;
        if f > CACHED_ABOVE {
            Self::Unmeasurable { ratio: f }
        } else {
            Self::Measured { fraction: f }
        }
    }
}

/// What the demo measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DemoReport {
    /// The probes' first round: repetition `r` probes round `probe_seed +
    /// r` (records by `flashtier_io::record_extents`, row blocks by
    /// `rows::probe_rows`), a new seed each run.
    pub probe_seed: u64,
    /// Bytes of all expert records (payload).
    pub expert_bytes: u64,
    /// Expert budget in bytes.
    pub budget_bytes: u64,
    /// Expert reads in flight at most, in the decode and in the probes.
    pub queue_depth: usize,
    /// Drive read bandwidth, each probe (bytes/s).
    pub drive_probes_bytes_per_sec: Vec<f64>,
    /// Median of the probes (bytes/s).
    pub drive_bytes_per_sec: f64,
    /// The drive replaying the median repetition's own reads (bytes/s).
    pub replay_bytes_per_sec: f64,
    /// Streamed decode (slots backing, direct reads): the median repetition.
    pub streamed: DecodeRun,
    /// The CPU reference: the median repetition's decode on the mapped
    /// (page-cache) backing.
    pub mapped: DecodeRun,
    /// Tokens/s the drive allows for the streamed decode's reads: experts
    /// at `drive_bytes_per_sec` plus, for Qwen4-Exp, rows at
    /// `rows.drive_bytes_per_sec`.
    pub io_bound_tokens_per_sec: f64,
    /// `streamed.tokens_per_sec / io_bound_tokens_per_sec` of every
    /// repetition against its own probe, in run order.
    pub fractions_of_io_bound: Vec<f64>,
    /// The median repetition against the median probe.
    pub bound: Bound,
    /// `streamed.tokens_per_sec` over the bound from replaying its own reads
    /// (which the host's cache may serve).
    pub fraction_of_replay_bound: f64,
    /// Every repetition's streamed decode produced the tokens of the CPU
    /// reference on its prompt.
    pub same_tokens: bool,
    /// Qwen4-Exp's PLE rows: the tables, the budget and the row probes.
    pub rows: Option<RowsReport>,
    /// What the streamed decode would give on a faster drive (a
    /// projection from this run's numbers, not a measurement).
    pub projection: Projection,
    /// Wall time of the whole demo, seconds.
    pub elapsed_secs: f64,
}

/// The drive the projection assumes: 14 GB/s of large reads (a PCIe 5
/// NVMe drive's sequential rate).
pub const FAST_DRIVE_BYTES_PER_SEC: f64 = 14e9;

/// The streamed decode on a [`FAST_DRIVE_BYTES_PER_SEC`] drive: the step's
/// time not spent waiting for reads (expert stall and row stall taken
/// out) against the drive time of its reads there, expert bytes at the
/// fast drive's rate and row bytes at it times this drive's ratio of
/// 4 KiB row-block reads to record reads (small random reads keep their
/// disadvantage). The slower of the two bounds a step.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Projection {
    /// Seconds per token of the streamed decode not waiting for reads.
    pub compute_secs_per_token: f64,
    /// Seconds per token the fast drive needs for the same reads.
    pub drive_secs_per_token: f64,
    /// `1 / max(compute, drive)`.
    pub tokens_per_sec: f64,
}

impl Projection {
    /// The projection of `run`, whose records this drive read at
    /// `expert_bps` and row blocks at `row_bps`.
    pub(super) fn of(run: &DecodeRun, expert_bps: f64, row_bps: Option<f64>) -> Self {
        let step = 1.0 / run.tokens_per_sec.max(1e-9);
        let waiting = run.stall_fraction + run.row_stall_fraction.unwrap_or(0.0);
        let compute = step * (1.0 - waiting).clamp(0.0, 1.0);
        let row_share = match (run.row_bytes_read_per_token, row_bps) {
            (Some(b), Some(r)) if r > 0.0 => b * expert_bps / r,
            _ => 0.0,
        };
        let drive = (run.miss_bytes_per_token + row_share) / FAST_DRIVE_BYTES_PER_SEC;
        Self {
            compute_secs_per_token: compute,
            drive_secs_per_token: drive,
            tokens_per_sec: 1.0 / compute.max(drive).max(1e-12),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        tokens_per_sec: f64,
        stall: f64,
        row_stall: Option<f64>,
        rows: Option<f64>,
    ) -> DecodeRun {
        DecodeRun {
            device: "cuda".into(),
            gpu_name: None,
            fallback: None,
            backing: "hbm".into(),
            generated_ids: Vec::new(),
            steps: 10,
            tokens_per_sec,
            expert_hit_rate: 0.9,
            miss_bytes_per_token: 140e6,
            prefetch_bytes_per_token: 0.0,
            prefetch_used_bytes_per_token: 0.0,
            stall_fraction: stall,
            h2d_bytes_per_token: 0.0,
            row_hit_rate: None,
            row_bytes_read_per_token: rows,
            row_stall_fraction: row_stall,
            drive_busy_share: None,
            reads_in_flight_while_busy: None,
        }
    }

    #[test]
    fn the_projection_takes_the_slower_of_compute_and_the_fast_drive() {
        // 10 tok/s, 60% + 10% waiting: 30 ms of compute a token; 140 MB
        // of records at 14 GB/s is 10 ms, plus 1 MB of row blocks that
        // read 8x slower than records here: 8 MB's worth, 0.57 ms.
        let p = Projection::of(&run(10.0, 0.6, Some(0.1), Some(1e6)), 2e9, Some(0.25e9));
        assert!((p.compute_secs_per_token - 0.03).abs() < 1e-12, "{p:?}");
        assert!(
            (p.drive_secs_per_token - 148e6 / 14e9).abs() < 1e-12,
            "{p:?}"
        );
        assert!((p.tokens_per_sec - 1.0 / 0.03).abs() < 1e-9, "{p:?}");
        // Compute-light: the drive bounds it.
        let p = Projection::of(&run(10.0, 0.99, None, None), 2e9, None);
        assert!((p.drive_secs_per_token - 0.01).abs() < 1e-12, "{p:?}");
        assert!((p.tokens_per_sec - 100.0).abs() < 1e-9, "{p:?}");
    }
}
