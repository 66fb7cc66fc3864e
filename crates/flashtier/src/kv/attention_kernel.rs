//! The inner loops of the CPU tiled attention: bounds checks of a tile and
//! the online-softmax fold of one task, a group of consecutive sequences x
//! one kv head.
//!
//! A task walks block index by block index and, within one, sequence by
//! sequence: each block is widened from BF16 once and folded into every
//! sequence of the group that reads it (a prompt chunk's rows share all
//! their blocks but the last), so each sequence still folds its own
//! blocks in its own order, with the operations it would get alone. Keys
//! are widened transposed, `LANES` tokens side by side per element, so one
//! head's scores of `LANES` tokens are vertical vector sums; values stay
//! token-major.
//!
//! The order each (sequence, query head) sees, whatever the grouping or
//! instruction set: a score is `q . k` as 8 accumulators over the whole
//! chunks of 8 elements (lane `i` takes elements `8c + i`, `c` in order),
//! summed in lane order as `Iterator::sum` does, plus a sequential tail,
//! times the softmax scale; per block the running max, `alpha`, the
//! exponentials summed in token order, `l = l * alpha + sum`, `o *= alpha`
//! (unless 1), then `o += p_t * v_t` token by token per output value. This
//! is pinned bit for bit by `tests/kv_attention_order.rs`.
//!
//! The fold is `#[inline(always)]` down to its innermost loop, so a
//! [`FoldRunner`] that enables wider vector instructions around
//! [`FoldTask::run`] gets all of it compiled for them. Its arithmetic is
//! plain `+` and `*` (no fused multiply-add, which Rust never forms on its
//! own), so every instruction set gives the same bits.
//!
//! Scratch: one buffer per thread, kept between tasks and steps (no heap
//! allocation per task once it has grown): `ceil(block_tokens / LANES) x
//! LANES x head_dim` f32 of transposed keys, `block_tokens x head_dim` of
//! values and `gqa_ratio x ceil(block_tokens / LANES) x LANES` of scores
//! (at head_dim 256, 16-token blocks, GQA 8: 32.5 KiB per thread).

use std::cell::Cell;

use flashtier_format::widen::bf16_to_f32;

use super::{AttentionDims, AttentionError, KvTile};

/// Runs the fold of each task (a group of sequences x one kv head) of
/// [`super::AttnState::step_tile_on`], on whichever rayon thread the task
/// lands on. An implementation may enable CPU features for the call (say,
/// through `pulp`'s `vectorize`); it must call [`FoldTask::run`] exactly
/// once.
pub trait FoldRunner: Sync {
    /// Run `task`.
    fn fold(&self, task: FoldTask<'_>);
}

/// The target's baseline instruction set (what [`super::AttnState::step_tile`] uses).
#[derive(Clone, Copy, Debug, Default)]
pub struct Baseline;

impl FoldRunner for Baseline {
    fn fold(&self, task: FoldTask<'_>) {
        task.run();
    }
}

/// Most sequences one task folds: 16 rows share each widened block.
pub(super) const MAX_TASK_SEQS: usize = 16;

/// Tokens whose keys sit side by side in the transposed block (one
/// 512-bit vector of f32).
const LANES: usize = 16;

/// One task: its tile, the step's queries, the first sequence of its group
/// and its disjoint slices of the running state (`m`, `l`: `seqs x gqa`,
/// `o`: `seqs x gqa x head_dim`, sequence-major).
pub struct FoldTask<'a> {
    pub(super) d: &'a AttentionDims,
    pub(super) tile: &'a KvTile<'a>,
    pub(super) first: usize,
    pub(super) kvh: usize,
    pub(super) q: &'a [f32],
    pub(super) m: &'a mut [f32],
    pub(super) l: &'a mut [f32],
    pub(super) o: &'a mut [f32],
}

impl FoldTask<'_> {
    /// Fold the task's blocks into its state (the tile was checked).
    #[inline(always)]
    pub fn run(self) {
        let mut scratch = SCRATCH.take();
        fold_group(self, &mut scratch);
        SCRATCH.set(scratch);
    }
}

