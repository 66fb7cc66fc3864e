//! The KV chunks of a cache that left HBM: offloaded through the KV tier
//! ([`KvSwap`], the KV store format of `docs/kv-format.md`) and restored
//! tile by tile for each attention over them. Device-independent: a
//! [`ChunkDevice`] copies chunks out of its memory and consumes landed
//! tiles (the CUDA cache; a host model of it in the tests), so the
//! schedule, the bookkeeping and the failure paths run on the CPU.
//!
//! One chunk of one layer is one store block (`block_tokens` = the chunk's
//! positions, f32 elements, the per-layer block order, so a layer's
//! offloaded chunks are consecutive in the file and a tile of them is one
//! read). A chunk is offloaded once, when it leaves the resident window
//! complete; it never changes afterwards, so its version stays valid for
//! the life of the cache.
//!
//! Restore: every offloaded chunk of a layer, at every attention over it,
//! in tiles of `tile_chunks` consecutive chunks through the swap's ring of
//! `read_ahead` tiles of pinned host memory: while the device consumes
//! tile `i`, tiles `i + 1..i + read_ahead` are read. Every block is checked
//! (generation and checksum, seeded by its id) before its bytes reach the
//! device; a failed or corrupt read is an error naming the block and tile
//! ([`KvError`]), never attention over wrong bytes.
//!
//! Bounds: the store file holds `layers x capacity_chunks` blocks (sparse;
//! only offloaded chunks are written); pinned host memory `read_ahead x
//! tile_chunks` blocks for restores, plus what the device stages for one
//! offload; the version table `layers x capacity_chunks` entries.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use flashtier::kv::KvError;
use flashtier::kv::swap::{BlockVersion, KvSwap, SwapOptions};
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::{LandingRegion, StorageBackend};

use crate::error::EngineError;

pub use crate::device::tier_stats::KvTierStats;

/// A device's side of offload and restore.
pub trait ChunkDevice {
    /// The bytes of complete, resident chunk `chunk` of `layer` (one store
    /// block), copied out of the device's memory into 4096-aligned host
    /// memory (an O_DIRECT write source; pinned on a GPU).
    fn download(&mut self, layer: usize, chunk: usize) -> Result<&[u8], EngineError>;
    /// Attend over the landed, verified chunks `first_chunk..` of `layer`
    /// (`bytes`: whole blocks). The bytes may be reused once this returns.
    fn consume(
        &mut self,
        layer: usize,
        first_chunk: usize,
        bytes: &[u8],
    ) -> Result<(), EngineError>;
    /// Memory of `len` bytes for the restore ring (pinned, on a GPU).
    fn staging(&mut self, len: usize) -> Result<Arc<LandingRegion>, EngineError>;
}

/// The shape of a tier's store and its restores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierShape {
    /// Layers.
    pub layers: usize,
    /// Chunks per layer at full context.
    pub capacity_chunks: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Positions per chunk.
    pub chunk_positions: usize,
    /// Most chunks restored per tile.
    pub tile_chunks: usize,
    /// Tiles of pinned memory reads land in (reads in flight while one is
    /// consumed: `read_ahead - 1`).
    pub read_ahead: usize,
}

impl TierShape {
    /// The store's layout: f32 elements, one block per chunk, per layer.
    pub fn layout(&self) -> Result<GroupLayout, EngineError> {
        let n = |x: usize, what: &str| {
            u32::try_from(x).map_err(|_| EngineError::TooLarge {
                what: format!("KV store {what}"),
                value: Some(x as u64),
                limit: u64::from(u32::MAX),
                unit: "values",
            })
        };
        let geometry = KvGeometry {
            num_layers: n(self.layers, "layers")?,
            num_blocks: n(self.capacity_chunks, "blocks per layer")?,
            num_kv_heads: n(self.kv_heads, "kv heads")?,
            block_tokens: n(self.chunk_positions, "block positions")?,
            head_dim: n(self.head_dim, "head width")?,
            dtype_bytes: 4,
        };
        GroupLayout::new(geometry, BlockOrder::PerLayer).map_err(|e| EngineError::Layout {
            what: "the KV store".into(),
            reason: e.to_string(),
        })
    }
}

/// Where the store goes and how it is read.
#[derive(Clone)]
pub struct TierIo {
    /// Folder of the store file (one per cache, removed with it).
    pub dir: PathBuf,
    /// The backend (posix, io_uring, or the simulator).
    pub backend: Arc<dyn StorageBackend>,
}

impl std::fmt::Debug for TierIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierIo")
            .field("dir", &self.dir)
            .field("backend", &self.backend.name())
            .finish()
    }
}

static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

/// The offloaded chunks of one cache and the store they live in.
pub struct KvTier {
    shape: TierShape,
    io: TierIo,
    path: PathBuf,
    swap: Option<KvSwap>,
    /// Per layer, the version of each offloaded chunk, in chunk order.
    versions: Vec<Vec<BlockVersion>>,
    stats: KvTierStats,
}

