//! Qwen4-Exp through the scheduler: its decoder holds one sequence's state
//! inside the model, so the server runs it one sequence at a time and keeps
//! no finished sequence for reuse. Sequential and concurrent requests, a
//! prompt repeating an earlier one included, each get the greedy tokens
//! the model decodes for it alone.
#![allow(clippy::unwrap_used, reason = "tests")]

use flashtier_engine::engine::{self, Engine, Placement};
use flashtier_engine::load::{GpuOptions, LoadOptions};
use flashtier_engine::sample::SamplingParams;
use flashtier_pack::pack::{PackOptions, pack_experts};
use flashtier_serve::scheduler::{Event, Finish, Job};
use flashtier_serve::{Scheduler, SchedulerConfig};

fn open(dir: &std::path::Path, store: &std::path::Path) -> Engine {
    let opts = LoadOptions::store(store);
    engine::open(dir, store, &opts, Placement::Cpu, &GpuOptions::default())
        .unwrap()
        .0
}

fn tokens(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token(p) => out.push(p.token),
            Event::Done(Finish::Length) => return out,
            Event::Done(f) => panic!("ended by {f:?}"),
            Event::Failed(e) => panic!("failed: {e}"),
            Event::Started { cached } => assert_eq!(cached, 0, "nothing is kept"),
        }
    }
    panic!("the scheduler stopped")
}

#[test]
fn qwen4_requests_run_one_at_a_time_and_each_gets_its_own_tokens() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine/qwen4_exp");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("experts.ftstore");
    pack_experts(&PackOptions::new(&dir, &store), &|_| {}).unwrap();
    let a: Vec<u32> = (10..22).collect();
    let b: Vec<u32> = (40..47).collect();
    let n = 6;
    let mut alone = open(&dir, &store);
    let first = alone
        .generate(&a, n, &[], false, |_| {})
        .unwrap()
        .generated_ids;
    // The third prompt extends everything the first sequence's cache held
    // (its prompt and all but its last token), the case a kept cache
    // would be reused whole for.
    let a_more: Vec<u32> = a
        .iter()
        .chain(&first[..n - 1])
        .copied()
        .chain([5])
        .collect();
    let mut want = Vec::new();
    for p in [&a, &b, &a_more] {
        alone.reset().unwrap();
        want.push(
            alone
                .generate(p, n, &[], false, |_| {})
                .unwrap()
                .generated_ids,
        );
    }
    let (d, s) = (dir.clone(), store.clone());
    let cfg = SchedulerConfig {
        max_batch: 8,
        max_queue: 8,
        step_rows: 256,
        context: 64,
        prefix_cache_tokens: 4096,
        prefix_spill: None,
    };
    let (sched, thread) = Scheduler::start(move || Ok::<_, String>(open(&d, &s)), cfg).unwrap();
    assert_eq!(
        thread.config().max_batch,
        1,
        "one Qwen4-Exp sequence at a time"
    );
    let job = |p: &Vec<u32>| Job {
        prompt: p.clone(),
        params: SamplingParams::greedy(),
        max_tokens: n,
        stop_ids: Vec::new(),
    };
    // One after another: the third repeats the first's prompt.
    for (p, w) in [&a, &b, &a_more].into_iter().zip(&want) {
        let mut rx = sched.submit(job(p)).unwrap();
        assert_eq!(&tokens(&mut rx), w);
    }
    // All at once: queued, then run in turn.
    let mut rxs: Vec<_> = [&a, &b, &a_more]
        .into_iter()
        .map(|p| sched.submit(job(p)).unwrap())
        .collect();
    for (rx, w) in rxs.iter_mut().zip(&want) {
        assert_eq!(&tokens(rx), w);
    }
    drop(sched);
    thread.join();
}

/// Qwen4-Exp with its PLE rows in the row store, behind HTTP: the row
/// counters on `/metrics` move with the requests (the hit rate is
/// `1 - row_misses_total / row_lookups_total`).
#[test]
fn qwen4_row_store_counters_show_on_metrics() {
    use crate::common::{MODEL, completion, get, metric, post_ok, start_on, wait_metrics};
    use flashtier_engine::family::qwen4::PleRowOptions;
    use flashtier_serve::HttpConfig;

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine/qwen4_exp");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("experts.ftstore");
    pack_experts(&PackOptions::new(&dir, &store), &|_| {}).unwrap();
    let rows = PleRowOptions {
        dir: tmp.path().join("rows"),
        budget_bytes: 1 << 20,
    };
    let cfg = SchedulerConfig {
        max_batch: 1,
        max_queue: 8,
        step_rows: 256,
        context: 64,
        prefix_cache_tokens: 4096,
        prefix_spill: None,
    };
    let http = HttpConfig {
        model_name: MODEL.into(),
        api_key: None,
        max_body_bytes: 1 << 20,
    };
    let s = start_on(cfg, http, move || {
        let opts = LoadOptions::store(&store);
        let gpu = GpuOptions::default();
        engine::open_with_rows(&dir, &store, &opts, Placement::Cpu, &gpu, Some(&rows))
            .unwrap()
            .0
    });
    let (_, text) = get(&s.url("/metrics"));
    assert!(text.contains("# TYPE flashtier_row_lookups_total counter"));
    assert_eq!(metric(&s, "row_lookups_total"), 0);
    let body = |p: Vec<u32>| {
        completion(
            serde_json::json!(p),
            serde_json::json!({"temperature": 0, "max_tokens": 4, "ignore_eos": true}),
        )
    };
    post_ok(&s.url("/v1/completions"), &body((10..22).collect()));
    wait_metrics(
        &s,
        std::time::Duration::from_secs(30),
        "one finished",
        |s| metric(s, "requests_finished_total") == 1,
    );
    let (lookups, misses) = (
        metric(&s, "row_lookups_total"),
        metric(&s, "row_misses_total"),
    );
    assert!(
        lookups > 0 && misses > 0 && misses <= lookups,
        "{lookups} {misses}"
    );
    assert!(metric(&s, "row_bytes_read_total") >= 4096);
    // The same prompt again: its rows are in the cache now.
    post_ok(&s.url("/v1/completions"), &body((10..22).collect()));
    wait_metrics(
        &s,
        std::time::Duration::from_secs(30),
        "two finished",
        |s| metric(s, "requests_finished_total") == 2,
    );
    assert!(metric(&s, "row_lookups_total") > lookups);
    assert!(metric(&s, "row_hits_total") > 0);
    assert_eq!(
        metric(&s, "row_misses_total"),
        misses,
        "every row was cached"
    );
}
