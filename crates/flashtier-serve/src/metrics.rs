//! `/metrics`: the scheduler's counters in Prometheus' text format. Every
//! value is an integer (counters and gauges); a rate is a pair of counters
//! (`expert_hits_total` / `expert_lookups_total`, `row_misses_total` /
//! `row_lookups_total`).

use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::scheduler::Counters;

/// The exposition text.
#[must_use]
pub fn render(c: &Counters) -> String {
    let mut s = String::new();
    let mut put = |name: &str, kind: &str, help: &str, v: u64| {
        let _ = writeln!(s, "# HELP flashtier_{name} {help}");
        let _ = writeln!(s, "# TYPE flashtier_{name} {kind}");
        let _ = writeln!(s, "flashtier_{name} {v}");
    };
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let g = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as u64;
    put(
        "requests_total",
        "counter",
        "Requests taken.",
        l(&c.requests),
    );
    put(
        "requests_rejected_total",
        "counter",
        "Requests refused at the queue limit (HTTP 429).",
        l(&c.rejected),
    );
    put(
        "requests_finished_total",
        "counter",
        "Requests ended (any way).",
        l(&c.finished),
    );
    put(
        "requests_failed_total",
        "counter",
        "Requests the engine failed.",
        l(&c.failed),
    );
    put(
        "requests_cancelled_total",
        "counter",
        "Requests whose client went away or whose stop string matched.",
        l(&c.cancelled),
    );
    put(
        "requests_waiting",
        "gauge",
        "Requests waiting for a batch slot.",
        g(&c.waiting),
    );
    put(
        "requests_running",
        "gauge",
        "Requests in the batch.",
        g(&c.running),
    );
    put(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens taken.",
        l(&c.prompt_tokens),
    );
    put(
        "prompt_tokens_cached_total",
        "counter",
        "Prompt tokens reused from kept KV caches.",
        l(&c.cached_tokens),
    );
    put(
        "generation_tokens_total",
        "counter",
        "Output tokens picked.",
        l(&c.generated_tokens),
    );
    put("steps_total", "counter", "Engine steps.", l(&c.steps));
    put(
        "step_rows_total",
        "counter",
        "Rows (tokens) over all engine steps.",
        l(&c.step_rows),
    );
    put(
        "step_ns_total",
        "counter",
        "Nanoseconds in engine steps.",
        l(&c.step_ns),
    );
    put(
        "expert_bytes_read_total",
        "counter",
        "Expert bytes read from the store.",
        l(&c.expert_bytes_read),
    );
    put(
        "expert_hits_total",
        "counter",
        "Expert uses served from memory.",
        l(&c.expert_hits),
    );
    put(
        "expert_stall_ns_total",
        "counter",
        "Nanoseconds the engine waited for expert reads (stall share: over step_ns_total).",
        l(&c.expert_stall_ns),
    );
    put(
        "expert_records_used_total",
        "counter",
        "Expert records the steps used, each once per step and layer.",
        l(&c.expert_records_used),
    );
    put(
        "decode_steps_total",
        "counter",
        "Steps of decode tokens only.",
        l(&c.decode_steps),
    );
    put(
        "decode_step_rows_total",
        "counter",
        "Rows of decode-only steps.",
        l(&c.decode_rows),
    );
    put(
        "decode_step_ns_total",
        "counter",
        "Nanoseconds of decode-only steps.",
        l(&c.decode_step_ns),
    );
    put(
        "expert_misses_total",
        "counter",
        "Expert uses read from the store.",
        l(&c.expert_misses),
    );
    put(
        "prefix_cache_tokens",
        "gauge",
        "Positions held in kept KV caches in memory.",
        g(&c.prefix_cache_tokens),
    );
    let hits = l(&c.expert_hits);
    put(
        "expert_lookups_total",
        "counter",
        "Expert uses, hits and misses (hit rate: expert_hits_total over this).",
        hits + l(&c.expert_misses),
    );
    for (name, help, v) in tier_counters(c) {
        put(name, "counter", help, v);
    }
    put(
        "prefix_spill_tokens",
        "gauge",
        "Positions held in kept KV caches spilled to the drive.",
        g(&c.prefix_spill_tokens),
    );
    s
}

/// The row store's, the KV tier's and the prefix spill's counters.
fn tier_counters(c: &Counters) -> [(&'static str, &'static str, u64); 16] {
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (r, p) = (&c.rows, &c.prefix_spill);
    let spill_written = l(&p.bytes_written);
    [
        (
            "row_lookups_total",
            "Row-store lookups (PLE/Engram rows; 0 without a row store).",
            l(&r.lookups),
        ),
        (
            "row_hits_total",
            "Row-store lookups served from its RAM cache (read-ahead rows included).",
            l(&r.hits),
        ),
        (
            "row_misses_total",
            "Rows read from the row shards (hit rate: 1 - row_misses_total / row_lookups_total).",
            l(&r.misses),
        ),
        (
            "row_bytes_read_total",
            "Bytes read from the row shards.",
            l(&r.bytes_read),
        ),
        (
            "kv_offloaded_bytes_total",
            "KV bytes written to the KV tier on the drive: sequence caches past their HBM budget \
             plus prefix-cache spills.",
            l(&c.kv_seq_offloaded_bytes) + spill_written,
        ),
        (
            "kv_seq_offloaded_bytes_total",
            "KV bytes sequence caches wrote to the KV tier (a GPU cache past its HBM budget).",
            l(&c.kv_seq_offloaded_bytes),
        ),
        (
            "prompt_tokens_cached_restored_total",
            "Prompt tokens reused from kept KV caches restored from the drive.",
            l(&c.cached_restored_tokens),
        ),
        (
            "prefix_spilled_total",
            "Kept KV caches written to the drive when they left memory.",
            l(&p.spilled),
        ),
        (
            "prefix_spill_failures_total",
            "Kept KV caches whose write to the drive failed (dropped).",
            l(&p.spill_failures),
        ),
        (
            "prefix_restored_total",
            "Spilled KV caches read back, verified, for a prompt.",
            l(&p.restored),
        ),
        (
            "prefix_restore_failures_total",
            "Spilled KV caches that failed to read back or verify (the prompt was recomputed).",
            l(&p.restore_failures),
        ),
        (
            "prefix_spill_dropped_total",
            "Spilled KV caches dropped to make room on the drive; kept ones too large for it or \
             finding too few free blocks.",
            l(&p.dropped),
        ),
        (
            "prefix_spill_queue_full_total",
            "Kept KV caches dropped because the spill's write queue was full.",
            l(&p.queue_full),
        ),
        (
            "prefix_spill_taken_writing_total",
            "Kept KV caches a prompt took from memory while their spill write was in flight.",
            l(&p.taken_writing),
        ),
        (
            "prefix_spill_bytes_written_total",
            "Bytes of the entries the prefix spill wrote to its store.",
            spill_written,
        ),
        (
            "prefix_spill_bytes_read_total",
            "Bytes the prefix spill read back and verified.",
            l(&p.bytes_read),
        ),
    ]
}
