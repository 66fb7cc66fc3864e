//! The decode demo: a synthetic Qwen3-MoE checkpoint whose experts are
//! several times the budget, packed into an expert store, decoded with the
//! experts streamed under 25% of the expert bytes on the chosen device (the
//! GPU when there is one: HBM slots under the budget, misses landing
//! NVMe -> pinned staging -> HBM), and compared with the drive's own limit
//! measured in the same run and with the CPU engine's decode on the mapped
//! (page-cache) backing.
//!
//! Steps: [`write_checkpoint`] -> [`pack_experts`] -> `reps` interleaved
//! repetitions of { drive probe (direct reads of whole pseudo-random records
//! at the pool's queue depth, a new set each time) -> streamed decode with a
//! cold pool of the repetition's own prompt (a different token walk, so a
//! repetition does not replay the reads of the one before), every read
//! logged -> replay of that log (the drive on the decode's own offsets,
//! queue depth kept full) } -> the CPU decode of each repetition's prompt on
//! the mapped backing -> a last probe.
//!
//! The I/O bound is `probe bytes/s / bytes read per token` with the median
//! probe. A virtual disk whose host caches what was written or read serves
//! some reads from RAM; then the decode can beat the "drive". The report
//! never prints such a fraction as a share of a bound: [`DemoReport::bound`]
//! says the bound could not be measured on this machine instead. Both
//! decodes must produce the same tokens (streaming never changes results,
//! and the GPU agrees with the CPU reference); the report says so.
//!
//! Qwen4-Exp ([`DemoModel::Qwen4`]) adds its PLE rows: the tables are
//! packed into row shards ([`rows::pack_rows`]) and the streamed decode
//! reads them through the row store under `rows_fraction` of the table
//! bytes, its prefetch started as soon as each token is known, while the
//! reference reads them from the checkpoint. Each repetition also probes
//! the drive on fresh 4 KiB blocks of the row shards at the row store's
//! queue depth, and the I/O bound is the drive time of both: `1 /
//! (expert bytes per token / expert probe + row bytes per token / row
//! probe)`. Qwen4-Exp runs on the device `placement` names, as the other
//! families do.
//!
//! Bounds: memory is the budget (and the row budget) plus the resident
//! non-expert weights plus `queue_depth` record buffers during a probe.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashtier_format::{Dtype, Store};
use flashtier_io::{
    DriveActivity, LoggingBackend, PosixBackend, Refill, StorageBackend, read_extents,
};

use flashtier_engine::engine::{Chosen, Placement};

use crate::error::DemoError;
use crate::session::{RowStore, Session, SessionOptions, StoreSource};
use crate::synth::{Qwen4Spec, SynthArch, SynthSpec};
use flashtier::experts::Backing;
use flashtier_engine::model::Generation;
use flashtier_io::measure::median;

mod prepare;
mod report;
pub mod rows;

use prepare::{prepare, probe_drive};
pub use report::{Bound, DecodeRun, DemoReport, FAST_DRIVE_BYTES_PER_SEC, Projection};
pub use rows::{RowsPacked, RowsReport};

/// The synthetic model a demo runs.
#[derive(Clone, Debug, PartialEq)]
pub enum DemoModel {
    /// One of the MoE families of [`SynthSpec`].
    Moe(SynthSpec),
    /// Qwen4-Exp, its PLE rows from the row store.
    Qwen4 {
        /// The model.
        spec: Qwen4Spec,
        /// Row-cache budget as a fraction of the table bytes.
        rows_fraction: f64,
    },
}

impl DemoModel {
    /// Qwen4-Exp at `size` bytes with a 10% row budget.
    #[must_use]
    pub fn qwen4(size: u64, seed: u64) -> Self {
        Self::Qwen4 {
            spec: Qwen4Spec::scaled_to(size, seed),
            rows_fraction: 0.10,
        }
    }

    /// Vocabulary.
    #[must_use]
    pub fn vocab(&self) -> u64 {
        match self {
            Self::Moe(s) => s.vocab,
            Self::Qwen4 { spec, .. } => spec.vocab,
        }
    }

