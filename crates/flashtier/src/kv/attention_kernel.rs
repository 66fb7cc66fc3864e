//! The inner loops of the CPU tiled attention: bounds checks of a tile and
//! the online-softmax fold of one (sequence, kv head) task.

use super::{AttentionDims, AttentionError, KvTile, MAX_HEAD_DIM, TileSeq};

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
#[inline]
fn load_row(src: &[u8], dst: &mut [f32]) {
    for (x, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        let bits = u16::from_le_bytes([b[0], b[1]]);
        *x = f32::from_bits(u32::from(bits) << 16);
    }
}

/// Dot product with 8 independent accumulators (vectorises).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

/// Fold the blocks of one sequence into the state of the `gqa` query heads
/// of kv head `kvh`: `m`, `l` hold `gqa` entries, `o` holds `gqa * head_dim`,
/// `qg` the queries. The tile was checked by [`check_tile`].
#[expect(
    clippy::too_many_arguments,
    reason = "one task's disjoint state slices"
)]
pub(super) fn fold_seq_head(
    d: &AttentionDims,
    tile: &KvTile<'_>,
    ts: &TileSeq<'_>,
    kvh: usize,
    qg: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
) {
    let (hd, bt, gqa) = (d.head_dim, d.block_tokens, d.gqa_ratio());
    let scale = d.softmax_scale();
    let s = tile.strides;
    let mut row = [0.0f32; MAX_HEAD_DIM];
    let row = &mut row[..hd];
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
        for t in 0..valid {
            let e = (base + t * s.token) * 2;
            load_row(tile.k.get(e..e + 2 * hd).unwrap_or_default(), row);
            for g in 0..gqa {
                scores[g * bt + t] = dot(&qg[g * hd..(g + 1) * hd], row) * scale;
            }
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
        for t in 0..valid {
            let e = (base + t * s.token) * 2;
            load_row(tile.v.get(e..e + 2 * hd).unwrap_or_default(), row);
            for g in 0..gqa {
                let p = scores[g * bt + t];
                let og = &mut o[g * hd..(g + 1) * hd];
                for (x, v) in og.iter_mut().zip(row.iter()) {
                    *x += p * v;
                }
            }
        }
    }
}