thread_local! {
    /// The fold's scratch of this thread (see the module docs). Taken for
    /// the task and put back, so a nested use would only allocate its own.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Sequences per task for a step of `num_seqs` x `num_kv_heads`: about four
/// tasks per thread of the pool, at most [`MAX_TASK_SEQS`] sequences each.
pub(super) fn seqs_per_task(num_seqs: usize, num_kv_heads: usize) -> usize {
    let wanted = 4 * rayon::current_num_threads().max(1);
    (num_seqs * num_kv_heads / wanted).clamp(1, MAX_TASK_SEQS)
}

/// Check every block of every sequence against its K and V buffers, so the
/// fold never reads out of bounds (and so never panics).
pub(super) fn check_tile(d: &AttentionDims, tile: &KvTile<'_>) -> Result<(), AttentionError> {
    let s = tile.strides;
    for (seq, ts) in tile.seqs.iter().enumerate() {
        if ts.blocks.is_empty() {
            continue;
        }
        if !(1..=d.block_tokens).contains(&ts.last_block_tokens) {
            return Err(AttentionError::LastBlockTokens {
                seq,
                got: ts.last_block_tokens,
                block_tokens: d.block_tokens,
            });
        }
        for &b in ts.blocks {
            // The last element a block touches, +1 (the fold widens whole
            // blocks, a partial last one too).
            let end = s.block_end(d, b as usize).unwrap_or(usize::MAX);
            for (which, buf) in [("K", tile.k), ("V", tile.v)] {
                let len = buf.len() / 2;
                if end > len {
                    return Err(AttentionError::OutOfBounds {
                        seq,
                        block: b,
                        which,
                        end,
                        len,
                    });
                }
            }
        }
    }
    Ok(())
}

/// `s`'s whole runs of `N` as arrays, and what is left.
#[inline(always)]
fn runs<T: bytemuck::Pod, const N: usize>(s: &[T]) -> (&[[T; N]], &[T])
where
    [T; N]: bytemuck::Pod,
{
    let (body, rest) = s.split_at(s.len() - s.len() % N);
    (bytemuck::cast_slice(body), rest)
}

/// [`runs`], mutable.
#[inline(always)]
fn runs_mut<T: bytemuck::Pod, const N: usize>(s: &mut [T]) -> (&mut [[T; N]], &mut [T])
where
    [T; N]: bytemuck::Pod,
{
    let whole = s.len() - s.len() % N;
    let (body, rest) = s.split_at_mut(whole);
    (bytemuck::cast_slice_mut(body), rest)
}

/// One BF16 (little-endian bytes) as f32 (exact; the shift that
/// vectorises, see [`bf16_to_f32`]).
#[inline(always)]
fn widen(b: &[u8]) -> f32 {
    bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// A row of BF16 bytes to f32.
#[inline(always)]
fn load_row(src: &[u8], dst: &mut [f32]) {
    for (x, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *x = widen(b);
    }
}

/// The task's view of one block, widened: keys transposed (`[chunk of
/// LANES tokens][element][lane]`), values token-major.
struct Block<'s> {
    keys: &'s mut [f32],
    values: &'s mut [f32],
}

impl Block<'_> {
    /// Widen block `b` of kv head `kvh` (all `block_tokens` tokens; lanes
    /// past them are zero).
    #[inline(always)]
    fn widen(&mut self, d: &AttentionDims, tile: &KvTile<'_>, b: u32, kvh: usize) {
        let (hd, bt, s) = (d.head_dim, d.block_tokens, tile.strides);
        let base = b as usize * s.block + kvh * s.kv_head;
        for t in 0..bt {
            let e = (base + t * s.token) * 2;
            let keys = tile.k.get(e..e + 2 * hd).unwrap_or_default();
            let chunk = &mut self.keys[t / LANES * LANES * hd..];
            for (j, x) in keys.chunks_exact(2).enumerate() {
                chunk[j * LANES + t % LANES] = widen(x);
            }
            let values = tile.v.get(e..e + 2 * hd).unwrap_or_default();
            load_row(values, &mut self.values[t * hd..(t + 1) * hd]);
        }
        for t in bt..bt.div_ceil(LANES) * LANES {
            let chunk = &mut self.keys[t / LANES * LANES * hd..];
            for j in 0..hd {
                chunk[j * LANES + t % LANES] = 0.0;
            }
        }
    }
}

/// `a[t] + q * k[t]` along one vector of `LANES`.
#[inline(always)]
fn mul_add(a: [f32; LANES], q: f32, k: &[f32; LANES]) -> [f32; LANES] {
    let mut out = a;
    for t in 0..LANES {
        out[t] = a[t] + q * k[t];
    }
    out
}

/// [`mul_add`] of 8 vectors, each with its own `q`.
#[inline(always)]
fn mul_add8(a: [[f32; LANES]; 8], q: &[f32; 8], k: &[[f32; LANES]; 8]) -> [[f32; LANES]; 8] {
    let [a0, a1, a2, a3, a4, a5, a6, a7] = a;
    [
        mul_add(a0, q[0], &k[0]),
        mul_add(a1, q[1], &k[1]),
        mul_add(a2, q[2], &k[2]),
        mul_add(a3, q[3], &k[3]),
        mul_add(a4, q[4], &k[4]),
        mul_add(a5, q[5], &k[5]),
        mul_add(a6, q[6], &k[6]),
        mul_add(a7, q[7], &k[7]),
    ]
}

