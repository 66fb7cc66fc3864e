//! The CUDA path's settings from the environment: every `FLASHTIER_*`
//! variable this crate reads, read here only, through the workspace's one
//! reader ([`flashtier_io::settings`]). A bad value is a [`SettingError`]
//! naming the variable, returned by [`crate::Gpu::open`] (the launch
//! settings) or [`crate::ops::DecodeKernels::new`] (the kernel tuning).
//!
//! None of them changes a result bit but [`PROMPT_MMA`], [`PROMPT_BLAS`],
//! [`PROMPT_ATTN`] and [`PROMPT_ATTN_TC`] (the prompt path's rounding,
//! within f32 bounds the tests pin): they exist for measuring, and their
//! defaults are what measured fastest on the H100 and H200
//! (docs/benchmarks.md).
//! Code that wants other values passes them instead of setting variables:
//! [`crate::Gpu::set_graphs`], [`crate::Gpu::set_pdl`],
//! [`crate::Gpu::set_segment_launches`],
//! [`crate::ops::DecodeKernels::with_tuning`].

use std::path::PathBuf;

use flashtier_io::settings::{Env, Setting, SettingError};

// The values the variables bound and default to, and the types they
// parse into, live here so that this module depends on none of the code
// it steers ([`crate::launch`], [`crate::ops`] re-export them).

/// Launches queued before a segment is issued (default;
/// [`crate::settings::GRAPH_SEGMENT`] sets another, 1 to
/// [`MAX_SEGMENT_LAUNCHES`]).
/// 32 measured faster than 64 and 256 on the H200 (docs/benchmarks.md,
/// session 9): a shorter segment starts on the device sooner while the
/// host records the next one.
pub const SEGMENT_LAUNCHES: usize = 32;
/// Most launches one segment may queue.
pub const MAX_SEGMENT_LAUNCHES: usize = 4096;
/// Chunks of 8 weights a lane of a one-row product keeps in flight
/// (`FLASHTIER_GEMV_LOADS` sets 1 to [`MAX_GEMV_LOADS`]; the sums are the
/// same bits whatever it is). 4 decoded 6% faster than 8 on the H200
/// (8 takes 60 registers a thread, so fewer blocks fit an SM).
pub const DEFAULT_GEMV_LOADS: u32 = 4;
/// Positions a warp of the decode attention loads before it uses them
/// (`FLASHTIER_ATTN_AHEAD` sets 1 to [`MAX_ATTN_AHEAD`]; the same bits
/// whatever it is: the positions update the softmax in the same order).
pub const DEFAULT_ATTN_AHEAD: u32 = 4;
/// Most positions a warp may load ahead.
pub const MAX_ATTN_AHEAD: u32 = 8;
/// Output rows of the experts' down product one decode block takes
/// (`FLASHTIER_DOWN_ROWS` sets 1 to [`MAX_DOWN_ROWS`]; the same bits
/// whatever it is). With 1, Qwen3-30B-A3B's shape ran 2048 short blocks,
/// about four waves of the H200; 4 decoded 0.3-2.7% faster there.
pub const DEFAULT_DOWN_ROWS: u32 = 4;
/// Most down-product rows a block may be given.
pub const MAX_DOWN_ROWS: u32 = 16;
/// Most chunks in flight a lane may be given.
pub const MAX_GEMV_LOADS: u32 = 16;
/// Input columns a tensor-core tile stages at once (default; [`MMA_BK`]
/// sets 32 or 64).
pub const DEFAULT_MMA_BK: u32 = 64;

