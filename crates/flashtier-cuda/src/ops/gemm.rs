//! Products of a prompt chunk's rows as tiled matrix products
//! (`kernels/decode/gemm.cu`): the dense products read each weight tile
//! once per 64 input rows instead of once per [`MAX_GEMV_ROWS`], and the
//! routed experts of a chunk run grouped by expert, each expert's weights
//! read once for every row that chose it instead of once per (row, expert)
//! pair.
//!
//! Each output is one multiply-add chain over its width in ascending
//! order, so it does not depend on which rows share its tile: a (row,
//! expert) pair gives the same bits whether its expert runs for one row or
//! for the whole chunk, which keeps a prompt's output the same at every
//! expert budget (a small budget runs a chunk's rows in groups whose
//! experts fit). Decode steps (one row) keep the one-pass GEMV kernels.
//!
//! Bounds: a grouped step uploads its pair order and tile list (one `i32`
//! per pair, three per tile; at most one tile per pair plus one per
//! expert), kept until the launches that read them are issued.

use cudarc::driver::LaunchConfig;

use super::buffers::{DevAct, DevMatrix};
use super::dense::{check_many, mats, scale_args};
use super::experts::{ExpertSlots, ExpertSpec};
use super::mma::{MMA_COLS, MMA_GROUP_ROWS, MMA_THREADS};
use super::route::DevRoutes;
use super::{DecodeKernels, MAX_GEMV_ROWS, dim, linear_cfg};
use crate::error::CudaError;
use crate::launch::Args;

pub use crate::settings::TileShape;

/// Threads of a tile's block (`GEMM_THREADS`).
const TILE_THREADS: u32 = 256;

/// The fewest rows [`DecodeKernels::products`] runs as tiles: more than
/// one GEMV pass takes.
pub const TILED_MIN_ROWS: usize = MAX_GEMV_ROWS + 1;

/// A grouped expert step's pairs in expert order and its tiles.
#[derive(Debug, PartialEq, Eq)]
pub struct Groups {
    /// Pair indices (`row * top_k + rank`), sorted by expert, then pair.
    pub perm: Vec<i32>,
    /// Per tile: expert id, first position in `perm`, pair count (at most
    /// the tile's rows).
    pub tiles: Vec<[i32; 3]>,
    /// Distinct experts.
    pub experts: usize,
}

/// The pairs of rows `rows` (of `top_k` ids each in `ids`) grouped by
/// expert into tiles of at most `tile_rows` pairs.
///
/// # Errors
/// An id at or past `experts`, or `ids` not whole rows covering `rows`.
pub fn group_pairs(
    ids: &[u32],
    top_k: usize,
    rows: std::ops::Range<usize>,
    experts: usize,
    tile_rows: usize,
) -> Result<Groups, CudaError> {
    if tile_rows == 0
        || top_k == 0
        || ids.len() % top_k != 0
        || rows.end * top_k > ids.len()
        || rows.is_empty()
    {
        return Err(CudaError::invalid(
            "grouped experts",
            format!("rows {rows:?} of {} ids at top-{top_k}", ids.len()),
        ));
    }
    let first = rows.start * top_k;
    let pairs = &ids[first..rows.end * top_k];
    if let Some(bad) = pairs.iter().find(|&&e| e as usize >= experts) {
        return Err(CudaError::invalid(
            "grouped experts",
            format!("expert id {bad} of {experts}"),
        ));
    }
    let mut perm: Vec<i32> = (0..pairs.len()).map(|i| (first + i) as i32).collect();
    // Stable: pairs of one expert stay in pair order.
    perm.sort_by_key(|&p| ids[p as usize]);
    let mut tiles = Vec::new();
    let mut distinct = 0;
    let mut at = 0;
    while at < perm.len() {
        let e = ids[perm[at] as usize];
        let mut end = at;
        while end < perm.len() && ids[perm[end] as usize] == e {
            end += 1;
        }
        distinct += 1;
        for start in (at..end).step_by(tile_rows) {
            let n = (end - start).min(tile_rows);
            tiles.push([e as i32, start as i32, n as i32]);
        }
        at = end;
    }
    Ok(Groups {
        perm,
        tiles,
        experts: distinct,
    })
}

