//! The attention consumer of `bench kv`: tiled decode attention of one
//! query per layer over every restored tile, layers in parallel, either as
//! the tiles land (the pipelined restore) or from memory ("attention
//! alone").
//!
//! Invariant: each tile's blocks are read through the slot tables of tile
//! 0 (every tile holds its blocks in the same slots); the last tile's last
//! block is partly filled, so the partial-block path runs too.

use std::hint::black_box;
use std::time::Instant;

use anyhow::Result;
use flashtier::kv::attention::{AttnState, KvTile, TileSeq};
use flashtier::kv::swap::KvError;
use flashtier_io::AlignedBuf;
use half::bf16;
use rayon::prelude::*;

use super::Bench;

impl Bench {
    /// Tokens in the last block of tile `tile` (the last tile's is partly
    /// filled).
    fn last_tokens(&self, tile: usize) -> usize {
        let bt = self.dims.block_tokens;
        if tile + 1 == self.num_tiles as usize {
            bt.saturating_sub(3).max(1)
        } else {
            bt
        }
    }

    /// One attention state per layer, its step begun.
    pub(super) fn new_states(&self) -> Result<Vec<AttnState>> {
        (0..self.args.layers)
            .map(|_| {
                let mut s = AttnState::new(self.dims)?;
                s.begin_step(1)?;
                Ok(s)
            })
            .collect()
    }

    /// Finish every state; the sum of the outputs (kept from the optimiser).
    pub(super) fn finish(states: &[AttnState]) -> Result<f32> {
        let mut sum = 0.0f32;
        for s in states {
            let d = s.dims();
            let mut out = vec![bf16::ZERO; d.num_q_heads * d.head_dim];
            s.finalize(&mut out)?;
            sum += out.iter().map(|x| x.to_f32()).sum::<f32>();
        }
        Ok(sum)
    }

    /// Fold tile `i` into every layer's state, layers in parallel; `k` and
    /// `v` are the tile's slots (`v` starts at the first slot's V half).
    pub(super) fn fold(
        &self,
        states: &mut [AttnState],
        i: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KvError> {
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
    pub(super) fn attention_alone(&self) -> Result<f64> {
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
