//! The streaming writer: a bounded pipeline from checkpoint tensors to
//! aligned store records.
//!
//! `readers` threads fill record buffers (positional reads of each tensor
//! into its offset, direct through a per-reader staging buffer of at most the
//! largest tensor plus 8 KiB, then the record's checksum); `writers` threads write each
//! whole record (its full stride, 4096-aligned, O_DIRECT where the file
//! system allows) at its offset. Bounds: exactly `depth` record buffers exist
//! (allocated once, recycled through a channel), so memory is `depth *
//! stride` bytes whatever the checkpoint's size, and reading record i+1..
//! overlaps writing record i. The tail and then the header are written last,
//! so an interrupted pack leaves a file without a valid header (and the
//! file is the output's temp file, renamed over the output only by
//! [`flashtier_io::persist::Output::commit`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};

use flashtier_format::{StoreWriterPlan, xxh3_64};
use flashtier_io::{ALIGN, AlignedBuf, DirectMode, StoreFile};

use flashtier_engine::checkpoint::files::CheckpointFiles;
use flashtier_engine::store::ExpertLayout;
use flashtier_engine::store::PackError;

/// What the pipeline needs to fill one record.
pub(crate) struct RecordSource<'a> {
    pub ckpt: &'a CheckpointFiles,
    /// The records' tensors and where each comes from.
    pub layout: &'a ExpertLayout,
    /// Read source tensors with direct I/O (bypassing the page cache).
    pub direct: bool,
}

/// Pipeline shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PipelineShape {
    /// Record buffers in the pipeline (>= 2).
    pub depth: usize,
    /// Reader threads (>= 1); reader r fills records r, r + readers, ...
    pub readers: usize,
    /// Writer threads (>= 1).
    pub writers: usize,
}

struct Filled {
    index: u64,
    buf: AlignedBuf,
    checksum: u64,
}

