//! `KvSwap`: one KV store file, its block table, and the scratch pool that
//! restores land in. See the durability policy in the [`crate::kv`] docs.
//!
//! A live `KvSwap` holds an exclusive lock on its store file
//! ([`StoreFile::lock_exclusive`]): a second `open` or `create` of the same
//! store, from this process or another, fails with [`IoError::InUse`]
//! instead of writing beside it.
//!
//! Bounds: the block table holds `num_layers * num_blocks` entries of 16
//! bytes; the scratch pool holds `ring_tiles * tile_slots` slots of
//! `block_bytes` (at most [`flashtier_io::blocks::MAX_POOL_BYTES`]); at most
//! `ring_tiles` tiles are in flight at once.

use std::path::Path;
use std::sync::Arc;

use flashtier_format::kv::{
    BlockEntry, BlockId, GroupLayout, KV_HEADER_BYTES, KV_TABLE_ENTRY_BYTES, KvFormatError,
    KvHeader, block_checksum,
};
use flashtier_io::blocks::{
    BatchId, BlockPath, BlockSpan, SlotPool, write_block, write_blocks_run, write_span,
};
use flashtier_io::persist::{Output, Wait};
use flashtier_io::{AlignedBuf, DirectMode, IoError, LandingRegion, StorageBackend, StoreFile};

use super::existing::check_replaceable;
use crate::verify::read_extent;

pub use super::error::KvError;

/// How a [`KvSwap`] is opened and how it restores.
#[derive(Clone, Copy, Debug)]
pub struct SwapOptions {
    /// O_DIRECT policy for the store file.
    pub direct: DirectMode,
    /// Coalesced block ops (default) or the per-head fan-out.
    pub path: BlockPath,
    /// Slots per restore tile (the most blocks one tile may hold).
    pub tile_slots: usize,
    /// Tiles in the restore ring: while one is consumed, up to
    /// `ring_tiles - 1` more are landing (>= 2 for any overlap).
    pub ring_tiles: usize,
    /// Identity of the model, checked on open.
    pub model_hash: u64,
    /// Tensor-parallel rank, checked on open.
    pub rank: u32,
}

impl Default for SwapOptions {
    fn default() -> Self {
        Self {
            direct: DirectMode::Prefer,
            path: BlockPath::Coalesced,
            tile_slots: 64,
            ring_tiles: 3,
            model_hash: 0,
            rank: 0,
        }
    }
}

/// A block as the caller offloaded it: restore checks the store still holds
/// exactly this generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockVersion {
    /// The block.
    pub id: BlockId,
    /// The generation its offload was sealed with.
    pub generation: u64,
}

/// One KV store file with its table and scratch pool.
pub struct KvSwap {
    backend: Arc<dyn StorageBackend>,
    file: Arc<StoreFile>,
    layout: GroupLayout,
    table: Vec<BlockEntry>,
    next_generation: u64,
    opts: SwapOptions,
    pool: SlotPool,
    header: KvHeader,
}

impl std::fmt::Debug for KvSwap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSwap")
            .field("path", &self.file.path())
            .field("layout", &self.layout)
            .field("backend", &self.backend.name())
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// A store at `target` that a live [`KvSwap`] holds (its lock) is not
/// replaced under it: [`IoError::InUse`].
fn refuse_in_use(target: &Path) -> Result<(), KvError> {
    match StoreFile::open_rw(target, DirectMode::Off, false) {
        // The probe's lock ends when it is dropped here.
        Ok(existing) => Ok(existing.lock_exclusive()?),
        // Nothing there (or nothing openable): nothing in use.
        Err(_) => Ok(()),
    }
}

