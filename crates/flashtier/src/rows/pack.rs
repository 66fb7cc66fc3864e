//! Writing packed row shards, and deterministic synthetic tables for tests
//! and benchmarks.
//!
//! [`pack_shard`] copies rows `[lo, hi)` of a [`TableSource`] into the
//! layout of `flashtier_format::row_shard`: whole rows (weight then scale) in
//! 4096-byte blocks, a checksum per block, the header last. It streams in
//! chunks of at most [`CHUNK_BLOCKS`] blocks (16 MiB) through
//! [`flashtier_io::persist`]: under a lock beside the output (a second
//! writer of the same shard waits, or fails with [`Wait::Fail`]), into a
//! unique temp file that is renamed into place after `fsync`, so a crash
//! never leaves a file that validates but is incomplete, and a failed pack
//! leaves no temp file. The output may not be (or link to) the table it
//! reads, and may replace only an older row shard.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use flashtier_format::row_shard::{
    ROW_SHARD_BLOCK_BYTES, ROW_SHARD_MAGIC, RowShardHeader, block_checksum, checksums_digest,
    encode_checksums,
};
use flashtier_io::persist::{FileKind, Output, Wait, refuse_inputs};
use flashtier_io::{DirectMode, StoreFile};

use crate::rows::{RowError, RowGeometry, TableSource};

/// What a packed row shard starts with (for replacing one).
pub const ROW_SHARD_KIND: FileKind = FileKind {
    name: "flashtier row shard",
    magic: &ROW_SHARD_MAGIC,
};

/// Blocks written per chunk (bounds the packer's memory to 16 MiB + rows).
pub const CHUNK_BLOCKS: u64 = 4096;

fn out_err(path: &Path, e: std::io::Error) -> RowError {
    RowError::Source {
        path: path.to_path_buf(),
        what: format!("write: {e}"),
    }
}

/// Supplies `n` rows (stride bytes each) starting at owned row `lo + local`.
pub type FillRows<'a> = dyn FnMut(u64, u64, &mut Vec<u8>) -> Result<(), RowError> + 'a;

