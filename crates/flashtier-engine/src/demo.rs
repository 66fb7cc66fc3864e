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
//! cold pool, every read logged -> replay of that log (the drive on the
//! decode's own offsets, queue depth kept full) } -> the CPU decode on the
//! mapped backing -> a last probe.
//!
//! The I/O bound is `probe bytes/s / bytes read per token` with the median
//! probe. A virtual disk whose host caches what was written or read serves
//! some reads from RAM; then the decode can beat the "drive". The report
//! never prints such a fraction as a share of a bound: [`DemoReport::bound`]
//! says the bound could not be measured on this machine instead. Both
//! decodes must produce the same tokens (streaming never changes results,
//! and the GPU agrees with the CPU reference); the report says so.
//!
//! Bounds: memory is the budget plus the resident non-expert weights plus
//! `queue_depth` record buffers during a probe.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use flashtier_format::{Dtype, Store};
use flashtier_io::{
    LoggingBackend, PosixBackend, Refill, StorageBackend, read_extents, record_extents,
};

use crate::config::ModelConfig;
use crate::device::cuda::experts::TierBudgets;
use crate::engine::{Chosen, Placement, open};
use crate::error::EngineError;
use crate::load::{GpuOptions, LoadOptions};
use crate::model::Generation;
use crate::pack::{PackOptions, pack_experts};
use crate::synth::{SynthArch, SynthSpec, write_checkpoint};
use flashtier::experts::Backing;

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Folder for the checkpoint and the store (created; reused if it holds them).
    pub work_dir: PathBuf,
    /// The synthetic model.
    pub spec: SynthSpec,
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
            spec,
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
    fn of(tokens_per_sec: f64, bound: f64) -> Self {
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
    /// Bytes of all expert records (payload).
    pub expert_bytes: u64,
    /// Expert budget in bytes.
    pub budget_bytes: u64,
    /// Drive read bandwidth, each probe (bytes/s).
    pub drive_probes_bytes_per_sec: Vec<f64>,
    /// Median of the probes (bytes/s).
    pub drive_bytes_per_sec: f64,
    /// The drive replaying the median repetition's own reads (bytes/s).
    pub replay_bytes_per_sec: f64,
    /// Streamed decode (slots backing, direct reads): the median repetition.
    pub streamed: DecodeRun,
    /// The CPU reference: the same decode on the mapped (page-cache) backing.
    pub mapped: DecodeRun,
    /// `drive_bytes_per_sec / streamed.miss_bytes_per_token`.
    pub io_bound_tokens_per_sec: f64,
    /// `streamed.tokens_per_sec / io_bound_tokens_per_sec` of every
    /// repetition against its own probe, in run order.
    pub fractions_of_io_bound: Vec<f64>,
    /// The median repetition against the median probe.
    pub bound: Bound,
    /// `streamed.tokens_per_sec` over the bound from replaying its own reads
    /// (which the host's cache may serve).
    pub fraction_of_replay_bound: f64,
    /// Both decodes produced the same tokens.
    pub same_tokens: bool,
    /// Wall time of the whole demo, seconds.
    pub elapsed_secs: f64,
}

/// Run the demo; `progress` sees every phase's advance.
pub fn run_decode_demo(
    opts: &DemoOptions,
    progress: &(dyn Fn(DemoProgress) + Sync),
) -> Result<DemoReport, EngineError> {
    let started = Instant::now();
    let model_dir = opts.work_dir.join("model");
    let store_path = opts.work_dir.join("experts.ftstore");
    prepare(opts, &model_dir, &store_path, progress)?;
    let store = Store::open(&store_path).map_err(flashtier::experts::ExpertsError::from)?;
    let stride = store.stride_bytes();
    let records = store.record_count();
    let expert_bytes = store.payload_bytes() * records;
    let budget_bytes = ((stride * records) as f64 * opts.budget_fraction) as u64;
    let cfg = ModelConfig::from_file(&model_dir.join("config.json"))?;
    let prompt: Vec<u32> = (0..opts.prompt_len)
        .map(|i| (i as u32 * 7919 + 13) % cfg.vocab_size as u32)
        .collect();
    let run = DecodeSetup {
        model: &model_dir,
        store: &store_path,
        prompt: &prompt,
        budget_bytes,
    };
    // Interleaved repetitions (the machine and its drive are shared, single
    // runs are noisy): probe, streamed decode (cold pool, reads logged),
    // replay of its reads; medians are reported.
    let mut probes = Vec::with_capacity(opts.reps + 1);
    let mut reps: Vec<(f64, f64, DecodeRun)> = Vec::with_capacity(opts.reps);
    for rep in 0..opts.reps.max(1) {
        let probe = probe_drive(&store, &store_path, opts, rep as u64, progress)?;
        probes.push(probe);
        let logger = Arc::new(LoggingBackend::new(Arc::new(PosixBackend::new(
            opts.queue_depth.max(1),
        )?)));
        let streamed = run.decode(
            opts.placement,
            Backing::Slots,
            logger.clone(),
            opts,
            progress,
        )?;
        let replay_bw = read_extents(
            &store_path,
            &logger.reads(),
            opts.queue_depth,
            Refill::Sliding,
            &mut |_| {},
        )?
        .bytes_per_sec();
        let fraction = streamed.tokens_per_sec / io_bound(probe, streamed.miss_bytes_per_token);
        reps.push((fraction, replay_bw, streamed));
    }
    let plain = Arc::new(PosixBackend::new(opts.queue_depth.max(1))?);
    let mapped = run.decode(Placement::Cpu, Backing::Mapped, plain, opts, progress)?;
    let last = probe_drive(&store, &store_path, opts, opts.reps as u64, progress)?;
    probes.push(last);
    let drive = median(&probes);
    let fractions: Vec<f64> = reps.iter().map(|r| r.0).collect();
    reps.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (_, replay_bw, streamed) = reps.swap_remove(reps.len() / 2);
    let bound = io_bound(drive, streamed.miss_bytes_per_token);
    Ok(DemoReport {
        expert_bytes,
        budget_bytes,
        drive_probes_bytes_per_sec: probes,
        drive_bytes_per_sec: drive,
        replay_bytes_per_sec: replay_bw,
        io_bound_tokens_per_sec: bound,
        fractions_of_io_bound: fractions,
        bound: Bound::of(streamed.tokens_per_sec, bound),
        fraction_of_replay_bound: streamed.tokens_per_sec
            / io_bound(replay_bw, streamed.miss_bytes_per_token),
        same_tokens: streamed.generated_ids == mapped.generated_ids,
        streamed,
        mapped,
        elapsed_secs: started.elapsed().as_secs_f64(),
    })
}

