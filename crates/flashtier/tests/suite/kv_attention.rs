//! Tiled decode attention against a naive two-pass softmax in f64.
//!
//! Error bound (f32 state, checked per output element):
//!   |out - ref| <= max|V| * (2 * delta_s + 4 * n * eps) + 1e-6
//! where eps = 2^-24 (f32 unit roundoff), n is the tokens attended, and
//! delta_s = 2 * head_dim * eps * scale * max_t sum_i |q_i k_ti| bounds the
//! f32 error of one score; a score perturbation of delta moves each softmax
//! weight by a factor within e^(+-2 delta), hence the 2 * delta_s term, and
//! the sums of positive terms add at most n * eps relative each. BF16 output
//! adds its rounding, at most 2^-8 |ref| (plus the same bound).

use flashtier::kv::attention::{
    AttentionDims, AttentionError, AttnState, KvTile, MAX_HEAD_DIM, TileSeq, attend_one,
};
use flashtier_format::kv::KvStrides;
use half::bf16;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const EPS: f64 = 1.0 / 16_777_216.0;

/// KV of `nblocks` blocks in the paged layout plus the same values in the
/// slot layout; `vals[b][t][h][d]` as f32 (exactly representable in BF16).
struct Kv {
    dims: AttentionDims,
    k: Vec<Vec<Vec<Vec<f32>>>>,
    v: Vec<Vec<Vec<Vec<f32>>>>,
}

fn put(buf: &mut [u8], elem: usize, x: f32) {
    buf[elem * 2..elem * 2 + 2].copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
}

