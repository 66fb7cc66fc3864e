//! One side-by-side sample of `bench kv`: fio and the restore alone in
//! interleaved pairs over two parts of a fresh store, then the pipelined
//! restore (attention consuming each tile as it lands) over the third.
//!
//! Invariant: no byte is read twice in a sample (each reader has its own
//! part), and the parts rotate between repetitions.

use std::hint::black_box;
use std::path::Path;

use anyhow::{Result, bail};
use flashtier::kv::restore::RestoreStats;
use flashtier::kv::swap::{BlockVersion, KvSwap};
use flashtier_format::kv::BlockOrder;
use indicatif::ProgressBar;

use super::{Bench, PARTS, Sample, fio};

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl Bench {
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

    /// Seconds fio takes to read tiles `[t0, t0 + n)` of part `part`.
    fn fio_chunk(&self, path: &Path, part: u32, t0: usize, n: usize) -> Result<f64> {
        let p = self.fio_part(part, t0, n);
        let bps = fio::seq_read_part_bytes_per_sec(path, p, self.op_bytes, self.ops_in_flight)?;
        Ok((p.len * p.regions) as f64 / bps)
    }

    /// The restore tiles of part `part`.
    fn part_tiles(&self, tiles: &[Vec<BlockVersion>], part: u32) -> Vec<Vec<BlockVersion>> {
        let n = self.num_tiles as usize;
        tiles[part as usize * n..(part as usize + 1) * n].to_vec()
    }

    /// Restore `tiles` with no consumer but a touch of each tile.
    fn restore_alone(swap: &mut KvSwap, tiles: &[Vec<BlockVersion>]) -> Result<RestoreStats> {
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
    ) -> Result<(f64, RestoreStats)> {
        let alone_tiles = self.part_tiles(tiles, alone_part);
        let nt = alone_tiles.len();
        let chunks = self.args.chunks.clamp(1, nt.max(1));
        let mut fio_s = 0.0;
        let mut total = RestoreStats::default();
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

    /// The sample of repetition `rep` over the store `swap` at `path`.
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
}
