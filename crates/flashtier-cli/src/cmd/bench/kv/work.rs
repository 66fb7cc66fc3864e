//! The measured work of `flashtier bench kv`: synthetic KV, fresh stores,
//! the attention consumer, and one side-by-side sample.
//!
//! Limits on what the flags set, checked by [`check_bounds`] before anything
//! is allocated (a [`Limit`] error naming the flags): `--layers` at most
//! [`MAX_LAYERS`]; `--block-tokens` at most [`MAX_BLOCK_TOKENS`]; one block
//! (`--block-tokens x --kv-heads x --head-dim` BF16 values of K and of V) at
//! most [`MAX_BLOCK_BYTES`], so the write bank of [`SPAN_BLOCKS`] blocks
//! stays within 1 GiB; the restore ring (`--ring x --tile-blocks x --layers`
//! blocks) at most [`MAX_RING_BYTES`]; the queries (`--layers x --q-heads x
//! --head-dim` f32) at most [`MAX_QUERY_BYTES`].

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use flashtier::kv::attention::{AttentionDims, AttnState, KvTile, TileSeq};
use flashtier::kv::swap::{BlockVersion, KvError, KvSwap, SwapOptions};
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::blocks::BlockPath;
use flashtier_io::{AlignedBuf, StorageBackend};
use half::bf16;
use indicatif::ProgressBar;
use rayon::prelude::*;

use super::Args;
use super::fio;
use crate::kit::limit::{Limit, at_most};

/// Blocks written per offload op (a 4 MiB span at 64 KiB blocks).
const SPAN_BLOCKS: u64 = 64;

/// Most layers.
pub const MAX_LAYERS: u64 = 4096;

/// Most tokens per block.
pub const MAX_BLOCK_TOKENS: u64 = 4096;

/// Most bytes of one block (K and V of every KV head).
pub const MAX_BLOCK_BYTES: u64 = 16 << 20;

/// Most bytes of the restore ring's tiles.
pub const MAX_RING_BYTES: u64 = 16 << 30;

/// Most bytes of the per-layer queries.
pub const MAX_QUERY_BYTES: u64 = 1 << 30;

