//! The prefix cache's second level: kept CPU caches written to a KV store
//! on a drive ([`flashtier::kv::swap::KvSwap`], `docs/kv-format.md`) when
//! they leave the memory budget, and read back for a prompt that shares
//! their first tokens.
//!
//! The store: one file per server, `.flashtier-prefix-<pid>-<n>.ftkv` in the
//! spill folder, created at the first spill from that cache's shape (every
//! CPU cache of one engine has the same) and held under an exclusive lock
//! while the server runs; BF16 values, the block-major order, [`BLOCK_TOKENS`]
//! positions a block. An entry takes `ceil(len / 16)` block numbers, the
//! same ones in every layer; block number `b` of every layer is one
//! contiguous extent, so one block number spills as one write and comes
//! back as one read (or a few, for a model whose layers pass the ring's
//! tile). Block numbers come from a free list: a dropped entry's are reused.
//!
//! Bounds: `--prefix-spill-tokens N` sets `blocks = ceil(N / 16)` block
//! numbers (at most [`MAX_SPILL_TOKENS`] positions). The file is made at its
//! final length, `4096 + round_up(layers x blocks x 16, 4096) + layers x
//! blocks x block_bytes` bytes (sparse until written), with `block_bytes =
//! 2 x kv_heads x round_up(16 x width x 2, 4096)` (`width` the stored head
//! width: twice `head_dim` at the default precision), and never grows:
//! every write is one of its blocks. Memory: a staging buffer of one tile
//! (at most `layers` blocks) for writes, and the restore ring of
//! [`RING_TILES`] tiles; a tile holds at most [`MAX_RING_BYTES`] `/ 3`.
//!
//! Durability (the KV tier's policy, `flashtier::kv`): the store is a cache
//! of state the model recomputes. A block's table entry is sealed (its
//! generation and checksum) only after its write completed; a restore
//! checks every block's generation and checksum before a byte reaches the
//! cache, so a failed, short or corrupt read is a [`SpillError::Restore`]
//! and the prompt is recomputed, never served from wrong bytes. Nothing is
//! fsynced: the file does not outlive the server, which removes it when it
//! stops; a file a killed server left behind (its pid gone and its lock
//! free) is removed when the next one starts in the same folder.
//!
//! GPU caches are not spilled: the CUDA cache has no path that writes
//! positions back into it from host memory, so a GPU entry that leaves the
//! memory budget is dropped as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use flashtier::kv::KvError;
use flashtier::kv::swap::{BlockVersion, KvSwap, SwapOptions};
use flashtier_engine::device::KvState;
use flashtier_engine::device::cpu::kv::{BLOCK_TOKENS, KvCache};
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::{AlignedBuf, DirectMode, PosixBackend, StorageBackend, StoreFile};

use super::error::SpillError;
use super::image::BlockImage;

/// Most positions the store may hold (16 Mi).
pub const MAX_SPILL_TOKENS: usize = 1 << 24;

/// Tiles in the restore ring (two land while one is copied out).
pub const RING_TILES: usize = 3;

/// Most bytes of the restore ring (64 MiB).
pub const MAX_RING_BYTES: usize = 64 << 20;

/// Workers of the default (posix) backend.
const QUEUE_DEPTH: usize = 4;

static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

/// Where and how much the prefix cache spills.
#[derive(Clone)]
pub struct SpillConfig {
    /// Folder of the store file (made if missing).
    pub dir: PathBuf,
    /// Positions the store holds at most (rounded up to whole blocks).
    pub tokens: usize,
    /// O_DIRECT policy of the store.
    pub direct: DirectMode,
    /// Backend of the store (default: posix, 4 workers).
    pub backend: Option<Arc<dyn StorageBackend>>,
}

impl SpillConfig {
    /// Spill to `dir`, at most `tokens` positions, posix reads, O_DIRECT
    /// where the file system allows it.
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>, tokens: usize) -> Self {
        Self {
            dir: dir.into(),
            tokens,
            direct: DirectMode::Prefer,
            backend: None,
        }
    }
}

impl std::fmt::Debug for SpillConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillConfig")
            .field("dir", &self.dir)
            .field("tokens", &self.tokens)
            .field("direct", &self.direct)
            .field("backend", &self.backend.as_ref().map(|b| b.name()))
            .finish()
    }
}

