//! Tiled decode attention, CPU reference.
//!
//! Per decode step: [`AttnState::begin_step`] resets the running state
//! (`m = -inf`, `l = 0`, `o = 0`) per (sequence, query head);
//! [`AttnState::step_tile`] folds one tile of KV blocks into it with the
//! online softmax; [`AttnState::finalize`] writes `o / l` as BF16. Two states
//! that folded disjoint tiles combine with [`AttnState::merge`] (log-sum-exp),
//! so tiles may be folded in any order or in parallel.
//!
//! KV elements are BF16 (little-endian bytes, as they land from disk);
//! queries, running state and accumulation are f32. GQA: query head `h`
//! reads kv head `h / (num_q_heads / num_kv_heads)`. A [`KvStrides`] triple
//! (block, token, kv_head, in elements; `flashtier_format::kv::tile`) selects
//! the layout: paged `[block, token, kv_head, dim]` or the scratch-pool slot
//! layout `[slot, K|V, kv_head, token, dim]`. Every block of a tile is full
//! except the last of each sequence, which holds `last_block_tokens` tokens.
//!
//! Bounds: the state holds `max_seqs * num_q_heads * (head_dim + 2)` f32,
//! allocated once in [`AttnState::new`], kept kv head by kv head (then
//! sequence, then the kv head's query heads) so one task's rows are one run
//! of it. A step's work is split into tasks of up to 16 consecutive
//! sequences x one kv head (about four tasks per thread of the rayon pool
//! it runs on); a task widens each KV block once for all its sequences that
//! read it and folds it into each one's state in that sequence's block
//! order, so the bits of a sequence do not depend on the grouping, the
//! pool or the instruction set. Each thread keeps one scratch buffer
//! between tasks (no allocation per task once grown): `2 * ceil(block_tokens
//! / 16) * 16 * head_dim + gqa_ratio * ceil(block_tokens / 16) * 16` f32 at
//! most (32.5 KiB at GQA 8, head_dim 256, 16-token blocks). A
//! [`FoldRunner`] given to [`AttnState::step_tile_on`] runs each task (the
//! engine's enables the instruction set it picked at run time), with the
//! same bits whatever it enables.
//!
//! ```
//! use flashtier::kv::attention::{AttentionDims, AttnState, KvTile, TileSeq};
//! use flashtier_format::kv::KvStrides;
//! let dims = AttentionDims::new(1, 4, 2, 8, 4);
//! let strides = KvStrides::paged(&dims);
//! // One block of 4 tokens, paged layout, every element 1.0 in BF16.
//! let kv: Vec<u8> = std::iter::repeat([0x80u8, 0x3f]).take(4 * 2 * 8).flatten().collect();
//! let seqs = [TileSeq { blocks: &[0], last_block_tokens: 3 }];
//! let tile = KvTile { k: &kv, v: &kv, strides, seqs: &seqs };
//! let mut state = AttnState::new(dims)?;
//! state.begin_step(1)?;
//! state.step_tile(&vec![0.5f32; 4 * 8], &tile)?;
//! let mut out = vec![half::bf16::ZERO; 4 * 8];
//! state.finalize(&mut out)?;
//! assert!(out.iter().all(|x| x.to_f32() == 1.0));
//! # Ok::<(), flashtier::kv::attention::AttentionError>(())
//! ```

use flashtier_format::kv::{KvShape, KvStrides};
use half::bf16;
use rayon::prelude::*;

pub use flashtier_format::kv::MAX_HEAD_DIM;

/// Shape of the attention the state is sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Most sequences one step may carry.
    pub max_seqs: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// KV heads (divides `num_q_heads`).
    pub num_kv_heads: usize,
    /// Elements per head (1..=256).
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
}

