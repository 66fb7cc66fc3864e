//! The synthetic Qwen4-Exp checkpoint loads in the Qwen4-Exp decoder, its
//! experts pack and stream, its PLE tables go through the row store, and
//! greedy decoding walks the vocabulary (every step a new token, so new
//! n-grams and new routing), identically from the checkpoint's rows and
//! from the row store at a budget far below the tables.

use flashtier_engine::family::qwen4::{PleRowOptions, Qwen4Model};
use flashtier_engine::load::LoadOptions;
use flashtier_pack::pack::{PackOptions, pack_experts};
use flashtier_pack::synth::{Qwen4Spec, write_qwen4_checkpoint};

#[test]
fn a_synthetic_qwen4_decodes_the_successor_walk_through_both_tiers()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("model");
    let store = dir.path().join("experts.ftstore");
    let spec = Qwen4Spec::scaled_to(24 << 20, 3);
    eprintln!("{spec:?}");
    let written = write_qwen4_checkpoint(&spec, &model, &mut |_| {})?;
    assert!(written.bytes <= 28 << 20, "{}", written.bytes);
    pack_experts(&PackOptions::new(&model, &store), &|_| {})?;
    let prompt = [100u32, 77, 5];
    let opts = LoadOptions::store(&store).budget(spec.all_expert_bytes() / 4);
    let mut plain = Qwen4Model::open(&model, &store, &opts)?;
    let want = plain.generate(&prompt, 6, &[], false)?;
    let rows = PleRowOptions {
        dir: dir.path().join("rows"),
        budget_bytes: spec.table_bytes() / 10,
    };
    let mut tiered = Qwen4Model::open_with_rows(&model, &store, &opts, Some(&rows))?;
    let got = tiered.generate(&prompt, 6, &[], false)?;
    assert_eq!(got.generated_ids, want.generated_ids);
    let ids = &want.generated_ids;
    let vocab = spec.vocab as u32;
    let shift = 7919 % vocab;
    for w in ids.windows(2) {
        assert_eq!(w[1], (w[0] + vocab - shift) % vocab, "the walk: {ids:?}");
    }
    let r = got.decode_rows.expect("row-store counters");
    assert!(r.lookups > 0 && r.bytes_read > 0, "{r:?}");
    assert!(got.decode_experts.bytes_read > 0);
    Ok(())
}