    /// Bytes of every tensor.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        match self {
            Self::Moe(s) => s.total_bytes(),
            Self::Qwen4 { spec, .. } => spec.total_bytes(),
        }
    }

    /// Bytes of all routed experts' tensors.
    #[must_use]
    pub fn expert_bytes(&self) -> u64 {
        match self {
            Self::Moe(s) => s.expert_bytes() * u64::from(s.experts) * u64::from(s.layers),
            Self::Qwen4 { spec, .. } => spec.all_expert_bytes(),
        }
    }
}

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Folder for the checkpoint and the store (created; reused if it holds them).
    pub work_dir: PathBuf,
    /// The synthetic model.
    pub model: DemoModel,
    /// Prompt tokens before decoding.
    pub prompt_len: usize,
    /// Tokens to decode per run.
    pub tokens: usize,
    /// Expert budget as a fraction of all expert bytes.
    pub budget_fraction: f64,
    /// Expert reads in flight at most (also the drive probe's queue depth).
    pub queue_depth: usize,
    /// Records the drive probe reads each time.
    pub probe_records: usize,
    /// Streamed decodes (each with its probe and replay); medians are reported.
    pub reps: usize,
    /// Where the streamed decode runs (the reference always runs on the CPU).
    pub placement: Placement,
}

impl DemoOptions {
    /// The default demo: Qwen3-30B-A3B's shape scaled to 1 GiB (see
    /// [`crate::synth::shape`]: 128 experts, top-8, widths, layers and
    /// vocabulary scaled together); 25% budget, queue depth 4, 24 tokens.
    pub fn new(work_dir: &Path) -> Self {
        let spec = SynthSpec::scaled_to(SynthArch::Qwen3Moe, Dtype::Bf16, 1 << 30, 7);
        Self {
            work_dir: work_dir.to_path_buf(),
            model: DemoModel::Moe(spec),
            prompt_len: 4,
            tokens: 24,
            budget_fraction: 0.25,
            queue_depth: 4,
            probe_records: 64,
            reps: 3,
            placement: Placement::Auto,
        }
    }
}

/// Where the demo is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DemoPhase {
    /// Writing the synthetic checkpoint (`done`/`total` in bytes).
    Generate,
    /// Packing the experts (bytes).
    Pack,
    /// Packing the PLE row shards (Qwen4-Exp; no count: `done` is 0 of 1).
    PackRows,
    /// Measuring the drive (bytes).
    Drive,
    /// Decoding with direct reads into slots, on the chosen device (tokens).
    Streamed,
    /// The CPU reference decoding on the mapped backing (tokens).
    Mapped,
}

/// A progress report.
#[derive(Clone, Copy, Debug)]
pub struct DemoProgress {
    /// Phase.
    pub phase: DemoPhase,
    /// Units done in this phase.
    pub done: u64,
    /// Units in this phase.
    pub total: u64,
}

