//! `bench decode --modes kv`: KV beyond HBM. A prompt of `--kv-context`
//! tokens and `--tokens` decode steps under `--kv-budget-hbm`, every
//! expert resident, against the limits of the same run: the drive read on
//! the run's own KV store with the restore's reads (tiles of offloaded
//! chunks, the same queue depth, O_DIRECT where allowed), right after the
//! decode; the pinned host-to-device copy ([`super::measure::Limits`]);
//! and the same context with every position in HBM (the compute time of a
//! token, and the same tokens).
//!
//! Bounds: the probe reads every offloaded tile once (the KV of the
//! context beyond the window, `layers x (chunks - window) x chunk` bytes).

use std::path::Path;

use anyhow::Context;
use flashtier_engine::device::cuda::kv::KvBudget;
use flashtier_engine::engine::Placement;
use flashtier_io::probe::{Extent, Refill, read_extents};
use flashtier_pack::session::{SessionOptions, StoreSource};
use serde::Serialize;

use super::measure::Limits;
use super::{Args, prompt};

/// The KV mode's result.
#[derive(Debug, Serialize)]
pub(super) struct KvBench {
    context_tokens: usize,
    budget_hbm_bytes: u64,
    kv_bytes_at_context: u64,
    tile_chunks: usize,
    read_ahead_tiles: usize,
    pub(super) tokens_per_sec: f64,
    resident_tokens_per_sec: f64,
    same_tokens_as_resident: bool,
    restored_bytes_per_token: f64,
    stall_ms_per_token: f64,
    stall_fraction: f64,
    read_wait_ms_per_token: f64,
    prefill_secs: f64,
    resident_prefill_secs: f64,
    drive_bytes_per_sec: f64,
    drive_probe_reads: usize,
    io_bound_tokens_per_sec: f64,
    pub(super) fraction_of_io_bound: f64,
    restore_share_of_h2d: f64,
}

fn load(
    args: &Args,
    store: &Path,
    kv: Option<(u64, std::path::PathBuf)>,
) -> anyhow::Result<flashtier_engine::Model<flashtier_engine::device::cuda::CudaDevice>> {
    let mut opts = SessionOptions::new(&args.model);
    opts.store = StoreSource::File(store.to_path_buf());
    opts.placement = Placement::Cuda(0);
    opts.queue_depth = args.queue_depth;
    opts.kv = kv.map(|(bytes, dir)| (bytes, Some(dir)));
    super::open_on_gpu(&opts).context("loading the model for the KV mode")
}

