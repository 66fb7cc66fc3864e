//! Qwen4-Exp on the GPU against HF transformers 5.17 and the CPU decoder,
//! on every Qwen4-Exp fixture (the tie fixture, with exact ties at the
//! indexer's keep/drop line and EOS inside the prompt, among them): prompt
//! logits within 1e-3 of transformers' f32 reference, the same greedy
//! tokens, and bit-identical output at every HBM and RAM expert budget
//! and every PLE row budget (0 included, and rows read from the checkpoint
//! directly). Skips with a printed reason where there is no GPU (CI).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use std::path::Path;

use flashtier_engine::Generation;
use flashtier_engine::engine::{Engine, Placement, open_with_rows};
use flashtier_engine::family::qwen4::PleRowOptions;
use flashtier_engine::load::{GpuOptions, LoadOptions};

use common::{assert_gpu_matches, fixture, gpu_opts, gpu_or_skip, max_abs_diff, pack, reference};

const NEW_TOKENS: usize = 8;
/// The bound against transformers' f32 logits (f32 activations, states and
/// accumulation on the GPU; sums in other orders than the CPU's).
const MAX_ABS_ERR: f32 = 1e-3;

/// Open `dir` on `placement` and decode the fixture's prompt.
fn decode(
    dir: &Path,
    store: &Path,
    placement: Placement,
    gpu: &GpuOptions,
    rows: Option<&PleRowOptions>,
) -> (Generation, Engine) {
    let r = reference(dir);
    let (mut e, chosen) =
        open_with_rows(dir, store, &LoadOptions::store(store), placement, gpu, rows).unwrap();
    if placement != Placement::Cpu {
        assert_eq!(chosen.device, "cuda");
    }
    let out = e
        .generate(&r.prompt, NEW_TOKENS, &[], true, |_| {})
        .unwrap();
    (out, e)
}

fn check(name: &str) {
    if !gpu_or_skip(&format!("gpu_qwen4 {name}")) {
        return;
    }
    let dir = fixture(name);
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let report = pack(&dir, tmp.path());
    let store = report.out.clone();
    let all_gpu = gpu_opts(None, 0, false);
    let (cpu, _) = decode(&dir, &store, Placement::Cpu, &all_gpu, None);
    let (out, gpu) = decode(&dir, &store, Placement::Cuda(0), &all_gpu, None);
    assert_gpu_matches(name, &out, &cpu, &r, MAX_ABS_ERR);
    // Every expert budget: HBM slots for half the records or one token's
    // top-k, with and without a RAM tier behind them.
    let stride = report.stride_bytes;
    let all = stride * report.records;
    let Engine::Qwen4(m) = &gpu else {
        panic!("{name}: not a Qwen4-Exp engine")
    };
    let top_k = m.config().top_k as u64;
    drop(gpu);
    for (hbm, ram) in [
        (Some(all / 2), 0),
        (Some(stride * top_k), 0),
        (Some(stride * top_k), all),
    ] {
        let (o, e) = decode(
            &dir,
            &store,
            Placement::Cuda(0),
            &gpu_opts(hbm, ram, false),
            None,
        );
        let what = format!("{name} hbm {hbm:?} ram {ram}");
        assert_eq!(o.generated_ids, out.generated_ids, "{what}: tokens changed");
        assert_eq!(o.prompt_logits, out.prompt_logits, "{what}: logits changed");
        let s = e.expert_stats();
        println!(
            "{what}: hit rate {:.3}, {} B read",
            s.hit_rate(),
            s.bytes_read
        );
        if hbm == Some(stride * top_k) {
            assert!(s.hit_rate() < 1.0, "{what}: a top-k budget must miss");
        }
    }
    // Every row budget, from the row store.
    let rows_dir = tmp.path().join("rows");
    for budget in [0u64, 4096, 1 << 20] {
        let rows = PleRowOptions {
            dir: rows_dir.clone(),
            budget_bytes: budget,
        };
        let (o, e) = decode(&dir, &store, Placement::Cuda(0), &all_gpu, Some(&rows));
        let what = format!("{name} rows budget {budget}");
        assert_eq!(o.generated_ids, out.generated_ids, "{what}: tokens changed");
        assert_eq!(o.prompt_logits, out.prompt_logits, "{what}: logits changed");
        let s = e.row_stats().unwrap();
        println!("{what}: {s:?}");
        assert!(s.lookups > 0, "{what}: no rows looked up");
    }
}

#[test]
fn qwen4_exp_on_the_gpu() {
    check("qwen4_exp");
}

#[test]
fn qwen4_exp_tied_on_the_gpu() {
    check("qwen4_exp_tied");
}

#[test]
fn qwen4_exp_ties_at_the_indexer_line_on_the_gpu() {
    check("qwen4_exp_ties");
}

/// The prompt fed in pieces (a prefix step of several rows, then one token
/// a step) gives the logits of the whole prompt at once, within the GPU's
/// bound: the states and the sparse cache carry across steps.
#[test]
fn steps_of_any_size_carry_the_states() {
    if !gpu_or_skip("gpu_qwen4 steps_of_any_size_carry_the_states") {
        return;
    }
    let dir = fixture("qwen4_exp_ties");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let store = pack(&dir, tmp.path()).out;
    let opts = LoadOptions::store(&store);
    let (mut e, _) = open_with_rows(
        &dir,
        &store,
        &opts,
        Placement::Cuda(0),
        &gpu_opts(None, 0, false),
        None,
    )
    .unwrap();
    let Engine::Qwen4(m) = &mut e else {
        panic!("not a Qwen4-Exp engine")
    };
    let vocab = m.config().vocab_size;
    let split = r.prompt.len() / 3;
    let mut got = m.forward(&r.prompt[..split], true).unwrap();
    for &t in &r.prompt[split..] {
        got.extend(m.forward(&[t], false).unwrap());
    }
    let rows: Vec<Vec<f32>> = got.chunks(vocab).map(<[f32]>::to_vec).collect();
    let worst = max_abs_diff(&rows, &r.logits);
    println!("pieces: max abs logit error {worst:.3e}");
    assert!(worst <= MAX_ABS_ERR, "{worst} > {MAX_ABS_ERR}");
}
