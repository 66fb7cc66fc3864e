//! The measured work of `flashtier bench kv`, fixed per block order: the
//! synthetic KV and queries, and fresh stores of [`PARTS`] equal parts
//! holding every block, each block stamped so no two hold the same bytes.
//!
//! Files: `work/sample.rs` (one side-by-side sample), `work/attend.rs` (the
//! attention consumer). The flags' bounds are checked first
//! ([`super::bounds`]).

mod attend;
mod sample;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use flashtier::kv::attention::{AttentionDims, AttnState};
use flashtier::kv::swap::{BlockVersion, KvSwap, SwapOptions};
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::blocks::BlockPath;
use flashtier_io::{AlignedBuf, StorageBackend};
use half::bf16;

use super::Args;
use super::bounds::SPAN_BLOCKS;
use super::fio;

/// Equal parts of each repetition's store: fio reads one, the restore alone
/// another, the pipelined restore the third. All three were written by the
/// same pass a moment earlier, so the host's cache of the virtio disk treats
/// them alike, and no byte is read twice.
const PARTS: u32 = 3;

/// One side-by-side sample.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Sample {
    pub restore_s: f64,
    pub restore_bps: f64,
    pub fio_bps: f64,
    pub pipelined_s: f64,
    pub attention_s: f64,
    pub verify_s: f64,
}

/// Everything fixed for one block order.
pub struct Bench {
    args: Args,
    order: BlockOrder,
    layout: GroupLayout,
    backend: Arc<dyn StorageBackend>,
    dims: AttentionDims,
    pub op_bytes: u64,
    pub ops_in_flight: usize,
    pub data_bytes: u64,
    num_tiles: u32,
    tile_slots: usize,
    bank: AlignedBuf,
    queries: Vec<Vec<f32>>,
    /// Per layer: the slots (within a tile) of that layer's blocks, in block order.
    tables: Vec<Vec<u32>>,
}

/// `len` bytes of BF16 values in [-2, 2], from a fixed xorshift sequence:
/// the blocks a span writes (each then stamped apart).
fn synthetic_bank(len: usize) -> AlignedBuf {
    let mut bank = AlignedBuf::zeroed(len);
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for pair in bank.chunks_exact_mut(2) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = bf16::from_f32(((x % 4001) as f32 - 2000.0) / 1000.0);
        pair.copy_from_slice(&v.to_bits().to_le_bytes());
    }
    bank
}

/// One decode query per layer, values in [-1, 1], fixed by the shape.
fn synthetic_queries(layers: u32, dims: AttentionDims) -> Vec<Vec<f32>> {
    (0..layers)
        .map(|ly| {
            (0..dims.num_q_heads * dims.head_dim)
                .map(|i| (((i as u32 ^ ly) * 2_654_435_761 % 2001) as f32 - 1000.0) / 1000.0)
                .collect()
        })
        .collect()
}

impl Bench {
    /// The bench of `order` under `args`, writing through `backend`.
    pub fn new(args: &Args, order: BlockOrder, backend: Arc<dyn StorageBackend>) -> Result<Self> {
        let l = args.layers;
        let tb = args.tile_blocks.max(1);
        let probe = KvGeometry {
            num_layers: l,
            num_blocks: 1,
            num_kv_heads: args.kv_heads,
            block_tokens: args.block_tokens,
            head_dim: args.head_dim,
            dtype_bytes: 2,
        };
        let bb = GroupLayout::new(probe, order)?.block_bytes();
        let want = (args.gib * f64::from(1u32 << 30)) as u64 / (u64::from(l) * bb);
        let num_blocks = u32::try_from(want / u64::from(tb) * u64::from(tb))?.max(tb);
        let layout = GroupLayout::new(
            KvGeometry {
                num_blocks: num_blocks
                    .checked_mul(PARTS)
                    .context("--gib too large for one store")?,
                ..probe
            },
            order,
        )?;
        let dims = AttentionDims::new(
            1,
            args.q_heads as usize,
            args.kv_heads as usize,
            args.head_dim as usize,
            args.block_tokens as usize,
        );
        AttnState::new(dims).context("attention dimensions")?;
        let tile_slots = tb as usize * l as usize;
        let (op_bytes, ops_per_tile) = match order {
            BlockOrder::PerLayer => (u64::from(tb) * bb, l as usize),
            BlockOrder::BlockMajor => (u64::from(tb) * u64::from(l) * bb, 1),
        };
        let ops_in_flight = args
            .qd
            .min(args.ring.saturating_sub(1).max(1) * ops_per_tile);
        let bank = synthetic_bank(usize::try_from(SPAN_BLOCKS * bb)?);
        let queries = synthetic_queries(l, dims);
        let mut bench = Self {
            args: args.clone(),
            order,
            layout,
            backend,
            dims,
            op_bytes,
            ops_in_flight,
            data_bytes: layout.data_extent().len_bytes / u64::from(PARTS),
            num_tiles: num_blocks / tb,
            tile_slots,
            bank,
            queries,
            tables: Vec::new(),
        };
        bench.tables = bench.slot_tables()?;
        Ok(bench)
    }

