//! Replay a routing trace against a real expert store under a budget, and
//! report the pool's hit rate beside LRU's and Belady's on the same trace and
//! capacity, plus bytes read, achieved bytes/s and the stall per token.
//!
//! Trace layer `i` is the store's `i`-th MoE layer (its distinct key layers in
//! ascending order); trace expert `e` is that layer's key `(layer, e)`. Each
//! (token, layer) is one pool step: acquire, plan, run, finish. There is no
//! compute in a replay, so every moment spent in the pool is stall: the
//! stall per token is the pool's wall time divided by the tokens.
//!
//! With `prefetch`, after each step the pool prefetches, for the next layer,
//! the experts that layer used at the previous token (a predictor that needs
//! no router).
//!
//! ```
//! use std::sync::Arc;
//! use flashtier::experts::replay::{ReplayConfig, replay};
//! use flashtier::experts::tracegen::{TraceFamily, generate};
//! use flashtier::experts::{StoreSet, testing::write_store};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("e.ftstore");
//! write_store(&path, 4, 16, 4096)?;
//! let trace = generate(&TraceFamily::Decode.params(4, 16, 2, 40, 1))?;
//! let stores = StoreSet::open(&path, false)?;
//! let backend = Arc::new(flashtier_io::PosixBackend::new(4)?);
//! let config = ReplayConfig { budget_bytes: 16 * 4096, ..ReplayConfig::default() };
//! let report = replay(stores, backend, &trace, &config, &mut |_, _| {})?;
//! assert!(report.hit_rate <= report.belady_hit_rate);
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Instant;

use flashtier_io::StorageBackend;

use super::ExpertsError;
use super::policy::PolicyKind;
use super::pool::{Backing, ExpertPool, PoolConfig};
use super::sim::{SimError, belady, simulate};
use super::store::StoreSet;
use super::trace::RoutingTrace;
use super::tracegen::{TraceFamily, generate};
use super::tracking::ReadSource;

/// Options of a replay.
#[derive(Debug, Clone, Copy)]
pub struct ReplayConfig {
    /// Pool budget in bytes.
    pub budget_bytes: u64,
    /// Eviction policy of the pool.
    pub policy: PolicyKind,
    /// Backing of the pool.
    pub backing: Backing,
    /// Prefetch the next layer's previous-token experts.
    pub prefetch: bool,
    /// Mapped backing: drop the store's cached pages first (a cold start).
    pub cold_start: bool,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            budget_bytes: 256 << 20,
            policy: PolicyKind::default(),
            backing: Backing::Slots,
            prefetch: false,
            cold_start: true,
        }
    }
}

/// What a replay measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplayReport {
    /// Policy of the pool.
    pub policy: PolicyKind,
    /// Backing of the pool.
    pub backing: Backing,
    /// Budget in bytes.
    pub budget_bytes: u64,
    /// Capacity in records.
    pub capacity_records: usize,
    /// Record stride in bytes.
    pub record_bytes: u64,
    /// Tokens replayed.
    pub tokens: usize,
    /// Record uses.
    pub accesses: u64,
    /// The pool's hit rate.
    pub hit_rate: f64,
    /// LRU's hit rate on the same trace and capacity.
    pub lru_hit_rate: f64,
    /// Belady's MIN hit rate on the same trace and capacity (the bound).
    pub belady_hit_rate: f64,
    /// The same policy simulated without I/O (equals `hit_rate` without
    /// prefetch and failures).
    pub policy_sim_hit_rate: f64,
    /// Mapped backing: records found in the page cache.
    pub page_cache_records: u64,
    /// Bytes read from the drive.
    pub bytes_read: u64,
    /// Bytes read by prefetches.
    pub prefetch_bytes: u64,
    /// Prefetched bytes then used.
    pub prefetch_used_bytes: u64,
    /// Wall time of the replay in seconds.
    pub elapsed_s: f64,
    /// Bytes read per second of pool time.
    pub bytes_per_sec: f64,
    /// Pool (stall) time per token in milliseconds.
    pub stall_ms_per_token: f64,
    /// Miss read latency percentiles (ns).
    pub read_latency_ns_p50: u64,
    /// 99th percentile.
    pub read_latency_ns_p99: u64,
    /// 99.9th percentile.
    pub read_latency_ns_p999: u64,
}

/// A replay that could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The trace does not fit the store.
    #[error("trace does not fit the store: {0}")]
    Mismatch(String),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] ExpertsError),
    /// The budget cannot hold one step.
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// The routing shape of a store: MoE layers, experts per layer, experts per
/// token (from the manifest's model facts, else `min(8, experts)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StoreShape {
    /// Layers with experts.
    pub layers: u32,
    /// Experts per layer (the smallest layer's count).
    pub experts: u32,
    /// Experts chosen per token per layer.
    pub top_k: u32,
}

/// The routing shape of `stores`.
#[must_use]
pub fn store_shape(stores: &StoreSet) -> StoreShape {
    let manifest = stores.full().store.manifest();
    let mut per_layer: std::collections::BTreeMap<u32, u32> = std::collections::BTreeMap::new();
    for k in &manifest.keys {
        *per_layer.entry(k.layer).or_default() += 1;
    }
    let experts = per_layer.values().copied().min().unwrap_or(0);
    let top_k = manifest
        .model
        .as_ref()
        .and_then(|m| m.experts_per_token)
        .unwrap_or(8)
        .clamp(1, experts.max(1));
    StoreShape {
        layers: per_layer.len() as u32,
        experts,
        top_k,
    }
}

