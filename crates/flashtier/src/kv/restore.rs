//! The pipelined restore: tiles of blocks land in a ring of scratch-pool
//! tiles while earlier tiles are consumed.
//!
//! Tile `t` lands in ring position `t % ring_tiles`. Up to `ring_tiles` tiles
//! are submitted ahead; tile `i` is waited for, verified block by block
//! (generation + checksum), handed to the consumer, and only then is its ring
//! position reused for tile `i + ring_tiles`. Within a tile, blocks that are
//! consecutive in file order go out as one read (a run of one layer in the
//! per-layer order, a block of every layer in the block-major order).
//!
//! A failed read or check stops the pipeline before that tile is consumed;
//! the tiles still in flight are drained (waited for, their bytes never
//! handed out) and the error names the tile.

use std::time::Instant;

use flashtier_format::kv::KvStrides;
use flashtier_io::blocks::{BatchId, BlockPath, BlockSpan};

use super::attention::{KvTile, TileSeq};
use super::swap::{BlockVersion, KvError, KvSwap, to_usize};

/// Time spent in each part of a restore, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreStats {
    /// Tiles consumed.
    pub tiles: u64,
    /// Blocks restored.
    pub blocks: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Read ops submitted.
    pub read_ops: u64,
    /// Time the consumer thread waited for reads to land.
    pub io_wait_ns: u64,
    /// Time spent verifying checksums.
    pub verify_ns: u64,
    /// Time spent in the consumer.
    pub consume_ns: u64,
    /// Wall time of the whole restore.
    pub total_ns: u64,
}

impl std::ops::AddAssign for RestoreStats {
    /// Sum two restores' counts and times (e.g. consecutive chunks).
    fn add_assign(&mut self, o: Self) {
        self.tiles += o.tiles;
        self.blocks += o.blocks;
        self.bytes += o.bytes;
        self.read_ops += o.read_ops;
        self.io_wait_ns += o.io_wait_ns;
        self.verify_ns += o.verify_ns;
        self.consume_ns += o.consume_ns;
        self.total_ns += o.total_ns;
    }
}

/// A landed, verified tile: its blocks in the order the caller listed them.
#[derive(Debug)]
pub struct LandedTile<'a> {
    bytes: &'a [u8],
    block_bytes: usize,
    versions: &'a [BlockVersion],
    strides: KvStrides,
    v_offset_bytes: usize,
}

impl<'a> LandedTile<'a> {
    /// Blocks in the tile.
    #[must_use]
    pub fn len(&self) -> usize {
        self.versions.len()
    }

    /// True for a tile of no blocks.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.versions.is_empty()
    }

    /// The version of the `j`th block.
    #[must_use]
    pub fn version(&self, j: usize) -> Option<BlockVersion> {
        self.versions.get(j).copied()
    }

    /// Bytes of every slot of the tile (`len() * block_bytes`), laid out
    /// `[slot, K|V, kv_head, token, dim]`; slot `j` holds the `j`th block.
    #[must_use]
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The `j`th block's bytes.
    pub fn block_bytes(&self, j: usize) -> Result<&'a [u8], KvError> {
        let start = j * self.block_bytes;
        self.bytes
            .get(start..start + self.block_bytes)
            .ok_or_else(|| KvError::Invalid(format!("tile has no block {j}")))
    }

    /// Attention strides of the tile's slots (BF16 elements).
    #[must_use]
    pub fn strides(&self) -> KvStrides {
        self.strides
    }

    /// An attention tile over these slots; `seqs` index blocks by slot `j`.
    #[must_use]
    pub fn kv_tile<'s>(&'s self, seqs: &'s [TileSeq<'s>]) -> KvTile<'s> {
        KvTile {
            k: self.bytes,
            v: self.bytes.get(self.v_offset_bytes..).unwrap_or_default(),
            strides: self.strides,
            seqs,
        }
    }
}

/// Spans of consecutive-in-file-order blocks, landing from `base_slot`.
fn plan_spans(
    swap: &KvSwap,
    tile: &[BlockVersion],
    base_slot: usize,
) -> Result<Vec<BlockSpan>, KvError> {
    let mut spans: Vec<BlockSpan> = Vec::new();
    let mut prev: Option<u64> = None;
    for (j, v) in tile.iter().enumerate() {
        let idx = swap.table_index(v.id)? as u64;
        match spans.last_mut() {
            Some(s) if prev.is_some_and(|p| p + 1 == idx) => s.count += 1,
            _ => spans.push(BlockSpan {
                first: v.id,
                count: 1,
                slot: base_slot + j,
            }),
        }
        prev = Some(idx);
    }
    Ok(spans)
}

impl KvSwap {
    fn submit_tile(
        &mut self,
        tile: &[BlockVersion],
        base: usize,
        stats: &mut RestoreStats,
    ) -> Result<BatchId, KvError> {
        let spans = plan_spans(self, tile, base)?;
        stats.read_ops += match self.options().path {
            BlockPath::Coalesced => spans.len() as u64,
            BlockPath::PerHead => tile.len() as u64 * u64::from(self.layout().groups_per_block()),
        };
        self.submit_spans(&spans)
    }