/// Run the demo; `progress` sees every phase's advance.
pub fn run_decode_demo(
    opts: &DemoOptions,
    progress: &(dyn Fn(DemoProgress) + Sync),
) -> Result<DemoReport, DemoError> {
    let started = Instant::now();
    let model_dir = opts.work_dir.join("model");
    let store_path = opts.work_dir.join("experts.ftstore");
    let packed = prepare(opts, &model_dir, &store_path, progress)?;
    let store = Store::open(&store_path).map_err(flashtier::experts::ExpertsError::from)?;
    let stride = store.stride_bytes();
    let records = store.record_count();
    let expert_bytes = store.payload_bytes() * records;
    let budget_bytes = ((stride * records) as f64 * opts.budget_fraction) as u64;
    let vocab = opts.model.vocab().max(1);
    // Each repetition decodes its own prompt (the base one shifted by a
    // share of the vocabulary), so no repetition replays the reads of the
    // one before: the host's cache of a virtual disk would serve those.
    let reps_n = opts.reps.max(1);
    let prompt_of = |rep: usize| -> Vec<u32> {
        let shift = rep as u64 * (vocab / (reps_n as u64 + 1));
        (0..opts.prompt_len as u64)
            .map(|i| ((i * 7919 + 13 + shift) % vocab) as u32)
            .collect()
    };
    let rows = packed.as_ref().map(|p| RowStore {
        dir: Some(p.dir.clone()),
        budget_bytes: p.budget_bytes,
    });
    let run = DecodeSetup {
        model: &model_dir,
        store: &store_path,
        budget_bytes,
        opts,
        progress,
    };
    // Interleaved repetitions (the machine and its drive are shared, single
    // runs are noisy): probes, streamed decode (cold pool, reads logged),
    // replay of its reads; medians are reported.
    let mut probes = Vec::with_capacity(opts.reps + 1);
    let mut row_probes = Vec::with_capacity(opts.reps + 1);
    let mut reps: Vec<(f64, f64, DecodeRun, usize)> = Vec::with_capacity(reps_n);
    // The probes' records and row blocks differ from run to run as well
    // (a run that reuses the folder would otherwise probe what the last
    // one probed, which the host may still cache); the seed is reported.
    let probe_seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for rep in 0..reps_n {
        let round = probe_seed.wrapping_add(rep as u64);
        let probe = probe_drive(&store, &store_path, opts, round, progress)?;
        probes.push(probe);
        let row_probe = packed
            .as_ref()
            .map(|p| rows::probe_rows(p, round, progress))
            .transpose()?;
        row_probes.extend(row_probe);
        let logger = Arc::new(LoggingBackend::new(Arc::new(PosixBackend::new(
            opts.queue_depth.max(1),
        )?)));
        let streamed = run.decode(
            &prompt_of(rep),
            opts.placement,
            Backing::Slots,
            logger.clone(),
            rows.as_ref(),
        )?;
        let replay_bw = read_extents(
            &store_path,
            &logger.reads(),
            opts.queue_depth,
            Refill::Sliding,
            &mut |_| {},
        )?
        .bytes_per_sec();
        let fraction = streamed.tokens_per_sec / io_bound(&streamed, probe, row_probe);
        reps.push((fraction, replay_bw, streamed, rep));
    }
    // The CPU reference of every repetition's prompt, after all of them
    // (its page-cache reads would warm the host's cache for the next).
    let mut mapped_runs = Vec::with_capacity(reps_n);
    for rep in 0..reps_n {
        let plain = Arc::new(PosixBackend::new(opts.queue_depth.max(1))?);
        let prompt = prompt_of(rep);
        mapped_runs.push(run.decode(&prompt, Placement::Cpu, Backing::Mapped, plain, None)?);
    }
    let same_tokens = reps.iter().all(|r| {
        mapped_runs
            .get(r.3)
            .is_some_and(|m| m.generated_ids == r.2.generated_ids)
    });
    let last_round = probe_seed.wrapping_add(reps_n as u64);
    let last = probe_drive(&store, &store_path, opts, last_round, progress)?;
    probes.push(last);
    if let Some(p) = &packed {
        row_probes.push(rows::probe_rows(p, last_round, progress)?);
    }
    let drive = median(&probes);
    let row_drive = packed.as_ref().map(|_| median(&row_probes));
    let fractions: Vec<f64> = reps.iter().map(|r| r.0).collect();
    reps.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (_, replay_bw, streamed, median_rep) = reps.swap_remove(reps.len() / 2);
    let mapped = mapped_runs.swap_remove(median_rep);
    let bound = io_bound(&streamed, drive, row_drive);
    let replay_bound = io_bound(&streamed, replay_bw, row_drive);
    Ok(DemoReport {
        probe_seed,
        expert_bytes,
        budget_bytes,
        queue_depth: opts.queue_depth.max(1),
        drive_probes_bytes_per_sec: probes,
        drive_bytes_per_sec: drive,
        replay_bytes_per_sec: replay_bw,
        io_bound_tokens_per_sec: bound,
        fractions_of_io_bound: fractions,
        bound: Bound::of(streamed.tokens_per_sec, bound),
        fraction_of_replay_bound: streamed.tokens_per_sec / replay_bound,
        same_tokens,
        rows: packed.map(|p| RowsReport::new(p, row_probes)),
        projection: Projection::of(&streamed, drive, row_drive),
        streamed,
        mapped,
        elapsed_secs: started.elapsed().as_secs_f64(),
    })
}

/// Tokens per second the drive allows for `run`'s reads: its expert bytes
/// at `expert_bps` plus its row bytes at `row_bps` (infinite when nothing
/// is read).
fn io_bound(run: &DecodeRun, expert_bps: f64, row_bps: Option<f64>) -> f64 {
    let secs = |bytes: f64, bps: f64| if bytes > 0.0 { bytes / bps } else { 0.0 };
    let rows = match (run.row_bytes_read_per_token, row_bps) {
        (Some(b), Some(bps)) => secs(b, bps),
        _ => 0.0,
    };
    let t = secs(run.miss_bytes_per_token, expert_bps) + rows;
    if t > 0.0 { 1.0 / t } else { f64::INFINITY }
}

