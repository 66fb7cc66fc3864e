//! The KV cache of one sequence, and attention over it through the KV
//! tier's tiled attention ([`flashtier::kv::attention`]).
//!
//! Keys and values are kept as BF16 in the KV tier's paged layout
//! `[block, token, kv_head, dim]`, `BLOCK_TOKENS` tokens a block; each
//! layer's buffers always hold whole blocks (the last one filled up to the
//! positions pushed), so attention reads them in place. Attention folds the
//! blocks into an [`AttnState`] tile by tile (`begin_step`, `step_tile_on`
//! per `TILE_BLOCKS` blocks, `finalize_f32`), exactly the path restored KV
//! tiles take. [`image`] hands a cache's bytes out and fills an empty one
//! with them (a kept cache spilled to a drive and restored).
//!
//! A prompt chunk pushes its rows' keys and values first, then attends its
//! query rows together: each row is one sequence of a tier step whose
//! blocks end at the row's own position (causal), so it folds exactly the
//! blocks, in exactly the order, that attending it alone after its push
//! would: the same bits. A step takes at most [`ROW_GROUP`] rows (fewer if
//! their scratch would pass [`MAX_SCRATCH_VALUES`]); its tasks (up to 16
//! consecutive rows x one kv head, sharing each widened block) run on
//! rayon's pool, each on its own slices of the state, with the vector
//! instructions [`Isa::current`] picked (the same bits as the baseline and
//! as any grouping: the fold has no fused multiply-adds and keeps each
//! row's order).
//!
//! Two precisions ([`KvPrecision`]):
//! - `Bf16`: one BF16 per value, as deployments keep KV (half the memory;
//!   logits then differ from an f32 reference by about 1e-2).
//! - `Bf16x2` (default): each f32 value `x` is stored as two BF16s, `hi =
//!   bf16(x)` and `lo = bf16(x - hi)`, side by side in a head twice as wide.
//!   The query is duplicated (`[q, q]`, scaled by sqrt 2 to undo the tier's
//!   `1/sqrt(2 d)`), so `q' . k' = q . (k_hi + k_lo)`, and the output's two
//!   halves add to `sum p (v_hi + v_lo)`: the tier's BF16 kernel computes
//!   attention on values accurate to about 2^-17 relative, which keeps the
//!   logits within 1e-3 of transformers' f32 computation. Needs
//!   `head_dim <= 128` (the tier's limit is 256).
//!
//! Bound: at most `capacity` positions per layer (`capacity x num_kv_heads x
//! head_dim x 2` BF16 values per layer, growing a block at a time with the
//! positions held); a push past it is [`EngineError::ContextFull`]. With a
//! sliding window (Mixtral) the capacity is the window, so no position ever
//! falls out of it.
//!
//! Memory besides the blocks, kept between calls: the state of one step
//! (`rows x q_heads x (width + 2)` f32, `width` the stored head width), the
//! widened queries and outputs of `Bf16x2` (`rows x q_heads x width` f32
//! each), `rows` at most [`ROW_GROUP`]; each thread of the pool keeps the
//! tier's fold scratch (`2 x BLOCK_TOKENS x width + gqa_ratio x
//! BLOCK_TOKENS` f32) between steps.
//!
//! Limits on what a config sets, checked by [`KvCache::new`] before anything
//! is allocated ([`EngineError::TooLarge`]): `capacity` (from
//! `max_position_embeddings` or `sliding_window`) at most [`MAX_POSITIONS`];
//! layers at most [`MAX_LAYERS`];
//! the cache at full capacity (K and V of every layer) within u64 bytes;
//! the widened query and output scratch of one row (`q_heads x` stored head
//! width f32) at most [`MAX_SCRATCH_VALUES`] values each.

use half::bf16;

use super::isa::Isa;
use crate::config::bounds::MAX_LAYERS;
use crate::device::{KvPrecision, KvSpec, KvState};
use crate::error::EngineError;
use flashtier::kv::attention::{
    AttentionDims, AttentionError, AttnState, FoldRunner, FoldTask, KvTile, TileSeq,
};
use flashtier_format::kv::KvStrides;

/// Tokens per KV block.
pub const BLOCK_TOKENS: usize = 16;

/// Blocks folded per `step_tile_on` call.
pub const TILE_BLOCKS: usize = 32;

