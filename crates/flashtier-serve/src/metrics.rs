//! `/metrics`: the scheduler's counters in Prometheus' text format.

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
        "Positions held in kept KV caches.",
        g(&c.prefix_cache_tokens),
    );
    s
}