impl Kv {
    fn random(dims: AttentionDims, nblocks: usize, rng: &mut SmallRng) -> Self {
        let mut make = || {
            (0..nblocks)
                .map(|_| {
                    (0..dims.block_tokens)
                        .map(|_| {
                            (0..dims.num_kv_heads)
                                .map(|_| {
                                    (0..dims.head_dim)
                                        .map(|_| {
                                            bf16::from_f32(rng.random_range(-2.0..2.0)).to_f32()
                                        })
                                        .collect()
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect()
        };
        let k = make();
        let v = make();
        Self { dims, k, v }
    }

    fn encode(&self, s: KvStrides, v_offset: usize) -> (Vec<u8>, Vec<u8>) {
        let d = self.dims;
        let n = self.k.len();
        let elems = n * s.block + v_offset;
        let (mut kb, mut vb) = (vec![0u8; elems * 2], vec![0u8; elems * 2]);
        for b in 0..n {
            for t in 0..d.block_tokens {
                for h in 0..d.num_kv_heads {
                    for i in 0..d.head_dim {
                        let e = b * s.block + t * s.token + h * s.kv_head + i;
                        put(&mut kb, e, self.k[b][t][h][i]);
                        put(&mut vb, e + v_offset, self.v[b][t][h][i]);
                    }
                }
            }
        }
        (kb, vb)
    }

    /// (reference output, bound) per element of [seq, head, dim] for block
    /// tables `tables` (seq -> (blocks, last_block_tokens)).
    fn reference(&self, q: &[f32], tables: &[(Vec<u32>, usize)]) -> (Vec<f64>, Vec<f64>) {
        let d = self.dims;
        let (hd, nq) = (d.head_dim, d.num_q_heads);
        let scale = f64::from(d.softmax_scale());
        let mut out = Vec::new();
        let mut bound = Vec::new();
        for (seq, (blocks, last)) in tables.iter().enumerate() {
            for h in 0..nq {
                let kvh = h / d.gqa_ratio();
                let qh = &q[(seq * nq + h) * hd..(seq * nq + h + 1) * hd];
                let mut toks = Vec::new();
                for (i, &b) in blocks.iter().enumerate() {
                    let valid = if i + 1 == blocks.len() {
                        *last
                    } else {
                        d.block_tokens
                    };
                    for t in 0..valid {
                        toks.push((b as usize, t));
                    }
                }
                let scores: Vec<f64> = toks
                    .iter()
                    .map(|&(b, t)| {
                        qh.iter()
                            .zip(&self.k[b][t][kvh])
                            .map(|(x, y)| f64::from(*x) * f64::from(*y))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let abs_dot = toks
                    .iter()
                    .map(|&(b, t)| {
                        qh.iter()
                            .zip(&self.k[b][t][kvh])
                            .map(|(x, y)| f64::from(x.abs()) * f64::from(y.abs()))
                            .sum::<f64>()
                    })
                    .fold(0.0, f64::max);
                let max_v = toks
                    .iter()
                    .flat_map(|&(b, t)| self.v[b][t][kvh].iter())
                    .fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = p.iter().sum();
                let delta_s = 2.0 * hd as f64 * EPS * scale * abs_dot;
                let b = max_v * (2.0 * delta_s + 4.0 * toks.len() as f64 * EPS) + 1e-6;
                for i in 0..hd {
                    let o: f64 = toks
                        .iter()
                        .zip(&p)
                        .map(|(&(bk, t), pw)| pw * f64::from(self.v[bk][t][kvh][i]))
                        .sum();
                    out.push(o / l);
                    bound.push(b);
                }
            }
        }
        (out, bound)
    }
}

fn random_q(n: usize, rng: &mut SmallRng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn check(got: &[f32], want: &[f64], bound: &[f64], extra_rel: f64) {
    for (i, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (f64::from(*g) - w).abs();
        assert!(
            err <= b + extra_rel * w.abs(),
            "element {i}: got {g}, want {w}, err {err:e} > bound {b:e}"
        );
    }
}

fn layouts(d: &AttentionDims) -> [(KvStrides, usize); 2] {
    let slot = KvStrides::slot(d);
    [
        (KvStrides::paged(d), 0),
        (slot, slot.slot_v_offset(d.num_kv_heads)),
    ]
}

/// One step over `tiles` (each: per-seq block lists) in the given layout.
fn run(
    kv: &Kv,
    q: &[f32],
    seq_tiles: &[Vec<(Vec<u32>, usize)>],
    s: KvStrides,
    v_off: usize,
) -> AttnState {
    let (kb, vb) = kv.encode(s, v_off);
    let num_seqs = seq_tiles[0].len();
    let mut st = AttnState::new(kv.dims).expect("dims");
    st.begin_step(num_seqs).expect("seqs");
    for tile in seq_tiles {
        let seqs: Vec<TileSeq<'_>> = tile
            .iter()
            .map(|(b, l)| TileSeq {
                blocks: b,
                last_block_tokens: *l,
            })
            .collect();
        let t = KvTile {
            k: &kb,
            v: &vb[v_off * 2..],
            strides: s,
            seqs: &seqs,
        };
        st.step_tile(q, &t).expect("tile");
    }
    st
}

#[test]
fn matches_f64_reference_in_both_layouts_with_gqa_and_partial_blocks() {
    let mut rng = SmallRng::seed_from_u64(11);
    let d = AttentionDims::new(3, 8, 2, 64, 16);
    let kv = Kv::random(d, 9, &mut rng);
    let q = random_q(2 * 8 * 64, &mut rng);
    // Two sequences; tiles of blocks; partly filled last blocks.
    let tables = vec![(vec![4u32, 0, 7, 2], 5usize), (vec![1u32, 8, 3], 16usize)];
    let tiles = vec![
        vec![(vec![4u32, 0], 16usize), (vec![1u32], 16usize)],
        vec![(vec![7u32, 2], 5usize), (vec![8u32, 3], 16usize)],
    ];
    let (want, bound) = kv.reference(&q, &tables);
    let mut first: Option<Vec<f32>> = None;
    for (s, v_off) in layouts(&d) {
        let st = run(&kv, &q, &tiles, s, v_off);
        let mut out = vec![0.0f32; want.len()];
        st.finalize_f32(&mut out).expect("finalize");
        check(&out, &want, &bound, 0.0);
        let mut out16 = vec![bf16::ZERO; want.len()];
        st.finalize(&mut out16).expect("finalize");
        let as32: Vec<f32> = out16.iter().map(|x| x.to_f32()).collect();
        check(&as32, &want, &bound, 1.0 / 256.0);
        // Both layouts do the same arithmetic: bit-identical results.
        match &first {
            None => first = Some(out),
            Some(f) => assert!(f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits())),
        }
    }
}

#[test]
fn attend_one_is_the_engine_entry_point() {
    let mut rng = SmallRng::seed_from_u64(3);
    let d = AttentionDims::new(1, 4, 4, MAX_HEAD_DIM, 8);
    let kv = Kv::random(d, 3, &mut rng);
    let q = random_q(4 * MAX_HEAD_DIM, &mut rng);
    let (want, bound) = kv.reference(&q, &[(vec![2, 1, 0], 3)]);
    let s = KvStrides::paged(&d);
    let (kb, vb) = kv.encode(s, 0);
    let (a, b) = (
        [TileSeq {
            blocks: &[2, 1],
            last_block_tokens: 8,
        }],
        [TileSeq {
            blocks: &[0],
            last_block_tokens: 3,
        }],
    );
    let tiles = [
        KvTile {
            k: &kb,
            v: &vb,
            strides: s,
            seqs: &a,
        },
        KvTile {
            k: &kb,
            v: &vb,
            strides: s,
            seqs: &b,
        },
    ];
    let mut st = AttnState::new(d).expect("dims");
    let mut out = vec![bf16::ZERO; 4 * MAX_HEAD_DIM];
    attend_one(&mut st, &q, &tiles, &mut out).expect("attend");
    let as32: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
    check(&as32, &want, &bound, 1.0 / 256.0);
}

#[test]
fn invalid_dimensions_are_typed_errors() {
    let e = AttnState::new(AttentionDims::new(1, 6, 4, 64, 16)).expect_err("gqa");
    assert_eq!(
        e,
        AttentionError::HeadsNotDivisible {
            num_q_heads: 6,
            num_kv_heads: 4
        }
    );
    let e = AttnState::new(AttentionDims::new(1, 4, 4, 257, 16)).expect_err("dim");
    assert_eq!(e, AttentionError::HeadDimTooLarge { head_dim: 257 });
    let e = AttnState::new(AttentionDims::new(1, 4, 0, 64, 16)).expect_err("zero");
    assert_eq!(
        e,
        AttentionError::Zero {
            field: "num_kv_heads"
        }
    );
    let d = AttentionDims::new(2, 4, 2, 16, 4);
    let mut st = AttnState::new(d).expect("dims");
    assert_eq!(
        st.begin_step(3),
        Err(AttentionError::TooManySeqs {
            num_seqs: 3,
            max_seqs: 2
        })
    );
    st.begin_step(1).expect("one");
    let s = KvStrides::paged(&d);
    let kv = vec![0u8; 2 * s.block * 2];
    let q = vec![0.0f32; 4 * 16];
    let tile = |blocks: &'static [u32], last| {
        [TileSeq {
            blocks,
            last_block_tokens: last,
        }]
    };
    let seqs = tile(&[2], 4);
    let t = KvTile {
        k: &kv,
        v: &kv,
        strides: s,
        seqs: &seqs,
    };
    assert!(matches!(
        st.step_tile(&q, &t),
        Err(AttentionError::OutOfBounds { block: 2, .. })
    ));
    let seqs = tile(&[1], 5);
    let t = KvTile {
        k: &kv,
        v: &kv,
        strides: s,
        seqs: &seqs,
    };
    assert!(matches!(
        st.step_tile(&q, &t),
        Err(AttentionError::LastBlockTokens { got: 5, .. })
    ));
    let seqs = tile(&[1], 0);
    let t = KvTile {
        k: &kv,
        v: &kv,
        strides: s,
        seqs: &seqs,
    };
    assert!(matches!(
        st.step_tile(&q, &t),
        Err(AttentionError::LastBlockTokens { got: 0, .. })
    ));
    let seqs = tile(&[1], 4);
    let t = KvTile {
        k: &kv,
        v: &kv,
        strides: s,
        seqs: &seqs,
    };
    assert!(matches!(
        st.step_tile(&q[1..], &t),
        Err(AttentionError::BadLength { what: "q", .. })
    ));
    let mut out = vec![bf16::ZERO; 64];
    assert_eq!(
        st.finalize(&mut out),
        Err(AttentionError::NoTokens { seq: 0, head: 0 })
    );
    st.step_tile(&q, &t).expect("valid tile");
    st.finalize(&mut out).expect("now it has tokens");
    assert!(matches!(
        st.finalize(&mut out[1..]),
        Err(AttentionError::BadLength { .. })
    ));
    let other = AttnState::new(AttentionDims::new(2, 4, 2, 16, 8)).expect("dims");
    assert_eq!(st.merge(&other), Err(AttentionError::MergeMismatch));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Split one step's blocks into tiles, fold each tile into its own state,
    /// merge the states in any order: same answer as the reference.
    #[test]
    fn merges_in_any_order(seed in any::<u64>(), nkv in 1usize..3, gqa in 1usize..4, dim in prop::sample::select(vec![8usize, 40, 128]),
                           nblocks in 1usize..7, last in 1usize..9, ntiles in 1usize..4, order_seed in any::<u64>()) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let d = AttentionDims::new(1, nkv * gqa, nkv, dim, 8);
        let kv = Kv::random(d, nblocks, &mut rng);
        let q = random_q(d.num_q_heads * dim, &mut rng);
        let mut blocks: Vec<u32> = (0..nblocks as u32).collect();
        for i in (1..blocks.len()).rev() { blocks.swap(i, rng.random_range(0..=i)); }
        let (want, bound) = kv.reference(&q, &[(blocks.clone(), last)]);
        // Contiguous pieces; only the final piece carries the partial block.
        let mut cuts: Vec<usize> = (0..ntiles.saturating_sub(1)).map(|_| rng.random_range(0..=nblocks)).collect();
        cuts.push(0); cuts.push(nblocks); cuts.sort_unstable();
        let (s, v_off) = layouts(&d)[seed as usize % 2];
        let mut states: Vec<AttnState> = cuts.windows(2).filter(|w| w[1] > w[0]).map(|w| {
            let l = if w[1] == nblocks { last } else { 8 };
            run(&kv, &q, &[vec![(blocks[w[0]..w[1]].to_vec(), l)]], s, v_off)
        }).collect();
        let mut orng = SmallRng::seed_from_u64(order_seed);
        for i in (1..states.len()).rev() { states.swap(i, orng.random_range(0..=i)); }
        let mut acc = states.pop().expect("at least one tile");
        while let Some(next) = states.pop() { acc.merge(&next).expect("same shape"); }
        let mut out = vec![0.0f32; want.len()];
        acc.finalize_f32(&mut out).expect("finalize");
        for (i, ((g, w), b)) in out.iter().zip(&want).zip(&bound).enumerate() {
            // Each of the (at most 2) merges rescales o and l once more: at
            // most 4 eps relative per merge on top of the fold's bound.
            let merge_slack = 2.0 * 4.0 * EPS * w.abs().max(1.0);
            let err = (f64::from(*g) - w).abs();
            prop_assert!(err <= b + merge_slack, "element {} err {:e} bound {:e}", i, err, b);
        }
    }
}
