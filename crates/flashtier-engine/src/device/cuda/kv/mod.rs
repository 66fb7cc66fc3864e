//! The CUDA device's KV cache, and KV beyond HBM.
//!
//! Without a KV budget every chunk of every layer stays in HBM
//! ([`DevKvCache`]). With one ([`KvBudget`], `flashtier run
//! --kv-budget-hbm`), the cache keeps the newest `slots` chunks of each
//! layer resident and the older ones in a KV store on the drive
//! ([`tier::KvTier`] over `flashtier::kv::KvSwap`): a chunk is offloaded
//! (HBM -> pinned -> store, checksummed) when it leaves the window, and
//! every attention over it restores it, tile by tile (store -> pinned, with
//! O_DIRECT where the file system allows it -> an HBM ring slot), the read
//! of the next tiles overlapping the attention over the current one.
//!
//! Exactness: a chunk is one attention split, and a split's partial result
//! depends only on its chunk's values, which come back byte for byte; the
//! merge combines the splits in their fixed order. So the output is the
//! same bits at every budget as with every chunk resident.
//!
//! Sizing ([`KvSizing::plan`]): the budget holds the resident window of
//! every layer (`layers x slots x chunk_bytes`) and the restore ring
//! (`ring_slots x tile_chunks x chunk_bytes`); `slots` is what is left
//! after the ring, at least two (a step writes at most two chunks), else
//! [`EngineError::KvBudgetTooSmall`] names the smallest budget. A budget
//! that holds the whole context at the model's limit changes nothing.
//! Outside the budget: the attention partials (`rows x q_heads x splits x
//! (dim + 2)` f32) and pinned host memory (`read_ahead x tile_chunks`
//! chunks for restores, one chunk for offloads).

pub mod tier;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::attn::ring::KvRing;
use flashtier_cuda::ops::attn::{CHUNK_POSITIONS, DevKvCache, group_floats};
use flashtier_cuda::ops::buffers::DevAct;
use flashtier_cuda::{Gpu, PinnedMemory};
use flashtier_io::{LandingRegion, StorageBackend};

use crate::device::{KvSpec, KvState};
use crate::error::EngineError;
use tier::{ChunkDevice, KvTier, KvTierStats, TierIo, TierShape};

/// Default chunks per restore tile.
pub const TILE_CHUNKS: usize = 2;
/// Default HBM restore ring slots.
pub const RING_SLOTS: usize = 2;
/// Default tiles of pinned memory restores land in.
pub const READ_AHEAD_TILES: usize = 4;

/// A KV budget: how much HBM the cache may take and where the rest goes.
#[derive(Clone)]
pub struct KvBudget {
    /// HBM bytes for keys and values (resident window and restore ring).
    pub hbm_bytes: u64,
    /// Folder of the KV store file (one file per cache, removed with it).
    pub dir: PathBuf,
    /// Chunks per restore tile.
    pub tile_chunks: usize,
    /// HBM slots of restored tiles.
    pub ring_slots: usize,
    /// Tiles of pinned memory that restores land in.
    pub read_ahead: usize,
    /// Backend of the store (default: posix, `read_ahead` workers).
    pub backend: Option<Arc<dyn StorageBackend>>,
}

impl std::fmt::Debug for KvBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBudget")
            .field("hbm_bytes", &self.hbm_bytes)
            .field("dir", &self.dir)
            .field("tile_chunks", &self.tile_chunks)
            .field("ring_slots", &self.ring_slots)
            .field("read_ahead", &self.read_ahead)
            .finish_non_exhaustive()
    }
}

impl KvBudget {
    /// `hbm_bytes` of HBM, the store in `dir`, default tiles and rings.
    #[must_use]
    pub fn new(hbm_bytes: u64, dir: PathBuf) -> Self {
        Self {
            hbm_bytes,
            dir,
            tile_chunks: TILE_CHUNKS,
            ring_slots: RING_SLOTS,
            read_ahead: READ_AHEAD_TILES,
            backend: None,
        }
    }
}

/// How a budget splits between the resident window and the restore ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSizing {
    /// Resident chunks per layer (every chunk when nothing is offloaded).
    pub slots: usize,
    /// Chunks per layer at the context limit.
    pub capacity_chunks: usize,
    /// Bytes of one chunk of one layer.
    pub chunk_bytes: u64,
    /// Whether chunks are ever offloaded.
    pub offloads: bool,
}