/// What the spill did, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpillStats {
    /// Entries written to the drive.
    pub spilled: u64,
    /// Entries whose write failed (dropped).
    pub spill_failures: u64,
    /// Entries read back for a prompt.
    pub restored: u64,
    /// Restores that failed (the prompt was recomputed).
    pub restore_failures: u64,
    /// Entries dropped from the drive to make room, or too large for it.
    pub dropped: u64,
    /// Bytes written to the store.
    pub bytes_written: u64,
    /// Bytes read back and verified.
    pub bytes_read: u64,
}

/// An entry on the drive: its block numbers, the versions a restore asks
/// for (block number by block number, every layer's in order), and what it
/// holds.
#[derive(Debug)]
pub(super) struct Spilled {
    blocks: Vec<u32>,
    versions: Vec<BlockVersion>,
    len: usize,
    capacity: usize,
}

impl Spilled {
    /// Positions the cache it came from could hold.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }
}

struct Store {
    swap: KvSwap,
    image: BlockImage,
    layers: usize,
    tile_blocks: usize,
    staging: AlignedBuf,
}

/// The store and its free block numbers (see the module docs).
pub struct PrefixSpill {
    cfg: SpillConfig,
    backend: Arc<dyn StorageBackend>,
    blocks: u32,
    path: PathBuf,
    store: Option<Store>,
    free: Vec<u32>,
    stats: SpillStats,
}

