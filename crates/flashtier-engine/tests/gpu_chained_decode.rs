//! Chained greedy decoding on the GPU (each step issued before the host
//! reads the token of the step before; the pick embedded on the device)
//! against the same engine reading every token back first: on several
//! fixture families the tokens are the same and transformers', a stop
//! token mid-way ends both at the same place, and the step the chained
//! decode issued on the stop token is undone, so the sequence goes on
//! exactly as the unchained one does (the next prompt's logits are the
//! same bits). Skips with a printed reason where there is no GPU (CI).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

mod common;

use flashtier_engine::Model;
use flashtier_engine::device::KvState;
use flashtier_engine::device::cuda::CudaDevice;

use common::two_resident_gpu_models;

const NEW: usize = 10;

fn models(name: &str) -> (common::Reference, tempfile::TempDir, [Model<CudaDevice>; 2]) {
    let (r, tmp, chained, plain) = two_resident_gpu_models(name);
    plain.device().set_chain(false);
    (r, tmp, [chained, plain])
}

fn check(name: &str) {
    if let Err(e) = CudaDevice::open(0) {
        flashtier_io::skip::notice(&format!("gpu_chained_decode {name}"), &e.to_string());
        return;
    }
    // Whole runs: the same tokens, transformers' where it has them.
    let (r, _tmp, [mut chained, mut plain]) = models(name);
    let a = chained
        .generate(&r.prompt, NEW, &[], false, |_| {})
        .unwrap();
    let b = plain.generate(&r.prompt, NEW, &[], false, |_| {}).unwrap();
    assert_eq!(a.generated_ids, b.generated_ids, "{name}: chained vs plain");
    assert_eq!(a.decode_steps, b.decode_steps, "{name}");
    let n = r.greedy.len().min(NEW);
    assert_eq!(
        &a.generated_ids[..n],
        &r.greedy[..n],
        "{name}: transformers' tokens"
    );
    assert_eq!(chained.kv().len(), plain.kv().len(), "{name}: positions");

    // A stop token mid-way: both end on it, and the chained decode's step
    // issued on it is taken back.
    // The first token from the third on that did not come before: the
    // decode runs chained steps before it stops there.
    let ids = &a.generated_ids;
    let first_stop = (2..ids.len())
        .find(|&i| !ids[..i].contains(&ids[i]))
        .expect("a new token after the second");
    let stop = ids[first_stop];
    let (_, _tmp2, [mut chained, mut plain]) = models(name);
    let a = chained
        .generate(&r.prompt, NEW, &[stop], false, |_| {})
        .unwrap();
    let b = plain
        .generate(&r.prompt, NEW, &[stop], false, |_| {})
        .unwrap();
    assert_eq!(a.generated_ids, b.generated_ids, "{name}: stopped runs");
    assert_eq!(
        a.generated_ids.len(),
        first_stop + 1,
        "{name}: ends on the stop token"
    );
    assert_eq!(
        chained.kv().len(),
        plain.kv().len(),
        "{name}: positions after a stop"
    );
    // Go on from there: feed the stop token and two more as a prompt.
    let more = [stop, r.prompt[0], r.prompt[r.prompt.len() - 1]];
    let a = chained.generate(&more, 4, &[], true, |_| {}).unwrap();
    let b = plain.generate(&more, 4, &[], true, |_| {}).unwrap();
    for (i, (x, y)) in a.prompt_logits.iter().zip(&b.prompt_logits).enumerate() {
        assert!(
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{name}: position {i} after the stop differs"
        );
    }
    assert_eq!(
        a.generated_ids, b.generated_ids,
        "{name}: tokens after the stop"
    );
}

#[test]
fn qwen3_moe_chained_decode_equals_plain() {
    check("qwen3_moe");
}

#[test]
fn mixtral_chained_decode_equals_plain() {
    check("mixtral");
}

#[test]
fn deepseek_v3_chained_decode_equals_plain() {
    check("deepseek_v3");
}
