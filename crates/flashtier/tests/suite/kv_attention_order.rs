//! The CPU fold's operation order, pinned bit for bit: against a scalar
//! fold written the plain way (one head, one token at a time), and through
//! a caller's [`FoldRunner`]. Callers rely on these bits: the CPU engine
//! attends a prompt chunk's rows together and a decoded row alone, and both
//! must give the same output.

use std::sync::atomic::{AtomicUsize, Ordering};

use flashtier::kv::attention::{AttentionDims, AttnState, FoldRunner, FoldTask, KvTile, TileSeq};
use flashtier_format::kv::KvStrides;
use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Paged K or V of `blocks` blocks: f32 values exact in BF16, and their bytes.
fn paged(d: &AttentionDims, blocks: usize, rng: &mut SmallRng) -> (Vec<f32>, Vec<u8>) {
    let n = blocks * d.block_tokens * d.num_kv_heads * d.head_dim;
    let vals: Vec<f32> = (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)).to_f32())
        .collect();
    let bytes = vals
        .iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect();
    (vals, bytes)
}

/// 8 lanes over whole chunks of 8, summed in lane order, plus the tail.
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let full = q.len() / 8 * 8;
    let mut acc = [0.0f32; 8];
    for c in (0..full).step_by(8) {
        for i in 0..8 {
            acc[i] += q[c + i] * k[c + i];
        }
    }
    let mut tail = 0.0f32;
    for i in full..q.len() {
        tail += q[i] * k[i];
    }
    acc.iter().sum::<f32>() + tail
}

/// One query head over `tokens` (key, value) rows, block by block: the
/// online softmax as the tier documents it, then `o / l`.
fn fold_one(d: &AttentionDims, q: &[f32], tokens: &[(&[f32], &[f32])]) -> Vec<f32> {
    let (mut m, mut l, mut o) = (f32::NEG_INFINITY, 0.0f32, vec![0.0f32; d.head_dim]);
    for block in tokens.chunks(d.block_tokens) {
        let scores: Vec<f32> = block
            .iter()
            .map(|(k, _)| dot(q, k) * d.softmax_scale())
            .collect();
        let m_new = m.max(scores.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let alpha = (m - m_new).exp();
        let mut sum = 0.0f32;
        let p: Vec<f32> = scores.iter().map(|s| (s - m_new).exp()).collect();
        for x in &p {
            sum += x;
        }
        l = l * alpha + sum;
        m = m_new;
        if alpha != 1.0 {
            o.iter_mut().for_each(|x| *x *= alpha);
        }
        for (pt, (_, v)) in p.iter().zip(block) {
            for (x, y) in o.iter_mut().zip(v.iter()) {
                *x += pt * y;
            }
        }
    }
    let inv = 1.0 / l;
    o.iter().map(|x| x * inv).collect()
}

/// Counts the tasks it runs, and runs them.
struct Counting(AtomicUsize);

impl FoldRunner for Counting {
    fn fold(&self, task: FoldTask<'_>) {
        self.0.fetch_add(1, Ordering::Relaxed);
        task.run();
    }
}

#[test]
fn the_fold_is_the_plain_fold_bit_for_bit_with_any_runner() {
    let mut rng = SmallRng::seed_from_u64(29);
    // GQA 12 scores heads 8 and 4 at a time, GQA 3 one at a time;
    // head_dim 44 leaves a dot tail and output columns past the last 32.
    for (qh, kvh, hd) in [(12, 1, 44), (6, 2, 44), (8, 2, 256)] {
        let d = AttentionDims::new(2, qh, kvh, hd, 16);
        let (nblocks, per_tile) = (5, 3);
        let (kf, kb) = paged(&d, nblocks, &mut rng);
        let (vf, vb) = paged(&d, nblocks, &mut rng);
        let q: Vec<f32> = (0..2 * qh * hd)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        // Sequence 0: blocks 4, 1, 0, 3 with 7 tokens in the last; 1: block 2 full.
        let tables = [(vec![4u32, 1, 0, 3], 7usize), (vec![2u32], 16usize)];
        let strides = KvStrides::paged(&d);
        let (mut plain, mut counted) = (AttnState::new(d).unwrap(), AttnState::new(d).unwrap());
        let runner = Counting(AtomicUsize::new(0));
        plain.begin_step(2).unwrap();
        counted.begin_step(2).unwrap();
        for first in (0..4).step_by(per_tile) {
            let seqs: Vec<TileSeq<'_>> = tables
                .iter()
                .map(|(b, last)| {
                    let end = b.len().min(first + per_tile);
                    TileSeq {
                        blocks: b.get(first..end).unwrap_or_default(),
                        last_block_tokens: if end == b.len() { *last } else { 16 },
                    }
                })
                .collect();
            let tile = KvTile {
                k: &kb,
                v: &vb,
                strides,
                seqs: &seqs,
            };
            plain.step_tile(&q, &tile).unwrap();
            counted.step_tile_on(&q, &tile, &runner).unwrap();
        }
        assert_eq!(
            runner.0.load(Ordering::Relaxed),
            2 * 2 * kvh,
            "one call per task"
        );
        let (mut a, mut b) = (vec![0.0f32; q.len()], vec![0.0f32; q.len()]);
        plain.finalize_f32(&mut a).unwrap();
        counted.finalize_f32(&mut b).unwrap();
        for (seq, (blocks, last)) in tables.iter().enumerate() {
            for h in 0..qh {
                let kv = h / d.gqa_ratio();
                let tokens: Vec<(&[f32], &[f32])> = blocks
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &blk)| {
                        let n = if i + 1 == blocks.len() { *last } else { 16 };
                        (0..n).map(move |t| (blk as usize * 16 + t) * kvh * hd + kv * hd)
                    })
                    .map(|at| (&kf[at..at + hd], &vf[at..at + hd]))
                    .collect();
                let at = (seq * qh + h) * hd;
                let want = fold_one(&d, &q[at..at + hd], &tokens);
                for (i, w) in want.iter().enumerate() {
                    let what = format!("{qh}/{kvh} heads of {hd}: seq {seq} head {h} value {i}");
                    assert_eq!(a[at + i].to_bits(), w.to_bits(), "step_tile, {what}");
                    assert_eq!(b[at + i].to_bits(), w.to_bits(), "step_tile_on, {what}");
                }
            }
        }
    }
}

