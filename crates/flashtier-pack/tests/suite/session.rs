//! The session builder: a missing store is packed once (its progress
//! reaching the caller) and reused after; the store cache's file is packed
//! on first use and reused; a KV budget on the CPU and a pool too small
//! for one step are refused with typed errors, the first before anything
//! is packed; a session decodes what the engine opened by hand decodes.

use std::sync::Mutex;

use flashtier_engine::EngineError;
use flashtier_engine::engine::{self, Placement};
use flashtier_engine::load::{GpuOptions, LoadOptions};
use flashtier_format::{Dtype, Store};
use flashtier_pack::session::{Opening, SessionError, SessionOptions, StoreSource};
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};

/// A tiny synthetic model in `tmp/model`, and options that open it on
/// the CPU with `store`.
fn cpu_session(tmp: &std::path::Path, store: StoreSource) -> (std::path::PathBuf, SessionOptions) {
    let model = tmp.join("model");
    let spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 11);
    write_checkpoint(&spec, &model, &mut |_| {}).expect("synth");
    let mut opts = SessionOptions::new(&model);
    opts.store = store;
    opts.placement = Placement::Cpu;
    (model, opts)
}

/// Every packing event `open` reported: (done, total, cached).
fn open_counting(
    opts: &SessionOptions,
) -> (flashtier_pack::session::Session, Vec<(u64, u64, bool)>) {
    let seen = Mutex::new(Vec::new());
    let session = opts
        .open(&|event| match event {
            Opening::Packing {
                done,
                total,
                cached,
                ..
            } => seen.lock().expect("lock").push((done, total, cached)),
        })
        .expect("open");
    (session, seen.into_inner().expect("lock"))
}

#[test]
fn a_missing_store_is_packed_once_with_progress_then_reused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("experts.ftstore");
    let (model, opts) = cpu_session(tmp.path(), StoreSource::File(store.clone()));

    let (mut first, events) = open_counting(&opts);
    assert_eq!(first.store, store);
    assert!(!events.is_empty(), "packing reported no progress");
    let total = events[0].1;
    assert!(total > 0);
    assert!(
        events.windows(2).all(|w| w[0].0 <= w[1].0),
        "progress went back"
    );
    assert_eq!(
        events.last().expect("an event").0,
        total,
        "packing did not reach its total"
    );
    assert!(events.iter().all(|e| e.1 == total && !e.2));
    let opened = Store::open(&store).expect("the packed store opens");
    assert_eq!(opened.payload_bytes() * opened.record_count(), total);
    assert!(first.weight_bytes_per_token > 0);
    assert_eq!(first.chosen.device, "cpu");

    let (mut again, events) = open_counting(&opts);
    assert!(events.is_empty(), "an existing store was packed again");

    // Both sessions decode the same tokens as the engine opened by hand.
    let prompt = [1u32, 5, 9, 2];
    let a = first
        .engine
        .generate(&prompt, 6, &[], false, |_| {})
        .expect("decode");
    let b = again
        .engine
        .generate(&prompt, 6, &[], false, |_| {})
        .expect("decode");
    let (mut by_hand, _) = engine::open(
        &model,
        &store,
        &LoadOptions::store(&store),
        Placement::Cpu,
        &GpuOptions::default(),
    )
    .expect("open by hand");
    let c = by_hand
        .generate(&prompt, 6, &[], false, |_| {})
        .expect("decode");
    assert_eq!(a.generated_ids.len(), 6);
    assert_eq!(a.generated_ids, b.generated_ids);
    assert_eq!(a.generated_ids, c.generated_ids);
}

#[test]
fn the_store_cache_packs_on_first_use_and_reuses_after() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cache = StoreSource::Cache(Some(tmp.path().join("cache")));
    let (_, opts) = cpu_session(tmp.path(), cache);
    let path = opts.store_path().expect("the cache's file");
    assert!(path.starts_with(tmp.path().join("cache")));
    assert!(!path.exists());

    let (first, events) = open_counting(&opts);
    assert_eq!(first.store, path);
    assert!(
        events.iter().all(|e| e.2),
        "a cache pack not said to be one"
    );
    assert!(!events.is_empty());
    let (_, events) = open_counting(&opts);
    assert!(events.is_empty(), "the cached store was packed again");
}

#[test]
fn a_kv_budget_on_the_cpu_is_refused_before_packing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("experts.ftstore");
    let (_, mut opts) = cpu_session(tmp.path(), StoreSource::File(store.clone()));
    opts.kv = Some((1 << 20, None));
    let err = opts.open(&|_| {}).expect_err("a KV budget on the CPU");
    assert!(
        matches!(err.engine(), Some(EngineError::KvBudgetNeedsGpu { .. })),
        "{err}"
    );
    assert!(!store.exists(), "the store was packed before the refusal");
}

#[test]
fn a_pool_too_small_for_one_step_names_the_records_it_needs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = StoreSource::File(tmp.path().join("experts.ftstore"));
    let (model, mut opts) = cpu_session(tmp.path(), store);
    opts.budget = Some(1);
    let err = match opts.open(&|_| {}) {
        Ok(mut s) => s
            .engine
            .generate(&[1, 2], 1, &[], false, |_| {})
            .map(|_| ())
            .map_err(|e| SessionError::Load {
                model: model.clone(),
                source: Box::new(e),
            })
            .expect_err("a one-byte pool cannot decode"),
        Err(e) => e,
    };
    let needed = err.pool_needs_records().expect("a pool-size error");
    assert!(needed >= 1, "{err}");
    assert!(err.to_string().contains("model"), "{err}");
}

#[test]
fn a_model_folder_without_a_config_names_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let opts = SessionOptions::new(tmp.path().join("nowhere"));
    let err = opts.open(&|_| {}).expect_err("no model");
    assert!(matches!(err, SessionError::Load { .. }), "{err:?}");
    assert!(err.to_string().contains("nowhere"), "{err}");
}