/// Tokens per second the drive allows at `bytes_per_sec` for
/// `bytes_per_token` (infinite when nothing is read).
fn io_bound(bytes_per_sec: f64, bytes_per_token: f64) -> f64 {
    if bytes_per_token > 0.0 {
        bytes_per_sec / bytes_per_token
    } else {
        f64::INFINITY
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Write the checkpoint and pack it, unless `work_dir` already holds both.
fn prepare(
    opts: &DemoOptions,
    model_dir: &Path,
    store_path: &Path,
    progress: &(dyn Fn(DemoProgress) + Sync),
) -> Result<(), EngineError> {
    let total = opts.spec.total_bytes();
    if !model_dir.join("config.json").exists() {
        let mut done = 0u64;
        write_checkpoint(&opts.spec, model_dir, &mut |n| {
            done += n;
            progress(DemoProgress {
                phase: DemoPhase::Generate,
                done,
                total,
            });
        })?;
    }
    if !store_path.exists() {
        let expert_total =
            opts.spec.expert_bytes() * u64::from(opts.spec.experts) * u64::from(opts.spec.layers);
        let done = std::sync::atomic::AtomicU64::new(0);
        pack_experts(&PackOptions::new(model_dir, store_path), &|n| {
            let d = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
            progress(DemoProgress {
                phase: DemoPhase::Pack,
                done: d,
                total: expert_total,
            });
        })?;
    }
    Ok(())
}

/// Read `probe_records` whole records (pseudo-random, `round` picks the
/// set) with direct I/O, `queue_depth` at a time, as the pool reads misses.
fn probe_drive(
    store: &Store,
    path: &Path,
    opts: &DemoOptions,
    round: u64,
    progress: &(dyn Fn(DemoProgress) + Sync),
) -> Result<f64, EngineError> {
    let extents = record_extents(store, opts.probe_records, round)?;
    let total = extents.iter().map(|e| e.len as u64).sum();
    let mut report = |done| {
        progress(DemoProgress {
            phase: DemoPhase::Drive,
            done,
            total,
        })
    };
    let read = read_extents(
        path,
        &extents,
        opts.queue_depth,
        Refill::Batches,
        &mut report,
    )?;
    Ok(read.bytes_per_sec())
}

/// What both decodes share.
struct DecodeSetup<'a> {
    model: &'a Path,
    store: &'a Path,
    prompt: &'a [u32],
    budget_bytes: u64,
}

impl DecodeSetup<'_> {
    /// Decode on `placement` with a cold pool under the budget: on a GPU the
    /// budget is the HBM slot arena and there is no RAM tier, so every miss
    /// is a drive read landing through pinned staging.
    fn decode(
        &self,
        placement: Placement,
        backing: Backing,
        backend: Arc<dyn StorageBackend>,
        opts: &DemoOptions,
        progress: &(dyn Fn(DemoProgress) + Sync),
    ) -> Result<DecodeRun, EngineError> {
        let mut load = LoadOptions::store(self.store).budget(self.budget_bytes);
        load.backing = backing;
        load.queue_depth = opts.queue_depth;
        load.backend = Some(backend);
        let gpu = GpuOptions {
            ordinal: 0,
            budgets: TierBudgets {
                hbm_bytes: Some(self.budget_bytes),
                ram_bytes: 0,
                in_place: false,
            },
        };
        let (mut engine, chosen) = open(self.model, self.store, &load, placement, &gpu)?;
        let phase = if backing == Backing::Mapped {
            DemoPhase::Mapped
        } else {
            DemoPhase::Streamed
        };
        let total = opts.tokens as u64;
        let mut done = 0u64;
        let out = engine.generate(self.prompt, opts.tokens, &[], false, |_| {
            done += 1;
            progress(DemoProgress { phase, done, total });
        })?;
        Ok(decode_run(&chosen, backing, &out))
    }
}

fn decode_run(chosen: &Chosen, backing: Backing, out: &Generation) -> DecodeRun {
    let e = out.decode_experts;
    let steps = out.decode_steps.max(1) as f64;
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
        stall_fraction: if out.decode_secs > 0.0 {
            e.stall_ns as f64 / 1e9 / out.decode_secs
        } else {
            0.0
        },
        h2d_bytes_per_token: e.h2d_bytes as f64 / steps,
    }
}
