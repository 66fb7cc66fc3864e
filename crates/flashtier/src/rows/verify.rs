//! Verifying a packed row shard end to end: the header (magic, version,
//! checksum, geometry), the file length and the checksum table are
//! validated on open, then every 4 KiB row block is read through a
//! `StorageBackend` ([`crate::verify::scan`], coalesced into 1 MiB reads)
//! and checked against its xxh3-64. A bad block is reported with its index,
//! the rows it holds, its offset and length; the scan goes on.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use flashtier_format::row_shard::{ROW_SHARD_BLOCK_BYTES, RowShardHeader};
use flashtier_io::{DirectMode, StorageBackend, StoreFile};

use super::RowError;
use super::shard::{load_packed, read_header};
use crate::verify::{BadUnit, Progress, Unit, VerifyReport, scan};

/// A packed shard's validated header and block checksums.
#[derive(Clone, Debug)]
pub struct ShardImage {
    /// The decoded header.
    pub header: RowShardHeader,
    /// One xxh3-64 per row block (the table already matched its checksum).
    pub checksums: Vec<u64>,
    /// Length of the file.
    pub file_len_bytes: u64,
}

/// Open the packed shard at `path` under the `direct` policy and validate
/// its header, length and checksum table (reads through `backend`).
pub fn open_shard(
    path: &Path,
    backend: &dyn StorageBackend,
    direct: DirectMode,
) -> Result<(Arc<StoreFile>, ShardImage), RowError> {
    let file = StoreFile::open_read(path, direct)?;
    let header = read_header(backend, &file)?;
    let (header, checksums) = load_packed(backend, file.clone(), header, None)?.into_table();
    let image = ShardImage {
        header,
        checksums,
        file_len_bytes: file.len_bytes()?,
    };
    Ok((file, image))
}

/// The rows block `block` of a shard holds, `lo..hi`.
fn block_rows(h: &RowShardHeader, block: u64) -> (u64, u64) {
    let per = u64::from(h.rows_per_block);
    let lo = h.lo + block * per;
    (lo, (lo + per).min(h.hi))
}

/// Check every row block of the shard at `path`. `progress(done, total)` in
/// bytes.
pub fn verify_shard(
    path: &Path,
    backend: &dyn StorageBackend,
    direct: DirectMode,
    progress: Progress<'_>,
) -> Result<(ShardImage, VerifyReport), RowError> {
    let t0 = Instant::now();
    let (file, image) = open_shard(path, backend, direct)?;
    let h = &image.header;
    let block_bytes = ROW_SHARD_BLOCK_BYTES as usize;
    let units = (0..h.block_count()).map(|b| Unit {
        index: b,
        offset: h.data_offset() + b * u64::from(ROW_SHARD_BLOCK_BYTES),
        len_bytes: block_bytes,
    });
    let mut check = |u: &Unit, bytes: &[u8]| {
        let stored = image.checksums.get(u.index as usize).copied().unwrap_or(0);
        let err = h.verify_block(path, u.index, bytes, stored).err()?;
        let (lo, hi) = block_rows(h, u.index);
        Some(BadUnit::new(
            u,
            format!("block {} (rows {lo}..{hi})", u.index),
            err.to_string(),
        ))
    };
    let total = h.block_count() * u64::from(ROW_SHARD_BLOCK_BYTES);
    let tally = scan(backend, &file, units, total, progress, &mut check)?;
    let report = tally.report(&file, "row_shard", "block", t0);
    Ok((image, report))
}