impl KvSizing {
    /// Split `budget` for a cache of `spec` (see the module docs).
    pub fn plan(spec: &KvSpec, budget: &KvBudget) -> Result<Self, EngineError> {
        let chunk_bytes = 8 * spec.kv_heads as u64 * group_floats(spec.head_dim) as u64;
        let capacity_chunks = spec.capacity.div_ceil(CHUNK_POSITIONS).max(1);
        let layers = spec.layers as u64;
        let whole = layers
            .saturating_mul(capacity_chunks as u64)
            .saturating_mul(chunk_bytes);
        if budget.hbm_bytes >= whole {
            return Ok(Self {
                slots: capacity_chunks,
                capacity_chunks,
                chunk_bytes,
                offloads: false,
            });
        }
        let ring_bytes = (budget.ring_slots as u64)
            .saturating_mul(budget.tile_chunks as u64)
            .saturating_mul(chunk_bytes);
        let per_slot = layers.saturating_mul(chunk_bytes).max(1);
        let slots = budget.hbm_bytes.saturating_sub(ring_bytes) / per_slot;
        let usable = budget.ring_slots > 0 && budget.tile_chunks > 0 && budget.read_ahead > 0;
        if slots < 2 || !usable {
            return Err(EngineError::KvBudgetTooSmall {
                budget: budget.hbm_bytes,
                needed: ring_bytes.max(chunk_bytes) + 2 * per_slot,
                chunk_bytes,
                layers: spec.layers,
                ring_bytes,
            });
        }
        Ok(Self {
            slots: usize::try_from(slots).unwrap_or(usize::MAX),
            capacity_chunks,
            chunk_bytes,
            offloads: true,
        })
    }
}

/// The CUDA device's KV cache: resident chunks in HBM, and with a KV
/// budget the offloaded ones in the KV tier.
pub struct CudaKv {
    cache: DevKvCache,
    spill: Option<Spill>,
}

/// What a budgeted cache adds: the tier, the restore ring, the offload
/// staging (the last two allocated at first use).
struct Spill {
    tier: KvTier,
    ring_slots: usize,
    ring: Option<KvRing>,
    staging: Option<PinnedMemory>,
    land_ns: u64,
}

impl std::fmt::Debug for CudaKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKv")
            .field("cache", &self.cache)
            .field("tier", &self.spill.as_ref().map(|s| &s.tier))
            .finish()
    }
}

impl KvState for CudaKv {
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn capacity(&self) -> usize {
        self.cache.capacity()
    }
    fn advance(&mut self, n: usize) {
        self.cache.advance(n);
    }
    fn tier_stats(&self) -> Option<KvTierStats> {
        self.spill.as_ref().map(|s| s.tier.stats())
    }
    fn rewinds(&self) -> bool {
        self.spill.is_none() && self.cache.rewinds()
    }
    fn rewind(&mut self, n: usize) -> Result<(), EngineError> {
        if self.spill.is_some() {
            return Err(EngineError::Shape {
                op: "kv rewind",
                what: format!("{n} positions of a cache with chunks on the drive"),
            });
        }
        Ok(self.cache.rewind(n)?)
    }
}

impl CudaKv {
    /// A cache of `spec` on `gpu`, every chunk resident (`budget` `None`)
    /// or under `budget`.
    pub fn new(gpu: &Gpu, spec: &KvSpec, budget: Option<&KvBudget>) -> Result<Self, EngineError> {
        let (layers, kvh, d, cap) = (spec.layers, spec.kv_heads, spec.head_dim, spec.capacity);
        let Some(budget) = budget else {
            let cache = DevKvCache::new(gpu, layers, kvh, d, cap)?;
            return Ok(Self { cache, spill: None });
        };
        let sizing = KvSizing::plan(spec, budget)?;
        let cache = DevKvCache::with_slots(gpu, layers, kvh, d, cap, sizing.slots)?;
        if !sizing.offloads {
            return Ok(Self { cache, spill: None });
        }
        let backend = match &budget.backend {
            Some(b) => b.clone(),
            None => Arc::new(flashtier_io::PosixBackend::new(budget.read_ahead.max(2))?),
        };
        let shape = TierShape {
            layers,
            capacity_chunks: sizing.capacity_chunks,
            kv_heads: kvh,
            head_dim: d,
            chunk_positions: CHUNK_POSITIONS,
            tile_chunks: budget.tile_chunks,
            read_ahead: budget.read_ahead,
        };
        let io = TierIo {
            dir: budget.dir.clone(),
            backend,
        };
        let spill = Spill {
            tier: KvTier::new(shape, io)?,
            ring_slots: budget.ring_slots,
            ring: None,
            staging: None,
            land_ns: 0,
        };
        Ok(Self {
            cache,
            spill: Some(spill),
        })
    }

    /// The resident cache.
    #[must_use]
    pub fn cache(&self) -> &DevKvCache {
        &self.cache
    }

    /// Head width.
    #[must_use]
    pub fn dim(&self) -> usize {
        self.cache.dim()
    }

    /// Can the next position at `layer` be attended beside other
    /// sequences' ([`DecodeKernels::attend_rows`]): no KV tier, every
    /// chunk resident.
    #[must_use]
    pub fn takes_rows(&self, layer: usize) -> bool {
        self.spill.is_none() && self.cache.takes_rows(layer)
    }

    /// The resident cache, for [`DecodeKernels::attend_rows`].
    pub fn cache_mut(&mut self) -> &mut DevKvCache {
        &mut self.cache
    }

    /// The KV store file, once a chunk was offloaded.
    #[must_use]
    pub fn store_path(&self) -> Option<&std::path::Path> {
        self.spill.as_ref().map(|s| s.tier.path())
    }