fn pool_for(
    layout: &GroupLayout,
    opts: &SwapOptions,
    region: Option<Arc<LandingRegion>>,
) -> Result<SlotPool, KvError> {
    if opts.tile_slots == 0 || opts.ring_tiles == 0 {
        return Err(KvError::Invalid(
            "tile_slots and ring_tiles must be >= 1".into(),
        ));
    }
    let slots = opts
        .tile_slots
        .checked_mul(opts.ring_tiles)
        .ok_or_else(|| KvError::Invalid("scratch pool size overflows".into()))?;
    let slot_bytes = usize::try_from(layout.block_bytes())
        .map_err(|_| KvError::Invalid("block larger than memory".into()))?;
    Ok(match region {
        Some(r) => SlotPool::in_region(r, slot_bytes, slots)?,
        None => SlotPool::new(slot_bytes, slots)?,
    })
}

impl KvSwap {
    /// Create a store at `path` for `layout`, owned by `opts`' model and
    /// rank, with no block resident.
    ///
    /// An existing file at `path` is replaced only when it is a KV store of
    /// the same layout and owner (or one whose header is damaged); anything
    /// else is refused with [`PersistError::NotReplaceable`] and left as it
    /// is ([`super::existing`]). The store is written as a temp file beside
    /// `path` and renamed over it ([`Output`]: lock, fsync, rename), so
    /// `path` never holds a store without its header; a second creator of
    /// the same path meanwhile gets [`PersistError::Busy`].
    ///
    /// [`PersistError::NotReplaceable`]: flashtier_io::PersistError::NotReplaceable
    /// [`PersistError::Busy`]: flashtier_io::PersistError::Busy
    pub fn create(
        backend: Arc<dyn StorageBackend>,
        path: &Path,
        layout: GroupLayout,
        opts: SwapOptions,
    ) -> Result<Self, KvError> {
        Self::create_in(backend, path, layout, opts, None)
    }

    /// [`Self::create`], with restores landing in `region` (at least
    /// `tile_slots * ring_tiles` blocks; e.g. pinned memory a device copies
    /// from) instead of a host allocation of the tier's own. The region is
    /// handed over (see [`SlotPool::in_region`]).
    pub fn create_in(
        backend: Arc<dyn StorageBackend>,
        path: &Path,
        layout: GroupLayout,
        opts: SwapOptions,
        region: Option<Arc<LandingRegion>>,
    ) -> Result<Self, KvError> {
        let pool = pool_for(&layout, &opts, region)?;
        let header = KvHeader {
            layout,
            model_hash: opts.model_hash,
            rank: opts.rank,
        };
        let mut out = Output::lock(path, Wait::Fail)?;
        check_replaceable(&out, &header)?;
        refuse_in_use(out.target())?;
        let tmp = out.create_temp()?.to_path_buf();
        let fresh = StoreFile::open_rw(&tmp, opts.direct, false)?;
        fresh.set_len(layout.file_len_bytes())?;
        let mut page = AlignedBuf::zeroed(KV_HEADER_BYTES);
        page.copy_from_slice(&header.encode());
        fresh.write_all_at(&page, 0)?;
        drop(fresh);
        out.commit()?;
        let file = StoreFile::open_rw(path, opts.direct, false)?;
        file.lock_exclusive()?;
        pool.register_with(backend.as_ref())?;
        Ok(Self {
            table: vec![BlockEntry::default(); table_len(&layout)?],
            backend,
            file,
            layout,
            next_generation: 1,
            opts,
            pool,
            header,
        })
    }

