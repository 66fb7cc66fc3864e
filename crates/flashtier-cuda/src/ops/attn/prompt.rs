//! Which kernel attends a prompt chunk as tiles, and its launch shape.
//!
//! Two kernels compute the same split partials (the [`super`] docs give
//! their layout): `attn_prompt_<D>`, f32 register tiles of
//! [`PROMPT_ATTN_QUERIES`] queries (kernels/decode/prompt_attn.cu), and
//! `attn_prompt_tc_<D>`, tiles of [`PROMPT_ATTN_TC_QUERIES`] queries on the
//! tensor cores, every f32 operand split into two TF32 parts and each
//! product taken as three TF32 products (kernels/decode/prompt_attn_tc.cu):
//! an error of a few parts in 2^22 of each term, about an f32 chain's
//! rounding. The tensor-core kernel takes heads of up to 128 elements on a
//! device of compute capability 8.0 or later, where
//! [`crate::settings::PROMPT_ATTN_TC`] is on (the default); wider heads
//! and the setting off keep the f32 tiles.
//!
//! Invariants: the choice depends on the rows, the head width, the device
//! and the settings only, so a chunk's partials are the same whether its
//! splits are resident or restored tile by tile. In either kernel a row's
//! bits depend on its own query, its visible positions and the split
//! bounds only (the tensor-core kernel's tiles of 16 rows are aligned to
//! positions that are multiples of 16, whatever row the chunk starts at).
//!
//! Bounds: dynamic shared memory per block, [`prompt_attn_smem`] (51 to
//! 147 KiB) and [`prompt_attn_tc_smem`] (105 KiB for heads of 64, 205 KiB
//! for 128); a kernel whose limit the device refuses is never chosen.

use std::collections::HashMap;

use cudarc::driver::CudaFunction;

use super::CHUNK_POSITIONS;
use super::launch::{PROMPT_ATTN_KERNELS, PROMPT_ATTN_QUERIES, PROMPT_ATTN_ROWS, prompt_attn_smem};
use crate::ops::DecodeKernels;

/// Queries per block of the tensor-core prompt attention: 8 warps of 16
/// (`PT_BM` in kernels/decode/prompt_attn_tc.cu).
pub const PROMPT_ATTN_TC_QUERIES: usize = 128;
/// Rows of one warp's tile in the tensor-core kernel, aligned to positions
/// that are multiples of this.
const TC_ROW_BLOCK: usize = 16;
/// Positions per tile of keys and values in the tensor-core kernel
/// (`PT_BN`).
const TC_POSITIONS: usize = 32;

// The tensor-core kernel's tiles start at the split start and must not
// straddle a block of 16 rows' positions.
const _: () = assert!(CHUNK_POSITIONS % TC_POSITIONS == 0 && TC_POSITIONS % TC_ROW_BLOCK == 0);

/// The tensor-core prompt attention's kernels and the widest head each
/// takes.
pub(crate) const PROMPT_ATTN_TC_KERNELS: [(&str, usize); 2] =
    [("attn_prompt_tc_64", 64), ("attn_prompt_tc_128", 128)];

/// Dynamic shared memory of `attn_prompt_tc_<tile>`: the queries split in
/// two ([`PROMPT_ATTN_TC_QUERIES`] rows of `tile + 4` f32 each part), one
/// tile of keys split in two (32 rows of `tile + 4`) and one of values,
/// transposed (`tile` rows of 2 x 32 + 16 f32).
#[must_use]
pub(crate) const fn prompt_attn_tc_smem(tile: usize) -> usize {
    (2 * PROMPT_ATTN_TC_QUERIES * (tile + 4)
        + 2 * TC_POSITIONS * (tile + 4)
        + tile * (2 * TC_POSITIONS + 16))
        * 4
}

