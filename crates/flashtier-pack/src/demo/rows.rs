//! The demo's PLE rows (Qwen4-Exp): packing the tables into row shards and
//! probing the drive on them.
//!
//! [`pack_rows`] opens the model with its rows in the row store, which packs
//! every missing shard from the checkpoint (the engine names and checks
//! them; see [`flashtier_engine::family::qwen4::rows`]), then lists the shards.
//! [`probe_rows`] reads [`PROBE_BLOCKS`] pseudo-random 4 KiB blocks (a new
//! set each round, one shard file per round) with direct I/O,
//! [`ROW_QUEUE_DEPTH`] at a time, on the backend the decode's row reads use
//! (io_uring where the kernel allows): the reads a decode step submits.

use std::path::{Path, PathBuf};

use flashtier_io::{Extent, Refill, read_extents_on};

use super::{DemoPhase, DemoProgress};
use flashtier_engine::error::EngineError;
use flashtier_engine::family::qwen4::rows::{ROW_QUEUE_DEPTH, row_backend};
use flashtier_engine::family::qwen4::{PleRowOptions, Qwen4Model};
use flashtier_engine::load::LoadOptions;

/// Blocks one row probe reads.
pub const PROBE_BLOCKS: usize = 1024;
/// Bytes of a row-shard block.
const BLOCK: u64 = 4096;

/// The packed row shards of a demo model.
#[derive(Clone, Debug)]
pub struct RowsPacked {
    /// Their folder.
    pub dir: PathBuf,
    /// The shard files, sorted.
    pub files: Vec<PathBuf>,
    /// Bytes of the shard files.
    pub file_bytes: u64,
    /// Bytes of the tables in the checkpoint.
    pub table_bytes: u64,
    /// Row-cache budget of the streamed decode.
    pub budget_bytes: u64,
}

/// The row side of a demo report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RowsReport {
    /// Bytes of the PLE tables in the checkpoint.
    pub table_bytes: u64,
    /// Row-cache budget of the streamed decode.
    pub budget_bytes: u64,
    /// Row shard files.
    pub shard_files: usize,
    /// Bytes of the shard files (rows, block checksums, headers).
    pub shard_bytes: u64,
    /// Row reads in flight at most (the probe's queue depth).
    pub queue_depth: usize,
    /// The drive on 4 KiB row blocks, each probe (bytes/s).
    pub drive_probes_bytes_per_sec: Vec<f64>,
    /// Median of the row probes (bytes/s).
    pub drive_bytes_per_sec: f64,
}

impl RowsReport {
    pub(super) fn new(p: RowsPacked, probes: Vec<f64>) -> Self {
        Self {
            table_bytes: p.table_bytes,
            budget_bytes: p.budget_bytes,
            shard_files: p.files.len(),
            shard_bytes: p.file_bytes,
            queue_depth: ROW_QUEUE_DEPTH,
            drive_bytes_per_sec: flashtier_io::measure::median(&probes),
            drive_probes_bytes_per_sec: probes,
        }
    }
}

/// Pack the PLE tables (`table_bytes` of them) of the Qwen4-Exp
/// checkpoint `model` (experts in `store`) into row shards in `dir`, those
/// missing; `budget_bytes` is the row budget the decode will use.
pub fn pack_rows(
    model: &Path,
    store: &Path,
    dir: &Path,
    table_bytes: u64,
    budget_bytes: u64,
) -> Result<RowsPacked, EngineError> {
    let rows = PleRowOptions {
        dir: dir.to_path_buf(),
        budget_bytes: 0,
    };
    // One record of budget: opening reads no expert.
    let one = flashtier_format::Store::open(store)
        .map_err(flashtier::experts::ExpertsError::from)?
        .stride_bytes();
    Qwen4Model::open_with_rows(
        model,
        store,
        &LoadOptions::store(store).budget(one),
        Some(&rows),
    )?;
    let io = |source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    let mut file_bytes = 0;
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "ftrows") {
            file_bytes += entry.metadata().map_err(io)?.len();
            files.push(path);
        }
    }
    files.sort();
    Ok(RowsPacked {
        dir: dir.to_path_buf(),
        files,
        file_bytes,
        table_bytes,
        budget_bytes,
    })
}

/// Read [`PROBE_BLOCKS`] pseudo-random blocks of one shard (`round` picks
/// the shard and the set) and return the bytes per second.
pub(super) fn probe_rows(
    p: &RowsPacked,
    round: u64,
    progress: &(dyn Fn(DemoProgress) + Sync),
) -> Result<f64, EngineError> {
    let Some(path) = p.files.get(round as usize % p.files.len().max(1)) else {
        return Ok(0.0);
    };
    let len = std::fs::metadata(path)
        .map_err(|source| EngineError::Io {
            path: path.clone(),
            source,
        })?
        .len();
    let blocks = (len / BLOCK).max(2);
    // Block 0 holds the header; the rest are rows.
    let extents: Vec<Extent> = (0..PROBE_BLOCKS as u64)
        .map(|i| {
            let r = (i ^ round.rotate_left(32))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(29);
            Extent {
                offset: (1 + r % (blocks - 1)) * BLOCK,
                len: BLOCK as usize,
            }
        })
        .collect();
    let total = PROBE_BLOCKS as u64 * BLOCK;
    let backend = row_backend()?;
    let read = read_extents_on(
        backend.as_ref(),
        path,
        &extents,
        ROW_QUEUE_DEPTH,
        Refill::Batches,
        &mut |done| {
            progress(DemoProgress {
                phase: DemoPhase::Drive,
                done,
                total,
            })
        },
    )?;
    Ok(read.bytes_per_sec())
}