/// Most positions one cache holds (16 Mi: above any supported model's
/// context).
pub const MAX_POSITIONS: usize = 1 << 24;

/// Most f32 values of the query and output scratch (64 MiB each).
pub const MAX_SCRATCH_VALUES: usize = 1 << 24;

/// Most query rows one attention step takes: 64 rows of 8 kv heads are
/// 512 tasks, plenty to balance over the cores, and Qwen3-30B's 64 x 32
/// heads x 256 stored values are 2 MiB of state.
pub const ROW_GROUP: usize = 64;

/// Keys and values of every layer, BF16 bytes, paged layout.
#[derive(Debug)]
pub struct KvCache {
    /// Whole blocks per layer.
    keys: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
    /// Positions each layer holds.
    held: Vec<usize>,
    precision: KvPrecision,
    head_dim: usize,
    /// Scratch for the widened queries and outputs (`Bf16x2`).
    q_wide: Vec<f32>,
    out_wide: Vec<f32>,
    /// Sized for `group` rows (`max_seqs`).
    dims: AttentionDims,
    state: AttnState,
    /// Rows per attention step.
    group: usize,
    /// The instruction set the fold runs on.
    isa: Isa,
    capacity: usize,
    len: usize,
}

impl KvState for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn rewinds(&self) -> bool {
        true
    }

    /// Every layer drops its last `n` positions: the blocks past the ones
    /// still held are freed and the rest of the last block is zeroed (as a
    /// block a push opens is), so the next push writes after the kept
    /// positions exactly as if the dropped ones never were.
    fn rewind(&mut self, n: usize) -> Result<(), EngineError> {
        if n > self.len || self.held.iter().any(|&h| h != self.len) {
            return Err(EngineError::Shape {
                op: "kv rewind",
                what: format!(
                    "{n} positions of a cache holding {} (layers at {:?})",
                    self.len, self.held
                ),
            });
        }
        let keep = self.len - n;
        let bytes = self.position_bytes();
        let end = keep.div_ceil(BLOCK_TOKENS) * BLOCK_TOKENS * bytes;
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            buf.truncate(end);
            if let Some(tail) = buf.get_mut(keep * bytes..) {
                tail.fill(0);
            }
        }
        self.held.fill(keep);
        self.len = keep;
        Ok(())
    }
}

/// Runs each fold task on an instruction set.
struct IsaFold(Isa);

/// One task under [`Isa::run`]: `call` inlines the whole fold.
struct FoldBody<'a>(FoldTask<'a>);

impl pulp::NullaryFnOnce for FoldBody<'_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        self.0.run();
    }
}

impl FoldRunner for IsaFold {
    fn fold(&self, task: FoldTask<'_>) {
        self.0.run(FoldBody(task));
    }
}

fn attention_err(e: AttentionError) -> EngineError {
    EngineError::Attention(e.to_string())
}

/// The limits of the module docs for a cache of `spec` storing heads
/// `width` wide; returns the scratch length (`q_heads x width`).
fn check_limits(spec: &KvSpec, width: usize) -> Result<usize, EngineError> {
    let too_large = |what: &str, value: Option<usize>, limit: usize, unit| EngineError::TooLarge {
        what: what.to_string(),
        value: value.map(|v| v as u64),
        limit: limit as u64,
        unit,
    };
    let at_most = |what: &str, value: usize, limit: usize, unit| {
        if value > limit {
            return Err(too_large(what, Some(value), limit, unit));
        }
        Ok(())
    };
    at_most("KV cache layers", spec.layers, MAX_LAYERS, "layers")?;
    at_most(
        "KV cache capacity (max_position_embeddings or sliding_window)",
        spec.capacity,
        MAX_POSITIONS,
        "positions",
    )?;
    let full = [spec.layers, spec.kv_heads, width, 2 * 2]
        .iter()
        .try_fold(spec.capacity as u64, |n, &x| n.checked_mul(x as u64));
    if full.is_none() {
        return Err(EngineError::TooLarge {
            what:
                "KV cache at full capacity (positions x layers x kv heads x head width x K and V)"
                    .into(),
            value: None,
            limit: u64::MAX,
            unit: "bytes",
        });
    }
    match spec.q_heads.checked_mul(width) {
        Some(n) if n <= MAX_SCRATCH_VALUES => Ok(n),
        n => Err(too_large(
            "attention query scratch (query heads x stored head width)",
            n,
            MAX_SCRATCH_VALUES,
            "values",
        )),
    }
}

