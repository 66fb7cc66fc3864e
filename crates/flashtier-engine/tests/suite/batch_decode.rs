//! Continuous batching on the CPU: sequences that join a running batch,
//! prompt chunks sharing steps with other sequences' decode tokens, each
//! sequence's logits bit-identical to decoding it alone, on every fixture
//! family and under an expert budget that streams (the union of the
//! batch's experts is read once per step).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use flashtier_engine::device::KvState;
use flashtier_engine::load::{LoadOptions, load_cpu};
use flashtier_engine::model::{RowOut, SeqStep, Want};

use common::batch::{alone, batched, plan_of};
use common::{fixture, pack, reference};

const FAMILIES: [&str; 6] = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "deepseek_v3_fp8",
    "qwen3_moe_yarn",
];

#[test]
fn every_sequence_of_a_batch_gets_the_bits_it_gets_alone() {
    for name in FAMILIES {
        let dir = fixture(name);
        let r = reference(&dir);
        let tmp = tempfile::tempdir().unwrap();
        let report = pack(&dir, tmp.path());
        let plan = plan_of(&r.prompt, 5);
        let mut m = load_cpu(&dir, &LoadOptions::store(&report.out)).unwrap();
        let want = alone(&mut m, &plan);
        // The first sequence alone is the fixture's reference decode.
        assert_eq!(
            want[0].tokens,
            r.greedy[..5],
            "{name}: the plan's first sequence is the reference prompt"
        );
        let got = batched(&mut m, &plan);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.tokens, w.tokens, "{name}: sequence {i}'s tokens");
            assert!(g.logits == w.logits, "{name}: sequence {i}'s logits differ");
        }
        // Room for one token's experts: every step of the batch streams
        // its union.
        let k = m.config().top_k as u64;
        let opts = LoadOptions::store(&report.out).budget(k * report.stride_bytes);
        let mut small = load_cpu(&dir, &opts).unwrap();
        let streamed = batched(&mut small, &plan);
        assert_eq!(streamed, got, "{name}: streamed batch");
        assert!(
            small.expert_stats().misses > 0,
            "{name}: the budget streams"
        );
    }
}

#[test]
fn a_batch_of_greedy_rows_picks_what_generate_picks() {
    let dir = fixture("qwen3_moe");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let mut m = load_cpu(&dir, &LoadOptions::store(&report.out)).unwrap();
    let n = r.greedy.len();
    let mut a = m.new_kv(64).unwrap();
    let mut b = m.new_kv(64).unwrap();
    let short = &r.prompt[..r.prompt.len() / 2];
    let want_b = m
        .generate(short, n, &[], false, |_| {})
        .unwrap()
        .generated_ids;
    let mut entries = [
        SeqStep {
            kv: &mut a,
            tokens: &r.prompt,
            want: Want::Greedy,
        },
        SeqStep {
            kv: &mut b,
            tokens: short,
            want: Want::Greedy,
        },
    ];
    let mut tokens = [Vec::new(), Vec::new()];
    let mut outs = m.step_batch(&mut entries).unwrap();
    for _ in 0..n {
        let next: Vec<u32> = outs
            .iter()
            .map(|o| match o {
                RowOut::Token(t) => *t,
                other => panic!("greedy row gave {other:?}"),
            })
            .collect();
        tokens[0].push(next[0]);
        tokens[1].push(next[1]);
        let [ta, tb] = [[next[0]], [next[1]]];
        let mut entries = [
            SeqStep {
                kv: &mut a,
                tokens: &ta,
                want: Want::Greedy,
            },
            SeqStep {
                kv: &mut b,
                tokens: &tb,
                want: Want::Greedy,
            },
        ];
        outs = m.step_batch(&mut entries).unwrap();
    }
    assert_eq!(tokens[0], r.greedy, "the reference's greedy tokens");
    assert_eq!(tokens[1], want_b, "the second sequence's own greedy tokens");
}

#[test]
fn batch_steps_refuse_what_does_not_fit() {
    let dir = fixture("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let mut m = load_cpu(&dir, &LoadOptions::store(&report.out)).unwrap();
    assert!(m.new_kv(0).is_err(), "an empty cache");
    assert!(
        m.new_kv(m.context_limit() + 1).is_err(),
        "past the model's context"
    );
    let mut kv = m.new_kv(4).unwrap();
    let too_long = [1u32, 2, 3, 4, 5];
    let err = m
        .step_batch(&mut [SeqStep {
            kv: &mut kv,
            tokens: &too_long,
            want: Want::Logits,
        }])
        .unwrap_err();
    assert!(err.to_string().contains('5'), "{err}");
    let out_of_vocab = [9999u32];
    assert!(
        m.step_batch(&mut [SeqStep {
            kv: &mut kv,
            tokens: &out_of_vocab,
            want: Want::Logits
        }])
        .is_err()
    );
    let big = vec![1u32; 200];
    let (mut k1, mut k2) = (m.new_kv(256).unwrap(), m.new_kv(256).unwrap());
    let err = m
        .step_batch(&mut [
            SeqStep {
                kv: &mut k1,
                tokens: &big,
                want: Want::Nothing,
            },
            SeqStep {
                kv: &mut k2,
                tokens: &big,
                want: Want::Nothing,
            },
        ])
        .unwrap_err();
    assert!(err.to_string().contains("400 rows"), "{err}");
    assert_eq!(kv.len(), 0, "a refused step pushes nothing");
}

#[test]
fn a_cache_cut_back_to_a_shared_prefix_continues_like_a_fresh_one() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let dir = fixture(name);
        let r = reference(&dir);
        let tmp = tempfile::tempdir().unwrap();
        let report = pack(&dir, tmp.path());
        let mut m = load_cpu(&dir, &LoadOptions::store(&report.out)).unwrap();
        let p = &r.prompt;
        let logits_of = |m: &mut _, kv: &mut _, tokens: &[u32]| match m_step(m, kv, tokens) {
            RowOut::Logits(l) => l,
            other => panic!("{other:?}"),
        };
        let mut fresh = m.new_kv(64).unwrap();
        let want = logits_of(&mut m, &mut fresh, p);
        // Another prompt sharing the first 3 tokens, past a block edge.
        let other: Vec<u32> = p[..3]
            .iter()
            .copied()
            .chain(std::iter::repeat_n(7, 20))
            .collect();
        let mut kv = m.new_kv(64).unwrap();
        logits_of(&mut m, &mut kv, &other);
        assert!(kv.rewinds());
        assert!(kv.rewind(24).is_err(), "more than it holds");
        kv.rewind(20).unwrap();
        assert_eq!(kv.len(), 3);
        let got = logits_of(&mut m, &mut kv, &p[3..]);
        assert!(got == want, "{name}: the cut cache's logits differ");
    }
}

fn m_step<D: flashtier_engine::device::Device>(
    m: &mut flashtier_engine::model::Model<D>,
    kv: &mut D::Kv,
    tokens: &[u32],
) -> RowOut {
    let mut e = [SeqStep {
        kv,
        tokens,
        want: Want::Logits,
    }];
    m.step_batch(&mut e).unwrap().remove(0)
}