    /// Open an existing store, checking its header, owner and table.
    pub fn open(
        backend: Arc<dyn StorageBackend>,
        path: &Path,
        opts: SwapOptions,
    ) -> Result<Self, KvError> {
        let file = StoreFile::open_rw(path, opts.direct, false)?;
        file.lock_exclusive()?;
        let page = read_extent(backend.as_ref(), &file, 0, KV_HEADER_BYTES)?;
        let fmt_err = |source| KvError::Format {
            path: path.display().to_string(),
            source,
        };
        let header = KvHeader::decode(&page).map_err(fmt_err)?;
        if (header.model_hash, header.rank) != (opts.model_hash, opts.rank) {
            return Err(KvError::WrongOwner {
                path: path.display().to_string(),
                found_model: header.model_hash,
                found_rank: header.rank,
                model: opts.model_hash,
                rank: opts.rank,
            });
        }
        let layout = header.layout;
        let have = file.len_bytes()?;
        if have < layout.file_len_bytes() {
            return Err(fmt_err(KvFormatError::Truncated {
                got: usize::try_from(have).unwrap_or(usize::MAX),
                need: usize::try_from(layout.file_len_bytes()).unwrap_or(usize::MAX),
            }));
        }
        let ext = layout.table_extent();
        let raw = read_extent(
            backend.as_ref(),
            &file,
            ext.offset,
            to_usize(ext.len_bytes)?,
        )?;
        let table: Vec<BlockEntry> = raw
            .chunks_exact(KV_TABLE_ENTRY_BYTES)
            .take(table_len(&layout)?)
            .map(BlockEntry::decode)
            .collect();
        let next_generation = table.iter().map(|e| e.generation).max().unwrap_or(0) + 1;
        let pool = pool_for(&layout, &opts, None)?;
        pool.register_with(backend.as_ref())?;
        Ok(Self {
            backend,
            file,
            layout,
            table,
            next_generation,
            opts,
            pool,
            header,
        })
    }

    /// The store's layout.
    #[must_use]
    pub fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    /// The store's header.
    #[must_use]
    pub fn header(&self) -> &KvHeader {
        &self.header
    }

    /// The options in force.
    #[must_use]
    pub fn options(&self) -> &SwapOptions {
        &self.opts
    }

    /// The backend's name.
    #[must_use]
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// The table entry of `id`, if resident.
    pub fn resident(&self, id: BlockId) -> Result<Option<BlockVersion>, KvError> {
        let e = self.entry(id)?;
        Ok((e.generation != 0).then_some(BlockVersion {
            id,
            generation: e.generation,
        }))
    }

    /// The scratch pool restores land in.
    pub(super) fn slot_pool(&self) -> &SlotPool {
        &self.pool
    }

    /// The scratch pool, to wait on or invalidate its slots.
    pub(super) fn slot_pool_mut(&mut self) -> &mut SlotPool {
        &mut self.pool
    }

    /// Submit the reads of `spans` into the scratch pool, on the path the
    /// options choose.
    pub(super) fn submit_spans(&mut self, spans: &[BlockSpan]) -> Result<BatchId, KvError> {
        Ok(self.pool.submit(
            self.backend.as_ref(),
            &self.file,
            &self.layout,
            spans,
            self.opts.path,
        )?)
    }

    pub(super) fn table_index(&self, id: BlockId) -> Result<usize, KvError> {
        let i = self
            .layout
            .file_index(id)
            .map_err(|source| KvError::Format {
                path: self.file.path().display().to_string(),
                source,
            })?;
        to_usize(i)
    }

    pub(super) fn entry(&self, id: BlockId) -> Result<BlockEntry, KvError> {
        let i = self.table_index(id)?;
        self.table
            .get(i)
            .copied()
            .ok_or_else(|| KvError::Invalid(format!("table index {i} out of range")))
    }

    fn set_entry(&mut self, id: BlockId, e: BlockEntry) -> Result<(), KvError> {
        let i = self.table_index(id)?;
        match self.table.get_mut(i) {
            Some(slot) => {
                *slot = e;
                Ok(())
            }
            None => Err(KvError::Invalid(format!("table index {i} out of range"))),
        }
    }

    fn seal(&mut self, id: BlockId, bytes: &[u8]) -> Result<BlockVersion, KvError> {
        let generation = self.next_generation;
        self.next_generation += 1;
        let checksum = block_checksum(id, generation, bytes);
        self.set_entry(
            id,
            BlockEntry {
                generation,
                checksum,
            },
        )?;
        Ok(BlockVersion { id, generation })
    }

    /// Offload one block image (`block_bytes`, 4096-aligned memory for
    /// O_DIRECT). Returns the version a restore must ask for.
    pub fn offload_block(&mut self, id: BlockId, src: &[u8]) -> Result<BlockVersion, KvError> {
        self.set_entry(id, BlockEntry::default())?;
        write_block(
            self.backend.as_ref(),
            &self.file,
            &self.layout,
            id,
            src,
            self.opts.path,
        )?;
        self.seal(id, src)
    }