    /// Blocks of tile `t`, in file order (so the restore coalesces them).
    fn tile_ids(&self, t: u32) -> Result<Vec<BlockId>> {
        let tb = self.args.tile_blocks.max(1);
        let mut ids: Vec<(u64, BlockId)> = (0..self.args.layers)
            .flat_map(|ly| (t * tb..(t + 1) * tb).map(move |b| BlockId::new(ly, b)))
            .map(|id| Ok((self.layout.file_index(id)?, id)))
            .collect::<Result<_>>()?;
        ids.sort_unstable();
        Ok(ids.into_iter().map(|(_, id)| id).collect())
    }

    fn slot_tables(&self) -> Result<Vec<Vec<u32>>> {
        let ids = self.tile_ids(0)?;
        Ok((0..self.args.layers)
            .map(|ly| {
                let mut slots: Vec<(u32, u32)> = ids
                    .iter()
                    .enumerate()
                    .filter(|(_, id)| id.layer == ly)
                    .map(|(j, id)| (id.block, j as u32))
                    .collect();
                slots.sort_unstable();
                slots.into_iter().map(|(_, j)| j).collect()
            })
            .collect())
    }

    fn store_path(&self, rep: usize, what: &str) -> PathBuf {
        self.args.dir.join(format!(
            "flashtier-kv-bench-{}-{}-{rep}-{what}.store",
            std::process::id(),
            self.order
        ))
    }

    /// A freshly written store holding every block of every part, and its
    /// restore tiles (`num_tiles` per part, part by part).
    fn fresh_store(&self, path: &Path) -> Result<(KvSwap, Vec<Vec<BlockVersion>>)> {
        let opts = SwapOptions {
            direct: self.args.direct,
            path: BlockPath::Coalesced,
            tile_slots: self.tile_slots,
            ring_tiles: self.args.ring.max(1),
            model_hash: 0,
            rank: 0,
        };
        let mut swap = KvSwap::create(self.backend.clone(), path, self.layout, opts)?;
        let bb = self.layout.block_bytes() as usize;
        let total = self.layout.blocks_total();
        let mut versions = Vec::with_capacity(usize::try_from(total)?);
        let mut src = AlignedBuf::zeroed(self.bank.len());
        src.copy_from_slice(&self.bank);
        let mut idx = 0u64;
        while idx < total {
            let count = SPAN_BLOCKS.min(total - idx);
            for j in 0..count {
                // Stamp each block so no two blocks hold the same bytes.
                let v = bf16::from_f32(((idx + j) % 1024) as f32 / 1024.0);
                let at = j as usize * bb;
                src[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
            let first = self.layout.block_at(idx)?;
            let part = &src[..count as usize * bb];
            versions.extend(swap.offload_span(first, u32::try_from(count)?, part)?);
            idx += count;
        }
        let tiles = (0..self.num_tiles * PARTS)
            .map(|t| {
                self.tile_ids(t)?
                    .into_iter()
                    .map(|id| Ok(versions[usize::try_from(self.layout.file_index(id)?)?]))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        Ok((swap, tiles))
    }
}