/// Give each kernel of `kernels` (a name and the widest head it takes)
/// found in `funcs` its dynamic shared memory, `smem(width)` bytes; the
/// head widths whose kernel took it (a device that refuses a width keeps
/// the per-row kernel, or the f32 tiles, for it).
pub(crate) fn prompt_attn_widths(
    funcs: &HashMap<&'static str, (CudaFunction, bool)>,
    kernels: &[(&'static str, usize)],
    smem: fn(usize) -> usize,
) -> Vec<usize> {
    kernels
        .iter()
        .filter(|&&(name, tile)| crate::ops::give_smem(funcs, name, smem(tile)))
        .map(|&(_, tile)| tile)
        .collect()
}

/// A tiled prompt attention launch: the kernel, its dynamic shared memory
/// and its blocks along x (tiles of queries of one kv head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PromptLaunch {
    pub name: &'static str,
    pub smem_bytes: usize,
    pub blocks: usize,
}

impl DecodeKernels {
    /// The kernel that attends a prompt chunk of `rows` rows with heads of
    /// `d` elements, and its shared memory: `None` where the per-row
    /// `attn_partial` does (fewer than [`PROMPT_ATTN_ROWS`] rows, a width
    /// not a multiple of 4, [`crate::settings::PROMPT_ATTN`] off).
    fn prompt_attn_pick(&self, rows: usize, d: usize) -> Option<(&'static str, usize, bool)> {
        if !self.prompt_attn_on || rows < PROMPT_ATTN_ROWS || d % 4 != 0 {
            return None;
        }
        let tc = PROMPT_ATTN_TC_KERNELS
            .iter()
            .copied()
            .find(|&(_, t)| d <= t)
            .filter(|&(_, t)| self.prompt_attn_tc_widths.contains(&t));
        if let Some((name, tile)) = tc {
            return Some((name, prompt_attn_tc_smem(tile), true));
        }
        let (name, tile) = PROMPT_ATTN_KERNELS.iter().copied().find(|&(_, t)| d <= t)?;
        self.prompt_attn_widths
            .contains(&tile)
            .then_some((name, prompt_attn_smem(tile), false))
    }

    /// The launch of the tiled prompt attention for `rows` rows from
    /// position `held` with heads of `d` elements, `group` query heads per
    /// kv head, where it applies ([`Self::prompt_attention_kernel`]).
    pub(super) fn prompt_attn_launch(
        &self,
        rows: usize,
        d: usize,
        group: usize,
        held: usize,
    ) -> Option<PromptLaunch> {
        let (name, smem_bytes, tc) = self.prompt_attn_pick(rows, d)?;
        let blocks = if tc {
            // Tiles of 16 rows counted from the multiple of 16 at or below
            // `held`, one per query head of the group.
            let lead = held % TC_ROW_BLOCK;
            let tiles = (rows + lead).div_ceil(TC_ROW_BLOCK) * group;
            tiles.div_ceil(PROMPT_ATTN_TC_QUERIES / TC_ROW_BLOCK)
        } else {
            (rows * group).div_ceil(PROMPT_ATTN_QUERIES)
        };
        Some(PromptLaunch {
            name,
            smem_bytes,
            blocks,
        })
    }

    /// The kernel a prompt chunk of `rows` rows with heads of `d` elements
    /// is attended with: `attn_prompt_tc_<D>`, `attn_prompt_<D>`, or `None`
    /// for the per-row decode kernel. The choice is fixed when the kernels
    /// load (settings, device); tests use it to know which one they check.
    #[must_use]
    pub fn prompt_attention_kernel(&self, rows: usize, d: usize) -> Option<&'static str> {
        self.prompt_attn_pick(rows, d).map(|(name, _, _)| name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared memory the kernels' comments promise, and under the
    /// 227 KiB a block of an H100 may take.
    #[test]
    fn tensor_core_tiles_fit_an_sm() {
        assert_eq!(prompt_attn_tc_smem(64), 107_520);
        assert_eq!(prompt_attn_tc_smem(128), 209_920);
        assert!(prompt_attn_tc_smem(128) <= 227 * 1024);
        // Two blocks of heads of 64 fit the H100's 228 KiB (1 KiB of each
        // block is the system's).
        assert!(2 * (prompt_attn_tc_smem(64) + 1024) <= 228 * 1024);
    }
}
