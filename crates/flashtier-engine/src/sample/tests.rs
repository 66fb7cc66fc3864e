//! The sampler against the distributions it must draw from: chi-square
//! goodness of fit (fixed seeds, so each verdict is fixed; thresholds at
//! p = 0.001), a Kolmogorov-Smirnov distance on a large vocabulary, the
//! filters against a brute-force reference (proptest, ties included), the
//! penalties by hand, greedy ties, seeds, logprobs and every range check.
#![allow(clippy::unwrap_used, reason = "tests")]

use proptest::prelude::*;

use super::*;

fn softmax(z: &[f32], t: f64) -> Vec<f64> {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = z.iter().map(|&v| ((v as f64 - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

fn params(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        seed: Some(7),
        ..SamplingParams::greedy()
    }
}

fn counts(p: SamplingParams, z: &[f32], draws: usize) -> Vec<usize> {
    let mut s = Sampler::new(p, z.len(), &[]).unwrap();
    let mut c = vec![0; z.len()];
    for _ in 0..draws {
        c[s.pick(z).unwrap().token as usize] += 1;
    }
    c
}

/// Pearson's statistic over the cells with expected mass; a draw in a cell
/// of zero mass fails at once.
fn chi_square(c: &[usize], p: &[f64]) -> (f64, usize) {
    let n: usize = c.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0;
    for (&o, &q) in c.iter().zip(p) {
        if q == 0.0 {
            assert_eq!(o, 0, "a draw of a token with no mass");
            continue;
        }
        let e = q * n as f64;
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    (stat, cells - 1)
}

/// Chi-square critical values at p = 0.001, by degrees of freedom.
fn critical(df: usize) -> f64 {
    [
        0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59,
    ][df]
}

const Z: [f32; 8] = [1.5, 0.2, -0.7, 2.1, 2.1, -3.0, 0.9, 0.0];

fn assert_fits(c: &[usize], want: &[f64], what: &str) {
    let (stat, df) = chi_square(c, want);
    assert!(
        stat < critical(df),
        "{what}: chi-square {stat:.2} with {df} df (critical {})",
        critical(df)
    );
}

#[test]
fn temperature_one_draws_the_softmax() {
    let c = counts(params(1.0), &Z, 40_000);
    assert_fits(&c, &softmax(&Z, 1.0), "t=1");
}

#[test]
fn temperature_scales_the_logits() {
    for t in [0.3f32, 0.7, 2.5] {
        let c = counts(params(t), &Z, 40_000);
        assert_fits(&c, &softmax(&Z, f64::from(t)), &format!("t={t}"));
    }
}

fn renormalised(p: &[f64], keep: &[usize]) -> Vec<f64> {
    let s: f64 = keep.iter().map(|&i| p[i]).sum();
    (0..p.len())
        .map(|i| if keep.contains(&i) { p[i] / s } else { 0.0 })
        .collect()
}

#[test]
fn top_k_keeps_the_k_most_likely_ties_to_the_lower_index() {
    // 3 and 4 tie at the top; k = 3 keeps 3, 4 and 0.
    let p = SamplingParams {
        top_k: 3,
        ..params(1.0)
    };
    let c = counts(p, &Z, 30_000);
    let want = renormalised(&softmax(&Z, 1.0), &[3, 4, 0]);
    assert_fits(&c, &want, "top_k=3");
    // k = 1 at a tie is the greedy token.
    let p = SamplingParams {
        top_k: 1,
        ..params(1.0)
    };
    assert_eq!(counts(p, &Z, 200)[3], 200);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let sm = softmax(&Z, 1.0);
    // Sorted: 3, 4 (0.311 each), 0 (0.169), 6 (0.092), ...
    let p = SamplingParams {
        top_p: 0.7,
        ..params(1.0)
    };
    let c = counts(p, &Z, 30_000);
    assert!(sm[3] + sm[4] < 0.7 && sm[3] + sm[4] + sm[0] >= 0.7);
    assert_fits(&c, &renormalised(&sm, &[3, 4, 0]), "top_p=0.7");
    // With top-k first, top-p is over the top-k's mass.
    let p = SamplingParams {
        top_k: 2,
        top_p: 0.6,
        ..params(1.0)
    };
    let c = counts(p, &Z, 20_000);
    assert_fits(&c, &renormalised(&sm, &[3, 4]), "top_k=2 top_p=0.6");
}

#[test]
fn min_p_keeps_tokens_near_the_most_likely() {
    let sm = softmax(&Z, 1.0);
    let p = SamplingParams {
        min_p: 0.3,
        ..params(1.0)
    };
    let c = counts(p, &Z, 30_000);
    let keep: Vec<usize> = (0..Z.len()).filter(|&i| sm[i] >= 0.3 * sm[3]).collect();
    assert_eq!(keep, [0, 3, 4, 6]);
    assert_fits(&c, &renormalised(&sm, &keep), "min_p=0.3");
}

#[test]
fn a_large_vocabulary_draws_its_cdf() {
    // 2000 tokens, mostly flat with a few peaks: top-p 0.95 needs the
    // growing prefix past 64 and 512 candidates.
    let z: Vec<f32> = (0..2000)
        .map(|i| {
            if i % 499 == 3 {
                4.0
            } else {
                ((i * 37 % 101) as f32) / 50.0
            }
        })
        .collect();
    for top_p in [1.0f32, 0.95] {
        let p = SamplingParams {
            top_p,
            ..params(1.0)
        };
        let n = 10_000;
        let c = counts(p, &z, n);
        let sm = softmax(&z, 1.0);
        let want = if top_p < 1.0 {
            renormalised(&sm, &brute_keep(&sm, 0, top_p, 0.0))
        } else {
            sm
        };
        // Kolmogorov-Smirnov distance over the index order.
        let (mut a, mut b, mut d) = (0.0f64, 0.0f64, 0.0f64);
        for (o, q) in c.iter().zip(&want) {
            a += *o as f64 / n as f64;
            b += q;
            d = d.max((a - b).abs());
        }
        let bound = 1.95 / (n as f64).sqrt(); // p = 0.001
        assert!(d < bound, "top_p {top_p}: KS distance {d:.4} >= {bound:.4}");
    }
}

/// The filters by full sort.
fn brute_keep(w: &[f64], top_k: usize, top_p: f32, min_p: f32) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..w.len()).collect();
    ids.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    if top_k > 0 {
        ids.truncate(top_k);
    }
    if top_p < 1.0 {
        let mass: f64 = if top_k == 0 {
            w.iter().sum()
        } else {
            ids.iter().map(|&i| w[i]).sum()
        };
        let mut acc = 0.0;
        let mut cut = ids.len();
        for (j, &i) in ids.iter().enumerate() {
            acc += w[i];
            if acc >= f64::from(top_p) * mass {
                cut = j + 1;
                break;
            }
        }
        ids.truncate(cut.max(1));
    }
    if min_p > 0.0 {
        let top = w[ids[0]];
        ids.retain(|&i| w[i] >= f64::from(min_p) * top);
    }
    ids
}

proptest! {
    #[test]
    fn filters_keep_what_a_full_sort_keeps(
        // Few distinct values: ties everywhere, at every cut.
        w in prop::collection::vec(0u8..6, 1..300),
        top_k in 0usize..20,
        top_p in prop::sample::select(vec![1.0f32, 0.99, 0.9, 0.5, 0.1, 0.01]),
        min_p in prop::sample::select(vec![0.0f32, 0.2, 0.9]),
    ) {
        let w: Vec<f64> = w.iter().map(|&x| f64::from(x).exp2() - 1.0 + 1e-3).collect();
        let got: Vec<usize> = keep(&w, top_k, top_p, min_p).into_iter().map(|i| i as usize).collect();
        prop_assert_eq!(got, brute_keep(&w, top_k, top_p, min_p));
    }
}

#[test]
fn greedy_is_the_lowest_index_of_the_largest_logit() {
    let mut s = Sampler::new(SamplingParams::greedy(), Z.len(), &[]).unwrap();
    assert_eq!(s.pick(&Z).unwrap().token, 3, "3 and 4 tie: the lower");
    assert!(SamplingParams::greedy().is_plain_greedy());
    assert_eq!(argmax(&[f32::NEG_INFINITY; 4]), 0);
}

#[test]
fn seeds_repeat_and_differ() {
    let run = |seed| {
        let p = SamplingParams {
            seed: Some(seed),
            ..params(1.0)
        };
        let mut s = Sampler::new(p, Z.len(), &[]).unwrap();
        (0..64)
            .map(|_| s.pick(&Z).unwrap().token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

#[test]
fn penalties_and_bias_by_hand() {
    // Output so far: token 3 twice, token 0 once; prompt holds 6.
    let p = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        logit_bias: vec![(5, 10.0)],
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(p, Z.len(), &[6, 6]).unwrap();
    for t in [3, 0, 3] {
        s.accept(t);
    }
    let mut z = Z.to_vec();
    s.process(&mut z);
    let mut want = Z.to_vec();
    want[5] += 10.0;
    want[3] = 2.1 / 2.0 - 0.5 - 0.25 * 2.0;
    want[0] = 1.5 / 2.0 - 0.5 - 0.25;
    want[6] = 0.9 / 2.0;
    for (g, w) in z.iter().zip(&want) {
        assert!((g - w).abs() < 1e-6, "{z:?} vs {want:?}");
    }
    // A negative logit is multiplied.
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    };
    let s = Sampler::new(p, Z.len(), &[2]).unwrap();
    let mut z = Z.to_vec();
    s.process(&mut z);
    assert_eq!(z[2], -1.4);
    // Greedy sees the processed logits: the bias wins.
    let p = SamplingParams {
        logit_bias: vec![(5, 10.0)],
        ..SamplingParams::greedy()
    };
    assert_eq!(Sampler::new(p, 8, &[]).unwrap().pick(&Z).unwrap().token, 5);
}

#[test]
fn logprobs_are_the_models_distribution() {
    let p = SamplingParams {
        logprobs: Some(3),
        ..params(0.5)
    };
    let mut s = Sampler::new(p, Z.len(), &[]).unwrap();
    let pick = s.pick(&Z).unwrap();
    let sm = softmax(&Z, 1.0);
    let lp = pick.logprob.unwrap();
    assert!((f64::from(lp) - sm[pick.token as usize].ln()).abs() < 1e-6);
    let ids: Vec<u32> = pick.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, [3, 4, 0], "ties to the lower index");
    let (_, all) = logprobs(&Z, 0, 8);
    let mass: f64 = all.iter().map(|t| f64::from(t.1).exp()).sum();
    assert!((mass - 1.0).abs() < 1e-5);
}

#[test]
fn every_range_is_checked() {
    let bad = [
        SamplingParams {
            temperature: -0.1,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            top_p: 0.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            top_p: 1.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            min_p: 2.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            presence_penalty: 3.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            frequency_penalty: -2.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logit_bias: vec![(1, 101.0)],
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logprobs: Some(21),
            ..SamplingParams::greedy()
        },
    ];
    for p in bad {
        let e = Sampler::new(p.clone(), 8, &[]).unwrap_err();
        assert!(matches!(e, SampleError::Param { .. }), "{p:?}: {e}");
    }
    let p = SamplingParams {
        logit_bias: vec![(8, 1.0)],
        ..SamplingParams::greedy()
    };
    assert_eq!(
        Sampler::new(p, 8, &[]).unwrap_err(),
        SampleError::BiasToken { token: 8, vocab: 8 }
    );
    let mut s = Sampler::new(params(1.0), 8, &[]).unwrap();
    assert!(matches!(
        s.pick(&Z[..7]),
        Err(SampleError::Logits { len: 7, .. })
    ));
    let mut nan = Z;
    nan[2] = f32::NAN;
    assert!(matches!(
        s.pick(&nan),
        Err(SampleError::Logits { nan: true, .. })
    ));
}