/// The compile-time knobs of the decode kernels, for measuring them: each
/// changes how the work is spread or loaded, never a result bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Evict-first hints on one-pass weight loads.
    pub stream_weights: bool,
    /// Chunks in flight per lane of a one-row product ([`GEMV_LOADS`]).
    pub gemv_loads: u32,
    /// Positions a warp of the decode attention loads ahead ([`ATTN_AHEAD`]).
    pub attn_ahead: u32,
    /// Output rows per block of the experts' down product ([`DOWN_ROWS`]).
    pub down_rows: u32,
    /// Prompt chunks' products as tiles.
    pub prompt_tiles: bool,
    /// BF16 prompt tiles on the tensor cores, the input split into two
    /// BF16 parts ([`PROMPT_MMA`]; unlike the other knobs this one changes
    /// the rounding: each product term carries an extra relative error of
    /// at most 2^-17).
    pub prompt_mma: bool,
    /// Prompt chunks' attention as tiles ([`PROMPT_ATTN`]; like
    /// `prompt_mma` this one changes the rounding: the same f32 values,
    /// summed in another order than the decode attention's).
    pub prompt_attn: bool,
    /// Prompt chunks' attention tiles on the tensor cores, heads of up to
    /// 128 ([`PROMPT_ATTN_TC`]; changes the rounding: each product is three
    /// TF32 products of split f32 operands, a few parts in 2^22 of each
    /// term, summed in another order than the f32 tiles').
    pub prompt_attn_tc: bool,
    /// The tensor-core attention for heads of 128 loads each k step's
    /// query and key fragments while the step before it computes
    /// ([`PROMPT_ATTN_PIPE`]; the same products in the same order, so the
    /// same bits).
    pub prompt_attn_pipe: bool,
    /// A BF16 prompt's dense products through cuBLASLt with one pinned
    /// algorithm per shape ([`PROMPT_BLAS`]; the rounding of two
    /// accumulating BF16 products, hi then lo, instead of the tiles').
    pub prompt_blas: bool,
    /// The dense and grouped tile shapes.
    pub tiles: (TileShape, TileShape),
    /// Columns of the input a tensor-core tile stages at once, 32 or 64
    /// ([`MMA_BK`]; the same bits either way: the sums run over k in the
    /// same order).
    pub mma_bk: u32,
    /// A prompt step's pairs grouped by expert on the device when every
    /// expert is resident ([`DEVICE_GROUPS`]; the same groups as the
    /// host's, so the same bits).
    pub device_groups: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            stream_weights: true,
            gemv_loads: DEFAULT_GEMV_LOADS,
            attn_ahead: DEFAULT_ATTN_AHEAD,
            down_rows: DEFAULT_DOWN_ROWS,
            prompt_tiles: true,
            prompt_mma: true,
            prompt_attn: true,
            prompt_attn_tc: true,
            prompt_attn_pipe: false,
            prompt_blas: true,
            tiles: (TileShape::DENSE, TileShape::GROUPED),
            mma_bk: DEFAULT_MMA_BK,
            device_groups: true,
        }
    }
}

/// A tile's shape: a thread's output rows (2, 4 or 8) and columns (4 or
/// 8); the tile is 16 times each (`GEMM_TM`/`GEMM_TN` and
/// `GROUP_TM`/`GROUP_TN` in the kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileShape {
    /// Output rows per thread.
    pub tm: usize,
    /// Output columns per thread.
    pub tn: usize,
}

impl TileShape {
    /// Dense products: 64 x 64.
    pub const DENSE: Self = Self { tm: 4, tn: 4 };
    /// Grouped experts: 32 pairs x 128 columns (a 256-row prompt chunk of
    /// top-8 over 128 experts gives an expert 16 pairs on average).
    pub const GROUPED: Self = Self { tm: 2, tn: 8 };

    /// Input rows (pairs) of a tile.
    #[must_use]
    pub fn rows(self) -> usize {
        16 * self.tm
    }

    /// Output columns of a tile.
    #[must_use]
    pub fn cols(self) -> usize {
        16 * self.tn
    }

