//! Streaming under faults and arbitrary access sequences: slow, reordered
//! reads change nothing; a failed read is a typed error, never wrong output;
//! the checkpoint source never holds more than its budget.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flashtier::experts::{Backing, ExpertsError};
use flashtier_engine::pack::{PackOptions, pack_experts};
use flashtier_engine::{
    Checkpoint, CheckpointExperts, EngineError, ExpertSource, Model, ModelConfig, StreamOptions,
    open_pool_with,
};
use flashtier_io::sim::{Fault, OpKind};
use flashtier_io::{FaultPlan, SimBackend};
use proptest::prelude::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/engine")
        .join(name)
}

fn packed(name: &str, dir: &Path) -> (ModelConfig, Arc<Checkpoint>, PathBuf, u64) {
    let model = fixture(name);
    let store = dir.join("experts.ftstore");
    let report = pack_experts(&PackOptions::new(&model, &store), &|_| {}).unwrap();
    let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
    (
        cfg,
        Arc::new(Checkpoint::open(&model).unwrap()),
        store,
        report.stride_bytes,
    )
}

const PROMPT: [u32; 6] = [138, 33, 283, 311, 155, 290];

#[test]
fn slow_reordered_reads_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, ckpt, store, stride) = packed("mixtral", dir.path());
    let mut base = Model::load(&fixture("mixtral"), None).unwrap();
    let want = base.generate(&PROMPT, 6, &[], true, |_| {}).unwrap();
    for seed in [1u64, 2, 3] {
        let plan = FaultPlan::seeded(seed).latency(0.5, Duration::from_micros(800));
        let sim = Arc::new(SimBackend::new(plan, 3).unwrap());
        println!("sim seed {}", sim.seed());
        let opts = StreamOptions {
            backing: Backing::Slots,
            budget_bytes: 3 * stride,
            queue_depth: 3,
        };
        let experts = open_pool_with(&store, &cfg, opts, sim).unwrap();
        let mut m = Model::with_experts(&cfg, &ckpt, Box::new(experts)).unwrap();
        let got = m.generate(&PROMPT, 6, &[], true, |_| {}).unwrap();
        assert_eq!(got.generated_ids, want.generated_ids, "seed {seed}");
        assert_eq!(got.prompt_logits, want.prompt_logits, "seed {seed}");
    }
}

#[test]
fn a_failed_read_is_a_typed_error_naming_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, ckpt, store, stride) = packed("qwen3_moe", dir.path());
    // Slots backing: every miss is a direct read (the mapped backing may find
    // the freshly packed store in the page cache and read nothing).
    {
        let backing = Backing::Slots;
        let plan = FaultPlan::seeded(5).fail_nth(OpKind::Read, 7, Fault::Eio);
        let sim = Arc::new(SimBackend::new(plan, 2).unwrap());
        let opts = StreamOptions {
            backing,
            budget_bytes: 2 * stride,
            queue_depth: 2,
        };
        let experts = open_pool_with(&store, &cfg, opts, sim).unwrap();
        let mut m = Model::with_experts(&cfg, &ckpt, Box::new(experts)).unwrap();
        let err = m.generate(&PROMPT, 8, &[], false, |_| {}).unwrap_err();
        assert!(
            matches!(err, EngineError::Pool(ExpertsError::Read { .. })),
            "{backing:?}: {err}"
        );
        assert!(err.to_string().contains("experts.ftstore"), "{err}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any request sequence, any budget that holds one step: the source
    /// serves the checkpoint's bytes and never caches more than the budget.
    #[test]
    fn checkpoint_source_is_exact_and_bounded(
        steps in proptest::collection::vec((0usize..3, proptest::collection::btree_set(0usize..8, 2)), 1..40),
        extra_records in 0u64..12,
    ) {
        let dir = fixture("qwen3_moe");
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
        let mut reference = CheckpointExperts::new(ckpt.clone(), &cfg, u64::MAX).unwrap();
        let record = reference.record_bytes();
        let budget = record * (2 + extra_records);
        let mut source = CheckpointExperts::new(ckpt, &cfg, budget).unwrap();
        let mut uses = 0u64;
        for (layer, experts) in steps {
            // Layer 1 is dense in this fixture: the sparse layers are 0 and 2.
            let layer = if layer == 1 { 2 } else { layer };
            let ids: Vec<usize> = experts.into_iter().collect();
            let mut got = Vec::new();
            source.with_experts(layer, &ids, &mut |pos, v| { got.push((pos, format!("{v:?}"))); Ok(()) }).unwrap();
            let mut want = Vec::new();
            reference.with_experts(layer, &ids, &mut |pos, v| { want.push((pos, format!("{v:?}"))); Ok(()) }).unwrap();
            prop_assert_eq!(got, want);
            prop_assert!(source.cached_bytes() <= budget);
            uses += ids.len() as u64;
        }
        let s = source.stats();
        prop_assert_eq!(s.hits + s.misses, uses);
        prop_assert_eq!(s.bytes_read, s.misses * record);
    }
}
