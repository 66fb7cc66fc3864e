//! The prefix cache's spill to the KV tier, end to end over HTTP on the
//! tiny Qwen3-MoE fixture: a prompt reusing a spilled cache gets the same
//! tokens and logprobs (so the same logits) as one computed from scratch
//! and one reusing a cache kept in memory; a spilled cache whose store was
//! damaged or whose read fails is recomputed, with the same answer; the
//! spill's and the tiers' counters are on `/metrics`; the store file goes
//! when the server stops. Spill writes run on the spill's writer thread:
//! where a step needs an entry on the drive, the test first waits for the
//! write to show on `/metrics`.
#![allow(clippy::unwrap_used, reason = "test")]

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use flashtier_format::kv::{BlockId, BlockOrder, GroupLayout, KvGeometry};
use flashtier_io::sim::{Fault, FaultPlan, OpKind, SimBackend};
use flashtier_serve::SchedulerConfig;
use flashtier_serve::prefix::SpillConfig;
use serde_json::{Value, json};

const COMPLETIONS: &str = "/v1/completions";
/// Positions kept in memory: one 55-position cache, not two.
const MEMORY: usize = 64;
/// Positions the drive holds: 16 blocks.
const DRIVE: usize = 256;

fn spill_config(dir: &Path, backend: Option<SimBackend>) -> SchedulerConfig {
    let mut spill = SpillConfig::new(dir, DRIVE);
    spill.backend = backend.map(|b| Arc::new(b) as _);
    SchedulerConfig {
        prefix_cache_tokens: MEMORY,
        prefix_spill: Some(spill),
        ..default_config()
    }
}

/// `n` prompt ids of the fixture's vocabulary, different for each `seed`.
fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 101 + 11) % 380)
        .collect()
}

/// A greedy completion of `prompt` with 3 logprobs a token: the choice and
/// the reused prompt positions.
fn complete(s: &Server, prompt: &[u32]) -> (Value, u64) {
    let body = completion(
        json!(prompt),
        json!({"temperature": 0, "max_tokens": 8, "ignore_eos": true, "logprobs": 3}),
    );
    let v = post_ok(&s.url(COMPLETIONS), &body);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (choice(&v).clone(), cached)
}

fn finished(s: &Server, n: u64) {
    wait_metrics(s, Duration::from_secs(30), "requests to finish", |s| {
        metric(s, "requests_finished_total") >= n
    });
}

/// Wait until `n` spill writes finished (the scheduler collects them
/// between steps, and every 200 ms while idle).
fn spills_written(s: &Server, n: u64) {
    wait_metrics(s, Duration::from_secs(30), "spill writes", |s| {
        metric(s, "prefix_spilled_total") + metric(s, "prefix_spill_failures_total") >= n
    });
}

/// The store file of the one server spilling into `dir`.
fn store_in(dir: &Path) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "ftkv"))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found.remove(0)
}

/// Where block (`layer`, `block`) of the spill store sits: 3 layers, 2 kv
/// heads, 16 tokens of 64 stored values (head_dim 32 as BF16 pairs).
fn block_offset(layer: u32, block: u32) -> u64 {
    let g = KvGeometry {
        num_layers: 3,
        num_blocks: (DRIVE / 16) as u32,
        num_kv_heads: 2,
        block_tokens: 16,
        head_dim: 64,
        dtype_bytes: 2,
    };
    let layout = GroupLayout::new(g, BlockOrder::BlockMajor).unwrap();
    layout
        .block_extent(BlockId::new(layer, block))
        .unwrap()
        .offset
}

/// Run `a` (48 ids: a 55-position cache), then `b` (30 ids), which pushes
/// `a`'s cache to the drive; returns `a`'s first answer.
fn spill_a(s: &Server, a: &[u32], b: &[u32]) -> Value {
    let (first, cached) = complete(s, a);
    assert_eq!(cached, 0);
    finished(s, 1);
    let before = metric(s, "requests_finished_total");
    complete(s, b);
    finished(s, before + 1);
    spills_written(s, 1);
    assert_eq!(metric(s, "prefix_spilled_total"), 1);
    assert_eq!(metric(s, "prefix_spill_tokens"), 55);
    first
}