    /// `TMxTN` (e.g. `4x4`) when both are sizes the kernels take (8x8
    /// is not: two matrices' tiles would need more than 48 KiB of shared
    /// memory).
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        let (m, n) = text.split_once('x')?;
        let s = Self {
            tm: m.trim().parse().ok()?,
            tn: n.trim().parse().ok()?,
        };
        (matches!(s.tm, 2 | 4 | 8) && matches!(s.tn, 4 | 8) && s.tm * s.tn < 64).then_some(s)
    }
}
/// `FLASHTIER_CUDA_GRAPHS`: `0` launches every kernel of a decode step one
/// by one instead of recording the step as CUDA graphs (default `1`).
pub const CUDA_GRAPHS: &str = "FLASHTIER_CUDA_GRAPHS";
/// `FLASHTIER_PDL`: `0` gives recorded graphs plain edges instead of
/// programmatic dependent launch (default `1`).
pub const PDL: &str = "FLASHTIER_PDL";
/// `FLASHTIER_GRAPH_SEGMENT`: launches per recorded graph segment, 1 to
/// [`MAX_SEGMENT_LAUNCHES`] (default [`SEGMENT_LAUNCHES`]).
pub const GRAPH_SEGMENT: &str = "FLASHTIER_GRAPH_SEGMENT";
/// `FLASHTIER_STREAM_WEIGHTS`: `0` compiles the one-pass weight loads
/// without their evict-first hint (default `1`).
pub const STREAM_WEIGHTS: &str = "FLASHTIER_STREAM_WEIGHTS";
/// `FLASHTIER_GEMV_LOADS`: 8-weight chunks a lane of a one-row product
/// keeps in flight, 1 to [`MAX_GEMV_LOADS`] (default
/// [`DEFAULT_GEMV_LOADS`]).
pub const GEMV_LOADS: &str = "FLASHTIER_GEMV_LOADS";
/// `FLASHTIER_ATTN_AHEAD`: positions a warp of the decode attention loads
/// before it uses them, 1 to [`MAX_ATTN_AHEAD`] (default
/// [`DEFAULT_ATTN_AHEAD`]).
pub const ATTN_AHEAD: &str = "FLASHTIER_ATTN_AHEAD";
/// `FLASHTIER_DOWN_ROWS`: output rows of the experts' down product one
/// block takes, 1 to [`MAX_DOWN_ROWS`] (default [`DEFAULT_DOWN_ROWS`]).
pub const DOWN_ROWS: &str = "FLASHTIER_DOWN_ROWS";
/// `FLASHTIER_PROMPT_TILES`: `0` runs prompt chunks as GEMV passes and
/// per-pair experts instead of tiles (default `1`).
pub const PROMPT_TILES: &str = "FLASHTIER_PROMPT_TILES";
/// `FLASHTIER_PROMPT_MMA`: `0` keeps a BF16 prompt's tiles on the CUDA
/// cores (f32 chains) instead of the tensor cores with split inputs
/// (default `1`; the tensor cores need compute capability 8.0 or later and
/// are used only there).
pub const PROMPT_MMA: &str = "FLASHTIER_PROMPT_MMA";
/// `FLASHTIER_PROMPT_ATTN`: `0` attends a prompt chunk's rows one block
/// per (row, head, split), as decode rows are, instead of as tiles of
/// queries over shared keys and values (default `1`).
pub const PROMPT_ATTN: &str = "FLASHTIER_PROMPT_ATTN";
/// `FLASHTIER_PROMPT_ATTN_TC`: `0` keeps a prompt chunk's attention tiles
/// in f32 on the CUDA cores instead of the tensor cores with each f32
/// operand split into two TF32 parts (default `1`: 20.4 vs 25.8 ms of a
/// 2048-token prompt's attention on an H100; used for heads of up to 128
/// on compute capability 8.0 or later, with [`PROMPT_ATTN`] on).
pub const PROMPT_ATTN_TC: &str = "FLASHTIER_PROMPT_ATTN_TC";
/// `FLASHTIER_PROMPT_ATTN_PIPE`: `1` has the tensor-core prompt attention
/// for heads of 128 load the next k step's fragments into a second set of
/// registers while the current step's products run (252 registers a
/// thread instead of 226; the same bits; default `0` until timed on a
/// GPU).
pub const PROMPT_ATTN_PIPE: &str = "FLASHTIER_PROMPT_ATTN_PIPE";
/// `FLASHTIER_PROMPT_BLAS`: `0` keeps a BF16 prompt's dense products on
/// this crate's tensor-core tiles instead of cuBLASLt (default `1`: 6.2 vs
/// 13.3 ms of a 2048-token prompt's dense products on an H100; used only
/// where libcublasLt loads and the tensor-core tiles would run).
pub const PROMPT_BLAS: &str = "FLASHTIER_PROMPT_BLAS";
/// `FLASHTIER_GEMM_TILE`: the tile shape `TMxTN` of a prompt's dense
/// products (default `4x4`; see [`TileShape::parse`]).
pub const GEMM_TILE: &str = "FLASHTIER_GEMM_TILE";
/// `FLASHTIER_GROUP_TILE`: the tile shape `TMxTN` of a prompt's grouped
/// experts (default `2x8`).
pub const GROUP_TILE: &str = "FLASHTIER_GROUP_TILE";
/// `FLASHTIER_MMA_BK`: input columns a tensor-core tile of a BF16 prompt
/// product stages at once, `32` or `64` (default [`DEFAULT_MMA_BK`]).
pub const MMA_BK: &str = "FLASHTIER_MMA_BK";
/// `FLASHTIER_DEVICE_GROUPS`: `0` groups a prompt step's pairs by expert
/// on the host (the routed ids copied back) even when every expert is
/// resident (default `1`: on the device; the same bits).
pub const DEVICE_GROUPS: &str = "FLASHTIER_DEVICE_GROUPS";
/// `FLASHTIER_DUMP_CUBIN`: a folder each compiled module's machine code is
/// also written to, for `cuobjdump --dump-sass` (default: none).
pub const DUMP_CUBIN: &str = "FLASHTIER_DUMP_CUBIN";