/// The limits of the module docs.
pub fn check_bounds(args: &Args) -> Result<(), Limit> {
    let layers = u64::from(args.layers);
    at_most("--layers", &[layers], MAX_LAYERS, "layers")?;
    let bt = u64::from(args.block_tokens);
    at_most("--block-tokens", &[bt], MAX_BLOCK_TOKENS, "tokens")?;
    let block = at_most(
        "one KV block (--block-tokens x --kv-heads x --head-dim, BF16 K and V)",
        &[
            bt,
            u64::from(args.kv_heads),
            u64::from(args.head_dim),
            2 * 2,
        ],
        MAX_BLOCK_BYTES,
        "bytes",
    )?;
    at_most(
        "the restore ring (--ring x --tile-blocks x --layers blocks)",
        &[
            args.ring.max(1) as u64,
            u64::from(args.tile_blocks.max(1)),
            layers,
            block,
        ],
        MAX_RING_BYTES,
        "bytes",
    )?;
    at_most(
        "the queries (--layers x --q-heads x --head-dim f32)",
        &[layers, u64::from(args.q_heads), u64::from(args.head_dim), 4],
        MAX_QUERY_BYTES,
        "bytes",
    )?;
    Ok(())
}

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

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl Bench {
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
        let bank_len = usize::try_from(SPAN_BLOCKS * bb)?;
        let mut bank = AlignedBuf::zeroed(bank_len);
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for pair in bank.chunks_exact_mut(2) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = bf16::from_f32(((x % 4001) as f32 - 2000.0) / 1000.0);
            pair.copy_from_slice(&v.to_bits().to_le_bytes());
        }
        let queries = (0..l)
            .map(|ly| {
                (0..dims.num_q_heads * dims.head_dim)
                    .map(|i| (((i as u32 ^ ly) * 2_654_435_761 % 2001) as f32 - 1000.0) / 1000.0)
                    .collect()
            })
            .collect();
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

    /// The bytes of tiles `[t0, t0 + n)` of part `p` of the data area, for
    /// fio: the same bytes the restore reads for those tiles of another part.
    fn fio_part(&self, p: u32, t0: usize, n: usize) -> fio::Part {
        let data = self.layout.data_extent();
        let regions = match self.order {
            BlockOrder::PerLayer => u64::from(self.args.layers),
            BlockOrder::BlockMajor => 1,
        };
        let region_bytes = data.len_bytes / regions;
        let part_len = region_bytes / u64::from(PARTS);
        fio::Part {
            data_offset: data.offset,
            region_bytes,
            regions,
            lo: u64::from(p) * part_len + t0 as u64 * self.op_bytes,
            len: n as u64 * self.op_bytes,
        }
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

    fn last_tokens(&self, tile: usize) -> usize {
        let bt = self.dims.block_tokens;
        if tile + 1 == self.num_tiles as usize {
            bt.saturating_sub(3).max(1)
        } else {
            bt
        }
    }

    fn new_states(&self) -> Result<Vec<AttnState>> {
        (0..self.args.layers)
            .map(|_| {
                let mut s = AttnState::new(self.dims)?;
                s.begin_step(1)?;
                Ok(s)
            })
            .collect()
    }

    fn finish(states: &[AttnState]) -> Result<f32> {
        let mut sum = 0.0f32;
        for s in states {
            let d = s.dims();
            let mut out = vec![bf16::ZERO; d.num_q_heads * d.head_dim];
            s.finalize(&mut out)?;
            sum += out.iter().map(|x| x.to_f32()).sum::<f32>();
        }
        Ok(sum)
    }

    /// Seconds fio takes to read tiles `[t0, t0 + n)` of part `part`.
    fn fio_chunk(&self, path: &Path, part: u32, t0: usize, n: usize) -> Result<f64> {
        let p = self.fio_part(part, t0, n);
        let bps = fio::seq_read_part_bytes_per_sec(path, p, self.op_bytes, self.ops_in_flight)?;
        Ok((p.len * p.regions) as f64 / bps)
    }

    fn part_tiles(&self, tiles: &[Vec<BlockVersion>], part: u32) -> Vec<Vec<BlockVersion>> {
        let n = self.num_tiles as usize;
        tiles[part as usize * n..(part as usize + 1) * n].to_vec()
    }

    fn restore_alone(
        swap: &mut KvSwap,
        tiles: &[Vec<BlockVersion>],
    ) -> Result<flashtier::kv::restore::RestoreStats> {
        let stats = swap.restore_tiles(tiles, |_, t| {
            black_box(t.bytes().first());
            Ok(())
        });
        Ok(stats?)
    }

    /// fio on one part and the restore alone on another, in `--chunks`
    /// interleaved pairs (who goes first alternates pair by pair), so both
    /// see the same moments of the shared disk. Returns fio's bytes/s and
    /// the restore's summed stats.
    fn paired(
        &self,
        rep: usize,
        path: &Path,
        swap: &mut KvSwap,
        tiles: &[Vec<BlockVersion>],
        (fio_part, alone_part): (u32, u32),
        pb: &ProgressBar,
    ) -> Result<(f64, flashtier::kv::restore::RestoreStats)> {
        let alone_tiles = self.part_tiles(tiles, alone_part);
        let nt = alone_tiles.len();
        let chunks = self.args.chunks.clamp(1, nt.max(1));
        let mut fio_s = 0.0;
        let mut total = flashtier::kv::restore::RestoreStats::default();
        for k in 0..chunks {
            let (t0, t1) = (k * nt / chunks, (k + 1) * nt / chunks);
            pb.set_message(format!(
                "{} rep {rep}: fio and restore, pair {}/{chunks}",
                self.order,
                k + 1
            ));
            let mut restore = || Self::restore_alone(swap, &alone_tiles[t0..t1]);
            let st = if (rep + k) % 2 == 0 {
                fio_s += self.fio_chunk(path, fio_part, t0, t1 - t0)?;
                restore()?
            } else {
                let st = restore()?;
                fio_s += self.fio_chunk(path, fio_part, t0, t1 - t0)?;
                st
            };
            total += st;
        }
        pb.inc(2);
        Ok((self.data_bytes as f64 / fio_s, total))
    }

    /// One repetition over one freshly written store of [`PARTS`] parts:
    /// fio, the restore alone and the pipelined restore each read their own
    /// part, the parts rotate between repetitions, and fio and the restore
    /// alone swap places on odd repetitions.
    pub fn sample(&self, rep: usize, pb: &ProgressBar) -> Result<Sample> {
        let order = self.order;
        pb.set_message(format!("{order} rep {rep}: writing the store"));
        let path = self.store_path(rep, "kv");
        let (mut swap, tiles) = self.fresh_store(&path)?;
        let result = self.measure(rep, &path, &mut swap, &tiles, pb);
        drop(swap);
        let _ = std::fs::remove_file(&path);
        result
    }

    fn measure(
        &self,
        rep: usize,
        path: &Path,
        swap: &mut KvSwap,
        tiles: &[Vec<BlockVersion>],
        pb: &ProgressBar,
    ) -> Result<Sample> {
        let order = self.order;
        let r = rep as u32;
        let (fio_part, alone_part, piped_part) = (r % PARTS, (r + 1) % PARTS, (r + 2) % PARTS);
        let (fio_bps, stats) = self.paired(rep, path, swap, tiles, (fio_part, alone_part), pb)?;

        pb.set_message(format!("{order} rep {rep}: pipelined"));
        let piped_tiles = self.part_tiles(tiles, piped_part);
        let mut states = self.new_states()?;
        let v_off = self.layout.slot_v_offset_bytes();
        let piped = swap.restore_tiles(&piped_tiles, |i, landed| {
            let k = landed.bytes();
            self.fold(&mut states, i, k, k.get(v_off..).unwrap_or_default())
        })?;
        black_box(Self::finish(&states)?);
        pb.inc(1);

        pb.set_message(format!("{order} rep {rep}: attention alone"));
        let attention_s = self.attention_alone()?;
        pb.inc(1);
        if stats.bytes != self.data_bytes {
            bail!("restored {} bytes of {}", stats.bytes, self.data_bytes);
        }
        let restore_s = secs(stats.total_ns);
        Ok(Sample {
            restore_s,
            restore_bps: self.data_bytes as f64 / restore_s,
            fio_bps,
            pipelined_s: secs(piped.total_ns),
            attention_s,
            verify_s: secs(stats.verify_ns),
        })
    }

    /// Fold tile `i` into every layer's state, layers in parallel; `k` and
    /// `v` are the tile's slots (`v` starts at the first slot's V half).
    fn fold(&self, states: &mut [AttnState], i: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let last = self.last_tokens(i);
        let strides = self.layout.slot_strides();
        let seqs: Vec<[TileSeq<'_>; 1]> = self
            .tables
            .iter()
            .map(|t| {
                [TileSeq {
                    blocks: t,
                    last_block_tokens: last,
                }]
            })
            .collect();
        states
            .par_iter_mut()
            .zip(seqs.par_iter())
            .zip(self.queries.par_iter())
            .try_for_each(|((st, seqs), q)| {
                st.step_tile(
                    q,
                    &KvTile {
                        k,
                        v,
                        strides,
                        seqs,
                    },
                )
            })
            .map_err(|e| KvError::Consumer {
                tile: i,
                what: e.to_string(),
            })
    }

    /// The same attention over the same tiles, from memory.
    fn attention_alone(&self) -> Result<f64> {
        let bb = self.layout.block_bytes() as usize;
        let mut buf = AlignedBuf::zeroed(self.tile_slots * bb);
        for chunk in buf.chunks_mut(self.bank.len()) {
            let n = chunk.len();
            chunk.copy_from_slice(&self.bank[..n]);
        }
        let v_off = self.layout.slot_v_offset_bytes();
        let mut states = self.new_states()?;
        let start = Instant::now();
        for i in 0..self.num_tiles as usize {
            self.fold(&mut states, i, &buf, buf.get(v_off..).unwrap_or_default())?;
        }
        let elapsed = start.elapsed().as_secs_f64();
        black_box(Self::finish(&states)?);
        Ok(elapsed)
    }
}