/// Write a shard with `header`'s geometry; `fill(local_row, n, out)` appends
/// `n` rows (stride bytes each) starting at owned row `lo + local_row`.
/// `progress(rows_done)` is called after each chunk. Waits for (or per
/// `wait`, refuses) another writer of `out`; replaces only a row shard.
pub fn write_shard(
    out: &Path,
    mut header: RowShardHeader,
    wait: Wait,
    fill: &mut FillRows<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<RowShardHeader, RowError> {
    let mut output = Output::lock(out, wait)?;
    output.existing(ROW_SHARD_KIND)?;
    let tmp = output.create_temp()?.to_path_buf();
    let file = File::options()
        .write(true)
        .open(&tmp)
        .map_err(|e| out_err(&tmp, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&vec![0u8; header.data_offset() as usize])
        .map_err(|e| out_err(&tmp, e))?;
    let rpb = u64::from(header.rows_per_block);
    let stride = header.row_stride() as usize;
    let total = header.owned_rows();
    let mut sums = Vec::with_capacity(usize::try_from(header.block_count()).unwrap_or(0));
    let mut rows = Vec::new();
    let mut block = vec![0u8; ROW_SHARD_BLOCK_BYTES as usize];
    let mut done = 0u64;
    while done < total {
        let n = (total - done).min(CHUNK_BLOCKS * rpb);
        rows.clear();
        fill(done, n, &mut rows)?;
        if rows.len() != n as usize * stride {
            return Err(RowError::Config(format!(
                "fill produced {} bytes for {n} rows",
                rows.len()
            )));
        }
        for chunk in rows.chunks(rpb as usize * stride) {
            block.fill(0);
            block[..chunk.len()].copy_from_slice(chunk);
            sums.push(block_checksum(&block));
            w.write_all(&block).map_err(|e| out_err(&tmp, e))?;
        }
        done += n;
        progress(done);
    }
    w.write_all(&encode_checksums(&sums))
        .map_err(|e| out_err(&tmp, e))?;
    header.checksums_xxh3 = checksums_digest(&sums);
    w.seek(SeekFrom::Start(0)).map_err(|e| out_err(&tmp, e))?;
    w.write_all(&header.encode())
        .map_err(|e| out_err(&tmp, e))?;
    drop(w.into_inner().map_err(|e| out_err(&tmp, e.into_error()))?);
    output.commit()?;
    Ok(header)
}

/// Pack rows `[lo, hi)` of `source` for `layer` into `out`, waiting for
/// another writer of `out`.
pub fn pack_shard(
    source: &TableSource,
    layer: u64,
    lo: u64,
    hi: u64,
    out: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<RowShardHeader, RowError> {
    pack_shard_with(source, layer, lo, hi, out, Wait::Block, progress)
}

/// [`pack_shard`], waiting for another writer of `out` or failing at once
/// per `wait`. Refuses an `out` that is (or links to) the table's files.
pub fn pack_shard_with(
    source: &TableSource,
    layer: u64,
    lo: u64,
    hi: u64,
    out: &Path,
    wait: Wait,
    progress: &mut dyn FnMut(u64),
) -> Result<RowShardHeader, RowError> {
    refuse_inputs(
        out,
        &[source.weights.path.clone(), source.scales.path.clone()],
    )?;
    source.validate()?;
    let g = source.geometry;
    let header = RowShardHeader::new(layer, lo, hi, source.rows, g.weight_bytes, g.scale_bytes)?;
    let wf = StoreFile::open_read(&source.weights.path, DirectMode::Off)?;
    let sf = StoreFile::open_read(&source.scales.path, DirectMode::Off)?;
    let (w, s) = (g.w(), g.s());
    let mut wbuf = Vec::new();
    let mut sbuf = Vec::new();
    let mut fill = |local: u64, n: u64, rows: &mut Vec<u8>| -> Result<(), RowError> {
        let first = lo + local;
        wbuf.resize(n as usize * w, 0);
        sbuf.resize(n as usize * s, 0);
        wf.read_exact_at(&mut wbuf, source.weights.offset + first * w as u64)?;
        sf.read_exact_at(&mut sbuf, source.scales.offset + first * s as u64)?;
        for k in 0..n as usize {
            rows.extend_from_slice(&wbuf[k * w..(k + 1) * w]);
            rows.extend_from_slice(&sbuf[k * s..(k + 1) * s]);
        }
        Ok(())
    };
    write_shard(out, header, wait, &mut fill, progress)
}

/// Row `id` of the synthetic table `seed` (weight then scale bytes): random
/// FP8 codes and, for 8-byte scales, two f32 block scales in [0.5, 2).
pub fn synthetic_row(seed: u64, id: u64, g: RowGeometry, out: &mut [u8]) {
    let mut x = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (w, rest) = out.split_at_mut(g.w().min(out.len()));
    for chunk in w.chunks_mut(8) {
        let v = next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    for chunk in rest.chunks_mut(4) {
        let scale = 0.5 + (next() % 1536) as f32 / 1024.0;
        let v = scale.to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Write a raw synthetic table (weights at 0, scales after them) and return
/// its source.
pub fn write_synthetic_table(
    path: &Path,
    rows: u64,
    g: RowGeometry,
    seed: u64,
) -> Result<TableSource, RowError> {
    g.validate()?;
    let file = File::create(path).map_err(|e| out_err(path, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut row = vec![0u8; g.stride()];
    for part in [0..g.w(), g.w()..g.stride()] {
        for id in 0..rows {
            synthetic_row(seed, id, g, &mut row);
            out.write_all(&row[part.clone()])
                .map_err(|e| out_err(path, e))?;
        }
    }
    out.flush().map_err(|e| out_err(path, e))?;
    drop(out);
    TableSource::raw(path, rows, 0, rows * u64::from(g.weight_bytes), g)
}

/// Write a packed shard (layer, range, table size and geometry from
/// `header`) of the synthetic table `seed` directly (no source
/// file), for benchmarks over tables far larger than RAM.
pub fn write_synthetic_packed(
    out: &Path,
    header: RowShardHeader,
    seed: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<RowShardHeader, RowError> {
    let g = RowGeometry {
        weight_bytes: header.row_weight_bytes,
        scale_bytes: header.scale_bytes,
    };
    let lo = header.lo;
    let mut row = vec![0u8; g.stride()];
    let mut fill = |local: u64, n: u64, rows: &mut Vec<u8>| -> Result<(), RowError> {
        for id in lo + local..lo + local + n {
            synthetic_row(seed, id, g, &mut row);
            rows.extend_from_slice(&row);
        }
        Ok(())
    };
    write_shard(out, header, Wait::Block, &mut fill, progress)
}