impl KvCache {
    /// An empty cache of `spec`'s shape.
    pub fn new(spec: &KvSpec) -> Result<Self, EngineError> {
        let KvSpec {
            layers: num_layers,
            q_heads: num_q_heads,
            kv_heads: num_kv_heads,
            head_dim,
            capacity,
            precision,
        } = *spec;
        let width = match precision {
            KvPrecision::Bf16 => head_dim,
            KvPrecision::Bf16x2 => head_dim.saturating_mul(2),
        };
        if width > flashtier::kv::attention::MAX_HEAD_DIM {
            return Err(EngineError::Attention(format!(
                "head_dim {head_dim} stored as {precision} is {width} wide, over the KV tier's \
                 limit of {}; use KvPrecision::Bf16",
                flashtier::kv::attention::MAX_HEAD_DIM
            )));
        }
        let scratch = check_limits(spec, width)?;
        let group = (MAX_SCRATCH_VALUES / scratch.max(1)).clamp(1, ROW_GROUP);
        let dims = AttentionDims::new(group, num_q_heads, num_kv_heads, width, BLOCK_TOKENS);
        let state = AttnState::new(dims).map_err(attention_err)?;
        Ok(Self {
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
            held: vec![0; num_layers],
            precision,
            head_dim,
            q_wide: Vec::new(),
            out_wide: Vec::new(),
            dims,
            state,
            group,
            isa: Isa::configured()?,
            capacity,
            len: 0,
        })
    }

    /// Bytes of one position of one layer (K or V).
    fn position_bytes(&self) -> usize {
        self.dims.num_kv_heads * self.dims.head_dim * 2
    }

    /// How values are stored.
    pub fn precision(&self) -> KvPrecision {
        self.precision
    }

    /// Append one position's keys and values (`[kv_head, head_dim]` f32) to
    /// `layer`, after the positions it holds; the position counts once every
    /// layer has it (see [`KvState::advance`]). A layer may run up to one
    /// step of rows ahead of the others while a step is in flight.
    pub fn push(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), EngineError> {
        let width = self.dims.num_kv_heads * self.head_dim;
        let held = self.held.get(layer).copied().unwrap_or(0);
        if held >= self.capacity {
            return Err(EngineError::ContextFull {
                len: held + 1,
                max: self.capacity,
            });
        }
        if k.len() != width || v.len() != width || layer >= self.keys.len() || held < self.len {
            return Err(EngineError::Attention(format!(
                "layer {layer}: push of {} keys at position {held} does not fit a cache of \
                 {} layers, {width} values per position and {} complete positions",
                k.len(),
                self.keys.len(),
                self.len
            )));
        }
        let (d, precision, bytes) = (self.head_dim, self.precision, self.position_bytes());
        let at = held * bytes;
        for (buf, src) in [(&mut self.keys[layer], k), (&mut self.values[layer], v)] {
            if held % BLOCK_TOKENS == 0 {
                buf.resize(at + BLOCK_TOKENS * bytes, 0);
            }
            encode(&mut buf[at..at + bytes], src, d, precision);
        }
        self.held[layer] += 1;
        Ok(())
    }

