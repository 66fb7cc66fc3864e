//! A prompt step's (row, expert) pairs grouped by expert on the device
//! (`group_count`, `group_offsets`, `group_place` in kernels/decode/moe.cu):
//! the same pair order and tiles as [`super::gemm::group_pairs`] on the
//! host, without copying the routed ids to the host. With every expert
//! resident, a prompt step's experts then queue behind its router with no
//! host round trip (each one drains the stream and leaves the GPU idle
//! while the host sorts and uploads).
//!
//! The tile list is sized for the most tiles the pairs can make
//! (`ceil(pairs / tile_rows)` plus one partial tile per group), the entries
//! past the step's last tile zero: the grouped kernels skip a tile of 0
//! pairs, so the launches take that many blocks in y and the host never
//! learns the count. An id out of range makes tiles of expert -1, which
//! the kernels read as not resident (NaN for its pairs).
//!
//! Bounds: four buffers per call, `pairs`, `3 x max_tiles` and twice
//! `experts + 1` i32, retired after the step's launches.

use cudarc::driver::CudaSlice;

use super::route::DevRoutes;
use super::{DecodeKernels, linear_cfg};
use crate::error::CudaError;
use crate::launch::Args;

/// The groups of one step on the device.
pub struct DevGroups {
    /// Pair indices sorted by expert, then pair.
    pub perm: CudaSlice<i32>,
    /// `max_tiles` entries of (expert, first place in `perm`, pairs); those
    /// past the last tile are (0, 0, 0).
    pub tiles: CudaSlice<i32>,
    /// Entries of `tiles`: the grid's y.
    pub max_tiles: usize,
    /// Scratch the kernels used (retired with the rest).
    scratch: CudaSlice<i32>,
}

impl DevGroups {
    /// The buffers, to retire once the launches that read them are queued.
    #[must_use]
    pub fn into_parts(self) -> (CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>) {
        (self.perm, self.tiles, self.scratch)
    }
}

/// The most tiles `pairs` pairs over `experts` experts (and one group of
/// ids out of range) make with tiles of `tile_rows`.
#[must_use]
pub fn max_tiles(pairs: usize, experts: usize, tile_rows: usize) -> usize {
    pairs.div_ceil(tile_rows.max(1)) + pairs.min(experts + 1)
}

impl DecodeKernels {
    /// Whether a resident prompt step's pairs are grouped on the device
    /// ([`crate::settings::DEVICE_GROUPS`]).
    #[must_use]
    pub fn device_groups(&self) -> bool {
        self.device_groups
    }

