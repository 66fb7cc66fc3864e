//! The spill's store file: its geometry, one entry's blocks written out and
//! read back through the KV tier's checked restore, and the sweep of files
//! that killed servers left (see [`super::spill`] for the layout, bounds
//! and durability).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashtier::kv::KvError;
use flashtier::kv::swap::{BlockVersion, KvSwap, SwapOptions};
use flashtier_engine::device::cpu::kv::KvCache;
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry, KvShape};
use flashtier_io::{AlignedBuf, DirectMode, StorageBackend, StoreFile};

use super::error::SpillError;
use super::image::BlockImage;

/// Tiles in the restore ring (two land while one is copied out).
pub const RING_TILES: usize = 3;

/// Most bytes of the restore ring (64 MiB).
pub const MAX_RING_BYTES: usize = 64 << 20;

/// One store file and what moves an entry in and out of it.
pub(super) struct Store {
    swap: KvSwap,
    path: PathBuf,
    image: BlockImage,
    layers: usize,
    /// Blocks per restore tile and per write (at most `layers`).
    tile_blocks: usize,
    /// One tile of block images, the source of every write.
    staging: AlignedBuf,
}

/// Where a store goes and how it is read.
pub(super) struct StoreIo {
    pub(super) path: PathBuf,
    pub(super) backend: Arc<dyn StorageBackend>,
    pub(super) direct: DirectMode,
    /// Block numbers per layer.
    pub(super) blocks: u32,
}

impl Store {
    /// A store at `io.path` for caches shaped like `kv`.
    pub(super) fn create(io: &StoreIo, kv: &KvCache) -> Result<Self, SpillError> {
        let shape = kv.shape();
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        let geometry = KvGeometry {
            num_layers: n(kv.layers()),
            num_blocks: io.blocks,
            num_kv_heads: n(shape.num_kv_heads),
            block_tokens: n(shape.block_tokens),
            head_dim: n(shape.head_dim),
            dtype_bytes: 2,
        };
        let create_err = |source| SpillError::Create {
            path: io.path.to_path_buf(),
            source,
        };
        let layout = GroupLayout::new(geometry, BlockOrder::BlockMajor).map_err(|e| {
            create_err(KvError::Format {
                path: io.path.display().to_string(),
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
            direct: io.direct,
            tile_slots: tile_blocks,
            ring_tiles: RING_TILES,
            model_hash: flashtier_format::checksum::xxh3_64(identity.as_bytes()),
            ..SwapOptions::default()
        };
        let swap =
            KvSwap::create(io.backend.clone(), &io.path, layout, opts).map_err(create_err)?;
        tracing::info!(
            path = %io.path.display(),
            blocks = io.blocks,
            file_bytes = layout.file_len_bytes(),
            "prefix spill store created"
        );
        Ok(Self {
            swap,
            path: io.path.clone(),
            image,
            layers: kv.layers(),
            tile_blocks,
            staging: AlignedBuf::zeroed(tile_blocks * bb),
        })
    }

    /// The file's length (fixed at creation).
    pub(super) fn file_len_bytes(&self) -> u64 {
        self.swap.layout().file_len_bytes()
    }

    /// Bytes of one block.
    pub(super) fn block_bytes(&self) -> u64 {
        self.image.block_bytes() as u64
    }

    fn shape(&self) -> KvShape {
        let g = self.swap.layout().geometry();
        KvShape {
            num_kv_heads: g.num_kv_heads as usize,
            block_tokens: g.block_tokens as usize,
            head_dim: g.head_dim as usize,
        }
    }

    /// `kv` has the store's shape ([`SpillError::Shape`] otherwise).
    pub(super) fn fits(&self, kv: &KvCache) -> Result<(), SpillError> {
        if self.layers == kv.layers() && self.shape() == kv.shape() {
            return Ok(());
        }
        Err(SpillError::Shape(format!(
            "a cache of {} layers, {:?}, against a store of {} layers, {:?}",
            kv.layers(),
            kv.shape(),
            self.layers,
            self.shape()
        )))
    }

    /// Write `kv`'s block `ordinal` to block number `block` of every
    /// layer, a tile of layers a write; returns the versions layer by
    /// layer. Each version is sealed only after its write completed.
    pub(super) fn write_block(
        &mut self,
        kv: &KvCache,
        ordinal: usize,
        block: u32,
    ) -> Result<Vec<BlockVersion>, SpillError> {
        self.fits(kv)?;
        let bb = self.image.block_bytes();
        let mut versions = Vec::with_capacity(self.layers);
        for first in (0..self.layers).step_by(self.tile_blocks) {
            let n = self.tile_blocks.min(self.layers - first);
            for i in 0..n {
                let (k, v) = kv.layer_bytes(first + i)?;
                let dst = self
                    .staging
                    .get_mut(i * bb..(i + 1) * bb)
                    .ok_or_else(|| SpillError::Shape("staging too small".into()))?;
                self.image.pack(k, v, ordinal, dst)?;
            }
            let id = BlockId::new(first as u32, block);
            let src = self.staging.get(..n * bb).unwrap_or_default();
            let written = self.swap.offload_span(id, n as u32, src);
            let written = written.map_err(|source| SpillError::Write {
                path: self.path.clone(),
                offset: self.swap.layout().block_extent(id).map_or(0, |e| e.offset),
                len_bytes: (n * bb) as u64,
                source,
            })?;
            versions.extend(written);
        }
        Ok(versions)
    }

    /// Read the blocks `versions` (whole block numbers, as
    /// [`Self::write_block`] returned them, block number after block
    /// number) into fresh buffers and fill the empty cache `into` with
    /// their first `fill` positions. Returns the bytes read.
    pub(super) fn read(
        &mut self,
        versions: &[BlockVersion],
        fill: usize,
        into: &mut KvCache,
    ) -> Result<u64, SpillError> {
        self.fits(into)?;
        let bytes = into.layer_len_bytes(fill);
        let mut keys = vec![vec![0u8; bytes]; self.layers];
        let mut values = vec![vec![0u8; bytes]; self.layers];
        let tiles: Vec<Vec<BlockVersion>> = versions
            .chunks(self.tile_blocks)
            .map(<[BlockVersion]>::to_vec)
            .collect();
        let (image, layers, per_tile) = (self.image, self.layers, self.tile_blocks);
        let stats = self.swap.restore_blocks(&tiles, |t, landed| {
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
            path: self.path.clone(),
            blocks: versions.len(),
            source,
        })?;
        into.fill(fill, keys, values)?;
        Ok(stats.bytes)
    }
}

/// Whether process `pid` runs: `/proc/<pid>/stat` exists and its state is
/// not zombie or dead (a killed server nobody reaped yet has closed its
/// files, so its store is free).
fn running(pid: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(Path::new("/proc").join(pid).join("stat")) else {
        return false;
    };
    // `pid (comm) S ...`: the state follows the last `)`.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z' | 'X'))
}

/// Remove `.flashtier-prefix-<pid>-<n>.ftkv` files in `dir` that no live
/// server holds: their pid is not running (where `/proc` tells; that
/// covers a store being created, not locked yet) and their lock is free.
/// Returns how many went.
pub(super) fn sweep_stale(dir: &Path) -> std::io::Result<usize> {
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
        if pid == own || (proc_fs && running(pid)) {
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