/// One head's query lane by lane: for each of the 8 dot lanes `i` its
/// elements `8c + i` in chunk order, then the tail past the whole chunks
/// (so the 8 values one chunk multiplies are not side by side in memory,
/// which would tempt LLVM to pack them together with their keys).
#[inline(always)]
fn arrange_query(q: &[f32], out: &mut [f32]) {
    let (chunks, tail) = runs::<_, 8>(q);
    let n = chunks.len();
    for (c, qc) in chunks.iter().enumerate() {
        for (i, x) in qc.iter().enumerate() {
            if let Some(slot) = out.get_mut(i * n + c) {
                *slot = *x;
            }
        }
    }
    if let Some(rest) = out.get_mut(8 * n..8 * n + tail.len()) {
        rest.copy_from_slice(tail);
    }
}

/// `q . k_t` for the `LANES` tokens `t` of one chunk of transposed keys
/// (`kt`, `head_dim x LANES`), in the order of the module docs; `qa` is
/// the head's query as [`arrange_query`] lays it out. (Written with arrays
/// passed by value and the 8 lanes spelled out: loops over the lanes get
/// vectorised across them, gathering, instead of along the tokens.)
#[inline(always)]
fn head_dots(qa: &[f32], kt: &[f32], out: &mut [f32; LANES]) {
    let mut acc = [[0.0f32; LANES]; 8];
    let (ks, k_tail) = runs::<_, 8>(runs::<_, LANES>(kt).0);
    let n = ks.len();
    let (lanes, q_tail) = qa.split_at((8 * n).min(qa.len()));
    if n > 0 && lanes.len() == 8 * n {
        let l: [&[f32]; 8] = std::array::from_fn(|i| &lanes[i * n..(i + 1) * n]);
        for (c, kc) in ks.iter().enumerate() {
            let q = [
                l[0][c], l[1][c], l[2][c], l[3][c], l[4][c], l[5][c], l[6][c], l[7][c],
            ];
            acc = mul_add8(acc, &q, kc);
        }
    }
    let mut tail = [0.0f32; LANES];
    for (qv, k) in q_tail.iter().zip(k_tail) {
        tail = mul_add(tail, *qv, k);
    }
    // `Iterator::sum` over the lanes in order, from its start value.
    let mut sum = [std::iter::empty::<f32>().sum::<f32>(); LANES];
    for a in acc {
        sum = add(sum, &a);
    }
    *out = add(sum, &tail);
}

/// `a[t] + b[t]` along one vector of `LANES`.
#[inline(always)]
fn add(a: [f32; LANES], b: &[f32; LANES]) -> [f32; LANES] {
    let mut out = a;
    for t in 0..LANES {
        out[t] = a[t] + b[t];
    }
    out
}

/// `o_g += p_g[t] * v_t` for each head `g` (`o` is `gqa x hd`, `p`
/// `gqa x stride`) over the tokens `t` of `values` (`valid x hd`) in
/// order: per output value the same sequence of `+=` as one token at a
/// time, with 8 vectors of `LANES` columns held in registers across the
/// tokens.
#[inline(always)]
fn add_values(o: &mut [f32], p: &[f32], stride: usize, values: &[f32], hd: usize) {
    for (og, pg) in o.chunks_exact_mut(hd).zip(p.chunks_exact(stride)) {
        let (vecs, tail) = runs_mut::<_, LANES>(og);
        let (groups, rest) = runs_mut::<_, 8>(vecs);
        let n = groups.len();
        for (gi, grp) in groups.iter_mut().enumerate() {
            let mut acc = *grp;
            for (p, v) in pg.iter().zip(values.chunks_exact(hd)) {
                let Some(vg) = runs::<_, 8>(runs::<_, LANES>(v).0).0.get(gi) else {
                    continue;
                };
                acc = mul_add8(acc, &[*p; 8], vg);
            }
            *grp = acc;
        }
        for (ri, x) in rest.iter_mut().enumerate() {
            let mut acc = *x;
            for (p, v) in pg.iter().zip(values.chunks_exact(hd)) {
                let Some(vv) = runs::<_, LANES>(v).0.get(n * 8 + ri) else {
                    continue;
                };
                acc = mul_add(acc, *p, vv);
            }
            *x = acc;
        }
        let body = hd - tail.len();
        for (p, v) in pg.iter().zip(values.chunks_exact(hd)) {
            for (x, y) in tail.iter_mut().zip(&v[body..]) {
                *x += p * y;
            }
        }
    }
}

