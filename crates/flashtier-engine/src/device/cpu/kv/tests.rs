use super::*;

fn spec(
    layers: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    precision: KvPrecision,
) -> KvSpec {
    KvSpec {
        layers,
        q_heads,
        kv_heads,
        head_dim,
        capacity,
        precision,
    }
}

/// Plain softmax attention in f64 over exact f32 keys and values.
fn naive(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], qh: usize, kvh: usize, d: usize) -> Vec<f64> {
    let mut out = vec![0f64; qh * d];
    for h in 0..qh {
        let kv = h / (qh / kvh);
        let scores: Vec<f64> = ks
            .iter()
            .map(|k| {
                let dot: f64 = (0..d)
                    .map(|i| f64::from(q[h * d + i]) * f64::from(k[kv * d + i]))
                    .sum();
                dot / (d as f64).sqrt()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        for (p, v) in w.iter().zip(vs) {
            for i in 0..d {
                out[h * d + i] += p / sum * f64::from(v[kv * d + i]);
            }
        }
    }
    out
}

fn value(i: usize, salt: f32) -> f32 {
    ((i as f32 * 0.618 + salt).sin() * 1.7)
        .tan()
        .clamp(-3.0, 3.0)
}

#[test]
fn tiled_attention_matches_f64_in_both_precisions() {
    let (qh, kvh, d) = (4, 2, 8);
    // 37 positions: several blocks, the last one partial, more than one tile of 2 blocks.
    let positions = 37;
    for (precision, tol) in [(KvPrecision::Bf16x2, 2e-5), (KvPrecision::Bf16, 3e-2)] {
        let mut cache = KvCache::new(&spec(2, qh, kvh, d, 64, precision)).unwrap();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for p in 0..positions {
            let k: Vec<f32> = (0..kvh * d).map(|i| value(i + 97 * p, 0.3)).collect();
            let v: Vec<f32> = (0..kvh * d).map(|i| value(i + 89 * p, 1.1)).collect();
            for layer in 0..2 {
                cache.push(layer, &k, &v).unwrap();
            }
            cache.advance(1);
            ks.push(k);
            vs.push(v);
        }
        let q: Vec<f32> = (0..qh * d).map(|i| value(i, 2.0)).collect();
        let mut out = vec![0f32; qh * d];
        cache.attend(1, &q, &mut out).unwrap();
        let want = naive(&q, &ks, &vs, qh, kvh, d);
        let worst = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < tol, "{precision:?}: max error {worst}");
    }
}

#[test]
fn capacity_and_width_limits_are_errors() {
    let mut cache = KvCache::new(&spec(1, 2, 1, 4, 1, KvPrecision::Bf16x2)).unwrap();
    cache.push(0, &[0.0; 4], &[0.0; 4]).unwrap();
    cache.advance(1);
    assert!(matches!(
        cache.push(0, &[0.0; 4], &[0.0; 4]),
        Err(EngineError::ContextFull { len: 2, max: 1 })
    ));
    assert!(matches!(
        cache.attend(0, &[0.0; 3], &mut [0.0; 3]),
        Err(EngineError::Attention(_))
    ));
    assert!(KvCache::new(&spec(1, 2, 1, 256, 8, KvPrecision::Bf16x2)).is_err());
    assert!(KvCache::new(&spec(1, 2, 1, 256, 8, KvPrecision::Bf16)).is_ok());
}

#[test]
fn sizes_a_config_sets_are_capped_before_allocating() {
    let e = KvCache::new(&spec(2, 2, 1, 8, 1_000_000_000_000, KvPrecision::Bf16)).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::TooLarge {
                unit: "positions",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
    let e = KvCache::new(&spec(2, 1 << 40, 1, 8, 16, KvPrecision::Bf16)).unwrap_err();
    assert!(
        matches!(e, EngineError::TooLarge { unit: "values", .. }),
        "{e}"
    );
    let e = KvCache::new(&spec(1 << 40, 2, 1, 8, 16, KvPrecision::Bf16)).unwrap_err();
    assert!(
        matches!(e, EngineError::TooLarge { unit: "layers", .. }),
        "{e}"
    );
    let e = KvCache::new(&spec(2, 2, usize::MAX / 4, 8, 1 << 20, KvPrecision::Bf16)).unwrap_err();
    assert!(e.to_string().contains("more than 2^64"), "{e}");
    assert!(KvCache::new(&spec(2, 2, 1, 8, MAX_POSITIONS, KvPrecision::Bf16)).is_ok());
}

/// Keys, values and queries of `n` positions, row-major.
struct Rows {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
}

fn rows(s: &KvSpec, n: usize) -> Rows {
    let (kw, qw) = (s.kv_heads * s.head_dim, s.q_heads * s.head_dim);
    Rows {
        k: (0..n * kw).map(|i| value(i, 0.3)).collect(),
        v: (0..n * kw).map(|i| value(i, 1.1)).collect(),
        q: (0..n * qw).map(|i| value(i, 2.0)).collect(),
    }
}

/// Feed `x` to a fresh cache of `s` in steps of `chunks` rows, as the
/// device does (push a step's rows into every layer, attend them at once,
/// advance); returns every layer's outputs, `[layer][position]`.
fn attend_in_steps(s: &KvSpec, x: &Rows, chunks: &[usize], isa: Isa) -> Vec<Vec<f32>> {
    let (kw, qw) = (s.kv_heads * s.head_dim, s.q_heads * s.head_dim);
    let mut cache = KvCache::new(s).unwrap();
    cache.isa = isa;
    let mut outs = vec![Vec::new(); s.layers];
    let mut first = 0;
    for &n in chunks {
        for (layer, out) in outs.iter_mut().enumerate() {
            for p in first..first + n {
                let (k, v) = (&x.k[p * kw..(p + 1) * kw], &x.v[p * kw..(p + 1) * kw]);
                cache.push(layer, k, v).unwrap();
            }
            let mut o = vec![0f32; n * qw];
            cache
                .attend(layer, &x.q[first * qw..(first + n) * qw], &mut o)
                .unwrap();
            out.extend(o);
        }
        cache.advance(n);
        first += n;
    }
    outs
}

fn assert_same_bits(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    for (layer, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: layer {layer}");
        let at = a
            .iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits());
        assert_eq!(at, None, "{what}: layer {layer} differs at value {at:?}");
    }
}

#[test]
fn a_chunk_attended_at_once_equals_its_rows_one_at_a_time_bit_for_bit() {
    // 600 positions: two tiles of 32 blocks, steps wider than ROW_GROUP,
    // steps ending inside a block, a partial last block. GQA 12 takes the
    // 8- and 4-head dot groups, GQA 3 the single one; head_dim 10 leaves a
    // dot tail (BF16) or none (BF16 x2, 20 wide).
    let steps = [1, 70, 256, 5, 268];
    let n: usize = steps.iter().sum();
    for (qh, kvh) in [(12, 1), (6, 2)] {
        for precision in [KvPrecision::Bf16x2, KvPrecision::Bf16] {
            let s = spec(2, qh, kvh, 10, n, precision);
            let x = rows(&s, n);
            let alone = attend_in_steps(&s, &x, &vec![1; n], Isa::Scalar);
            for isa in Isa::available() {
                let what = format!("{precision:?} {qh}/{kvh} heads on {}", isa.name());
                let together = attend_in_steps(&s, &x, &steps, isa);
                assert_same_bits(&together, &alone, &what);
            }
        }
    }
}

#[test]
fn a_sliding_window_cache_fills_in_chunks_as_row_by_row_then_is_full() {
    // Mixtral's window is the capacity: a step may end exactly at it.
    let (window, steps) = (40, [17, 23]);
    for precision in [KvPrecision::Bf16x2, KvPrecision::Bf16] {
        let s = spec(1, 8, 2, 16, window, precision);
        let x = rows(&s, window);
        let alone = attend_in_steps(&s, &x, &[1; 40], Isa::current());
        assert_same_bits(
            &attend_in_steps(&s, &x, &steps, Isa::current()),
            &alone,
            &format!("{precision:?}"),
        );
        let mut cache = KvCache::new(&s).unwrap();
        for p in 0..window {
            cache
                .push(0, &x.k[p * 32..(p + 1) * 32], &x.v[p * 32..(p + 1) * 32])
                .unwrap();
        }
        cache.advance(window);
        assert!(matches!(
            cache.push(0, &x.k[..32], &x.v[..32]),
            Err(EngineError::ContextFull { len: 41, max: 40 })
        ));
    }
}

#[test]
fn attending_more_rows_than_pushed_or_none_is_an_error() {
    let mut cache = KvCache::new(&spec(1, 2, 1, 4, 8, KvPrecision::Bf16)).unwrap();
    cache.push(0, &[1.0; 4], &[1.0; 4]).unwrap();
    let mut out = [0.0; 16];
    let e = cache.attend(0, &[0.5; 16], &mut out).unwrap_err();
    assert!(e.to_string().contains("for the 1 positions"), "{e}");
    assert!(cache.attend(0, &[], &mut []).is_err());
    assert!(cache.attend(1, &[0.5; 8], &mut out[..8]).is_err());
    cache.attend(0, &[0.5; 8], &mut out[..8]).unwrap();
    assert!(out[..8].iter().all(|&x| x == 1.0), "{out:?}");
}

#[test]
fn grouped_rows_at_gqa_8_4_and_1_equal_row_by_row_bit_for_bit_on_any_pool() {
    // head_dim 128 stored as BF16 x2 is the benchmark model's 256-wide head.
    // Steps start and end inside blocks, so a task's rows end in different
    // blocks; a 1-thread pool groups up to 16 rows per task, 3 threads fewer.
    let steps = [3, 45, 20];
    let n: usize = steps.iter().sum();
    for (qh, kvh) in [(8, 1), (8, 2), (2, 2)] {
        let s = spec(1, qh, kvh, 128, n, KvPrecision::Bf16x2);
        let x = rows(&s, n);
        let alone = attend_in_steps(&s, &x, &vec![1; n], Isa::Scalar);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for isa in Isa::available() {
                let together = pool.install(|| attend_in_steps(&s, &x, &steps, isa));
                let what = format!("{qh}/{kvh} heads, {threads} threads, {}", isa.name());
                assert_same_bits(&together, &alone, &what);
            }
        }
    }
}