    /// Attention of the last `rows` positions `layer` holds: `q` is their
    /// queries, `rows x [num_q_heads, head_dim]` f32, and `out` is written
    /// like `q`. Each row attends every position up to its own (itself
    /// included), with the bits attending it alone right after its push
    /// gives.
    pub fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        let held = self.held.get(layer).copied().unwrap_or(0);
        let row = self.dims.num_q_heads * self.head_dim;
        let rows = q.len() / row.max(1);
        if q.len() != rows * row || out.len() != q.len() || rows > held {
            return Err(EngineError::Attention(format!(
                "layer {layer}: {} query values and {} outputs are not whole rows of {} heads \
                 of {} for the {held} positions the layer holds",
                q.len(),
                out.len(),
                self.dims.num_q_heads,
                self.head_dim
            )));
        }
        if rows == 0 {
            return Err(EngineError::Attention(format!(
                "layer {layer}: no query row (it holds {held} positions)"
            )));
        }
        let step = self.group * row;
        for (i, (qs, os)) in q.chunks(step).zip(out.chunks_mut(step)).enumerate() {
            // Positions the group's first row sees, less one.
            let before = held - rows + i * self.group;
            match self.precision {
                KvPrecision::Bf16 => self.fold_rows(layer, before, qs, os)?,
                KvPrecision::Bf16x2 => self.attend_wide(layer, before, qs, os)?,
            }
        }
        Ok(())
    }

    /// `Bf16x2`: `[q, q] * sqrt 2` against `[hi, lo]` heads; the output
    /// halves add up.
    fn attend_wide(
        &mut self,
        layer: usize,
        before: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let d = self.head_dim;
        let mut q_wide = std::mem::take(&mut self.q_wide);
        let mut out_wide = std::mem::take(&mut self.out_wide);
        q_wide.resize(2 * q.len(), 0.0);
        out_wide.resize(2 * q.len(), 0.0);
        for (wide, head) in q_wide.chunks_exact_mut(2 * d).zip(q.chunks_exact(d)) {
            for (i, x) in head.iter().enumerate() {
                wide[i] = x * std::f32::consts::SQRT_2;
                wide[d + i] = x * std::f32::consts::SQRT_2;
            }
        }
        let result = self.fold_rows(layer, before, &q_wide, &mut out_wide);
        for (o, wide) in out.chunks_exact_mut(d).zip(out_wide.chunks_exact(2 * d)) {
            for i in 0..d {
                o[i] = wide[i] + wide[d + i];
            }
        }
        self.q_wide = q_wide;
        self.out_wide = out_wide;
        result
    }

    /// One step over `q`'s rows (at most `group`, stored width): row `r`
    /// attends the first `before + r + 1` positions.
    fn fold_rows(
        &mut self,
        layer: usize,
        before: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let rows = q.len() / (self.dims.num_q_heads * self.dims.head_dim);
        let blocks = (before + rows).div_ceil(BLOCK_TOKENS);
        let ids: Vec<u32> = (0..blocks as u32).collect();
        let strides = KvStrides::paged(&self.dims);
        let runner = IsaFold(self.isa);
        self.state.begin_step(rows).map_err(attention_err)?;
        for first in (0..blocks).step_by(TILE_BLOCKS) {
            let seqs: Vec<TileSeq<'_>> = (0..rows)
                .map(|r| row_tile(&ids, first, before + r + 1))
                .collect();
            let tile = KvTile {
                k: &self.keys[layer],
                v: &self.values[layer],
                strides,
                seqs: &seqs,
            };
            self.state
                .step_tile_on(q, &tile, &runner)
                .map_err(attention_err)?;
        }
        self.state.finalize_f32(out).map_err(attention_err)
    }
}

/// The blocks of tile `first..first + TILE_BLOCKS` a row that sees `seen`
/// positions folds (none once its blocks end before the tile).
fn row_tile(ids: &[u32], first: usize, seen: usize) -> TileSeq<'_> {
    let blocks = seen.div_ceil(BLOCK_TOKENS);
    let end = blocks.min(first + TILE_BLOCKS);
    TileSeq {
        blocks: ids.get(first..end).unwrap_or_default(),
        last_block_tokens: if end == blocks {
            seen - (blocks - 1) * BLOCK_TOKENS
        } else {
            BLOCK_TOKENS
        },
    }
}

/// One position's f32 values (`d`-wide heads) as BF16 bytes in `dst`:
/// per head `hi`, then for `Bf16x2` `lo`.
fn encode(dst: &mut [u8], src: &[f32], d: usize, precision: KvPrecision) {
    let head_bytes = match precision {
        KvPrecision::Bf16 => 2 * d,
        KvPrecision::Bf16x2 => 4 * d,
    };
    for (out, head) in dst.chunks_exact_mut(head_bytes).zip(src.chunks_exact(d)) {
        // `lo` is empty for `Bf16`.
        let (hi, lo) = out.split_at_mut(2 * d);
        for (x, h) in head.iter().zip(hi.chunks_exact_mut(2)) {
            h.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
        }
        for (x, l) in head.iter().zip(lo.chunks_exact_mut(2)) {
            let rest = x - bf16::from_f32(*x).to_f32();
            l.copy_from_slice(&bf16::from_f32(rest).to_le_bytes());
        }
    }
}

pub mod image;

#[cfg(test)]
mod tests;