    /// `(offset, length)` in the store of every tile a restore of every
    /// layer reads now (see [`KvTier::tile_extents`]).
    pub fn tile_extents(&self) -> Result<Vec<(u64, usize)>, EngineError> {
        self.spill
            .as_ref()
            .map_or(Ok(Vec::new()), |s| s.tier.tile_extents())
    }

    /// Time spent waiting for restored tiles' copies to the device.
    #[must_use]
    pub fn land_ns(&self) -> u64 {
        self.spill.as_ref().map_or(0, |s| s.land_ns)
    }

    /// Append the rows' keys and values to `layer` and attend (see
    /// [`DecodeKernels::attend`]); with a budget, offload the chunks that
    /// leave the window first and restore the offloaded ones for the
    /// attention.
    #[allow(clippy::too_many_arguments, reason = "the attention step's operands")]
    pub fn attend(
        &mut self,
        kernels: &DecodeKernels,
        layer: usize,
        q_heads: usize,
        q: &DevAct,
        (k, v): (&DevAct, &DevAct),
        scale: f32,
        out: &mut DevAct,
    ) -> Result<(), EngineError> {
        let rows = q.rows();
        if let Some(spill) = &mut self.spill {
            let held = self.cache.layer_len(layer)?;
            let done = self.cache.offloaded(layer)?;
            let leaving = self
                .cache
                .window()
                .evictions(held, rows, done)
                .map_err(|e| EngineError::Attention(format!("layer {layer}: {e}")))?;
            if !leaving.is_empty() {
                let end = leaving.end;
                let (tier, mut dev) = split(kernels, &mut self.cache, spill, (q_heads, q, scale));
                tier.offload(&mut dev, layer, leaving)?;
                self.cache.mark_offloaded(layer, end)?;
            }
        }
        kernels.kv_push(&mut self.cache, layer, k, v)?;
        let s = kernels.attend_resident(&mut self.cache, layer, q_heads, q, scale, out)?;
        if s.first_resident > 0 {
            let Some(spill) = &mut self.spill else {
                return Err(EngineError::Attention(format!(
                    "layer {layer}: chunks 0..{} are offloaded but no KV tier holds them",
                    s.first_resident
                )));
            };
            let len = self.cache.layer_len(layer)?;
            let tiles = self
                .cache
                .window()
                .cold_tiles(len, spill.tier.shape().tile_chunks);
            let (tier, mut dev) = split(kernels, &mut self.cache, spill, (q_heads, q, scale));
            tier.restore(&mut dev, layer, &tiles)?;
        }
        kernels.attend_merge(&self.cache, q_heads, rows, s, out)?;
        Ok(())
    }
}

/// The CUDA side of one attention's offloads and restores.
struct Chunks<'a> {
    kernels: &'a DecodeKernels,
    cache: &'a mut DevKvCache,
    ring: &'a mut Option<KvRing>,
    ring_slots: usize,
    tile_chunks: usize,
    staging: &'a mut Option<PinnedMemory>,
    land_ns: &'a mut u64,
    query: (usize, &'a DevAct, f32),
}

/// The tier of `spill` and the device side over `cache`, borrowed apart.
fn split<'a>(
    kernels: &'a DecodeKernels,
    cache: &'a mut DevKvCache,
    spill: &'a mut Spill,
    query: (usize, &'a DevAct, f32),
) -> (&'a mut KvTier, Chunks<'a>) {
    let Spill {
        tier,
        ring_slots,
        ring,
        staging,
        land_ns,
    } = spill;
    let dev = Chunks {
        kernels,
        cache,
        ring,
        ring_slots: *ring_slots,
        tile_chunks: tier.shape().tile_chunks,
        staging,
        land_ns,
        query,
    };
    (tier, dev)
}

impl ChunkDevice for Chunks<'_> {
    fn download(&mut self, layer: usize, chunk: usize) -> Result<&[u8], EngineError> {
        let bytes = self.cache.chunk_bytes();
        if self.staging.is_none() {
            *self.staging = Some(PinnedMemory::new(self.kernels.gpu(), bytes)?);
        }
        let staging = self
            .staging
            .as_mut()
            .ok_or_else(|| EngineError::Attention("no offload staging".into()))?;
        self.cache.download_chunk(layer, chunk, staging)?;
        Ok(staging.bytes_mut(0, bytes)?)
    }

    fn consume(&mut self, layer: usize, first: usize, bytes: &[u8]) -> Result<(), EngineError> {
        if self.ring.is_none() {
            let (gpu, floats) = (self.kernels.gpu(), self.cache.chunk_floats());
            *self.ring = Some(KvRing::new(gpu, self.ring_slots, self.tile_chunks, floats)?);
        }
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| EngineError::Attention("no restore ring".into()))?;
        let started = Instant::now();
        let tile = ring.land(layer, first, bytes)?;
        *self.land_ns += u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let (q_heads, q, scale) = self.query;
        self.kernels
            .attend_tile(self.cache, layer, q_heads, q, scale, &tile)?;
        ring.release(&tile)?;
        Ok(())
    }

    fn staging(&mut self, len: usize) -> Result<Arc<LandingRegion>, EngineError> {
        Ok(PinnedMemory::region(self.kernels.gpu(), len)?)
    }
}