/// This crate's variables.
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: CUDA_GRAPHS,
        default: "1",
        doc: "0: every decode kernel launched one by one (no CUDA graphs)",
    },
    Setting {
        name: PDL,
        default: "1",
        doc: "0: plain graph edges instead of programmatic dependent launch",
    },
    Setting {
        name: GRAPH_SEGMENT,
        default: "32",
        doc: "launches per recorded graph segment (1 to 4096)",
    },
    Setting {
        name: STREAM_WEIGHTS,
        default: "1",
        doc: "0: one-pass weight loads without the evict-first hint",
    },
    Setting {
        name: GEMV_LOADS,
        default: "4",
        doc: "8-weight chunks a lane of a one-row product keeps in flight (1 to 16)",
    },
    Setting {
        name: ATTN_AHEAD,
        default: "4",
        doc: "positions a warp of the decode attention loads ahead (1 to 8)",
    },
    Setting {
        name: DOWN_ROWS,
        default: "4",
        doc: "output rows per block of the experts' down product (1 to 16)",
    },
    Setting {
        name: PROMPT_TILES,
        default: "1",
        doc: "0: prompt chunks as GEMV passes and per-pair experts instead of tiles",
    },
    Setting {
        name: PROMPT_MMA,
        default: "1",
        doc: "0: a BF16 prompt's tiles on the CUDA cores (f32) instead of the tensor cores (split BF16 inputs)",
    },
    Setting {
        name: PROMPT_ATTN,
        default: "1",
        doc: "0: a prompt chunk's attention one block per row, head and split instead of as tiles",
    },
    Setting {
        name: PROMPT_ATTN_TC,
        default: "1",
        doc: "0: a prompt chunk's attention tiles in f32 instead of on the tensor cores (split TF32)",
    },
    Setting {
        name: PROMPT_ATTN_PIPE,
        default: "0",
        doc: "1: the tensor-core prompt attention (heads of 128) loads the next k step's fragments during this one's products (same bits)",
    },
    Setting {
        name: PROMPT_BLAS,
        default: "1",
        doc: "0: a BF16 prompt's dense products on the tensor-core tiles instead of cuBLASLt",
    },
    Setting {
        name: GEMM_TILE,
        default: "4x4",
        doc: "tile shape TMxTN of a prompt's dense products (TM 2, 4 or 8; TN 4 or 8; not 8x8)",
    },
    Setting {
        name: GROUP_TILE,
        default: "2x8",
        doc: "tile shape TMxTN of a prompt's grouped experts (as FLASHTIER_GEMM_TILE)",
    },
    Setting {
        name: MMA_BK,
        default: "64",
        doc: "input columns a tensor-core prompt tile stages at once (32 or 64)",
    },
    Setting {
        name: DEVICE_GROUPS,
        default: "1",
        doc: "0: a prompt step's pairs grouped by expert on the host (ids copied back) instead of on the device",
    },
    Setting {
        name: DUMP_CUBIN,
        default: "unset",
        doc: "a folder the compiled kernels' machine code is written to (cuobjdump --dump-sass)",
    },
];