    /// Group the pairs of rows `rows` of `routes` (ids below `experts`)
    /// by expert into tiles of at most `tile_rows` pairs, on the device.
    pub fn group_on_device(
        &self,
        routes: &DevRoutes,
        rows: std::ops::Range<usize>,
        experts: usize,
        tile_rows: usize,
    ) -> Result<DevGroups, CudaError> {
        let k = routes.top_k();
        if tile_rows == 0 || rows.is_empty() || rows.end > routes.rows() || experts == 0 {
            return Err(CudaError::invalid(
                "grouped experts",
                format!(
                    "rows {rows:?} of {} at top-{k}, {experts} experts, tiles of {tile_rows}",
                    routes.rows()
                ),
            ));
        }
        let (first, pairs) = (rows.start * k, rows.len() * k);
        let max_tiles = max_tiles(pairs, experts, tile_rows);
        let as_i32 = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| CudaError::invalid("grouped experts", format!("{what} {v}")))
        };
        let stream = self.gpu.stream();
        let alloc = |n: usize, what: &'static str| {
            // SAFETY: every element is written by the kernels below before
            // any kernel reads it (counts, offsets and tile starts by the
            // first two, the places and every tile entry by the last two).
            unsafe { stream.alloc::<i32>(n) }.map_err(CudaError::driver(what))
        };
        let perm = alloc(pairs, "allocate the grouped pairs")?;
        let tiles = alloc(3 * max_tiles, "allocate the expert tiles")?;
        // counts | offsets | tile starts, experts + 1 each.
        let groups = experts + 1;
        let scratch = alloc(3 * groups, "allocate the group counts")?;
        let g = &self.gpu;
        let at = |i: usize| super::addr(g, &scratch, i * groups);
        let warps_cfg = linear_cfg(groups * 32, 256)?;
        let mut a = Args::new();
        a.buf(g, routes.ids())
            .push(as_i32(first, "first pair")?)
            .push(as_i32(pairs, "pairs")?)
            .push(as_i32(experts, "experts")?)
            .push(at(0));
        // SAFETY: matches `group_count`: reads ids first .. first + pairs
        // (rows.end <= routes.rows(), so inside the ids buffer) and writes
        // counts[0 ..= experts] (the scratch holds 3 x (experts + 1)).
        unsafe { self.launch("group_count", warps_cfg, a) }?;
        let mut a = Args::new();
        a.push(at(0))
            .push(as_i32(experts, "experts")?)
            .push(as_i32(tile_rows, "tile rows")?)
            .push(as_i32(max_tiles, "tiles")?)
            .push(at(1))
            .push(at(2))
            .buf(g, &tiles);
        // SAFETY: matches `group_offsets`: one thread reads the counts and
        // writes offsets and tile starts (experts + 1 each) and the tile
        // entries from the last group's end to max_tiles, which bounds the
        // tiles the counts make (`max_tiles`).
        unsafe { self.launch("group_offsets", linear_cfg(1, 32)?, a) }?;
        let mut a = Args::new();
        a.buf(g, routes.ids())
            .push(as_i32(first, "first pair")?)
            .push(as_i32(pairs, "pairs")?)
            .push(as_i32(experts, "experts")?)
            .push(as_i32(tile_rows, "tile rows")?)
            .push(at(0))
            .push(at(1))
            .push(at(2))
            .buf(g, &perm)
            .buf(g, &tiles);
        // SAFETY: matches `group_place`: group g's warp writes perm places
        // offsets[g] .. + counts[g] (the groups' counts sum to pairs) and
        // tile entries tile_first[g] .. + ceil(counts[g] / tile_rows), below
        // max_tiles.
        unsafe { self.launch("group_place", warps_cfg, a) }?;
        Ok(DevGroups {
            perm,
            tiles,
            max_tiles,
            scratch,
        })
    }
}

#[cfg(test)]
mod tests {
    use flashtier_format::splitmix::splitmix64_next;
    use proptest::prelude::*;

    use super::max_tiles;
    use crate::ops::gemm::group_pairs;

    proptest! {
        /// The device's tile list is never shorter than the tiles the host
        /// grouping makes of the same pairs (the kernels write no entry
        /// past `max_tiles`, and the launch's grid is that long).
        #[test]
        fn the_tile_list_holds_every_grouping(
            experts in 1usize..600,
            k in 1usize..11,
            rows in 1usize..300,
            tile_rows in prop::sample::select(vec![1usize, 16, 32, 64]),
            seed in any::<u64>(),
            skew in 0u32..4,
        ) {
            // Ids from a splitmix stream, skewed toward low experts by
            // `skew` halvings so that some experts take many tiles.
            let mut x = seed;
            let ids: Vec<u32> = (0..rows * k)
                .map(|_| ((splitmix64_next(&mut x) % experts as u64) >> skew) as u32)
                .collect();
            let g = group_pairs(&ids, k, 0..rows, experts, tile_rows).unwrap();
            prop_assert!(g.tiles.len() <= max_tiles(rows * k, experts, tile_rows));
        }
    }

    #[test]
    fn the_bound_is_met_at_its_extremes() {
        // Every pair its own expert: one tile each.
        let ids: Vec<u32> = (0..50).collect();
        let g = group_pairs(&ids, 1, 0..50, 50, 32).unwrap();
        assert_eq!(g.tiles.len(), 50);
        assert!(g.tiles.len() <= max_tiles(50, 50, 32));
        // One expert: whole tiles and a partial one.
        let g = group_pairs(&[3; 65], 1, 0..65, 4, 32).unwrap();
        assert_eq!(g.tiles.len(), 3);
        assert!(g.tiles.len() <= max_tiles(65, 4, 32));
    }
}