/// Write every record, the tail and the header of `plan` into the empty
/// file `path` (the output's temp file, reopened here with the O_DIRECT
/// policy `direct`). Returns whether the file was written with O_DIRECT.
pub(crate) fn write_store(
    src: &RecordSource<'_>,
    plan: &StoreWriterPlan,
    path: &Path,
    direct: DirectMode,
    shape: PipelineShape,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<bool, PackError> {
    let file = StoreFile::open_rw(path, direct, false)?;
    // Allocate the file up front: direct writes into allocated extents are
    // overwrites, which file systems such as ext4 run in parallel (extending
    // writes and writes into holes are serialised on the inode lock).
    if !file.preallocate(plan.file_len())? {
        tracing::info!(path = %path.display(), "file system cannot preallocate; writing a sparse file");
    }
    let sums = run_pipeline(src, plan, &file, shape, progress)?;
    finish(plan, &file, &sums)?;
    Ok(file.is_direct())
}

/// Run the readers and writers over every record; the record checksums.
fn run_pipeline(
    src: &RecordSource<'_>,
    plan: &StoreWriterPlan,
    file: &StoreFile,
    shape: PipelineShape,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<u64>, PackError> {
    let stride = usize::try_from(plan.header().record_stride_bytes)
        .map_err(|_| PackError::Thread("record stride exceeds the address space".into()))?;
    let count = plan.header().record_count;
    let depth = shape.depth.max(2);
    let (free_tx, free_rx) = sync_channel::<AlignedBuf>(depth);
    let (filled_tx, filled_rx) = sync_channel::<Filled>(depth);
    for _ in 0..depth {
        // Cannot fail: the channel has room for `depth` buffers.
        let _ = free_tx.send(AlignedBuf::zeroed(stride));
    }
    let filled_rx = Arc::new(Mutex::new(filled_rx));
    let free_rx = Arc::new(Mutex::new(free_rx));
    let sums = Mutex::new(vec![0u64; usize::try_from(count).unwrap_or(0)]);
    let failed = AtomicBool::new(false);
    let results = std::thread::scope(|s| {
        let failed = &failed;
        let n_readers = shape.readers.max(1) as u64;
        let readers: Vec<_> = (0..n_readers)
            .map(|r| {
                let (free, filled) = (free_rx.clone(), filled_tx.clone());
                let lane = Lane {
                    first: r,
                    step: n_readers,
                    count,
                };
                s.spawn(move || {
                    let res = fill_records(src, lane, &free, &filled, failed);
                    if res.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    res
                })
            })
            .collect();
        drop(filled_tx);
        let writers: Vec<_> = (0..shape.writers.max(1))
            .map(|_| {
                let rx = filled_rx.clone();
                let tx = free_tx.clone();
                let sums = &sums;
                s.spawn(move || {
                    let r = write_records(plan, file, &rx, &tx, sums, progress);
                    if r.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        drop(free_tx);
        let mut out: Vec<_> = readers.into_iter().map(join).collect();
        out.extend(writers.into_iter().map(join));
        out
    });
    for r in results {
        r?;
    }
    Ok(sums.into_inner().unwrap_or_else(PoisonError::into_inner))
}

fn join<T>(h: std::thread::ScopedJoinHandle<'_, Result<T, PackError>>) -> Result<T, PackError> {
    h.join()
        .unwrap_or_else(|_| Err(PackError::Thread("a packing thread panicked".into())))
}

/// The records one reader fills: `first`, `first + step`, ... below `count`.
#[derive(Clone, Copy)]
struct Lane {
    first: u64,
    step: u64,
    count: u64,
}

/// Reader: fill each record of its lane (tensors, then checksum), in order.
fn fill_records(
    src: &RecordSource<'_>,
    lane: Lane,
    free: &Mutex<Receiver<AlignedBuf>>,
    filled: &SyncSender<Filled>,
    failed: &AtomicBool,
) -> Result<(), PackError> {
    let payload = src
        .layout
        .tensors
        .last()
        .map_or(0, |t| t.offset + t.len_bytes) as usize;
    let mut staging = AlignedBuf::zeroed(ALIGN);
    let indices = (lane.first..lane.count).step_by(usize::try_from(lane.step).unwrap_or(1));
    for index in indices {
        let Some(key) = usize::try_from(index)
            .ok()
            .and_then(|i| src.layout.keys.get(i))
        else {
            return Err(PackError::Thread(format!("record {index} has no key")));
        };
        // Another thread failed: stop; it reports its own error.
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let next = free.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(mut buf) = next else {
            return Ok(());
        };
        for t in &src.layout.tensors {
            let (name, at) = src.layout.source_of(*key, t);
            let start = t.offset as usize;
            let dst = buf
                .get_mut(start..start + t.len_bytes as usize)
                .ok_or_else(|| PackError::Inconsistent {
                    tensor: name.clone(),
                    why: "tensor outside its record".into(),
                })?;
            // The expert's bytes of the source tensor: all of it for the
            // hub layout (the layout checked every expert's shape), its
            // slice of a fused tensor otherwise.
            if src.direct {
                src.ckpt
                    .read_tensor_part_direct(&name, at, dst, &mut staging)?;
            } else {
                src.ckpt.read_tensor_part(&name, at, dst)?;
            }
        }
        let checksum = xxh3_64(buf.get(..payload).unwrap_or_default());
        if filled
            .send(Filled {
                index,
                buf,
                checksum,
            })
            .is_err()
        {
            return Ok(());
        }
    }
    Ok(())
}

/// Writer: write whole records at their offsets, recycle the buffers.
fn write_records(
    plan: &StoreWriterPlan,
    file: &StoreFile,
    filled: &Mutex<Receiver<Filled>>,
    free: &SyncSender<AlignedBuf>,
    sums: &Mutex<Vec<u64>>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(), PackError> {
    let payload = plan.header().payload_bytes;
    loop {
        let job = filled.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(job) = job else { return Ok(()) };
        let Some(offset) = plan.record_offset(job.index) else {
            return Err(PackError::Thread(format!(
                "record {} outside the plan",
                job.index
            )));
        };
        file.write_all_at(&job.buf, offset)?;
        if let Some(slot) = sums
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(job.index as usize)
        {
            *slot = job.checksum;
        }
        progress(payload);
        // The reader may have finished; a closed channel is fine.
        let _ = free.send(job.buf);
    }
}

/// Write the tail and then the header, syncing before and after the header.
fn finish(plan: &StoreWriterPlan, file: &StoreFile, sums: &[u64]) -> Result<(), PackError> {
    let tail = plan.tail_bytes(sums)?;
    let mut buf = AlignedBuf::zeroed(tail.len());
    buf.copy_from_slice(&tail);
    file.write_all_at(&buf, plan.tail_offset())?;
    file.sync_data()?;
    let header = plan.header_bytes(sums)?;
    let mut hbuf = AlignedBuf::zeroed(header.len());
    hbuf.copy_from_slice(&header);
    file.write_all_at(&hbuf, 0)?;
    file.sync_data()?;
    Ok(())
}