/// One sequence's running state for the `gqa` heads of the task's kv head
/// (`q`: their queries, each laid out by [`arrange_query`]).
struct SeqState<'a> {
    q: &'a [f32],
    m: &'a mut [f32],
    l: &'a mut [f32],
    o: &'a mut [f32],
}

/// Fold the first `valid` tokens of the widened `block` into one
/// sequence's state; `scores` holds `gqa x stride` f32, `stride` the
/// block's tokens rounded up to whole `LANES`.
#[inline(always)]
fn fold_block(
    d: &AttentionDims,
    block: &Block<'_>,
    valid: usize,
    st: SeqState<'_>,
    scores: &mut [f32],
) {
    let (hd, gqa, scale) = (d.head_dim, d.gqa_ratio(), d.softmax_scale());
    let stride = scores.len() / gqa.max(1);
    let SeqState { q, m, l, o } = st;
    for (qh, sg) in q.chunks_exact(hd).zip(scores.chunks_exact_mut(stride)) {
        let chunks = block
            .keys
            .chunks_exact(LANES * hd)
            .take(valid.div_ceil(LANES));
        for (kt, out) in chunks.zip(sg.chunks_exact_mut(LANES)) {
            let mut s = [0.0f32; LANES];
            head_dots(qh, kt, &mut s);
            for (x, y) in out.iter_mut().zip(s) {
                *x = y * scale;
            }
        }
    }
    // Online softmax: rescale the old state to the new running max.
    for g in 0..gqa {
        let sg = &mut scores[g * stride..g * stride + valid];
        let blk_max = sg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m_new = m[g].max(blk_max);
        let alpha = (m[g] - m_new).exp();
        let mut sum = 0.0f32;
        for x in sg.iter_mut() {
            *x = (*x - m_new).exp();
            sum += *x;
        }
        l[g] = l[g] * alpha + sum;
        m[g] = m_new;
        if alpha != 1.0 {
            o[g * hd..(g + 1) * hd].iter_mut().for_each(|x| *x *= alpha);
        }
    }
    add_values(
        &mut o[..gqa * hd],
        scores,
        stride,
        &block.values[..valid * hd],
        hd,
    );
}

/// Fold the blocks of the task's sequences into their states, block index
/// by block index, widening each block once for the sequences that share
/// it. The tile was checked by [`check_tile`].
#[inline(always)]
fn fold_group(task: FoldTask<'_>, scratch: &mut Vec<f32>) {
    let FoldTask {
        d,
        tile,
        first,
        kvh,
        q,
        m,
        l,
        o,
    } = task;
    let (hd, bt, gqa) = (d.head_dim, d.block_tokens, d.gqa_ratio());
    let stride = bt.div_ceil(LANES) * LANES;
    let n = m.len() / gqa.max(1);
    let need = stride * hd + bt * hd + gqa * stride + n * gqa * hd;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    let (keys, rest) = scratch.split_at_mut(stride * hd);
    let (values, rest) = rest.split_at_mut(bt * hd);
    let (scores, rest) = rest.split_at_mut(gqa * stride);
    let queries = &mut rest[..n * gqa * hd];
    for (r, qs) in queries.chunks_exact_mut(gqa * hd).enumerate() {
        let q0 = ((first + r) * d.num_q_heads + kvh * gqa) * hd;
        let Some(q) = q.get(q0..q0 + gqa * hd) else {
            continue;
        };
        for (head, out) in q.chunks_exact(hd).zip(qs.chunks_exact_mut(hd)) {
            arrange_query(head, out);
        }
    }
    let mut block = Block { keys, values };
    let seqs = tile.seqs.get(first..first + n).unwrap_or_default();
    let depth = seqs.iter().map(|ts| ts.blocks.len()).max().unwrap_or(0);
    let mut widened = None;
    for i in 0..depth {
        for (r, ts) in seqs.iter().enumerate() {
            let Some(&b) = ts.blocks.get(i) else {
                continue;
            };
            let run = r * gqa * hd..(r + 1) * gqa * hd;
            let (Some(q), Some(o)) = (queries.get(run.clone()), o.get_mut(run)) else {
                continue;
            };
            if widened != Some(b) {
                block.widen(d, tile, b, kvh);
                widened = Some(b);
            }
            let valid = if i + 1 == ts.blocks.len() {
                ts.last_block_tokens
            } else {
                bt
            };
            let (m, l) = (
                &mut m[r * gqa..(r + 1) * gqa],
                &mut l[r * gqa..(r + 1) * gqa],
            );
            fold_block(d, &block, valid, SeqState { q, m, l, o }, scores);
        }
    }
}