impl std::fmt::Debug for PrefixSpill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixSpill")
            .field("path", &self.path)
            .field("blocks", &self.blocks)
            .field("free", &self.free.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Block numbers for `len` positions.
pub(super) fn blocks_for(len: usize) -> usize {
    len.div_ceil(BLOCK_TOKENS)
}

impl PrefixSpill {
    /// A spill into `cfg.dir` (made if missing; stale stores of killed
    /// servers there are removed). The store file is created at the first
    /// spill.
    pub fn new(cfg: SpillConfig) -> Result<Self, SpillError> {
        if cfg.tokens == 0 || cfg.tokens > MAX_SPILL_TOKENS {
            return Err(SpillError::Shape(format!(
                "prefix spill of {} positions: 1..={MAX_SPILL_TOKENS}",
                cfg.tokens
            )));
        }
        let dir_err = |source| SpillError::Dir {
            path: cfg.dir.clone(),
            source,
        };
        std::fs::create_dir_all(&cfg.dir).map_err(dir_err)?;
        sweep_stale(&cfg.dir).map_err(dir_err)?;
        let backend = match &cfg.backend {
            Some(b) => b.clone(),
            None => Arc::new(PosixBackend::new(QUEUE_DEPTH).map_err(|e| SpillError::Create {
                path: cfg.dir.clone(),
                source: e.into(),
            })?),
        };
        let blocks = u32::try_from(blocks_for(cfg.tokens))
            .map_err(|_| SpillError::Shape("too many spill blocks".into()))?;
        let n = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let path = cfg
            .dir
            .join(format!(".flashtier-prefix-{}-{n}.ftkv", std::process::id()));
        Ok(Self {
            cfg,
            backend,
            blocks,
            path,
            store: None,
            free: (0..blocks).rev().collect(),
            stats: SpillStats::default(),
        })
    }

    /// The store file (there once something was spilled).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Block numbers the store holds (each `BLOCK_TOKENS` positions).
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.blocks as usize
    }

    /// Block numbers free now.
    #[must_use]
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// The store's length in bytes, once it exists (fixed at creation).
    #[must_use]
    pub fn file_len_bytes(&self) -> Option<u64> {
        self.store
            .as_ref()
            .map(|s| s.swap.layout().file_len_bytes())
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> SpillStats {
        self.stats
    }

    /// An entry left the drive without being restored.
    pub(super) fn drop_entry(&mut self, s: Spilled) {
        self.stats.dropped += 1;
        self.release(s);
    }

    /// Count an entry that could not go to the drive at all.
    pub(super) fn note_dropped(&mut self) {
        self.stats.dropped += 1;
    }

    /// Its block numbers are free again (nothing reads them afterwards: the
    /// next write of a block seals a new generation).
    pub(super) fn release(&mut self, s: Spilled) {
        self.free.extend(s.blocks.iter().rev());
    }

    fn create(&self, kv: &KvCache) -> Result<Store, SpillError> {
        let shape = kv.shape();
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        let geometry = KvGeometry {
            num_layers: n(kv.layers()),
            num_blocks: self.blocks,
            num_kv_heads: n(shape.num_kv_heads),
            block_tokens: n(shape.block_tokens),
            head_dim: n(shape.head_dim),
            dtype_bytes: 2,
        };
        let create_err = |source| SpillError::Create {
            path: self.path.clone(),
            source,
        };
        let layout = GroupLayout::new(geometry, BlockOrder::BlockMajor).map_err(|e| {
            create_err(KvError::Format {
                path: self.path.display().to_string(),
                source: e,
            })
        })?;
        let image = BlockImage::new(shape, &layout)?;
        let bb = image.block_bytes();
        let tile_blocks = (MAX_RING_BYTES / RING_TILES / bb).clamp(1, kv.layers().max(1));
        let identity = format!(
            "flashtier prefix spill: {} layers, {shape:?}, {}",
            kv.layers(),
            kv.precision()
        );
        let opts = SwapOptions {
            direct: self.cfg.direct,
            tile_slots: tile_blocks,
            ring_tiles: RING_TILES,
            model_hash: flashtier_format::checksum::xxh3_64(identity.as_bytes()),
            ..SwapOptions::default()
        };
        let swap = KvSwap::create(self.backend.clone(), &self.path, layout, opts)
            .map_err(create_err)?;
        tracing::info!(
            path = %self.path.display(),
            blocks = self.blocks,
            file_bytes = layout.file_len_bytes(),
            "prefix spill store created"
        );
        Ok(Store {
            swap,
            image,
            layers: kv.layers(),
            tile_blocks,
            staging: AlignedBuf::zeroed(tile_blocks * bb),
        })
    }

    /// Write `kv` (a cache of `capacity` positions) to the drive. The
    /// caller made room ([`Self::free_blocks`]); on failure nothing of it
    /// is kept.
    pub(super) fn write(&mut self, kv: &KvCache, capacity: usize) -> Result<Spilled, SpillError> {
        let result = self.try_write(kv, capacity);
        match &result {
            Ok(s) => {
                self.stats.spilled += 1;
                let per = s.versions.len() as u64;
                self.stats.bytes_written += per * self.block_bytes();
            }
            Err(e) => {
                self.stats.spill_failures += 1;
                tracing::warn!("a kept cache was dropped instead of spilled: {e}");
            }
        }
        result
    }

    fn block_bytes(&self) -> u64 {
        self.store.as_ref().map_or(0, |s| s.image.block_bytes() as u64)
    }

    fn try_write(&mut self, kv: &KvCache, capacity: usize) -> Result<Spilled, SpillError> {
        let need = blocks_for(kv.len());
        if need == 0 || need > self.free.len() {
            return Err(SpillError::Shape(format!(
                "{} positions need {need} blocks; {} of {} are free",
                kv.len(),
                self.free.len(),
                self.blocks
            )));
        }
        if self.store.is_none() {
            self.store = Some(self.create(kv)?);
        }
        let Self {
            store, free, path, ..
        } = self;
        let store = store
            .as_mut()
            .ok_or_else(|| SpillError::Shape("no spill store".into()))?;
        if store.layers != kv.layers() || BlockImage::new(kv.shape(), store.swap.layout()).is_err()
        {
            return Err(SpillError::Shape(format!(
                "a cache of {} layers, {:?}, into a store of {}",
                kv.layers(),
                kv.shape(),
                describe(store)
            )));
        }
        let mut blocks = free.split_off(free.len() - need);
        blocks.reverse();
        match write_blocks(store, kv, &blocks, path) {
            Ok(versions) => Ok(Spilled {
                blocks,
                versions,
                len: kv.len(),
                capacity,
            }),
            Err(e) => {
                free.extend(blocks.iter().rev());
                Err(e)
            }
        }
    }

    /// Read the first `positions` positions of `s` (whole blocks of them)
    /// back into `into`, an empty cache of the engine's; the caller cuts it
    /// back to `positions` and releases `s`.
    pub(super) fn restore(
        &mut self,
        s: &Spilled,
        positions: usize,
        into: &mut KvCache,
    ) -> Result<(), SpillError> {
        let result = self.try_restore(s, positions, into);
        match &result {
            Ok(bytes) => {
                self.stats.restored += 1;
                self.stats.bytes_read += bytes;
            }
            Err(_) => self.stats.restore_failures += 1,
        }
        result.map(|_| ())
    }

    fn try_restore(
        &mut self,
        s: &Spilled,
        positions: usize,
        into: &mut KvCache,
    ) -> Result<u64, SpillError> {
        let path = self.path.clone();
        let store = self
            .store
            .as_mut()
            .ok_or_else(|| SpillError::Shape("no spill store".into()))?;
        let need = blocks_for(positions.min(s.len)).max(1);
        let fill = (need * BLOCK_TOKENS).min(s.len);
        if store.layers != into.layers() || into.shape() != shape_of(store) {
            return Err(SpillError::Shape(format!(
                "a store of {} into a cache of {} layers, {:?}",
                describe(store),
                into.layers(),
                into.shape()
            )));
        }
        let versions = s
            .versions
            .get(..need * store.layers)
            .ok_or_else(|| {
                SpillError::Shape(format!("{need} blocks of an entry of {}", s.blocks.len()))
            })?;
        let bytes = into.layer_len_bytes(fill);
        let mut keys = vec![vec![0u8; bytes]; store.layers];
        let mut values = vec![vec![0u8; bytes]; store.layers];
        let tiles: Vec<Vec<BlockVersion>> = versions
            .chunks(store.tile_blocks)
            .map(<[BlockVersion]>::to_vec)
            .collect();
        let (image, layers, per_tile) = (store.image, store.layers, store.tile_blocks);
        let stats = store.swap.restore_blocks(&tiles, |t, landed| {
            for j in 0..landed.len() {
                let g = t * per_tile + j;
                let (ordinal, layer) = (g / layers, g % layers);
                let src = landed.block_bytes(j)?;
                let put = match (keys.get_mut(layer), values.get_mut(layer)) {
                    (Some(k), Some(v)) => image.unpack(src, ordinal, k, v),
                    _ => Err(SpillError::Shape(format!("layer {layer}"))),
                };
                put.map_err(|e| KvError::Consumer {
                    tile: t,
                    what: e.to_string(),
                })?;
            }
            Ok(())
        });
        let stats = stats.map_err(|source| SpillError::Restore {
            path,
            blocks: versions.len(),
            source,
        })?;
        into.fill(fill, keys, values)?;
        Ok(stats.bytes)
    }
}

fn shape_of(store: &Store) -> flashtier_format::kv::KvShape {
    let g = store.swap.layout().geometry();
    flashtier_format::kv::KvShape {
        num_kv_heads: g.num_kv_heads as usize,
        block_tokens: g.block_tokens as usize,
        head_dim: g.head_dim as usize,
    }
}

fn describe(store: &Store) -> String {
    format!("{} layers, {:?}", store.layers, shape_of(store))
}

/// Write every block number of `blocks` (block number by block number, a
/// tile of layers a write); returns the versions in that order.
fn write_blocks(
    store: &mut Store,
    kv: &KvCache,
    blocks: &[u32],
    path: &Path,
) -> Result<Vec<BlockVersion>, SpillError> {
    let bb = store.image.block_bytes();
    let mut versions = Vec::with_capacity(blocks.len() * store.layers);
    for (ordinal, &b) in blocks.iter().enumerate() {
        for first in (0..store.layers).step_by(store.tile_blocks) {
            let n = store.tile_blocks.min(store.layers - first);
            for i in 0..n {
                let (k, v) = kv.layer_bytes(first + i)?;
                let dst = store
                    .staging
                    .get_mut(i * bb..(i + 1) * bb)
                    .ok_or_else(|| SpillError::Shape("staging too small".into()))?;
                store.image.pack(k, v, ordinal, dst)?;
            }
            let id = BlockId::new(first as u32, b);
            let src = store.staging.get(..n * bb).unwrap_or_default();
            let written = store.swap.offload_span(id, n as u32, src);
            let written = written.map_err(|source| SpillError::Write {
                path: path.to_path_buf(),
                offset: store
                    .swap
                    .layout()
                    .block_extent(id)
                    .map_or(0, |e| e.offset),
                len_bytes: (n * bb) as u64,
                source,
            })?;
            versions.extend(written);
        }
    }
    Ok(versions)
}

/// Remove `.flashtier-prefix-<pid>-<n>.ftkv` files in `dir` that no live
/// server holds: their pid is not running (where `/proc` tells) and their
/// lock is free. Returns how many went.
fn sweep_stale(dir: &Path) -> std::io::Result<usize> {
    let own = std::process::id().to_string();
    let proc_fs = Path::new("/proc/self").exists();
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = name
            .strip_prefix(".flashtier-prefix-")
            .and_then(|r| r.strip_suffix(".ftkv"))
        else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        if pid == own || (proc_fs && Path::new("/proc").join(pid).exists()) {
            continue;
        }
        let free = StoreFile::open_rw(&entry.path(), DirectMode::Off, false)
            .and_then(|f| f.lock_exclusive());
        if free.is_ok() && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(path = %entry.path().display(), "removed a stale prefix spill store");
            removed += 1;
        }
    }
    Ok(removed)
}

impl Drop for PrefixSpill {
    fn drop(&mut self) {
        // The store is the server's scratch: its lock ends with the swap,
        // then the file goes.
        if self.store.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