impl DecodeKernels {
    /// The dense and grouped tile shapes the kernels were compiled with.
    #[must_use]
    pub fn tile_shapes(&self) -> (TileShape, TileShape) {
        self.tiles
    }

    /// Whether [`Self::products`] runs `x`'s rows as tiles: more rows than
    /// one GEMV pass takes, a width in whole chunks of 8, and tiles not
    /// turned off (`FLASHTIER_PROMPT_TILES=0`).
    #[must_use]
    pub fn tiled(&self, k: usize, rows: usize) -> bool {
        self.tiles_on && rows >= TILED_MIN_ROWS && k % 8 == 0
    }

    /// `outs[q][r] = ws[q] x[r]` for every row of `x`: as tiles when
    /// [`Self::tiled`], else in GEMV passes (the same shapes and checks as
    /// [`Self::gemv_many`]).
    pub fn products(
        &self,
        outs: &mut [&mut DevAct],
        ws: &[&DevMatrix],
        x: &DevAct,
    ) -> Result<(), CudaError> {
        if self.tiled(x.cols(), x.rows()) {
            self.gemm_many(outs, ws, x)
        } else {
            self.gemv_many(outs, ws, x)
        }
    }

    /// `outs[q][r] = ws[q] x[r]` as tiles of the dense [`TileShape`] (BF16
    /// on the tensor cores where [`Self::mma`]), up to four matrices of one
    /// dtype and width in one launch; the width must be a multiple of 8.
    pub fn gemm_many(
        &self,
        outs: &mut [&mut DevAct],
        ws: &[&DevMatrix],
        x: &DevAct,
    ) -> Result<(), CudaError> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        check_many(outs, ws, x)?;
        let (ty, k) = (first.ty(), first.cols());
        if k % 8 != 0 {
            return Err(CudaError::invalid(
                "gemm",
                format!("width {k} is not a multiple of 8"),
            ));
        }
        if self.mma(ty) {
            return self.gemm_mma(outs, ws, x, k);
        }
        let (_, br, bc) = scale_args(first);
        let tile = self.tiles.0;
        let col_tiles: usize = ws.iter().map(|w| w.rows().div_ceil(tile.cols())).sum();
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(col_tiles)
                    .map_err(|_| CudaError::invalid("gemm", format!("{col_tiles} tiles")))?,
                dim(x.rows().div_ceil(tile.rows()), "gemm rows")?,
                1,
            ),
            block_dim: (TILE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let gpu = &self.gpu;
        let mut a = Args::new();
        a.push(mats(gpu, outs, ws, 0))
            .push((k * ty.elem_bytes()) as i64)
            .push(br)
            .push(bc)
            .push(k as i32)
            .push(super::addr(gpu, x.buf(), 0))
            .push(x.rows() as i32);
        // SAFETY: matches `gemm_*` in kernels/decode/gemm.cu. Each matrix
        // holds its rows of k elements (checked at upload) and, for FP8, a
        // scale grid covering every (row / br, col / bc); every output holds
        // x.rows() rows of its matrix's rows and x holds x.rows() rows of k
        // (`check_many`); k % 8 == 0 makes every 8-element chunk and every
        // 4-float input load whole, and buffers start 256-byte aligned; a
        // block reads and writes only rows below x.rows() and columns below
        // its matrix's rows.
        unsafe { self.launch(&format!("gemm_{}", ty.suffix()), cfg, a) }
    }

    /// Whether an expert layout can run grouped (widths in whole chunks of
    /// 8) and grouping is on (`FLASHTIER_PROMPT_TILES=0` turns it off).
    #[must_use]
    pub fn grouped(&self, spec: &ExpertSpec) -> bool {
        self.tiles_on && spec.hidden % 8 == 0 && spec.inter % 8 == 0
    }

    /// `out[r]` for the rows `rows` of `x`: each row's routed experts
    /// weighted and summed in routed order, computed grouped by expert:
    /// grouped on the host from `ids` (the host copy of `routes`' ids), or
    /// with `None` on the device (`super::group`: no host round trip; the
    /// same groups, so the same bits). `act` (`x.rows() * top_k
    /// x inter`) and `y` (`x.rows() * top_k x hidden`) are scratch, indexed
    /// by pair. Rows outside `rows` are left as they are.
    #[allow(clippy::too_many_arguments, reason = "the step's operands and scratch")]
    pub fn moe_grouped(
        &self,
        slots: &ExpertSlots,
        (layer_base, experts): (usize, usize),
        routes: &DevRoutes,
        ids: Option<&[u32]>,
        rows: std::ops::Range<usize>,
        spec: &ExpertSpec,
        x: &DevAct,
        (act, y): (&mut DevAct, &mut DevAct),
        out: &mut DevAct,
    ) -> Result<(), CudaError> {
        spec.validate()?;
        let (n, k) = (x.rows(), routes.top_k());
        let pairs = n * k;
        let ok = routes.rows() == n
            && ids.is_none_or(|ids| ids.len() == pairs)
            && x.cols() == spec.hidden
            && out.rows() == n
            && out.cols() == spec.hidden
            && act.rows() == pairs
            && act.cols() == spec.inter
            && y.rows() == pairs
            && y.cols() == spec.hidden
            && rows.end <= n
            && layer_base + experts <= slots.entries()
            && slots.record_bytes >= spec.min_record_bytes()
            && self.grouped(spec);
        if !ok {
            return Err(CudaError::invalid(
                "grouped experts",
                format!(
                    "rows {rows:?} of {n} x top-{k}, {}x{} input, {:?} ids, table base {layer_base} + {experts} of {}, {}x{} experts",
                    x.rows(),
                    x.cols(),
                    ids.map(<[u32]>::len),
                    slots.entries(),
                    spec.hidden,
                    spec.inter
                ),
            ));
        }
        if rows.is_empty() {
            return Ok(());
        }
        // The tensor cores' tiles for BF16 (`mma`), else the f32 tiles.
        let mma = self.mma(spec.ty);
        let (tile_rows, tile_cols, threads, kind) = if mma {
            (MMA_GROUP_ROWS, MMA_COLS, MMA_THREADS, "mma_")
        } else {
            let t = self.tiles.1;
            (t.rows(), t.cols(), TILE_THREADS, "")
        };
        let stream = self.gpu.stream();
        let (perm, tiles, tile_count, scratch) = match ids {
            Some(ids) => {
                let groups = group_pairs(ids, k, rows.clone(), experts, tile_rows)?;
                let perm = stream
                    .clone_htod(&groups.perm)
                    .map_err(CudaError::driver("upload the grouped pairs"))?;
                let flat: Vec<i32> = groups.tiles.iter().flatten().copied().collect();
                let tiles = stream
                    .clone_htod(&flat)
                    .map_err(CudaError::driver("upload the expert tiles"))?;
                (perm, tiles, groups.tiles.len(), None)
            }
            None => {
                let g = self.group_on_device(routes, rows.clone(), experts, tile_rows)?;
                let n = g.max_tiles;
                let (perm, tiles, scratch) = g.into_parts();
                (perm, tiles, n, Some(scratch))
            }
        };
        let g = &self.gpu;
        let geo = spec.geometry();
        let sfx = spec.ty.suffix();
        let (h, i) = (spec.hidden, spec.inter);
        let cfg = |cols: usize| -> Result<LaunchConfig, CudaError> {
            Ok(LaunchConfig {
                grid_dim: (
                    dim(cols.div_ceil(tile_cols), "expert columns")?,
                    dim(tile_count, "expert tiles")?,
                    1,
                ),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        };
        // The input of each product: f32 rows, or on the tensor cores their
        // BF16 parts (`split_input`: hi values, then as many lo values).
        let input = |a: &mut Args, v: &DevAct| -> Result<(), CudaError> {
            if mma {
                let (xs, lo_off) = self.split_input(v)?;
                a.push(xs).push(lo_off);
            } else {
                a.buf(g, v.buf());
            }
            Ok(())
        };
        let mut a = Args::new();
        a.buf(g, &slots.table_dev)
            .push(layer_base as i32)
            .buf(g, &perm)
            .buf(g, &tiles)
            .push(k as i32);
        input(&mut a, x)?;
        a.push(h as i32).push(i as i32).push(geo).buf(g, act.buf());
        // SAFETY: matches `moe_group_gate_up_*` (and its `mma_` form for
        // BF16 records, which takes x's split parts in place of x; its tiles
        // hold at most MMA_GROUP_ROWS pairs, as group_pairs made them).
        // Every tile names an expert below `experts` (checked by
        // group_pairs; grouped on the device, an id out of range makes tiles
        // of expert -1, which the kernels never look up, and the entries
        // past the last tile hold 0 pairs, which the kernels skip), so its
        // table index is below `entries`; set entries
        // point at whole records of at least `min_record_bytes`, cleared
        // ones are 0 and never read. perm holds pair indices below n *
        // top_k, so x rows p / top_k < n and act rows p < pairs; hidden and
        // inter are multiples of 8 (`grouped`).
        unsafe { self.launch(&format!("moe_group_gate_up_{kind}{sfx}"), cfg(i)?, a) }?;
        let mut a = Args::new();
        a.buf(g, &slots.table_dev)
            .push(layer_base as i32)
            .buf(g, &perm)
            .buf(g, &tiles);
        input(&mut a, act)?;
        a.push(h as i32).push(i as i32).push(geo).buf(g, y.buf());
        // SAFETY: as above, reading act rows p < pairs (inter wide; split
        // after the gate/up product wrote them, in stream order) and writing
        // y rows p < pairs (hidden wide).
        unsafe { self.launch(&format!("moe_group_down_{kind}{sfx}"), cfg(h)?, a) }?;
        let count = rows.len() * h;
        let mut a = Args::new();
        a.push(super::addr(g, y.buf(), rows.start * k * h))
            .push(super::addr(g, routes.weights(), rows.start * k))
            .push(k as i32)
            .push(h as i32)
            .push(count as i64)
            .push(super::addr(g, out.buf(), rows.start * h));
        // SAFETY: matches `moe_group_sum`: outputs rows.start.. of out
        // (rows.len() * hidden values, rows.end <= n), reading y's pairs and
        // the routed weights of those rows only.
        unsafe { self.launch("moe_group_sum", linear_cfg(count, 256)?, a) }?;
        g.retire((perm, tiles, scratch));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{TileShape, group_pairs};

    const GROUP_ROWS: usize = 32;

    #[test]
    fn pairs_group_by_expert_in_pair_order_and_split_into_tiles() {
        // 3 rows of top-2.
        let ids = [4, 1, 1, 4, 0, 1];
        let g = group_pairs(&ids, 2, 0..3, 5, GROUP_ROWS).unwrap();
        assert_eq!(g.perm, [4, 1, 2, 5, 0, 3]);
        assert_eq!(g.tiles, [[0, 0, 1], [1, 1, 3], [4, 4, 2]]);
        assert_eq!(g.experts, 3);
        // Only row 1.
        let g = group_pairs(&ids, 2, 1..2, 5, GROUP_ROWS).unwrap();
        assert_eq!(g.perm, [2, 3]);
        assert_eq!(g.tiles, [[1, 0, 1], [4, 1, 1]]);
        // One expert chosen by more rows than a tile holds.
        let many = vec![7u32; 2 * GROUP_ROWS + 3];
        let g = group_pairs(&many, 1, 0..many.len(), 8, GROUP_ROWS).unwrap();
        assert_eq!(g.tiles.len(), 3);
        assert_eq!(g.tiles[2], [7, 2 * GROUP_ROWS as i32, 3]);
    }

    #[test]
    fn out_of_range_ids_and_ragged_rows_are_errors() {
        assert!(group_pairs(&[0, 9], 2, 0..1, 9, 32).is_err());
        assert!(group_pairs(&[0, 1, 2], 2, 0..1, 9, 32).is_err());
        assert!(group_pairs(&[0, 1], 2, 0..2, 9, 32).is_err());
        assert!(group_pairs(&[0, 1], 2, 1..1, 9, 32).is_err());
        assert!(group_pairs(&[0, 1], 2, 0..1, 9, 0).is_err());
    }

    #[test]
    fn tile_shapes_parse_only_what_the_kernels_take() {
        assert_eq!(TileShape::parse("4x4"), Some(TileShape::DENSE));
        assert_eq!(TileShape::parse("2x8"), Some(TileShape::GROUPED));
        assert_eq!(TileShape::parse("8x4").map(TileShape::rows), Some(128));
        for bad in ["1x4", "4x2", "4x16", "8x8", "4", "x4", "ax4"] {
            assert_eq!(TileShape::parse(bad), None, "{bad}");
        }
    }
}