/// A synthetic decode trace of `tokens` tokens shaped like `stores`.
pub fn synth_trace(
    stores: &StoreSet,
    family: TraceFamily,
    tokens: u32,
    seed: u64,
) -> Result<RoutingTrace, ReplayError> {
    let s = store_shape(stores);
    generate(&family.params(s.layers, s.experts, s.top_k, tokens, seed))
        .map_err(|e| ReplayError::Mismatch(e.to_string()))
}

/// Store record index of every (trace layer, expert).
fn record_map(stores: &StoreSet, trace: &RoutingTrace) -> Result<Vec<Vec<usize>>, ReplayError> {
    let mut layers: Vec<u32> = stores
        .full()
        .store
        .manifest()
        .keys
        .iter()
        .map(|k| k.layer)
        .collect();
    layers.sort_unstable();
    layers.dedup();
    if (trace.layers as usize) > layers.len() {
        return Err(ReplayError::Mismatch(format!(
            "trace has {} layers, store {}",
            trace.layers,
            layers.len()
        )));
    }
    layers
        .iter()
        .take(trace.layers as usize)
        .map(|&layer| {
            (0..trace.experts)
                .map(|e| {
                    stores.index_of(layer, e).map_err(|_| {
                        ReplayError::Mismatch(format!(
                            "store has no expert {e} in layer {layer} (trace has {} experts)",
                            trace.experts
                        ))
                    })
                })
                .collect()
        })
        .collect()
}

/// Replay `trace`; `progress(done, total)` is called after each token.
pub fn replay(
    stores: StoreSet,
    backend: Arc<dyn StorageBackend>,
    trace: &RoutingTrace,
    config: &ReplayConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayReport, ReplayError> {
    let map = record_map(&stores, trace)?;
    let record_bytes = stores.full().read_bytes() as u64;
    if config.cold_start
        && let Some(m) = &stores.full().map
    {
        m.drop_cached(0, m.len_bytes())
            .map_err(ExpertsError::from)?;
    }
    let pool_config = PoolConfig {
        backing: config.backing,
        budget_bytes: config.budget_bytes,
        policy: config.policy,
    };
    let mut pool = ExpertPool::new(stores, backend, pool_config)?;
    let capacity = pool.capacity();
    let lru = simulate(trace, PolicyKind::Lru, capacity)?;
    let opt = belady(trace, capacity)?;
    let same = simulate(trace, config.policy, capacity)?;
    let started = Instant::now();
    let mut pool_ns: u128 = 0;
    let mut page_cache = 0u64;
    for (t, step) in trace.steps.iter().enumerate() {
        for (l, route) in step.layers.iter().enumerate() {
            let recs: Vec<usize> = route.ids.iter().map(|&e| map[l][e as usize]).collect();
            let t0 = Instant::now();
            let need = pool.acquire(&recs)?;
            let plan = pool.plan(&need)?;
            page_cache += plan.page_cache_hits() as u64;
            pool.run(plan)?;
            pool.finish()?;
            pool_ns += t0.elapsed().as_nanos();
            if config.prefetch
                && let (Some(next), Some(prev)) = (
                    map.get(l + 1),
                    t.checked_sub(1).and_then(|p| trace.steps.get(p)),
                )
                && let Some(prev_route) = prev.layers.get(l + 1)
            {
                let t1 = Instant::now();
                let layer = pool.stores().layer_of(next[0]);
                pool.prefetch(layer, &prev_route.ids)?;
                pool_ns += t1.elapsed().as_nanos();
            }
        }
        progress(t + 1, trace.steps.len());
    }
    let s = pool.stats();
    let pool_s = pool_ns as f64 / 1e9;
    let tokens = trace.steps.len();
    Ok(ReplayReport {
        policy: config.policy,
        backing: config.backing,
        budget_bytes: config.budget_bytes,
        capacity_records: capacity,
        record_bytes,
        tokens,
        accesses: s.accesses,
        hit_rate: if s.accesses == 0 {
            0.0
        } else {
            s.hits as f64 / s.accesses as f64
        },
        lru_hit_rate: lru.rate(),
        belady_hit_rate: opt.rate(),
        policy_sim_hit_rate: same.rate(),
        page_cache_records: page_cache,
        bytes_read: s.bytes_read,
        prefetch_bytes: s.prefetch_bytes,
        prefetch_used_bytes: s.prefetch_used_bytes,
        elapsed_s: started.elapsed().as_secs_f64(),
        bytes_per_sec: if pool_s > 0.0 {
            s.bytes_read as f64 / pool_s
        } else {
            0.0
        },
        stall_ms_per_token: if tokens == 0 {
            0.0
        } else {
            pool_s * 1e3 / tokens as f64
        },
        read_latency_ns_p50: pool.tracker().latency_ns_quantile(ReadSource::Disk, 0.5),
        read_latency_ns_p99: pool.tracker().latency_ns_quantile(ReadSource::Disk, 0.99),
        read_latency_ns_p999: pool.tracker().latency_ns_quantile(ReadSource::Disk, 0.999),
    })
}
