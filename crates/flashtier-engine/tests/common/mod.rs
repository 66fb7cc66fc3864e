//! Helpers shared by the engine's integration tests.
#![allow(dead_code, reason = "each test binary uses its own subset")]
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

pub mod batch;
pub mod rewrite;

use std::path::{Path, PathBuf};

use flashtier::experts::Backing;
use flashtier_engine::device::cpu::CpuDevice;
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::device::cuda::experts::TierBudgets;
use flashtier_engine::experts::ExpertStats;
use flashtier_engine::load::{GpuOptions, LoadOptions, load_cpu, load_cuda};
use flashtier_engine::{EngineError, Generation, Model};
use flashtier_pack::pack::{PackOptions, PackReport, pack_experts};
use serde_json::Value;

/// Whether GPU 0 opens; where it does not, prints why `test` is skipped.
pub fn gpu_or_skip(test: &str) -> bool {
    match CudaDevice::open(0) {
        Ok(_) => true,
        Err(e) => {
            flashtier_io::skip::notice(test, &e.to_string());
            false
        }
    }
}

/// GPU 0 with no KV budget and the expert tiers under `hbm` (`None`: every
/// record) and `ram` bytes, on the in-place path where `in_place`.
pub fn gpu_opts(hbm: Option<u64>, ram: u64, in_place: bool) -> GpuOptions {
    GpuOptions {
        kv: None,
        ordinal: 0,
        budgets: TierBudgets {
            hbm_bytes: hbm,
            ram_bytes: ram,
            in_place,
        },
    }
}

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
    Reference {
        prompt: ids("prompt_ids"),
        logits: logit_rows(&v, "prompt_logits"),
        greedy: ids("greedy_ids"),
    }
}

/// The logit table `key` (`[row][vocab]`) of a parsed `reference.json`.
pub fn logit_rows(v: &Value, key: &str) -> Vec<Vec<f32>> {
    v[key]
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
        .collect()
}

/// Decode with `run(opts)` at every expert budget (all of `report`'s
/// records, half, one token's `top_k`) on both backings (queue depth 4):
/// each gives `want`'s tokens and logit bits; the smallest budget on slots
/// misses and reads whole records.
pub fn same_bits_at_every_budget(
    name: &str,
    report: &PackReport,
    top_k: usize,
    want: &Generation,
    mut run: impl FnMut(&LoadOptions) -> (Generation, ExpertStats),
) {
    let stride = report.stride_bytes;
    let all = stride * report.records;
    let smallest = stride * top_k as u64;
    for backing in [Backing::Slots, Backing::Mapped] {
        for budget in [all, all / 2, smallest] {
            let mut opts = LoadOptions::store(&report.out).budget(budget);
            opts.backing = backing;
            opts.queue_depth = 4;
            let (o, s) = run(&opts);
            let what = format!("{name} {backing:?} budget {budget}");
            assert_eq!(
                o.generated_ids, want.generated_ids,
                "{what}: tokens changed"
            );
            assert_eq!(
                o.prompt_logits, want.prompt_logits,
                "{what}: logits changed"
            );
            println!(
                "{what} B: hit rate {:.3}, {} B read",
                s.hit_rate(),
                s.bytes_read
            );
            if budget == smallest && backing == Backing::Slots {
                assert!(
                    s.misses > 0 && s.bytes_read >= s.misses * stride,
                    "{what}: {s:?}"
                );
            }
        }
    }
}

/// A GPU decode of fixture `name` against transformers' reference `r` and
/// the CPU's decode `cpu`: prompt logits within `bound` of the reference
/// (the error printed, and the CPU's), and the greedy tokens of both.
pub fn assert_gpu_matches(
    name: &str,
    gpu: &Generation,
    cpu: &Generation,
    r: &Reference,
    bound: f32,
) {
    let worst = max_abs_diff(&gpu.prompt_logits, &r.logits);
    let vs_cpu = max_abs_diff(&gpu.prompt_logits, &cpu.prompt_logits);
    println!("{name}: GPU max abs logit error {worst:.3e} (vs CPU {vs_cpu:.3e})");
    assert!(worst <= bound, "{name}: {worst} > {bound}");
    assert_eq!(
        gpu.generated_ids, r.greedy,
        "{name}: tokens differ from transformers"
    );
    assert_eq!(
        gpu.generated_ids, cpu.generated_ids,
        "{name}: tokens differ from the CPU"
    );
}

/// The model's experts packed into `dir/experts.ftstore`.
pub fn pack(model: &Path, dir: &Path) -> PackReport {
    let store = dir.join("experts.ftstore");
    pack_experts(&PackOptions::new(model, &store), &|_| {}).unwrap()
}

/// `model` on the CPU, experts from a store cache in `cache` (packed
/// there first when missing).
pub fn load(model: &Path, cache: &Path) -> Result<Model<CpuDevice>, EngineError> {
    let store = flashtier_pack::cache::StoreCache::at(cache).ensure(model, &|_, _| {})?;
    load_cpu(model, &LoadOptions::store(store.path()))
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

/// Fixture `name`'s reference, its packed store (kept while the models
/// run) and two GPU models of it with every expert resident in HBM.
pub fn two_resident_gpu_models(
    name: &str,
) -> (
    Reference,
    tempfile::TempDir,
    Model<CudaDevice>,
    Model<CudaDevice>,
) {
    let dir = fixture(name);
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
    let a = load_cuda(&dir, &store, &opts).unwrap();
    let b = load_cuda(&dir, &store, &opts).unwrap();
    (r, tmp, a, b)
}