/// Invalid dimensions or inputs; nothing is computed when one is returned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttentionError {
    /// A dimension is zero.
    #[error("attention dimension {field} is zero")]
    Zero {
        /// Field name.
        field: &'static str,
    },
    /// GQA needs `num_q_heads` to be a multiple of `num_kv_heads`.
    #[error("num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")]
    HeadsNotDivisible {
        /// Query heads.
        num_q_heads: usize,
        /// KV heads.
        num_kv_heads: usize,
    },
    /// Head dimension above [`MAX_HEAD_DIM`].
    #[error("head_dim {head_dim} exceeds the maximum {MAX_HEAD_DIM}")]
    HeadDimTooLarge {
        /// Head dimension asked for.
        head_dim: usize,
    },
    /// More sequences than the state was sized for.
    #[error("{num_seqs} sequences exceed max_seqs {max_seqs}")]
    TooManySeqs {
        /// Sequences asked for.
        num_seqs: usize,
        /// The state's maximum.
        max_seqs: usize,
    },
    /// An input or output buffer has the wrong length.
    #[error("{what} holds {got} elements, expected {expected}")]
    BadLength {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length required.
        expected: usize,
    },
    /// `last_block_tokens` outside `1..=block_tokens`.
    #[error("sequence {seq}: last block holds {got} tokens, must be 1..={block_tokens}")]
    LastBlockTokens {
        /// Sequence.
        seq: usize,
        /// Tokens given.
        got: usize,
        /// Tokens per block.
        block_tokens: usize,
    },
    /// A block of the tile reaches past its K or V buffer.
    #[error("sequence {seq}: block {block} reaches element {end} of {which}, which holds {len}")]
    OutOfBounds {
        /// Sequence.
        seq: usize,
        /// Block index in the buffer.
        block: u32,
        /// "K" or "V".
        which: &'static str,
        /// One past the last element the block needs.
        end: usize,
        /// Elements in the buffer.
        len: usize,
    },
    /// Merging states of different shapes or steps.
    #[error("cannot merge attention states of different shapes")]
    MergeMismatch,
    /// A (sequence, head) received no token, so it has no softmax.
    #[error("sequence {seq} head {head} attended to no token")]
    NoTokens {
        /// Sequence.
        seq: usize,
        /// Query head.
        head: usize,
    },
}

impl AttentionDims {
    /// Dimensions (validated by [`AttnState::new`]).
    #[must_use]
    pub fn new(
        max_seqs: usize,
        num_q_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_tokens: usize,
    ) -> Self {
        Self {
            max_seqs,
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_tokens,
        }
    }

    /// Check every constraint.
    pub fn validate(&self) -> Result<(), AttentionError> {
        let fields = [
            ("max_seqs", self.max_seqs),
            ("num_q_heads", self.num_q_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("block_tokens", self.block_tokens),
        ];
        if let Some((field, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(AttentionError::Zero { field });
        }
        if self.num_q_heads % self.num_kv_heads != 0 {
            return Err(AttentionError::HeadsNotDivisible {
                num_q_heads: self.num_q_heads,
                num_kv_heads: self.num_kv_heads,
            });
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(AttentionError::HeadDimTooLarge {
                head_dim: self.head_dim,
            });
        }
        Ok(())
    }

    /// Query heads per kv head.
    #[must_use]
    pub fn gqa_ratio(&self) -> usize {
        self.num_q_heads / self.num_kv_heads.max(1)
    }

    /// `1 / sqrt(head_dim)`.
    #[must_use]
    pub fn softmax_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

impl From<&AttentionDims> for KvShape {
    fn from(d: &AttentionDims) -> Self {
        Self {
            num_kv_heads: d.num_kv_heads,
            block_tokens: d.block_tokens,
            head_dim: d.head_dim,
        }
    }
}

/// One sequence's blocks in a tile.
#[derive(Clone, Copy, Debug)]
pub struct TileSeq<'a> {
    /// Block indexes into the tile's K/V buffers, in token order (may be empty).
    pub blocks: &'a [u32],
    /// Valid tokens of the last block (1..=block_tokens); the others are full.
    pub last_block_tokens: usize,
}

/// One tile: K and V buffers (BF16, little-endian bytes), their strides, and
/// the blocks of every sequence of the step.
#[derive(Clone, Copy, Debug)]
pub struct KvTile<'a> {
    /// K elements.
    pub k: &'a [u8],
    /// V elements.
    pub v: &'a [u8],
    /// Layout of both buffers.
    pub strides: KvStrides,
    /// One entry per sequence of the step.
    pub seqs: &'a [TileSeq<'a>],
}