#[test]
fn a_spilled_cache_gives_the_bits_of_a_fresh_and_a_kept_one() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(spill_config(dir.path(), None), None);
    let fresh = start(
        SchedulerConfig {
            prefix_cache_tokens: 0,
            ..default_config()
        },
        None,
    );
    let (a, b) = (ids(48, 1), ids(30, 2));
    let (scratch, _) = complete(&fresh, &a);
    let first = spill_a(&s, &a, &b);
    assert_eq!(first, scratch);
    let (restored, cached) = complete(&s, &a);
    assert_eq!(cached, 47, "all of the prompt but its last token");
    assert_eq!(restored, scratch);
    finished(&s, 3);
    assert_eq!(metric(&s, "prefix_restored_total"), 1);
    assert_eq!(metric(&s, "prompt_tokens_cached_restored_total"), 47);
    // `a` is back in memory (`b` went to the drive): the kept copy.
    let (kept, cached) = complete(&s, &a);
    assert_eq!((cached, &kept), (47, &scratch));
    assert_eq!(metric(&s, "prefix_restored_total"), 1);

    // `b` comes back from the drive, pushing `a` out; then a prompt sharing
    // 20 of `a`'s ids restores two blocks, cuts back, and decodes the
    // tokens `run` decodes from scratch.
    spills_written(&s, 2);
    complete(&s, &b);
    finished(&s, 5);
    spills_written(&s, 3);
    let mut c = a[..20].to_vec();
    c.extend(ids(9, 3));
    let (got, cached) = complete(&s, &c);
    assert_eq!(cached, 20);
    assert_eq!(got, complete(&fresh, &c).0);
    let g = open_engine().generate(&c, 8, &[], false, |_| {}).unwrap();
    assert_eq!(got["text"], text().decode(&g.generated_ids, true).unwrap());
    finished(&s, 6);
    assert_eq!(metric(&s, "prefix_restored_total"), 3);
    assert_eq!(metric(&s, "prefix_restore_failures_total"), 0);
    assert_eq!(metric(&s, "requests_failed_total"), 0);
    let store = store_in(dir.path());
    assert_eq!(
        std::fs::metadata(&store).unwrap().len(),
        block_offset(0, (DRIVE / 16) as u32 - 1) + 3 * 16384,
        "the store's fixed length"
    );
    drop(s);
    assert!(!store.exists(), "the store goes when the server stops");
}

/// `a` spilled, its store damaged by `damage` (or its read failed by the
/// simulator's plan): the prompt is computed whole, with the same answer.
fn recomputes(backend: Option<SimBackend>, damage: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let s = start(spill_config(dir.path(), backend), None);
    let (a, b) = (ids(48, 1), ids(30, 2));
    let first = spill_a(&s, &a, &b);
    damage(&store_in(dir.path()));
    let (again, cached) = complete(&s, &a);
    assert_eq!((cached, &again), (0, &first));
    finished(&s, 3);
    assert_eq!(metric(&s, "prefix_restore_failures_total"), 1);
    assert_eq!(metric(&s, "prefix_restored_total"), 0);
    assert_eq!(metric(&s, "prompt_tokens_cached_restored_total"), 0);
    assert_eq!(metric(&s, "requests_failed_total"), 0);
}

#[test]
fn a_corrupt_spilled_block_is_recomputed() {
    recomputes(None, |store| {
        let f = std::fs::OpenOptions::new().write(true).open(store).unwrap();
        f.write_all_at(&[0xa5; 16], block_offset(2, 2) + 64)
            .unwrap();
    });
}

#[test]
fn a_failed_spill_read_is_recomputed() {
    let plan = FaultPlan::seeded(21).fail_nth(OpKind::Read, 1, Fault::Eio);
    recomputes(Some(SimBackend::new(plan, 2).unwrap()), |_| {});
}

#[test]
fn a_short_read_of_a_cut_store_is_recomputed() {
    let sim = SimBackend::new(FaultPlan::seeded(22).short_reads(0.5), 2).unwrap();
    recomputes(Some(sim), |store| {
        let f = std::fs::OpenOptions::new().write(true).open(store).unwrap();
        f.set_len(block_offset(0, 1)).unwrap();
    });
}

/// The names `/metrics` must carry, each with its HELP and TYPE lines.
const NEW_METRICS: [&str; 17] = [
    "expert_lookups_total",
    "row_lookups_total",
    "row_hits_total",
    "row_misses_total",
    "row_bytes_read_total",
    "kv_offloaded_bytes_total",
    "kv_seq_offloaded_bytes_total",
    "prompt_tokens_cached_restored_total",
    "prefix_spilled_total",
    "prefix_spill_failures_total",
    "prefix_restored_total",
    "prefix_restore_failures_total",
    "prefix_spill_dropped_total",
    "prefix_spill_queue_full_total",
    "prefix_spill_taken_writing_total",
    "prefix_spill_bytes_written_total",
    "prefix_spill_bytes_read_total",
];

