//! The inner loops of the CPU tiled attention: bounds checks of a tile and
//! the online-softmax fold of one (sequence, kv head) task.
//!
//! The fold is `#[inline(always)]` down to its innermost loop, so a
//! [`FoldRunner`] that enables wider vector instructions around
//! [`FoldTask::run`] gets all of it compiled for them. Its arithmetic is
//! plain `+` and `*` in a fixed order (no fused multiply-add, which Rust
//! never forms on its own), so every instruction set gives the same bits.

use super::{AttentionDims, AttentionError, KvTile, TileSeq};

/// Runs the fold of each (sequence, kv head) task of
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

/// One (sequence, kv head) task: its tile, its queries and its disjoint
/// slices of the running state.
pub struct FoldTask<'a> {
    pub(super) d: &'a AttentionDims,
    pub(super) tile: &'a KvTile<'a>,
    pub(super) ts: &'a TileSeq<'a>,
    pub(super) kvh: usize,
    pub(super) qg: &'a [f32],
    pub(super) m: &'a mut [f32],
    pub(super) l: &'a mut [f32],
    pub(super) o: &'a mut [f32],
}

impl FoldTask<'_> {
    /// Fold the task's blocks into its state (the tile was checked).
    #[inline(always)]
    pub fn run(self) {
        fold_seq_head(self);
    }
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
            // The last element a block touches, +1 (full block: conservative
            // for a partial last block).
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

/// BF16 little-endian bytes to f32 (exact).
#[inline(always)]
fn load_row(src: &[u8], dst: &mut [f32]) {
    for (x, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        let bits = u16::from_le_bytes([b[0], b[1]]);
        *x = f32::from_bits(u32::from(bits) << 16);
    }
}

/// Query heads one pass of [`dots`] takes, of the `left` still to score.
#[inline(always)]
fn group_width(left: usize) -> usize {
    match left {
        8.. => 8,
        4..=7 => 4,
        _ => 1,
    }
}

/// The whole 8-value chunks of the `gqa` query heads of `qg` (`gqa x hd`)
/// in the order [`dots`] reads them: per group of [`group_width`] heads,
/// per chunk, the group's heads side by side.
#[inline(always)]
fn arrange_queries(qg: &[f32], hd: usize, out: &mut Vec<f32>) {
    let (body, gqa) = (hd - hd % 8, qg.len() / hd.max(1));
    out.clear();
    let mut g = 0;
    while g < gqa {
        let n = group_width(gqa - g);
        for c in (0..body).step_by(8) {
            for h in g..g + n {
                out.extend_from_slice(&qg[h * hd + c..h * hd + c + 8]);
            }
        }
        g += n;
    }
}

/// `N` dot products of query heads with one key row: `qc` holds their
/// whole chunks (see [`arrange_queries`]), `qg` the heads themselves (for
/// the tail). Each is the dot of 8 independent accumulators over the
/// chunks, summed in lane order, plus a sequential tail: the `N` run side
/// by side so their add chains overlap, but each head sees the same
/// operations in the same order as alone.
#[inline(always)]
fn dots<const N: usize>(qc: &[f32], qg: &[f32], row: &[f32], out: &mut [f32; N]) {
    let (hd, full) = (row.len(), row.len() / 8);
    let qc = &qc[..full * N * 8];
    let mut acc = [[0.0f32; 8]; N];
    for c in 0..full {
        let r = &row[c * 8..c * 8 + 8];
        for (n, a) in acc.iter_mut().enumerate() {
            let at = (c * N + n) * 8;
            let q = &qc[at..at + 8];
            for i in 0..8 {
                a[i] += q[i] * r[i];
            }
        }
    }
    for (n, (a, o)) in acc.iter().zip(out.iter_mut()).enumerate() {
        let mut tail = 0.0f32;
        for i in full * 8..hd {
            tail += qg[n * hd + i] * row[i];
        }
        *o = a.iter().sum::<f32>() + tail;
    }
}

/// Scores of the `qg.len() / row.len()` query heads against one key row,
/// `scores[g * stride] = q_g . row * scale`; `qc` is
/// [`arrange_queries`]' layout of `qg`.
#[inline(always)]
fn head_scores(qc: &[f32], qg: &[f32], row: &[f32], scale: f32, scores: &mut [f32], stride: usize) {
    let (hd, gqa) = (row.len(), qg.len() / row.len().max(1));
    let body = hd - hd % 8;
    let mut g = 0;
    while g < gqa {
        let n = group_width(gqa - g);
        let (qc, qg) = (&qc[g * body..(g + n) * body], &qg[g * hd..]);
        let out = &mut scores[g * stride..];
        match n {
            8 => head_group::<8>(qc, qg, row, scale, out, stride),
            4 => head_group::<4>(qc, qg, row, scale, out, stride),
            _ => head_group::<1>(qc, qg, row, scale, out, stride),
        }
        g += n;
    }
}