impl std::fmt::Debug for KvTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvTier")
            .field("shape", &self.shape)
            .field("path", &self.path)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl KvTier {
    /// A tier of `shape` whose store (created at the first offload) is a
    /// new file in `io.dir`.
    pub fn new(shape: TierShape, io: TierIo) -> Result<Self, EngineError> {
        shape.layout()?;
        if shape.tile_chunks == 0 || shape.read_ahead == 0 {
            return Err(EngineError::config(
                "kv tier",
                "tiles and read-ahead of at least one",
            ));
        }
        let n = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let path = io
            .dir
            .join(format!(".flashtier-kv-{}-{n}.ftkv", std::process::id()));
        Ok(Self {
            versions: vec![Vec::new(); shape.layers],
            shape,
            io,
            path,
            swap: None,
            stats: KvTierStats::default(),
        })
    }

    /// The shape.
    #[must_use]
    pub fn shape(&self) -> &TierShape {
        &self.shape
    }

    /// The store file (once created).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> KvTierStats {
        self.stats
    }

    /// Chunks of `layer` offloaded so far.
    #[must_use]
    pub fn offloaded(&self, layer: usize) -> usize {
        self.versions.get(layer).map_or(0, Vec::len)
    }

    fn swap(&mut self, dev: &mut impl ChunkDevice) -> Result<&mut KvSwap, EngineError> {
        if self.swap.is_none() {
            let layout = self.shape.layout()?;
            let block = usize::try_from(layout.block_bytes()).map_err(|_| EngineError::Layout {
                what: "the KV store".into(),
                reason: "a block larger than memory".into(),
            })?;
            let opts = SwapOptions {
                tile_slots: self.shape.tile_chunks,
                ring_tiles: self.shape.read_ahead,
                ..SwapOptions::default()
            };
            let region = dev.staging(block * self.shape.tile_chunks * self.shape.read_ahead)?;
            let swap = KvSwap::create_in(
                self.io.backend.clone(),
                &self.path,
                layout,
                opts,
                Some(region),
            )?;
            self.swap = Some(swap);
        }
        self.swap
            .as_mut()
            .ok_or_else(|| EngineError::Attention("no KV store".into()))
    }

    /// `(offset, length)` in the store file of every tile of offloaded
    /// chunks, layer by layer, as a restore reads them (for a drive probe
    /// with the same reads).
    pub fn tile_extents(&self) -> Result<Vec<(u64, usize)>, EngineError> {
        let layout = self.shape.layout()?;
        let block = layout.block_bytes();
        let mut out = Vec::new();
        for (layer, v) in self.versions.iter().enumerate() {
            for first in (0..v.len()).step_by(self.shape.tile_chunks.max(1)) {
                let n = self.shape.tile_chunks.min(v.len() - first) as u64;
                let ext = layout
                    .block_extent(BlockId::new(layer as u32, first as u32))
                    .map_err(|e| EngineError::Layout {
                        what: "the KV store".into(),
                        reason: e.to_string(),
                    })?;
                out.push((ext.offset, usize::try_from(n * block).unwrap_or(usize::MAX)));
            }
        }
        Ok(out)
    }

    /// Offload chunks `chunks` of `layer` (the next ones not yet in the
    /// store, complete and resident on `dev`).
    pub fn offload(
        &mut self,
        dev: &mut impl ChunkDevice,
        layer: usize,
        chunks: Range<usize>,
    ) -> Result<(), EngineError> {
        let have = self.offloaded(layer);
        if chunks.start != have
            || layer >= self.shape.layers
            || chunks.end > self.shape.capacity_chunks
        {
            return Err(EngineError::Attention(format!(
                "offload of chunks {}..{} of layer {layer}: {have} are in the store",
                chunks.start, chunks.end
            )));
        }
        // The store exists before the first chunk leaves the device.
        self.swap(dev)?;
        for c in chunks {
            let started = Instant::now();
            let id = BlockId::new(layer as u32, c as u32);
            let bytes = dev.download(layer, c)?;
            let swap = self
                .swap
                .as_mut()
                .ok_or_else(|| EngineError::Attention("no KV store".into()))?;
            let version = swap.offload_block(id, bytes)?;
            self.stats.offloaded_bytes += bytes.len() as u64;
            self.stats.offloaded_blocks += 1;
            self.stats.offload_ns += elapsed_ns(started);
            if let Some(v) = self.versions.get_mut(layer) {
                v.push(version);
            }
        }
        Ok(())
    }

    /// Restore `tiles` (ranges of offloaded chunks of `layer`, each at most
    /// `tile_chunks`) and hand each to `dev.consume`, in order.
    pub fn restore(
        &mut self,
        dev: &mut impl ChunkDevice,
        layer: usize,
        tiles: &[Range<usize>],
    ) -> Result<(), EngineError> {
        let have = self.offloaded(layer);
        let versions = self
            .versions
            .get(layer)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let mut plan = Vec::with_capacity(tiles.len());
        for t in tiles {
            let v = versions
                .get(t.clone())
                .filter(|v| !v.is_empty() && v.len() <= self.shape.tile_chunks);
            let Some(v) = v else {
                return Err(EngineError::Attention(format!(
                    "restore of chunks {}..{} of layer {layer}: {have} are in the store, tiles of {}",
                    t.start, t.end, self.shape.tile_chunks
                )));
            };
            plan.push(v.to_vec());
        }
        if plan.is_empty() {
            return Ok(());
        }
        let swap = self.swap(dev)?;
        let mut failed: Option<EngineError> = None;
        let result = swap.restore_blocks(&plan, |i, landed| {
            let first = tiles.get(i).map_or(0, |t| t.start);
            dev.consume(layer, first, landed.bytes()).map_err(|e| {
                let what = e.to_string();
                failed = Some(e);
                KvError::Consumer { tile: i, what }
            })
        });
        let st = match (result, failed) {
            (Ok(st), _) => st,
            (Err(_), Some(e)) => return Err(e),
            (Err(e), None) => return Err(e.into()),
        };
        self.stats.restored_blocks += st.blocks;
        self.stats.restored_bytes += st.bytes;
        self.stats.restored_tiles += st.tiles;
        self.stats.read_wait_ns += st.io_wait_ns;
        self.stats.verify_ns += st.verify_ns;
        self.stats.consume_ns += st.consume_ns;
        self.stats.restore_ns += st.total_ns;
        Ok(())
    }
}

impl Drop for KvTier {
    fn drop(&mut self) {
        // The store is this cache's scratch: nothing outlives the cache.
        if self.swap.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
