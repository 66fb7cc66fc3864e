//! A prompt of several chunks against the same prompt fed one token at a
//! time: the same logits bit for bit at every position (the chunk's
//! experts run in parallel, its rows' norms, RoPE and routing on the pool,
//! the products in register blocks), and the same new tokens whether or
//! not the prompt's logits are kept (chunks before the last skip the LM
//! head). Under a budget of one token's experts the chunk's experts are
//! served in several batches as their reads land, with the same bits.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use flashtier::experts::Backing;
use flashtier_engine::load::{LoadOptions, load_cpu};
use flashtier_engine::model::PREFILL_CHUNK;
use flashtier_format::Dtype;
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};

use common::pack;

#[test]
fn a_chunked_prompt_equals_its_tokens_one_at_a_time_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    // 64-wide rows: whole 32-lane chunks, so AVX-512 takes the pair kernel.
    let mut spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 9);
    spec.experts = 8;
    write_checkpoint(&spec, &model, &mut |_| {}).unwrap();
    let report = pack(&model, tmp.path());
    let prompt: Vec<u32> = (0..PREFILL_CHUNK as u32 + 37)
        .map(|i| (i * 37 + 5) % 128)
        .collect();

    let mut one = load_cpu(&model, &LoadOptions::store(&report.out)).unwrap();
    let mut alone = Vec::new();
    for &t in &prompt {
        alone.push(one.forward(&[t], true).unwrap());
    }

    let all = report.stride_bytes * report.records;
    for (backing, budget) in [
        (Backing::Slots, all),
        (Backing::Slots, report.stride_bytes * 2),
        (Backing::Mapped, all),
    ] {
        let what = format!("{backing:?} budget {budget}");
        let mut opts = LoadOptions::store(&report.out).budget(budget);
        opts.backing = backing;
        opts.queue_depth = 2;
        let mut m = load_cpu(&model, &opts).unwrap();
        let kept = m.generate(&prompt, 4, &[], true, |_| {}).unwrap();
        assert_eq!(kept.prompt_logits, alone, "{what}: chunked logits");
        m.reset().unwrap();
        let bare = m.generate(&prompt, 4, &[], false, |_| {}).unwrap();
        assert!(bare.prompt_logits.is_empty());
        assert_eq!(bare.generated_ids, kept.generated_ids, "{what}: new tokens");
        assert_eq!(bare.generated_ids.len(), 4);
    }
}
