//! The engine's, the tiers' and the prefix cache's counters copied into
//! [`Counters`] for `/metrics`, after each step and each admission.

use std::sync::atomic::Ordering;

use flashtier_engine::engine::{Engine, SeqKv};

use super::Counters;
use crate::prefix::PrefixCache;

/// Expert and row-store counters (cumulative in the engine: stored).
pub(super) fn engine(engine: &Engine, c: &Counters) {
    let e = engine.expert_stats();
    c.expert_bytes_read.store(e.bytes_read, Ordering::Relaxed);
    c.expert_hits.store(e.hits, Ordering::Relaxed);
    c.expert_misses.store(e.misses, Ordering::Relaxed);
    c.expert_stall_ns.store(e.stall_ns, Ordering::Relaxed);
    c.expert_records_used
        .store(e.records_used, Ordering::Relaxed);
    if let Some(r) = engine.row_stats() {
        c.rows.lookups.store(r.lookups, Ordering::Relaxed);
        c.rows.hits.store(r.hits, Ordering::Relaxed);
        c.rows.misses.store(r.misses, Ordering::Relaxed);
        c.rows.bytes_read.store(r.bytes_read, Ordering::Relaxed);
    }
}

/// KV bytes a sequence's cache wrote to the KV tier since `seen` (its
/// count at the last call), added to the counter; returns the new count.
pub(super) fn kv_offloaded(kv: &SeqKv, seen: u64, c: &Counters) -> u64 {
    let now = kv.tier_stats().map_or(seen, |t| t.offloaded_bytes);
    c.kv_seq_offloaded_bytes
        .fetch_add(now.saturating_sub(seen), Ordering::Relaxed);
    now
}

/// The kept caches' positions and the spill's counters.
pub(super) fn prefix(p: &PrefixCache, c: &Counters) {
    c.prefix_cache_tokens.store(p.held(), Ordering::Relaxed);
    c.prefix_spill_tokens.store(p.spilled(), Ordering::Relaxed);
    let Some(s) = p.spill().map(crate::prefix::PrefixSpill::stats) else {
        return;
    };
    let to = &c.prefix_spill;
    for (counter, v) in [
        (&to.spilled, s.spilled),
        (&to.spill_failures, s.spill_failures),
        (&to.restored, s.restored),
        (&to.restore_failures, s.restore_failures),
        (&to.dropped, s.dropped),
        (&to.queue_full, s.queue_full),
        (&to.taken_writing, s.taken_writing),
        (&to.bytes_written, s.bytes_written),
        (&to.bytes_read, s.bytes_read),
    ] {
        counter.store(v, Ordering::Relaxed);
    }
}
