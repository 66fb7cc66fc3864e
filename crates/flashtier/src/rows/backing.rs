//! What a row store serves from: the open files of a table source, the
//! table locked in RAM (RAM mode), and a packed shard with its block
//! checksums. Fields are private; `state`, `store`, `fetch` and `shard` use
//! the methods.

use std::sync::Arc;

use flashtier_format::row_shard::{RowLocation, RowShardHeader};
use flashtier_io::{DirectMode, LockedMap, StoreFile};

use crate::rows::{RowError, TableSource};

/// A table source's open files.
pub(crate) struct SourceFiles {
    table: TableSource,
    /// Weights under the store's O_DIRECT policy.
    weights: Arc<StoreFile>,
    /// Weights buffered, for the unaligned tail of the file.
    weights_buffered: Arc<StoreFile>,
    weights_len: u64,
    /// Scales, buffered (pinned once, or read per miss without pinning).
    scales: Arc<StoreFile>,
}

impl SourceFiles {
    /// Open `table`'s files, the weights under `mode`.
    pub(crate) fn open(table: TableSource, mode: DirectMode) -> Result<Self, RowError> {
        let weights = StoreFile::open_read(&table.weights.path, mode)?;
        let weights_len = weights.len_bytes()?;
        Ok(Self {
            weights_buffered: StoreFile::open_read(&table.weights.path, DirectMode::Off)?,
            scales: StoreFile::open_read(&table.scales.path, DirectMode::Off)?,
            weights,
            weights_len,
            table,
        })
    }

    /// The table the files hold.
    pub(crate) fn table(&self) -> &TableSource {
        &self.table
    }

    /// The weight file under the store's O_DIRECT policy.
    pub(crate) fn weights(&self) -> &Arc<StoreFile> {
        &self.weights
    }

    /// The weight file, buffered.
    pub(crate) fn weights_buffered(&self) -> &Arc<StoreFile> {
        &self.weights_buffered
    }

    /// Bytes of the weight file.
    pub(crate) fn weights_len(&self) -> u64 {
        self.weights_len
    }

    /// The scale file, buffered.
    pub(crate) fn scales(&self) -> &Arc<StoreFile> {
        &self.scales
    }

    /// File offset of row `id`'s weights.
    pub(crate) fn weight_offset(&self, id: u64) -> u64 {
        self.table.weights.offset + id * u64::from(self.table.geometry.weight_bytes)
    }

    /// File offset of row `id`'s scale.
    pub(crate) fn scale_offset(&self, id: u64) -> u64 {
        self.table.scales.offset + id * u64::from(self.table.geometry.scale_bytes)
    }
}

/// RAM mode: the whole table mapped and locked.
pub(crate) struct RamTable {
    weights: LockedMap,
    /// `None` when the scales live in the weight file.
    scales: Option<LockedMap>,
}

impl RamTable {
    /// Map and lock `table`'s file(s).
    pub(crate) fn lock(table: &TableSource) -> Result<Self, RowError> {
        let weights = LockedMap::open(&table.weights.path)?;
        let scales = if table.scales.path == table.weights.path {
            None
        } else {
            Some(LockedMap::open(&table.scales.path)?)
        };
        Ok(Self { weights, scales })
    }

    /// Copy row `id` of `src` out of the mapping into `wo` / `so`.
    pub(crate) fn copy_row(
        &self,
        src: &SourceFiles,
        id: u64,
        wo: &mut [u8],
        so: &mut [u8],
    ) -> Result<(), RowError> {
        let g = src.table.geometry;
        let at = |base: u64, n: usize| -> Option<std::ops::Range<usize>> {
            let start = usize::try_from(base + id * n as u64).ok()?;
            Some(start..start + n)
        };
        let sbytes = self.scales.as_ref().unwrap_or(&self.weights).bytes();
        let w = at(src.table.weights.offset, g.w()).and_then(|r| self.weights.bytes().get(r));
        let s = at(src.table.scales.offset, g.s()).and_then(|r| sbytes.get(r));
        match (w, s) {
            (Some(w), Some(s)) => {
                wo.copy_from_slice(w);
                so.copy_from_slice(s);
                Ok(())
            }
            _ => Err(RowError::Source {
                path: src.table.weights.path.clone(),
                what: format!(
                    "row {id} lies outside the locked mapping (file changed after open?)"
                ),
            }),
        }
    }
}

/// A packed shard: its file, header and per-block checksums.
pub(crate) struct Packed {
    file: Arc<StoreFile>,
    header: RowShardHeader,
    checksums: Vec<u64>,
}

impl Packed {
    /// A shard whose header and checksum table were read and checked.
    pub(crate) fn new(file: Arc<StoreFile>, header: RowShardHeader, checksums: Vec<u64>) -> Self {
        Self {
            file,
            header,
            checksums,
        }
    }

    /// The shard file.
    pub(crate) fn file(&self) -> &Arc<StoreFile> {
        &self.file
    }

    /// The header and the block checksums, for a caller that keeps them
    /// without the file (the verifier's image).
    pub(crate) fn into_table(self) -> (RowShardHeader, Vec<u64>) {
        (self.header, self.checksums)
    }

    /// Where row `id` sits, or `None` outside the shard's range.
    pub(crate) fn locate(&self, id: u64) -> Option<RowLocation> {
        self.header.locate(id)
    }

    /// Check block `block`'s bytes against its stored checksum.
    pub(crate) fn verify_block(&self, block: u64, bytes: &[u8]) -> Result<(), RowError> {
        let stored = self.checksums.get(block as usize).copied().unwrap_or(0);
        Ok(self
            .header
            .verify_block(self.file.path(), block, bytes, stored)?)
    }
}
