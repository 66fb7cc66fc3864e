//! Continuous batching on the GPU: sequences joining a running batch, prompt
//! chunks sharing steps with decode tokens, against each sequence decoded
//! alone on the GPU and on the CPU. A multi-row GPU step may run other
//! kernels (tiles, grouped experts) than a one-row step, so the bound is
//! f32 rounding, not bits: the same greedy tokens, logits within
//! [`MAX_ABS_ERR`] of the sequence decoded alone. Also under an HBM budget
//! that streams. Skips with a printed reason where there is no GPU (CI).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::device::cuda::experts::TierBudgets;
use flashtier_engine::load::{GpuOptions, LoadOptions, load_cpu, load_cuda};

use common::batch::{Trace, alone, batched, plan_of};
use common::{fixture, pack, reference};

/// The GPU's batched logits against the same sequence alone.
const MAX_ABS_ERR: f32 = 2e-3;

fn worst(a: &[Trace], b: &[Trace]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.logits.iter().zip(&y.logits))
        .flat_map(|(p, q)| p.iter().zip(q))
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_gpu_batch_gives_each_sequence_what_it_gets_alone() {
    if let Err(e) = CudaDevice::open(0) {
        flashtier_io::skip::notice("gpu_batch_decode", &e.to_string());
        return;
    }
    for name in ["qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe"] {
        let dir = fixture(name);
        let r = reference(&dir);
        let tmp = tempfile::tempdir().unwrap();
        let report = pack(&dir, tmp.path());
        let store = LoadOptions::store(&report.out);
        let plan = plan_of(&r.prompt, 5);
        let mut cpu = load_cpu(&dir, &store).unwrap();
        let want = alone(&mut cpu, &plan);
        for hbm in [None, Some(4 * report.stride_bytes)] {
            let opts = GpuOptions {
                kv: None,
                ordinal: 0,
                budgets: TierBudgets {
                    hbm_bytes: hbm,
                    ram_bytes: 0,
                    in_place: false,
                },
            };
            let mut gpu = load_cuda(&dir, &store, &opts).unwrap();
            let one = alone(&mut gpu, &plan);
            let got = batched(&mut gpu, &plan);
            for (i, ((g, o), w)) in got.iter().zip(&one).zip(&want).enumerate() {
                assert_eq!(
                    g.tokens, o.tokens,
                    "{name} {hbm:?}: sequence {i}, batch vs alone"
                );
                assert_eq!(
                    g.tokens, w.tokens,
                    "{name} {hbm:?}: sequence {i}, GPU vs CPU"
                );
            }
            let (vs_alone, vs_cpu) = (worst(&got, &one), worst(&got, &want));
            println!("{name} hbm {hbm:?}: batch vs alone {vs_alone:.2e}, vs CPU {vs_cpu:.2e}");
            assert!(vs_alone <= MAX_ABS_ERR, "{name}: {vs_alone} vs alone");
            assert!(vs_cpu <= MAX_ABS_ERR, "{name}: {vs_cpu} vs the CPU");
        }
    }
}

#[test]
fn chained_decode_of_one_sequence_picks_what_generate_picks() {
    if let Err(e) = CudaDevice::open(0) {
        flashtier_io::skip::notice("gpu_batch_decode chained", &e.to_string());
        return;
    }
    use flashtier_engine::device::KvState;
    use flashtier_engine::model::{RowOut, SeqStep, Want};
    let dir = fixture("qwen3_moe");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = LoadOptions::store(&report.out);
    let opts = GpuOptions {
        kv: None,
        ordinal: 0,
        budgets: TierBudgets {
            hbm_bytes: None,
            ram_bytes: 0,
            in_place: false,
        },
    };
    let mut gpu = load_cuda(&dir, &store, &opts).unwrap();
    let n = r.greedy.len();
    let want = gpu
        .generate(&r.prompt, n, &[], false, |_| {})
        .unwrap()
        .generated_ids;
    let mut kv = gpu.new_kv(64).unwrap();
    let mut e = [SeqStep {
        kv: &mut kv,
        tokens: &r.prompt,
        want: Want::Greedy,
    }];
    let RowOut::Token(first) = gpu.step_batch(&mut e).unwrap().remove(0) else {
        panic!("no greedy token")
    };
    let mut got = vec![first];
    // Chained in two runs (the first stopped by its taker), a batch step
    // between them: the cache resumes where each left it.
    let mut taken = Vec::new();
    let mut take = |t: u32| {
        taken.push(t);
        taken.len() == 3
    };
    let ran = gpu.decode_chained(&mut kv, first, n, &mut take).unwrap();
    assert_eq!(ran, Some(3));
    got.extend(&taken);
    assert_eq!(
        kv.len(),
        r.prompt.len() + 3,
        "the last taken token is not fed"
    );
    let last = [*got.last().unwrap()];
    let mut e = [SeqStep {
        kv: &mut kv,
        tokens: &last,
        want: Want::Greedy,
    }];
    let RowOut::Token(t) = gpu.step_batch(&mut e).unwrap().remove(0) else {
        panic!("no greedy token")
    };
    got.push(t);
    let mut rest = Vec::new();
    let left = n - got.len();
    gpu.decode_chained(&mut kv, t, left, &mut |t| {
        rest.push(t);
        false
    })
    .unwrap();
    got.extend(rest);
    assert_eq!(got, want, "chained, batched and chained again");
}