#[test]
fn metrics_carry_the_spill_and_tier_counters_and_they_move() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(spill_config(dir.path(), None), None);
    let (_, text) = get(&s.url("/metrics"));
    for name in NEW_METRICS.iter().chain(&["prefix_spill_tokens"]) {
        assert!(
            text.contains(&format!("# HELP flashtier_{name} ")),
            "{name}"
        );
        assert!(
            text.contains(&format!("# TYPE flashtier_{name} ")),
            "{name}"
        );
        assert_eq!(metric(&s, name), 0, "{name} before any request");
    }
    let (a, b) = (ids(48, 1), ids(30, 2));
    spill_a(&s, &a, &b);
    complete(&s, &a);
    finished(&s, 3);
    spills_written(&s, 2);
    // Out: `a`'s 55 positions (4 blocks of 3 layers, 16 KiB each), then
    // `b`'s 37 (3 blocks) when `a` came back. In: the 3 blocks holding
    // `a`'s 47 reused positions.
    let block = 3 * 16384;
    assert_eq!(metric(&s, "prefix_spilled_total"), 2);
    assert_eq!(metric(&s, "prefix_spill_bytes_written_total"), 7 * block);
    assert_eq!(metric(&s, "prefix_spill_bytes_read_total"), 3 * block);
    assert_eq!(metric(&s, "kv_offloaded_bytes_total"), 7 * block);
    assert_eq!(metric(&s, "kv_seq_offloaded_bytes_total"), 0, "no GPU");
    assert_eq!(metric(&s, "prefix_restored_total"), 1);
    let lookups = metric(&s, "expert_lookups_total");
    assert!(lookups > 0);
    assert_eq!(
        lookups,
        metric(&s, "expert_hits_total") + metric(&s, "expert_misses_total")
    );
    assert_eq!(metric(&s, "row_lookups_total"), 0, "no row store");
    // `a` came back to memory and pushed `b` to the drive.
    assert_eq!(metric(&s, "prefix_spill_tokens"), 37);
    assert_eq!(metric(&s, "prefix_cache_tokens"), 55);
}

/// A prompt whose reuse is on the drive does not hold up a sequence that
/// is decoding: while its restore waits on slow reads (every store
/// operation takes 400 ms in the simulator), the other stream keeps
/// getting tokens, and the restored prompt still answers as from scratch.
#[test]
fn a_restore_from_the_drive_does_not_stall_the_running_batch() {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::seeded(23).latency(1.0, Duration::from_millis(400));
    let s = start(
        spill_config(dir.path(), Some(SimBackend::new(plan, 2).unwrap())),
        None,
    );
    let (a, b) = (ids(48, 1), ids(30, 2));
    let first = spill_a(&s, &a, &b);
    let long = completion(
        json!(ids(10, 5)),
        json!({"temperature": 0, "max_tokens": 240, "ignore_eos": true, "stream": true}),
    );
    let mut stream = open_stream(&s.url(COMPLETIONS), &long);
    assert!(
        stream.next_data().is_some(),
        "the long stream's first event"
    );
    let url = s.url(COMPLETIONS);
    let restore = std::thread::spawn(move || {
        let body = completion(
            json!(a),
            json!({"temperature": 0, "max_tokens": 8, "ignore_eos": true, "logprobs": 3}),
        );
        let start = std::time::Instant::now();
        let v = post_ok(&url, &body);
        (v, start, std::time::Instant::now())
    });
    let mut arrivals = Vec::new();
    while let Some(d) = stream.next_data() {
        if d == "[DONE]" {
            break;
        }
        arrivals.push(std::time::Instant::now());
    }
    let (v, start, end) = restore.join().unwrap();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 47);
    assert_eq!(choice(&v), &first);
    assert!(
        end - start >= Duration::from_millis(400),
        "the restore took {:?}",
        end - start
    );
    let during = arrivals
        .iter()
        .filter(|&&t| t > start + Duration::from_millis(50) && t + Duration::from_millis(50) < end)
        .count();
    assert!(
        during >= 3,
        "{during} tokens of the other stream while the restore ran ({:?}); {} in all",
        end - start,
        arrivals.len()
    );
    assert_eq!(metric(&s, "prefix_restored_total"), 1);
}
