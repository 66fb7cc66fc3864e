//! The n-gram ids against the ones transformers gathered for the fixture
//! (`reference.json` `ngram_ids`, hooked at each PLE layer's embedding).

use serde_json::Value;

use super::{NgramSpec, PleNgramHasher};
use crate::config::qwen4::Qwen4Config;

fn fixture(file: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/engine/qwen4_exp/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Per PLE layer (by decoder index), `[position][head]` ids.
type LayerIds = Vec<(usize, Vec<Vec<u64>>)>;

/// Prompt then greedy tokens, and per PLE layer the ids.
fn reference() -> (Vec<u32>, LayerIds) {
    let r = fixture("reference.json");
    let mut tokens = u64s(&r["prompt_ids"]);
    tokens.extend(u64s(&r["greedy_ids"]));
    let tokens = tokens.into_iter().map(|t| t as u32).collect();
    let mut layers: LayerIds = r["ngram_ids"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.parse().unwrap(),
                v.as_array().unwrap().iter().map(u64s).collect(),
            )
        })
        .collect();
    layers.sort_by_key(|(k, _)| *k);
    (tokens, layers)
}

fn hashers() -> Vec<(usize, PleNgramHasher)> {
    let c = Qwen4Config::from_json(&fixture("config.json")).unwrap();
    let p = c.ple.unwrap();
    let spec = NgramSpec::of_config(c.vocab_size, &p);
    p.layers
        .iter()
        .enumerate()
        .map(|(rank, &l)| (l, PleNgramHasher::new(spec, rank)))
        .collect()
}

#[test]
fn ids_match_transformers_token_by_token_and_at_once() {
    let (tokens, want) = reference();
    let prompt = tokens.len() - 8;
    for ((layer, mut h), (wl, ids)) in hashers().into_iter().zip(&want) {
        assert_eq!(layer, *wl);
        assert_eq!(ids.len(), tokens.len());
        let mut at_once = h.clone();
        assert_eq!(&at_once.step(&tokens), ids, "layer {layer}: whole sequence");
        // The prompt as one step, then each greedy token alone.
        let mut got = h.step(&tokens[..prompt]);
        for &t in &tokens[prompt..] {
            got.extend(h.step(&[t]));
        }
        assert_eq!(&got, ids, "layer {layer}: prompt then decode steps");
        let rows = h.rows();
        assert!(ids.iter().flatten().all(|&i| i < rows));
        h.reset();
        assert_eq!(h.step(&tokens[..prompt]), ids[..prompt], "after reset");
    }
}

#[test]
fn the_fixture_needs_the_eos_segments() {
    // The prompt holds EOS twice: ignoring the segments changes some ids.
    let (tokens, want) = reference();
    for ((_, h), (layer, ids)) in hashers().into_iter().zip(&want) {
        let plain = h.ids(&tokens, false);
        let differ = plain.iter().zip(ids).filter(|(a, b)| a != b).count();
        assert!(differ >= 2, "layer {layer}: only {differ} positions differ");
        assert_eq!(h.ids(&tokens, true), *ids);
    }
}

proptest::proptest! {
    /// However a sequence is cut into steps, the ids are those of the whole.
    #[test]
    fn any_chunking_gives_the_ids_of_the_whole(
        tokens in proptest::collection::vec(0u32..8, 1..40),
        cuts in proptest::collection::vec(1usize..6, 1..20),
    ) {
        // A tiny vocabulary makes EOS (2) frequent.
        let spec = NgramSpec {
            vocab: 8,
            ngram_size: 4,
            heads_per_ngram: 2,
            vocab_base: 50,
            divisor: 8,
            seed: 7,
            eos: 2,
        };
        let mut whole = PleNgramHasher::new(spec, 1);
        let want = whole.step(&tokens);
        let mut h = PleNgramHasher::new(spec, 1);
        let (mut got, mut at) = (Vec::new(), 0);
        for c in cuts.iter().cycle() {
            if at >= tokens.len() {
                break;
            }
            let end = (at + c).min(tokens.len());
            got.extend(h.step(&tokens[at..end]));
            at = end;
        }
        proptest::prop_assert_eq!(got, want);
    }
}