/// The running state (m, l, o) of a decode step, sized once for the maximum
/// shape.
#[derive(Clone, Debug)]
pub struct AttnState {
    dims: AttentionDims,
    num_seqs: usize,
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

#[path = "attention_kernel.rs"]
mod kernel;

pub use kernel::{Baseline, FoldRunner, FoldTask};

impl AttnState {
    /// A state for `dims` (validated), ready for `begin_step`.
    pub fn new(dims: AttentionDims) -> Result<Self, AttentionError> {
        dims.validate()?;
        let rows = dims.max_seqs * dims.num_q_heads;
        Ok(Self {
            dims,
            num_seqs: 0,
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            o: vec![0.0; rows * dims.head_dim],
        })
    }

    /// The dimensions.
    #[must_use]
    pub fn dims(&self) -> AttentionDims {
        self.dims
    }

    /// Sequences of the current step.
    #[must_use]
    pub fn num_seqs(&self) -> usize {
        self.num_seqs
    }

    /// Reset the state for a step of `num_seqs` sequences.
    pub fn begin_step(&mut self, num_seqs: usize) -> Result<(), AttentionError> {
        if num_seqs > self.dims.max_seqs {
            return Err(AttentionError::TooManySeqs {
                num_seqs,
                max_seqs: self.dims.max_seqs,
            });
        }
        self.num_seqs = num_seqs;
        let rows = num_seqs * self.dims.num_q_heads;
        self.m[..rows].fill(f32::NEG_INFINITY);
        self.l[..rows].fill(0.0);
        self.o[..rows * self.dims.head_dim].fill(0.0);
        Ok(())
    }

    /// Fold one tile into the state. `q` is `[num_seqs, num_q_heads,
    /// head_dim]` f32; scores are `q . k * softmax_scale()` (for another
    /// scale `s`, pass `q * s / softmax_scale()`).
    pub fn step_tile(&mut self, q: &[f32], tile: &KvTile<'_>) -> Result<(), AttentionError> {
        self.step_tile_on(q, tile, &Baseline)
    }

    /// [`AttnState::step_tile`], each (sequence, kv head) task's fold run
    /// through `runner` (which may enable wider vector instructions for
    /// it: the same bits, faster).
    pub fn step_tile_on<R: FoldRunner>(
        &mut self,
        q: &[f32],
        tile: &KvTile<'_>,
        runner: &R,
    ) -> Result<(), AttentionError> {
        let d = self.dims;
        let rows = self.num_seqs * d.num_q_heads;
        check_len("q", q.len(), rows * d.head_dim)?;
        check_len("tile sequences", tile.seqs.len(), self.num_seqs)?;
        kernel::check_tile(&d, tile)?;
        if rows == 0 {
            return Ok(());
        }
        let (gqa, hd) = (d.gqa_ratio(), d.head_dim);
        // Per kv head, its sequences' rows; per task, a group of them.
        let (slab, per) = (
            self.num_seqs * gqa,
            kernel::seqs_per_task(self.num_seqs, d.num_kv_heads) * gqa,
        );
        self.m[..rows]
            .par_chunks_mut(slab)
            .zip(self.l[..rows].par_chunks_mut(slab))
            .zip(self.o[..rows * hd].par_chunks_mut(slab * hd))
            .enumerate()
            .flat_map(|(kvh, ((m, l), o))| {
                m.par_chunks_mut(per)
                    .zip(l.par_chunks_mut(per))
                    .zip(o.par_chunks_mut(per * hd))
                    .enumerate()
                    .map(move |(group, ((m, l), o))| (kvh, group * per / gqa, m, l, o))
            })
            .for_each(|(kvh, first, m, l, o)| {
                runner.fold(FoldTask {
                    d: &d,
                    tile,
                    first,
                    kvh,
                    q,
                    m,
                    l,
                    o,
                });
            });
        Ok(())
    }

