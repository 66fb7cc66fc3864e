//! The Qwen4-Exp forward pass layer by layer against transformers' hidden
//! states, and the fixture constraining its parts: leaving out the EOS
//! segments of the n-gram hashing, the GatedDeltaNet conv state, or one
//! stream's hyper-connection injection breaks the 1e-3 logit bound.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{Mixer, Qwen4Model};
use crate::load::LoadOptions;
// The packer is a dev-dependency: only paths cross into it, so the two
// builds of this crate (this test and the one it links) never meet.
use flashtier_pack::pack::{PackOptions, pack_experts};

const MAX_ABS_ERR: f32 = 1e-3;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/engine/qwen4_exp")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(a) => a.iter().flat_map(floats).collect(),
        other => vec![other.as_f64().unwrap() as f32],
    }
}

fn prompt(r: &Value) -> Vec<u32> {
    r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The model with its experts packed into `tmp`.
fn open(tmp: &Path) -> Qwen4Model {
    let store = tmp.join("experts.ftstore");
    pack_experts(&PackOptions::new(&dir(), &store), &|_| {}).unwrap();
    Qwen4Model::open(&dir(), &store, &LoadOptions::store(&store)).unwrap()
}

fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn every_layer_matches_the_hidden_states_of_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = open(tmp.path());
    let r = reference();
    let (_, traced) = m.forward_streams(&prompt(&r), true).unwrap();
    let want = r["layer_outputs"].as_array().unwrap();
    assert_eq!(traced.len(), want.len());
    for (i, (got, want)) in traced.iter().zip(want).enumerate() {
        let err = max_err(got, &floats(want));
        println!("layer {i}: max abs error {err:.3e}");
        assert!(err <= 1e-4, "layer {i}: {err}");
    }
}

/// The prompt logits' worst error after `ablate` changed the model.
fn error_with(ablate: impl FnOnce(&mut Qwen4Model)) -> f32 {
    let tmp = tempfile::tempdir().unwrap();
    let mut m = open(tmp.path());
    ablate(&mut m);
    let r = reference();
    let got = m.forward(&prompt(&r), true).unwrap();
    max_err(&got, &floats(&r["prompt_logits"]))
}

#[test]
fn the_fixture_constrains_eos_segments_conv_state_and_each_hyper_connection() {
    assert!(error_with(|_| {}) <= MAX_ABS_ERR);
    let eos = error_with(|m| {
        m.layers
            .iter_mut()
            .filter_map(|l| l.ple.as_mut())
            .for_each(|p| p.ignore_eos_segments());
    });
    let conv = error_with(|m| {
        for l in &mut m.layers {
            if let Mixer::Linear(g) = &mut l.mixer {
                g.drop_conv_state = true;
            }
        }
    });
    let hc = error_with(|m| m.drop_inject_stream = Some(1));
    println!("without EOS segments {eos:.3e}, conv state {conv:.3e}, stream 1 injection {hc:.3e}");
    for (what, err) in [
        ("EOS segments", eos),
        ("conv state", conv),
        ("stream 1", hc),
    ] {
        assert!(
            err > 10.0 * MAX_ABS_ERR,
            "leaving out {what} still passes: {err}"
        );
    }
}

/// A long prompt through the row store in chunks, each starting the next
/// chunk's row reads while it computes: the bits of the rows read from the
/// checkpoint, the reads in flight between the chunks, and no row read
/// twice (the same bytes read as without reading ahead).
#[test]
fn rows_read_a_chunk_ahead_change_reads_not_results() {
    use super::super::rows::PleRowOptions;
    let tmp = tempfile::tempdir().unwrap();
    let mut plain = open(tmp.path());
    let store = tmp.path().join("experts.ftstore");
    let with_rows = |name: &str| {
        let rows = PleRowOptions {
            dir: tmp.path().join(name),
            budget_bytes: 1 << 20,
        };
        Qwen4Model::open_with_rows(&dir(), &store, &LoadOptions::store(&store), Some(&rows))
            .unwrap()
    };
    let (mut ahead, mut behind) = (with_rows("rows-a"), with_rows("rows-b"));
    // 200 tokens (EOS among them), four chunks.
    let tokens: Vec<u32> = (0..200u32).map(|i| (i * 37 + 11) % 256).collect();
    let chunks: Vec<&[u32]> = tokens.chunks(50).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (c, chunk) in chunks.iter().enumerate() {
        let want = plain.forward(chunk, true).unwrap();
        if let Some(next) = chunks.get(c + 1) {
            ahead.set_prompt_ahead(next);
        }
        assert_eq!(
            bits(&ahead.forward(chunk, true).unwrap()),
            bits(&want),
            "chunk {c}"
        );
        assert_eq!(
            bits(&behind.forward(chunk, true).unwrap()),
            bits(&want),
            "chunk {c}"
        );
        let in_flight: usize = ahead
            .layers
            .iter()
            .filter_map(|l| l.ple.as_ref())
            .map(|p| p.reads_ahead())
            .sum();
        assert_eq!(
            in_flight > 0,
            c + 1 < chunks.len(),
            "chunk {c}: {in_flight} reads ahead"
        );
    }
    let (a, b) = (ahead.row_stats().unwrap(), behind.row_stats().unwrap());
    println!("ahead {a:?}\nbehind {b:?}");
    assert_eq!((a.lookups, a.bytes_read), (b.lookups, b.bytes_read));
}