/// What both decodes share.
struct DecodeSetup<'a> {
    model: &'a Path,
    store: &'a Path,
    budget_bytes: u64,
    opts: &'a DemoOptions,
    progress: &'a (dyn Fn(DemoProgress) + Sync),
}

impl DecodeSetup<'_> {
    /// Decode on `placement` with a cold pool under the budget: on a GPU the
    /// budget is the HBM slot arena and there is no RAM tier, so every miss
    /// is a drive read landing through pinned staging.
    fn decode(
        &self,
        prompt: &[u32],
        placement: Placement,
        backing: Backing,
        backend: Arc<dyn StorageBackend>,
        rows: Option<&RowStore>,
    ) -> Result<DecodeRun, DemoError> {
        let (opts, progress) = (self.opts, self.progress);
        let session = SessionOptions {
            store: StoreSource::File(self.store.to_path_buf()),
            placement,
            budget: Some(self.budget_bytes),
            budget_hbm: Some(self.budget_bytes),
            budget_ram: 0,
            kv: None,
            rows: rows.cloned(),
            backing,
            queue_depth: opts.queue_depth,
            backend: Some(backend.clone()),
            ..SessionOptions::new(self.model)
        };
        let Session {
            mut engine, chosen, ..
        } = session.open(&|_| {})?;
        let phase = if backing == Backing::Mapped {
            DemoPhase::Mapped
        } else {
            DemoPhase::Streamed
        };
        let total = opts.tokens as u64;
        let mut done = 0u64;
        // The decode's window of the backend's reads: from the first token
        // (the prompt's reads are behind it) to the end.
        let mut decode_start = None;
        let out = engine.generate(prompt, opts.tokens, &[], false, |_| {
            if done == 0 {
                decode_start = backend.activity().map(|a| (a, Instant::now()));
            }
            done += 1;
            progress(DemoProgress { phase, done, total });
        })?;
        let drive = decode_start
            .zip(backend.activity())
            .map(|((was, at), now)| (now.since(&was), at.elapsed()));
        Ok(decode_run(&chosen, backing, &out, drive))
    }
}

fn decode_run(
    chosen: &Chosen,
    backing: Backing,
    out: &Generation,
    drive: Option<(DriveActivity, Duration)>,
) -> DecodeRun {
    let e = out.decode_experts;
    let steps = out.decode_steps.max(1) as f64;
    let share = |ns: u64| {
        if out.decode_secs > 0.0 {
            ns as f64 / 1e9 / out.decode_secs
        } else {
            0.0
        }
    };
    let backing = match (chosen.device, backing) {
        ("cuda", _) => "hbm",
        (_, Backing::Mapped) => "mapped",
        _ => "slots",
    };
    DecodeRun {
        device: chosen.device.to_string(),
        gpu_name: chosen.gpu_name.clone(),
        fallback: chosen.fallback.clone(),
        backing: backing.to_string(),
        generated_ids: out.generated_ids.clone(),
        steps: out.decode_steps,
        tokens_per_sec: out.tokens_per_sec(),
        expert_hit_rate: e.hit_rate(),
        miss_bytes_per_token: e.bytes_read as f64 / steps,
        prefetch_bytes_per_token: e.prefetch_bytes as f64 / steps,
        prefetch_used_bytes_per_token: e.prefetch_used_bytes as f64 / steps,
        stall_fraction: share(e.stall_ns),
        h2d_bytes_per_token: e.h2d_bytes as f64 / steps,
        row_hit_rate: out.decode_rows.map(|r| r.hit_rate()),
        row_bytes_read_per_token: out.decode_rows.map(|r| r.bytes_read as f64 / steps),
        row_stall_fraction: out.decode_rows.map(|r| share(r.stall_ns)),
        drive_busy_share: drive.map(|(a, window)| a.busy_share(window)),
        reads_in_flight_while_busy: drive.map(|(a, _)| a.mean_in_flight_while_busy()),
    }
}