    /// Fold `other` (the same step over disjoint tiles) into `self`.
    pub fn merge(&mut self, other: &Self) -> Result<(), AttentionError> {
        if self.dims != other.dims || self.num_seqs != other.num_seqs {
            return Err(AttentionError::MergeMismatch);
        }
        let hd = self.dims.head_dim;
        let rows = self.num_seqs * self.dims.num_q_heads;
        for r in 0..rows {
            let (m1, m2) = (self.m[r], other.m[r]);
            let m = m1.max(m2);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let a1 = (m1 - m).exp();
            let a2 = (m2 - m).exp();
            self.m[r] = m;
            self.l[r] = a1 * self.l[r] + a2 * other.l[r];
            let (o1, o2) = (
                &mut self.o[r * hd..(r + 1) * hd],
                &other.o[r * hd..(r + 1) * hd],
            );
            for (x, y) in o1.iter_mut().zip(o2) {
                *x = a1 * *x + a2 * y;
            }
        }
        Ok(())
    }

    /// Write `o / l` as f32, `[num_seqs, num_q_heads, head_dim]`.
    pub fn finalize_f32(&self, out: &mut [f32]) -> Result<(), AttentionError> {
        self.finalize_with(out.len(), |i, x| {
            if let Some(slot) = out.get_mut(i) {
                *slot = x;
            }
        })
    }

    /// Write `o / l` as BF16, `[num_seqs, num_q_heads, head_dim]`.
    pub fn finalize(&self, out: &mut [bf16]) -> Result<(), AttentionError> {
        self.finalize_with(out.len(), |i, x| {
            if let Some(slot) = out.get_mut(i) {
                *slot = bf16::from_f32(x);
            }
        })
    }

    fn finalize_with(
        &self,
        out_len: usize,
        mut put: impl FnMut(usize, f32),
    ) -> Result<(), AttentionError> {
        let d = self.dims;
        let rows = self.num_seqs * d.num_q_heads;
        check_len("output", out_len, rows * d.head_dim)?;
        let at = |r: usize| self.row(r / d.num_q_heads, r % d.num_q_heads);
        if let Some(r) = (0..rows).find(|&r| self.l[at(r)] <= 0.0) {
            return Err(AttentionError::NoTokens {
                seq: r / d.num_q_heads,
                head: r % d.num_q_heads,
            });
        }
        for r in 0..rows {
            let s = at(r);
            let inv = 1.0 / self.l[s];
            let o = &self.o[s * d.head_dim..(s + 1) * d.head_dim];
            for (i, x) in o.iter().enumerate() {
                put(r * d.head_dim + i, x * inv);
            }
        }
        Ok(())
    }

    /// Where the state of (sequence, query head) sits: kv head by kv head,
    /// then sequence by sequence, so a task's group of sequences of one kv
    /// head is one run of the state.
    fn row(&self, seq: usize, head: usize) -> usize {
        let gqa = self.dims.gqa_ratio();
        (head / gqa * self.num_seqs + seq) * gqa + head % gqa
    }
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), AttentionError> {
    if got == expected {
        Ok(())
    } else {
        Err(AttentionError::BadLength {
            what,
            got,
            expected,
        })
    }
}

/// One sequence's decode attention over `tiles`: `q` is `[num_q_heads,
/// head_dim]`, the result `[num_q_heads, head_dim]` BF16. `state` is reused
/// (sized for at least one sequence).
pub fn attend_one(
    state: &mut AttnState,
    q: &[f32],
    tiles: &[KvTile<'_>],
    out: &mut [bf16],
) -> Result<(), AttentionError> {
    state.begin_step(1)?;
    for t in tiles {
        state.step_tile(q, t)?;
    }
    state.finalize(out)
}