    /// Verify every block of a landed tile on this thread: a 4 MiB tile
    /// checks in well under a millisecond, less than waking a thread pool
    /// costs on a loaded machine, and the next submission waits on it.
    fn verify_tile(&mut self, tile: &[BlockVersion], base: usize) -> Result<(), KvError> {
        let bytes = self.slot_pool().landed(base, tile.len())?;
        let bb = self.slot_pool().slot_bytes();
        let bad = tile.iter().enumerate().find_map(|(j, &v)| {
            let slot = bytes.get(j * bb..(j + 1) * bb).unwrap_or_default();
            self.verify(v, slot).err().map(|e| (j, e))
        });
        if let Some((j, e)) = bad {
            // The slot's bytes are not a valid block: never served again.
            self.slot_pool_mut().invalidate(base + j)?;
            return Err(e);
        }
        Ok(())
    }

    fn drain(&mut self, in_flight: &mut std::collections::VecDeque<(usize, BatchId)>) {
        for (_, batch) in in_flight.drain(..) {
            let _ = self.slot_pool_mut().wait(batch);
        }
    }

    /// Restore `tiles` (each at most `tile_slots` blocks) through the ring,
    /// calling `consume(tile_index, landed)` for each in order. Returns the
    /// time split; the first failure stops the pipeline (see module docs).
    /// The blocks must be BF16 (what [`LandedTile::kv_tile`] reads); see
    /// [`Self::restore_blocks`] for blocks of any element width.
    pub fn restore_tiles(
        &mut self,
        tiles: &[Vec<BlockVersion>],
        consume: impl FnMut(usize, &LandedTile<'_>) -> Result<(), KvError>,
    ) -> Result<RestoreStats, KvError> {
        if self.layout().geometry().dtype_bytes != 2 {
            return Err(KvError::Invalid(
                "restore for attention needs 2-byte (BF16) elements".into(),
            ));
        }
        self.restore_blocks(tiles, consume)
    }

    /// [`Self::restore_tiles`] for a consumer that reads the landed blocks'
    /// bytes itself ([`LandedTile::bytes`]), whatever their element width
    /// (the GPU engine's f32 chunks).
    pub fn restore_blocks(
        &mut self,
        tiles: &[Vec<BlockVersion>],
        mut consume: impl FnMut(usize, &LandedTile<'_>) -> Result<(), KvError>,
    ) -> Result<RestoreStats, KvError> {
        let (cap, depth) = (self.options().tile_slots, self.options().ring_tiles);
        if let Some((i, t)) = tiles.iter().enumerate().find(|(_, t)| t.len() > cap) {
            return Err(KvError::Invalid(format!(
                "tile {i} holds {} blocks, the ring's tiles {cap}",
                t.len()
            )));
        }
        let start = Instant::now();
        let mut stats = RestoreStats::default();
        let mut in_flight = std::collections::VecDeque::with_capacity(depth);
        let result = self.run_ring(tiles, &mut consume, &mut in_flight, &mut stats);
        self.drain(&mut in_flight);
        stats.total_ns = elapsed_ns(start);
        result.map(|()| stats)
    }

    fn run_ring(
        &mut self,
        tiles: &[Vec<BlockVersion>],
        consume: &mut impl FnMut(usize, &LandedTile<'_>) -> Result<(), KvError>,
        in_flight: &mut std::collections::VecDeque<(usize, BatchId)>,
        stats: &mut RestoreStats,
    ) -> Result<(), KvError> {
        let (cap, depth) = (self.options().tile_slots, self.options().ring_tiles);
        let fail = |tile: usize| {
            move |e: KvError| KvError::Restore {
                tile,
                source: Box::new(e),
            }
        };
        for (t, tile) in tiles.iter().enumerate().take(depth) {
            let b = self
                .submit_tile(tile, (t % depth) * cap, stats)
                .map_err(fail(t))?;
            in_flight.push_back((t, b));
        }
        let layout = *self.layout();
        let bb = to_usize(layout.block_bytes())?;
        let strides = layout.slot_strides();
        let v_offset_bytes = layout.slot_v_offset_bytes();
        for (i, tile) in tiles.iter().enumerate() {
            let base = (i % depth) * cap;
            let Some((_, batch)) = in_flight.pop_front() else {
                return Err(KvError::Invalid(format!("tile {i} was never submitted")));
            };
            let t0 = Instant::now();
            self.slot_pool_mut()
                .wait(batch)
                .map_err(|e| fail(i)(e.into()))?;
            let t1 = Instant::now();
            self.verify_tile(tile, base).map_err(fail(i))?;
            let t2 = Instant::now();
            let landed = LandedTile {
                bytes: self
                    .slot_pool()
                    .landed(base, tile.len())
                    .map_err(|e| fail(i)(e.into()))?,
                block_bytes: bb,
                versions: tile,
                strides,
                v_offset_bytes,
            };
            consume(i, &landed)?;
            let t3 = Instant::now();
            stats.io_wait_ns += (t1 - t0).as_nanos() as u64;
            stats.verify_ns += (t2 - t1).as_nanos() as u64;
            stats.consume_ns += (t3 - t2).as_nanos() as u64;
            stats.tiles += 1;
            stats.blocks += tile.len() as u64;
            stats.bytes += (tile.len() * bb) as u64;
            if let Some(next) = tiles.get(i + depth) {
                let b = self
                    .submit_tile(next, base, stats)
                    .map_err(fail(i + depth))?;
                in_flight.push_back((i + depth, b));
            }
        }
        Ok(())
    }
}

fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