    /// Offload `run_len` consecutive blocks of one layer from `first` with
    /// `write_blocks_run` (one op where the layout makes the run contiguous).
    pub fn offload_run(
        &mut self,
        first: BlockId,
        run_len: u32,
        src: &[u8],
    ) -> Result<Vec<BlockVersion>, KvError> {
        let ids: Vec<BlockId> = (0..run_len)
            .map(|i| BlockId::new(first.layer, first.block.saturating_add(i)))
            .collect();
        self.offload_ids(&ids, src, |s| {
            write_blocks_run(
                s.backend.as_ref(),
                &s.file,
                &s.layout,
                first,
                run_len,
                src,
                s.opts.path,
            )
        })
    }

    /// Offload `count` blocks consecutive in file order from `first` (see
    /// [`GroupLayout::block_at`]) as one write; returns their versions in
    /// file order.
    pub fn offload_span(
        &mut self,
        first: BlockId,
        count: u32,
        src: &[u8],
    ) -> Result<Vec<BlockVersion>, KvError> {
        let start = self.table_index(first)? as u64;
        let ids = (0..u64::from(count))
            .map(|i| {
                self.layout
                    .block_at(start + i)
                    .map_err(|source| KvError::Format {
                        path: self.file.path().display().to_string(),
                        source,
                    })
            })
            .collect::<Result<Vec<BlockId>, KvError>>()?;
        self.offload_ids(&ids, src, |s| {
            write_span(
                s.backend.as_ref(),
                &s.file,
                &s.layout,
                first,
                count,
                src,
                s.opts.path,
            )
        })
    }

    /// Offload the blocks `ids` whose images are `src` (block after block)
    /// with one `write`: their entries are cleared first, so a torn write
    /// never reads back as valid, then sealed.
    fn offload_ids(
        &mut self,
        ids: &[BlockId],
        src: &[u8],
        write: impl FnOnce(&Self) -> Result<usize, IoError>,
    ) -> Result<Vec<BlockVersion>, KvError> {
        for &id in ids {
            self.set_entry(id, BlockEntry::default())?;
        }
        write(self)?;
        let bb = to_usize(self.layout.block_bytes())?;
        ids.iter()
            .zip(src.chunks_exact(bb))
            .map(|(&id, bytes)| self.seal(id, bytes))
            .collect()
    }

    /// Make the store durable: sync the data, then write and sync the table.
    pub fn persist(&mut self) -> Result<(), KvError> {
        self.file.sync_data()?;
        let ext = self.layout.table_extent();
        let mut buf = AlignedBuf::zeroed(to_usize(ext.len_bytes)?);
        for (dst, e) in buf.chunks_exact_mut(KV_TABLE_ENTRY_BYTES).zip(&self.table) {
            dst.copy_from_slice(&e.encode());
        }
        self.backend.write(&self.file, ext.offset, &buf)?;
        self.file.sync_data()?;
        Ok(())
    }

    /// Check a landed block against the table; `bytes` are its slot.
    pub(super) fn verify(&self, want: BlockVersion, bytes: &[u8]) -> Result<(), KvError> {
        let e = self.entry(want.id)?;
        if e.generation == 0 {
            return Err(KvError::NotResident { id: want.id });
        }
        if e.generation != want.generation {
            return Err(KvError::Stale {
                id: want.id,
                expected: want.generation,
                found: e.generation,
            });
        }
        if block_checksum(want.id, e.generation, bytes) != e.checksum {
            let offset = self.layout.block_extent(want.id).map_or(0, |x| x.offset);
            return Err(KvError::Corrupt {
                id: want.id,
                generation: e.generation,
                path: self.file.path().display().to_string(),
                offset,
            });
        }
        Ok(())
    }
}

pub(super) fn to_usize(x: u64) -> Result<usize, KvError> {
    usize::try_from(x).map_err(|_| KvError::Invalid(format!("{x} does not fit in memory")))
}

fn table_len(layout: &GroupLayout) -> Result<usize, KvError> {
    to_usize(layout.blocks_total())
}
