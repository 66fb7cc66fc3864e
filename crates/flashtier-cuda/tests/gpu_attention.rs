//! GPU decode attention against the CPU reference (`flashtier::kv::attention`,
//! same tiles, same contract) and a float64 reference, on random shapes (both
//! layouts, GQA ratios 1..32, partial last blocks, several tiles per step).
//! Bound: max |gpu - ref| <= 2e-2 on the BF16 output. Skips without a GPU.

mod common;

use common::{bf16, f32_of, gpu_or_skip};
use flashtier::kv::attention::{AttentionDims, AttnState, KvTile, TileSeq};
use flashtier_cuda::{AttnDims, DecodeAttention, Gpu};
use flashtier_format::kv::KvStrides;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const BOUND: f64 = 2e-2;

struct Case {
    lens: Vec<usize>,
    nq: usize,
    nkv: usize,
    d: usize,
    bs: usize,
    tile_capacity: usize,
    slot_layout: bool,
    q_amp: f32,
}

/// Host copy of a problem: q, pools, block lists per sequence.
struct Problem {
    q: Vec<u16>,
    k: Vec<u16>,
    v: Vec<u16>,
    seq_blocks: Vec<Vec<u32>>,
    layout: KvStrides,
    dims: AttnDims,
}

fn make_problem(c: &Case, rng: &mut StdRng) -> Problem {
    let dims = AttnDims {
        max_seqs: c.lens.len(),
        num_q_heads: c.nq,
        num_kv_heads: c.nkv,
        head_dim: c.d,
        block_size: c.bs,
        tile_capacity: c.tile_capacity,
    };
    let layout = if c.slot_layout {
        KvStrides::slot(&dims)
    } else {
        KvStrides::paged(&dims)
    };
    let per_seq: Vec<usize> = c.lens.iter().map(|l| l.div_ceil(c.bs)).collect();
    let total_blocks = per_seq.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
    ids.shuffle(rng);
    let mut next = ids.into_iter();
    let seq_blocks = per_seq
        .iter()
        .map(|&n| next.by_ref().take(n).collect())
        .collect();
    let pool_len = layout
        .block_end(&dims, total_blocks - 1)
        .expect("pool size");
    let mut rand_vec = |n: usize, amp: f32| -> Vec<u16> {
        (0..n)
            .map(|_| bf16((rng.random::<f32>() * 2.0 - 1.0) * amp))
            .collect()
    };
    let q = rand_vec(c.lens.len() * c.nq * c.d, c.q_amp);
    // In the slot layout K and V share one allocation (V after K's stripe);
    // separate pools with the same strides hold the same geometry.
    let k = rand_vec(pool_len, 1.0);
    let v = rand_vec(pool_len, 1.0);
    Problem {
        q,
        k,
        v,
        seq_blocks,
        layout,
        dims,
    }
}