/// Run the KV mode on `store`'s model.
pub(super) fn run(
    args: &Args,
    store: &Path,
    limits: &Limits,
    show: bool,
) -> anyhow::Result<KvBench> {
    let dir = args.kv_dir.clone().unwrap_or_else(|| {
        store
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| ".".into(), Path::to_path_buf)
    });
    let budget = KvBudget::new(args.kv_budget_hbm, dir.clone());
    let (tile, ahead) = (budget.tile_chunks, budget.read_ahead);
    let mut m = load(args, store, Some((args.kv_budget_hbm, dir)))?;
    let cfg = m.config().clone();
    let p = prompt(args.kv_context, cfg.vocab_size);
    if show {
        eprintln!(
            "kv: {} prompt tokens, KV budget {} MiB",
            p.len(),
            args.kv_budget_hbm >> 20
        );
    }
    let out = m.generate(&p, args.tokens, &[], false, |_| {})?;
    let kv = out
        .decode_kv
        .context("the KV budget holds the whole context: nothing was offloaded")?;
    let extents: Vec<Extent> = m
        .kv()
        .tile_extents()?
        .into_iter()
        .map(|(offset, len)| Extent { offset, len })
        .collect();
    let path = m.kv().store_path().context("no KV store")?.to_path_buf();
    let probe = read_extents(&path, &extents, ahead.max(1), Refill::Sliding, &mut |_| {})?;
    let kv_bytes = m.kv().cache().chunk_bytes() as u64
        * cfg.num_layers as u64
        * (p.len() + args.tokens).div_ceil(256) as u64;
    drop(m);
    let mut r = load(args, store, None)?;
    let resident = r.generate(&p, args.tokens, &[], false, |_| {})?;
    let steps = out.decode_steps.max(1) as f64;
    let restored = kv.restored_bytes as f64 / steps;
    let drive = probe.bytes_per_sec();
    let bound = if restored > 0.0 {
        drive / restored
    } else {
        f64::INFINITY
    };
    let tok_s = out.tokens_per_sec();
    Ok(KvBench {
        context_tokens: p.len(),
        budget_hbm_bytes: args.kv_budget_hbm,
        kv_bytes_at_context: kv_bytes,
        tile_chunks: tile,
        read_ahead_tiles: ahead,
        tokens_per_sec: tok_s,
        resident_tokens_per_sec: resident.tokens_per_sec(),
        same_tokens_as_resident: resident.generated_ids == out.generated_ids,
        restored_bytes_per_token: restored,
        stall_ms_per_token: kv.stall_ns() as f64 / 1e6 / steps,
        stall_fraction: kv.stall_ns() as f64 / 1e9 / out.decode_secs.max(1e-9),
        read_wait_ms_per_token: kv.read_wait_ns as f64 / 1e6 / steps,
        prefill_secs: out.prefill_secs,
        resident_prefill_secs: resident.prefill_secs,
        drive_bytes_per_sec: drive,
        drive_probe_reads: extents.len(),
        io_bound_tokens_per_sec: bound,
        fraction_of_io_bound: tok_s / bound,
        restore_share_of_h2d: restored * tok_s / limits.h2d_pinned_bytes_per_sec.max(1.0),
    })
}

/// Qwen3-30B-A3B's context limit.
const REFERENCE_POSITIONS: usize = 40_960;

/// Raise a freshly generated synthetic checkpoint's context limit
/// (`max_position_embeddings`, 4096 as written) to Qwen3-30B-A3B's 40960,
/// or `positions` if more, before its store is packed (RoPE does not
/// depend on it).
pub(super) fn raise_context(model: &Path, positions: usize) -> anyhow::Result<()> {
    let positions = positions.max(REFERENCE_POSITIONS);
    let path = model.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text)?;
    let have = cfg["max_position_embeddings"].as_u64().unwrap_or(0);
    if have < positions as u64 {
        cfg["max_position_embeddings"] = positions.into();
        flashtier_io::persist::write_file(
            &path,
            cfg.to_string().as_bytes(),
            flashtier_io::Wait::Block,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The KV mode's lines of the text report.
pub(super) fn print(k: &KvBench) {
    let gb = |b: f64| b / 1e9;
    println!(
        "kv: {} tokens of context ({:.2} GB of KV) under {:.0} MiB of HBM: {:.2} tok/s ({:.1} with all KV in HBM; same tokens: {}), {:.0} MB restored/token, KV stall {:.1} ms/token ({:.0}%)",
        k.context_tokens,
        gb(k.kv_bytes_at_context as f64),
        k.budget_hbm_bytes as f64 / f64::from(1u32 << 20),
        k.tokens_per_sec,
        k.resident_tokens_per_sec,
        k.same_tokens_as_resident,
        k.restored_bytes_per_token / 1e6,
        k.stall_ms_per_token,
        100.0 * k.stall_fraction
    );
    println!(
        "  drive on the KV store's tiles {:.2} GB/s ({} reads): I/O bound {:.2} tok/s, {:.0}% of it; {:.1}% of the pinned h2d copy bandwidth",
        gb(k.drive_bytes_per_sec),
        k.drive_probe_reads,
        k.io_bound_tokens_per_sec,
        100.0 * k.fraction_of_io_bound,
        100.0 * k.restore_share_of_h2d
    );
}
