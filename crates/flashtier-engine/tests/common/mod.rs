//! Helpers shared by the engine's integration tests.
#![allow(dead_code, reason = "each test binary uses its own subset")]
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::path::{Path, PathBuf};

use flashtier_engine::device::cpu::CpuDevice;
use flashtier_engine::load::{LoadOptions, load_cpu};
use flashtier_engine::pack::{PackOptions, PackReport, pack_experts};
use flashtier_engine::{EngineError, Model};
use serde_json::Value;

/// A committed fixture made by `tools/make_fixtures.py` (from the crate the
/// test was built in, or, for a test binary carried to another machine,
/// from the checkout it runs in).
pub fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/engine");
    let root = if built.exists() {
        built
    } else {
        PathBuf::from("crates/flashtier-engine/tests/fixtures/engine")
    };
    root.join(name)
}

/// What transformers produced for a fixture.
pub struct Reference {
    pub prompt: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub greedy: Vec<u32>,
}

/// The fixture's `reference.json`.
pub fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let logits = v["prompt_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    Reference {
        prompt: ids("prompt_ids"),
        logits,
        greedy: ids("greedy_ids"),
    }
}

/// The model's experts packed into `dir/experts.ftstore`.
pub fn pack(model: &Path, dir: &Path) -> PackReport {
    let store = dir.join("experts.ftstore");
    pack_experts(&PackOptions::new(model, &store), &|_| {}).unwrap()
}

/// `model` on the CPU, experts from a store cache in `cache`.
pub fn load(model: &Path, cache: &Path) -> Result<Model<CpuDevice>, EngineError> {
    load_cpu(model, &LoadOptions::cached(cache))
}

/// Largest absolute difference of two logit tables.
pub fn max_abs_diff(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len());
    let mut worst = 0f32;
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len());
        for (a, b) in g.iter().zip(w) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}