fn reference(p: &Problem, lens: &[usize]) -> Vec<f64> {
    let d = &p.dims;
    let group = d.group();
    let scale = 1.0 / (d.head_dim as f64).sqrt();
    let mut out = vec![0.0f64; lens.len() * d.num_q_heads * d.head_dim];
    for (s, &len) in lens.iter().enumerate() {
        for h in 0..d.num_q_heads {
            let kvh = h / group;
            let qrow = &p.q[(s * d.num_q_heads + h) * d.head_dim..][..d.head_dim];
            let addr = |t: usize| {
                let b = p.seq_blocks[s][t / d.block_size] as usize;
                b * p.layout.block + (t % d.block_size) * p.layout.token + kvh * p.layout.kv_head
            };
            let scores: Vec<f64> = (0..len)
                .map(|t| {
                    let a = addr(t);
                    (0..d.head_dim)
                        .map(|i| f64::from(f32_of(qrow[i])) * f64::from(f32_of(p.k[a + i])))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = w.iter().sum();
            let o = &mut out[(s * d.num_q_heads + h) * d.head_dim..][..d.head_dim];
            for (t, wt) in w.iter().enumerate() {
                let a = addr(t);
                for (i, oi) in o.iter_mut().enumerate() {
                    *oi += wt / l * f64::from(f32_of(p.v[a + i]));
                }
            }
        }
    }
    out
}

/// The tiles of a step: per tile, per sequence, its blocks and the filled
/// tokens of its last block.
fn tiles(p: &Problem, lens: &[usize]) -> Vec<Vec<(Vec<u32>, usize)>> {
    let d = p.dims;
    let n = p
        .seq_blocks
        .iter()
        .map(|b| b.len().div_ceil(d.tile_capacity))
        .max()
        .unwrap_or(0);
    (0..n)
        .map(|tix| {
            p.seq_blocks
                .iter()
                .zip(lens)
                .map(|(sb, &len)| {
                    let lo = (tix * d.tile_capacity).min(sb.len());
                    let hi = ((tix + 1) * d.tile_capacity).min(sb.len());
                    let ends = hi == sb.len() && len % d.block_size != 0;
                    (
                        sb[lo..hi].to_vec(),
                        if ends {
                            len % d.block_size
                        } else {
                            d.block_size
                        },
                    )
                })
                .collect()
        })
        .collect()
}

/// The CPU reference of `flashtier::kv` over the same tiles.
fn cpu_reference(p: &Problem, lens: &[usize]) -> Vec<f32> {
    let d = p.dims;
    let dims = AttentionDims::new(
        lens.len(),
        d.num_q_heads,
        d.num_kv_heads,
        d.head_dim,
        d.block_size,
    );
    let strides = p.layout;
    let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (k, v) = (bytes(&p.k), bytes(&p.v));
    let q: Vec<f32> = p.q.iter().map(|&b| f32_of(b)).collect();
    let mut state = AttnState::new(dims).expect("cpu state");
    state.begin_step(lens.len()).expect("cpu begin");
    for tile in tiles(p, lens) {
        let seqs: Vec<TileSeq<'_>> = tile
            .iter()
            .map(|(b, last)| TileSeq {
                blocks: b,
                last_block_tokens: *last,
            })
            .collect();
        state
            .step_tile(
                &q,
                &KvTile {
                    k: &k,
                    v: &v,
                    strides,
                    seqs: &seqs,
                },
            )
            .expect("cpu step_tile");
    }
    let mut out = vec![half::bf16::ZERO; q.len()];
    state.finalize(&mut out).expect("cpu finalize");
    out.iter().map(|x| x.to_f32()).collect()
}

/// Run one decode step on the GPU, cutting each sequence into tiles of at
/// most `tile_capacity` blocks.
fn run_gpu(
    gpu: &Gpu,
    attn: &mut DecodeAttention,
    p: &Problem,
    lens: &[usize],
    fused: bool,
) -> Vec<u16> {
    let d = p.dims;
    let s = gpu.stream();
    let q = s.clone_htod(&p.q).expect("upload q");
    let k = s.clone_htod(&p.k).expect("upload k");
    let v = s.clone_htod(&p.v).expect("upload v");
    let mut out = s.alloc_zeros::<u16>(p.q.len()).expect("alloc out");
    // Poison the output so unwritten elements show.
    s.memcpy_htod(&vec![0x7FC0u16; p.q.len()], &mut out)
        .expect("poison");
    attn.begin_step(lens.len()).expect("begin_step");
    let tiles = p
        .seq_blocks
        .iter()
        .map(|b| b.len().div_ceil(d.tile_capacity))
        .max()
        .unwrap_or(0);
    for tix in 0..tiles {
        let mut blocks: Vec<&[u32]> = Vec::new();
        let mut last = Vec::new();
        for (sb, &len) in p.seq_blocks.iter().zip(lens) {
            let lo = (tix * d.tile_capacity).min(sb.len());
            let hi = ((tix + 1) * d.tile_capacity).min(sb.len());
            blocks.push(&sb[lo..hi]);
            let ends_seq = hi == sb.len();
            last.push(if ends_seq && len % d.block_size != 0 {
                len % d.block_size
            } else {
                d.block_size
            });
        }
        let table = attn.tile_table(&blocks, &last).expect("tile table");
        if fused && tix + 1 == tiles {
            attn.step_tile_final(&q, &k, &v, p.layout, &table, &mut out)
                .expect("step_tile_final");
        } else {
            attn.step_tile(&q, &k, &v, p.layout, &table)
                .expect("step_tile");
        }
    }
    if !(fused && tiles > 0) {
        attn.finalize(&mut out).expect("finalize");
    }
    s.clone_dtoh(&out).expect("download")
}

fn check_case(gpu: &Gpu, c: &Case, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let p = make_problem(c, &mut rng);
    let mut attn = DecodeAttention::new(gpu, p.dims).expect("compile attention");
    for step in 0..2 {
        let p = if step == 0 {
            Problem {
                q: p.q.clone(),
                k: p.k.clone(),
                v: p.v.clone(),
                seq_blocks: p.seq_blocks.clone(),
                ..p
            }
        } else {
            make_problem(c, &mut rng)
        };
        let got = run_gpu(gpu, &mut attn, &p, &c.lens, step == 1);
        let want = reference(&p, &c.lens);
        let cpu = cpu_reference(&p, &c.lens);
        let (mut max_err, mut max_err_cpu) = (0.0f64, 0.0f64);
        for (i, ((&g, &w), &r)) in got.iter().zip(&want).zip(&cpu).enumerate() {
            let g = f64::from(f32_of(g));
            assert!(
                g.is_finite(),
                "seed {seed} step {step}: output {i} is {g} (unwritten or NaN)"
            );
            max_err = max_err.max((g - w).abs());
            max_err_cpu = max_err_cpu.max((g - f64::from(r)).abs());
        }
        assert!(
            max_err_cpu <= BOUND,
            "seed {seed}: max abs err vs the CPU reference {max_err_cpu} > {BOUND}"
        );
        eprintln!(
            "seed {seed} step {step} (fused final {}): lens {:?} nq {} nkv {} d {} bs {} slot {} -> max abs err {max_err:.2e} (f64), {max_err_cpu:.2e} (CPU reference)",
            step == 1,
            c.lens,
            c.nq,
            c.nkv,
            c.d,
            c.bs,
            c.slot_layout
        );
        assert!(
            max_err <= BOUND,
            "seed {seed}: max abs err {max_err} > {BOUND}"
        );
    }
}

#[test]
fn attention_matches_reference_on_random_shapes() {
    let Some(gpu) = gpu_or_skip("attention_matches_reference_on_random_shapes") else {
        return;
    };
    let case = |lens: &[usize], nq, nkv, d, bs, cap, slot, amp| Case {
        lens: lens.to_vec(),
        nq,
        nkv,
        d,
        bs,
        tile_capacity: cap,
        slot_layout: slot,
        q_amp: amp,
    };
    let cases = [
        case(&[1000], 8, 1, 128, 16, 64, false, 1.0),
        case(&[1, 17, 300], 32, 4, 128, 16, 4, true, 2.0),
        case(&[50, 129], 16, 16, 64, 7, 5, false, 1.0),
        case(&[700, 33], 32, 1, 256, 32, 8, false, 1.0),
        case(&[77, 5, 260, 1024], 12, 4, 80, 16, 16, true, 4.0),
        case(&[40], 4, 2, 16, 16, 1, false, 1.0),
        case(&[3000, 2500], 32, 4, 128, 64, 64, false, 1.0),
    ];
    let base: u64 = std::env::var("FT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    for (i, c) in cases.iter().enumerate() {
        check_case(&gpu, c, base + i as u64);
    }
}

#[test]
fn finalize_without_tiles_writes_zeros() {
    let Some(gpu) = gpu_or_skip("finalize_without_tiles_writes_zeros") else {
        return;
    };
    let dims = AttnDims {
        max_seqs: 2,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        tile_capacity: 4,
    };
    let mut attn = DecodeAttention::new(&gpu, dims).expect("compile");
    let mut out = gpu
        .stream()
        .clone_htod(&vec![0x3F80u16; 2 * 8 * 64])
        .expect("upload");
    attn.begin_step(2).expect("begin");
    attn.finalize(&mut out).expect("finalize");
    let host = gpu.stream().clone_dtoh(&out).expect("download");
    assert!(host.iter().all(|&b| b == 0));
}

#[test]
fn bad_tiles_are_rejected() {
    let Some(gpu) = gpu_or_skip("bad_tiles_are_rejected") else {
        return;
    };
    let dims = AttnDims {
        max_seqs: 1,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        tile_capacity: 2,
    };
    let mut attn = DecodeAttention::new(&gpu, dims).expect("compile");
    assert!(
        attn.tile_table(&[&[0, 1, 2]], &[16]).is_err(),
        "over capacity"
    );
    assert!(
        attn.tile_table(&[&[0]], &[17]).is_err(),
        "last slots > block size"
    );
    assert!(attn.tile_table(&[&[0]], &[0]).is_err(), "last slots 0");
    let s = gpu.stream();
    let q = s.alloc_zeros::<u16>(8 * 64).expect("q");
    let small = s.alloc_zeros::<u16>(16 * 2 * 64).expect("pool");
    let table = attn.tile_table(&[&[5]], &[16]).expect("table");
    attn.begin_step(1).expect("begin");
    let err = attn.step_tile(&q, &small, &small, KvStrides::paged(&dims), &table);
    assert!(err.is_err(), "block 5 lies outside a 1-block pool");
}