/// [`head_scores`] of one group of `N` heads.
#[inline(always)]
fn head_group<const N: usize>(
    qc: &[f32],
    qg: &[f32],
    row: &[f32],
    scale: f32,
    scores: &mut [f32],
    stride: usize,
) {
    let mut s = [0.0f32; N];
    dots(qc, qg, row, &mut s);
    for (n, x) in s.iter().enumerate() {
        scores[n * stride] = x * scale;
    }
}

/// Output columns [`add_values`] keeps in registers at a time.
const COLS: usize = 32;

/// `o_g += p_g[t] * v_t` for each head `g` (`o` is `gqa x hd`, `p`
/// `gqa x stride`) over the tokens `t` of `values` (`valid x hd`) in
/// order: per output value the same sequence of `+=` as one token at a
/// time, with `COLS` columns held in registers across the tokens.
#[inline(always)]
fn add_values(o: &mut [f32], p: &[f32], stride: usize, values: &[f32], hd: usize) {
    let body = hd - hd % COLS;
    for (og, pg) in o.chunks_exact_mut(hd).zip(p.chunks_exact(stride)) {
        let (cols, tail) = og.split_at_mut(body);
        for (j, oc) in cols.chunks_exact_mut(COLS).enumerate() {
            let Ok(oc) = <&mut [f32; COLS]>::try_from(oc) else {
                continue;
            };
            let mut acc = *oc;
            for (p, v) in pg.iter().zip(values.chunks_exact(hd)) {
                let Some(Ok(v)) = v
                    .get(j * COLS..(j + 1) * COLS)
                    .map(<&[f32; COLS]>::try_from)
                else {
                    continue;
                };
                for i in 0..COLS {
                    acc[i] += p * v[i];
                }
            }
            *oc = acc;
        }
        for (p, v) in pg.iter().zip(values.chunks_exact(hd)) {
            for (x, y) in tail.iter_mut().zip(&v[body..]) {
                *x += p * y;
            }
        }
    }
}

/// Fold the blocks of one sequence into the state of the `gqa` query heads
/// of kv head `kvh`: `m`, `l` hold `gqa` entries, `o` holds `gqa * head_dim`,
/// `qg` the queries. The tile was checked by [`check_tile`].
#[inline(always)]
fn fold_seq_head(task: FoldTask<'_>) {
    let FoldTask {
        d,
        tile,
        ts,
        kvh,
        qg,
        m,
        l,
        o,
    } = task;
    let (hd, bt, gqa) = (d.head_dim, d.block_tokens, d.gqa_ratio());
    let scale = d.softmax_scale();
    let s = tile.strides;
    let qg = qg.get(..gqa * hd).unwrap_or_default();
    let mut qc = Vec::with_capacity(qg.len());
    arrange_queries(qg, hd, &mut qc);
    // One block's keys, then its values, as f32 rows.
    let mut rows = vec![0.0f32; bt * hd];
    // scores[g * bt + t]
    let mut scores = vec![0.0f32; gqa * bt];
    let nblocks = ts.blocks.len();
    for (i, &b) in ts.blocks.iter().enumerate() {
        let valid = if i + 1 == nblocks {
            ts.last_block_tokens
        } else {
            bt
        };
        let base = b as usize * s.block + kvh * s.kv_head;
        let rows = &mut rows[..valid * hd];
        for (t, row) in rows.chunks_exact_mut(hd).enumerate() {
            let e = (base + t * s.token) * 2;
            load_row(tile.k.get(e..e + 2 * hd).unwrap_or_default(), row);
            head_scores(&qc, qg, row, scale, &mut scores[t..], bt);
        }
        // Online softmax: rescale the old state to the new running max.
        for g in 0..gqa {
            let sg = &mut scores[g * bt..g * bt + valid];
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
        for (t, row) in rows.chunks_exact_mut(hd).enumerate() {
            let e = (base + t * s.token) * 2;
            load_row(tile.v.get(e..e + 2 * hd).unwrap_or_default(), row);
        }
        add_values(&mut o[..gqa * hd], &scores, bt, rows, hd);
    }
}
