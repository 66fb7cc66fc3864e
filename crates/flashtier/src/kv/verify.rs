//! Verifying a KV store end to end, read-only and without its owner's
//! identity: the header (magic, version, checksum, every derived field) is
//! decoded, the file length checked against the geometry, the block table
//! read, then every resident block (generation != 0; an empty block holds
//! nothing sealed) is read through a `StorageBackend`
//! ([`crate::verify::scan`]) and checked against the checksum that sealed it
//! (`block_checksum(id, generation, bytes)`). A bad block is reported with
//! its file-order index, (layer, block, generation), offset and length; the
//! scan goes on.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use flashtier_format::kv::{
    BlockEntry, BlockId, KV_HEADER_BYTES, KV_TABLE_ENTRY_BYTES, KvFormatError, KvHeader,
    block_checksum,
};
use flashtier_io::{DirectMode, StorageBackend, StoreFile};

use super::swap::{KvError, to_usize};
use crate::verify::{BadUnit, Progress, Unit, VerifyReport, read_extent, scan};

/// A KV store's validated header and block table.
#[derive(Clone, Debug)]
pub struct KvImage {
    /// The decoded header.
    pub header: KvHeader,
    /// One entry per block, in file order.
    pub table: Vec<BlockEntry>,
    /// Length of the file.
    pub file_len_bytes: u64,
}

impl KvImage {
    /// Blocks holding a sealed offload.
    #[must_use]
    pub fn resident_blocks(&self) -> u64 {
        self.table.iter().filter(|e| e.generation != 0).count() as u64
    }
}

/// Open the KV store at `path` read-only under the `direct` policy and
/// validate its header, length and table (reads through `backend`).
pub fn open_kv(
    path: &Path,
    backend: &dyn StorageBackend,
    direct: DirectMode,
) -> Result<(Arc<StoreFile>, KvImage), KvError> {
    let fmt_err = |source| KvError::Format {
        path: path.display().to_string(),
        source,
    };
    let file = StoreFile::open_read(path, direct)?;
    let have = file.len_bytes()?;
    if have < KV_HEADER_BYTES as u64 {
        return Err(fmt_err(KvFormatError::Truncated {
            got: to_usize(have)?,
            need: KV_HEADER_BYTES,
        }));
    }
    let page = read_extent(backend, &file, 0, KV_HEADER_BYTES)?;
    let header = KvHeader::decode(&page).map_err(fmt_err)?;
    let layout = header.layout;
    if have < layout.file_len_bytes() {
        return Err(fmt_err(KvFormatError::Truncated {
            got: usize::try_from(have).unwrap_or(usize::MAX),
            need: usize::try_from(layout.file_len_bytes()).unwrap_or(usize::MAX),
        }));
    }
    let ext = layout.table_extent();
    let raw = read_extent(backend, &file, ext.offset, to_usize(ext.len_bytes)?)?;
    let table = raw
        .chunks_exact(KV_TABLE_ENTRY_BYTES)
        .take(to_usize(layout.blocks_total())?)
        .map(BlockEntry::decode)
        .collect();
    let image = KvImage {
        header,
        table,
        file_len_bytes: have,
    };
    Ok((file, image))
}

/// Check every resident block of the KV store at `path`.
/// `progress(done, total)` in bytes.
pub fn verify_kv(
    path: &Path,
    backend: &dyn StorageBackend,
    direct: DirectMode,
    progress: Progress<'_>,
) -> Result<(KvImage, VerifyReport), KvError> {
    let t0 = Instant::now();
    let (file, image) = open_kv(path, backend, direct)?;
    let layout = image.header.layout;
    let block_bytes = to_usize(layout.block_bytes())?;
    let data = layout.data_extent().offset;
    let units = image
        .table
        .iter()
        .enumerate()
        .filter(|(_, e)| e.generation != 0)
        .map(|(i, _)| Unit {
            index: i as u64,
            offset: data + i as u64 * layout.block_bytes(),
            len_bytes: block_bytes,
        });
    let mut check = |u: &Unit, bytes: &[u8]| {
        let e = image
            .table
            .get(u.index as usize)
            .copied()
            .unwrap_or_default();
        let id = layout
            .block_at(u.index)
            .unwrap_or(BlockId::new(u32::MAX, u32::MAX));
        let key = format!(
            "layer {} block {} generation {}",
            id.layer, id.block, e.generation
        );
        let computed = block_checksum(id, e.generation, bytes);
        (computed != e.checksum).then(|| {
            let error = format!(
                "{}: block (layer {}, block {}) generation {} at offset {} length {} fails its \
                 checksum (stored {:#018x}, computed {computed:#018x})",
                path.display(),
                id.layer,
                id.block,
                e.generation,
                u.offset,
                u.len_bytes,
                e.checksum
            );
            BadUnit::new(u, key, error)
        })
    };
    let total = image.resident_blocks() * layout.block_bytes();
    let tally = scan(backend, &file, units, total, progress, &mut check)?;
    let report = tally.report(&file, "kv_store", "block", t0);
    Ok((image, report))
}
