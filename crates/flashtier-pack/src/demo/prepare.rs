//! Before the decodes: the synthetic checkpoint written and packed (kept
//! when `work_dir` holds them already), and the drive probed on records
//! no decode reads.

use std::path::Path;

use flashtier_engine::error::EngineError;
use flashtier_format::Store;
use flashtier_io::{Refill, read_extents, record_extents};

use crate::error::DemoError;
use crate::pack::{PackOptions, pack_experts};
use crate::synth::{write_checkpoint, write_qwen4_checkpoint};

use super::*;

/// Write the checkpoint and pack it, unless `work_dir` already holds both;
/// for Qwen4-Exp also pack its PLE row shards (those missing).
pub(super) fn prepare(
    opts: &DemoOptions,
    model_dir: &Path,
    store_path: &Path,
    progress: &(dyn Fn(DemoProgress) + Sync),
) -> Result<Option<RowsPacked>, DemoError> {
    let total = opts.model.total_bytes();
    let rows_dir = opts.work_dir.join("rows");
    if !model_dir.join("config.json").exists() {
        // Shards of an earlier checkpoint would only be refused later.
        remove_row_shards(&rows_dir)?;
        let mut done = 0u64;
        let mut report = |n| {
            done += n;
            progress(DemoProgress {
                phase: DemoPhase::Generate,
                done,
                total,
            });
        };
        match &opts.model {
            DemoModel::Moe(spec) => write_checkpoint(spec, model_dir, &mut report)?,
            DemoModel::Qwen4 { spec, .. } => write_qwen4_checkpoint(spec, model_dir, &mut report)?,
        };
    }
    if !store_path.exists() {
        let expert_total = opts.model.expert_bytes();
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
    match &opts.model {
        DemoModel::Moe(_) => Ok(None),
        DemoModel::Qwen4 {
            spec,
            rows_fraction,
        } => {
            progress(DemoProgress {
                phase: DemoPhase::PackRows,
                done: 0,
                total: 1,
            });
            let table = spec.table_bytes();
            let budget = (table as f64 * rows_fraction) as u64;
            Ok(rows::pack_rows(model_dir, store_path, &rows_dir, table, budget).map(Some)?)
        }
    }
}

/// Remove the `.ftrows` files in `dir` (nothing else; a missing folder is
/// fine).
fn remove_row_shards(dir: &Path) -> Result<(), EngineError> {
    let io = |source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    for entry in entries {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "ftrows") {
            std::fs::remove_file(&path).map_err(io)?;
        }
    }
    Ok(())
}

/// Read `probe_records` whole records (pseudo-random, `round` picks the
/// set) with direct I/O, `queue_depth` at a time, as the pool reads misses.
pub(super) fn probe_drive(
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