/// How the launch path issues a decode step's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchSettings {
    /// Record one-token steps as CUDA graphs ([`CUDA_GRAPHS`]).
    pub graphs: bool,
    /// Programmatic dependent launch inside the graphs ([`PDL`]).
    pub pdl: bool,
    /// Launches per recorded segment ([`GRAPH_SEGMENT`]).
    pub segment_launches: usize,
}

impl Default for LaunchSettings {
    fn default() -> Self {
        Self {
            graphs: true,
            pdl: true,
            segment_launches: SEGMENT_LAUNCHES,
        }
    }
}

impl LaunchSettings {
    /// The defaults, each overridden by its variable in `env`.
    pub fn read(env: &Env<'_>) -> Result<Self, SettingError> {
        let d = Self::default();
        Ok(Self {
            graphs: env.flag(CUDA_GRAPHS, d.graphs)?,
            pdl: env.flag(PDL, d.pdl)?,
            segment_launches: env.int(
                GRAPH_SEGMENT,
                1..=MAX_SEGMENT_LAUNCHES,
                d.segment_launches,
            )?,
        })
    }
}

impl Tuning {
    /// The kernel tuning: the defaults, each overridden by its
    /// variable in `env`.
    pub fn read(env: &Env<'_>) -> Result<Tuning, SettingError> {
        let d = Tuning::default();
        let shape = |var: &'static str, default: TileShape| {
            env.parsed(
                var,
                "a tile shape TMxTN (TM 2, 4 or 8; TN 4 or 8; not 8x8)",
                default,
                TileShape::parse,
            )
        };
        Ok(Tuning {
            stream_weights: env.flag(STREAM_WEIGHTS, d.stream_weights)?,
            gemv_loads: env.int(GEMV_LOADS, 1..=MAX_GEMV_LOADS, d.gemv_loads)?,
            attn_ahead: env.int(ATTN_AHEAD, 1..=MAX_ATTN_AHEAD, d.attn_ahead)?,
            down_rows: env.int(DOWN_ROWS, 1..=MAX_DOWN_ROWS, d.down_rows)?,
            prompt_tiles: env.flag(PROMPT_TILES, d.prompt_tiles)?,
            prompt_mma: env.flag(PROMPT_MMA, d.prompt_mma)?,
            prompt_attn: env.flag(PROMPT_ATTN, d.prompt_attn)?,
            prompt_attn_tc: env.flag(PROMPT_ATTN_TC, d.prompt_attn_tc)?,
            prompt_attn_pipe: env.flag(PROMPT_ATTN_PIPE, d.prompt_attn_pipe)?,
            prompt_blas: env.flag(PROMPT_BLAS, d.prompt_blas)?,
            tiles: (shape(GEMM_TILE, d.tiles.0)?, shape(GROUP_TILE, d.tiles.1)?),
            mma_bk: env.parsed(MMA_BK, "32 or 64", d.mma_bk, |v| {
                v.trim().parse().ok().filter(|b| matches!(b, 32 | 64))
            })?,
            device_groups: env.flag(DEVICE_GROUPS, d.device_groups)?,
        })
    }
}

/// [`DUMP_CUBIN`], if set.
#[must_use]
pub fn dump_cubin(env: &Env<'_>) -> Option<PathBuf> {
    env.path(DUMP_CUBIN)
}

#[cfg(test)]
mod tests;