/// `tables[s]`'s tokens of kv head `kv`: (key, value) rows of `kf`, `vf`.
fn table_tokens<'a>(
    d: &AttentionDims,
    (kf, vf): (&'a [f32], &'a [f32]),
    (blocks, last): (&[u32], usize),
    kv: usize,
) -> Vec<(&'a [f32], &'a [f32])> {
    let (bt, row) = (d.block_tokens, d.num_kv_heads * d.head_dim);
    blocks
        .iter()
        .enumerate()
        .flat_map(|(i, &blk)| {
            let n = if i + 1 == blocks.len() { last } else { bt };
            (0..n).map(move |t| (blk as usize * bt + t) * row + kv * d.head_dim)
        })
        .map(|at| (&kf[at..at + d.head_dim], &vf[at..at + d.head_dim]))
        .collect()
}

#[test]
fn sequences_folded_in_groups_keep_each_ones_plain_fold_bit_for_bit() {
    let mut rng = SmallRng::seed_from_u64(31);
    // GQA 8, 4 and 1; a head width with and without a dot tail and value
    // columns past the last whole 8 vectors of 16.
    for (qh, kvh, hd) in [(16, 2, 256), (8, 2, 44), (3, 3, 20)] {
        // A chunk of 37 rows seeing 6..=42 tokens (rows straddle block
        // boundaries inside a group), then rows of other tables in the same
        // step: a shuffled one, a lone partial block, one block of a tile
        // that ends before the others'.
        let mut tables: Vec<(Vec<u32>, usize)> = (6..=42usize)
            .map(|seen| {
                let n = seen.div_ceil(16);
                ((0..n as u32).collect(), seen - (n - 1) * 16)
            })
            .collect();
        tables.extend([(vec![2, 0, 1], 5), (vec![1], 9), (vec![0], 16)]);
        let d = AttentionDims::new(tables.len(), qh, kvh, hd, 16);
        let (kf, kb) = paged(&d, 3, &mut rng);
        let (vf, vb) = paged(&d, 3, &mut rng);
        let q: Vec<f32> = (0..tables.len() * qh * hd)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let seqs: Vec<TileSeq<'_>> = tables
            .iter()
            .map(|(b, last)| TileSeq {
                blocks: b,
                last_block_tokens: *last,
            })
            .collect();
        let tile = KvTile {
            k: &kb,
            v: &vb,
            strides: KvStrides::paged(&d),
            seqs: &seqs,
        };
        // 1 thread: groups of up to 16 sequences; 5: groups of a few.
        for threads in [1, 5] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut state = AttnState::new(d).unwrap();
            let mut out = vec![0.0f32; q.len()];
            pool.install(|| {
                state.begin_step(tables.len()).unwrap();
                state.step_tile(&q, &tile).unwrap();
                state.finalize_f32(&mut out).unwrap();
            });
            for (seq, (blocks, last)) in tables.iter().enumerate() {
                for h in 0..qh {
                    let kv = h / d.gqa_ratio();
                    let tokens = table_tokens(&d, (&kf, &vf), (blocks, *last), kv);
                    let at = (seq * qh + h) * hd;
                    let want = fold_one(&d, &q[at..at + hd], &tokens);
                    let got: Vec<u32> = out[at..at + hd].iter().map(|x| x.to_bits()).collect();
                    let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(
                        got, want,
                        "{qh}/{kvh} heads of {hd}, {threads} threads: seq {seq} head {h}"
                    );
                }
            }
        }
    }
}
