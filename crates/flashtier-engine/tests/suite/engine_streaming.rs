//! Streaming under faults and arbitrary access sequences: slow, reordered
//! reads change nothing; a failed read is a typed error, never wrong output;
//! the pool-backed tier serves exact records and never holds more than its
//! budget.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use flashtier::experts::{Backing, ExpertsError};
use flashtier_engine::EngineError;
use flashtier_engine::ModelConfig;
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::device::ExpertTier;
use flashtier_engine::device::cpu::experts::PoolExperts;
use flashtier_engine::experts::{StreamOptions, open_pool};
use flashtier_engine::load::{LoadOptions, load_cpu};
use flashtier_io::sim::{Fault, OpKind};
use flashtier_io::{FaultPlan, PosixBackend, SimBackend, StorageBackend};
use proptest::prelude::*;

use common::{fixture, pack};

const PROMPT: [u32; 6] = [138, 33, 283, 311, 155, 290];

fn opts_with(store: &Path, budget: u64, backend: Arc<dyn StorageBackend>) -> LoadOptions {
    let mut opts = LoadOptions::store(store).budget(budget);
    opts.queue_depth = 3;
    opts.backend = Some(backend);
    opts
}

#[test]
fn slow_reordered_reads_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("mixtral");
    let report = pack(&model, dir.path());
    let mut base = load_cpu(&model, &LoadOptions::store(&report.out)).unwrap();
    let want = base.generate(&PROMPT, 6, &[], true, |_| {}).unwrap();
    for seed in [1u64, 2, 3] {
        let plan = FaultPlan::seeded(seed).latency(0.5, Duration::from_micros(800));
        let sim = Arc::new(SimBackend::new(plan, 3).unwrap());
        println!("sim seed {}", sim.seed());
        let opts = opts_with(&report.out, 3 * report.stride_bytes, sim);
        let mut m = load_cpu(&model, &opts).unwrap();
        let got = m.generate(&PROMPT, 6, &[], true, |_| {}).unwrap();
        assert_eq!(got.generated_ids, want.generated_ids, "seed {seed}");
        assert_eq!(got.prompt_logits, want.prompt_logits, "seed {seed}");
    }
}

#[test]
fn a_failed_read_is_a_typed_error_naming_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("qwen3_moe");
    let report = pack(&model, dir.path());
    // Slots backing: every miss is a direct read (the mapped backing may find
    // the freshly packed store in the page cache and read nothing).
    let plan = FaultPlan::seeded(5).fail_nth(OpKind::Read, 7, Fault::Eio);
    let sim = Arc::new(SimBackend::new(plan, 2).unwrap());
    let mut opts = opts_with(&report.out, 2 * report.stride_bytes, sim);
    opts.backing = Backing::Slots;
    let mut m = load_cpu(&model, &opts).unwrap();
    let err = m.generate(&PROMPT, 8, &[], false, |_| {}).unwrap_err();
    assert!(
        matches!(err, EngineError::Pool(ExpertsError::Read { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("experts.ftstore"), "{err}");
}

/// A pool-backed tier over the qwen3_moe fixture's store.
fn tier(store: &Path, cfg: &ModelConfig, budget: u64) -> PoolExperts {
    let backend = Arc::new(PosixBackend::new(2).unwrap());
    let opts = StreamOptions {
        backing: Backing::Slots,
        budget_bytes: budget,
        queue_depth: 2,
    };
    let (pool, layout) = open_pool(store, cfg, opts, backend).unwrap();
    PoolExperts::new(pool, layout)
}

/// Every view a tier serves for one request, rendered.
fn served(t: &mut PoolExperts, layer: usize, ids: &[usize]) -> Vec<(usize, String)> {
    let mut got = Vec::new();
    t.with_experts(layer, ids, &mut |pos, v| {
        got.push((pos, format!("{v:?}")));
        Ok(())
    })
    .unwrap();
    got.sort();
    got
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Any request sequence, any budget that holds one step: the tier
    /// serves the store's exact bytes, never holds more records than the
    /// budget, and counts every use.
    #[test]
    fn pool_tier_is_exact_and_bounded(
        steps in proptest::collection::vec((0usize..3, proptest::collection::btree_set(0usize..8, 2)), 1..30),
        extra_records in 0u64..12,
    ) {
        let model = fixture("qwen3_moe");
        let dir = tempfile::tempdir().unwrap();
        let report = pack(&model, dir.path());
        let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
        let budget = report.stride_bytes * (2 + extra_records);
        let mut reference = tier(&report.out, &cfg, u64::MAX);
        let mut source = tier(&report.out, &cfg, budget);
        let mut uses = 0u64;
        for (layer, experts) in steps {
            // Layer 1 is dense in this fixture: the sparse layers are 0 and 2.
            let layer = if layer == 1 { 2 } else { layer };
            let ids: Vec<usize> = experts.into_iter().collect();
            prop_assert_eq!(served(&mut source, layer, &ids), served(&mut reference, layer, &ids));
            let held = source.pool().stats().resident_records as u64;
            prop_assert!(held <= 2 + extra_records, "{} records resident", held);
            uses += ids.len() as u64;
        }
        let s = source.stats();
        prop_assert_eq!(s.hits + s.misses, uses);
        prop_assert_eq!(s.bytes_read, s.misses * report.stride_bytes);
    }
}

/// The checkpoint's non-expert tensors load through the same backend as
/// the experts: a failed read of them is the backend's typed error too.
#[test]
fn weight_loads_go_through_the_backend() {
    let model = fixture("mixtral");
    let plan = FaultPlan::seeded(9).fail_nth(OpKind::Read, 3, Fault::Eio);
    let sim: Arc<dyn StorageBackend> = Arc::new(SimBackend::new(plan, 2).unwrap());
    let ckpt = Checkpoint::open_with(&model, sim).unwrap();
    let cfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let report = pack(&model, dir.path());
    let experts = tier(&report.out, &cfg, u64::MAX);
    let err = flashtier_engine::Model::new(
        flashtier_engine::device::cpu::CpuDevice,
        &cfg,
        &ckpt,
        experts,
    )
    .unwrap_err();
    assert!(matches!(err, EngineError::StoreIo(_)), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}
