//! `flashtier replay`: replay a routing trace against an expert store under a
//! memory budget and compare the pool's hit rate with LRU and Belady's MIN.

use std::io::BufReader;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use flashtier::experts::replay::{ReplayConfig, ReplayReport, replay, synth_trace};
use flashtier::experts::trace::RoutingTrace;
use flashtier::experts::tracegen::TraceFamily;
use flashtier::experts::{Backing, PolicyKind, StoreSet};
use flashtier_io::{BackendKind, open_backend};

use crate::kit::{count_bar, parse_bytes};

/// Options of `flashtier replay`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Expert store to read.
    #[arg(long)]
    pub store: PathBuf,
    /// Routing trace (JSON Lines, see docs), or `synth:<family>` with family
    /// zipf | local | correlated | drift | decode, generated for the store's shape.
    #[arg(long)]
    pub trace: String,
    /// Memory budget for resident records in bytes (K, M, G, T: powers of 1024).
    #[arg(long, value_parser = parse_bytes)]
    pub budget: u64,
    /// Eviction policy: layer-clock (default) | s3-fifo | sieve | lru.
    #[arg(long, default_value = "default")]
    pub policy: PolicyKind,
    /// Backing: slots (direct reads into an arena) | mapped (mmap + page
    /// cache; the store must not be modified in place while mapped, replacing
    /// it by rename is safe: a changed record fails its checksum, a truncated
    /// store is an error, a truncation racing a read can still raise SIGBUS).
    #[arg(long, default_value = "slots")]
    pub backing: Backing,
    /// I/O backend: uring (falls back to posix) | posix | sim.
    #[arg(long, default_value = "uring")]
    pub backend: BackendKind,
    /// Reads kept in flight.
    #[arg(long, default_value_t = 32)]
    pub queue_depth: usize,
    /// Prefetch each next layer's experts of the previous token.
    #[arg(long)]
    pub prefetch: bool,
    /// Mapped backing: keep the store's cached pages (default: drop them first).
    #[arg(long)]
    pub warm: bool,
    /// Tokens of a synthetic trace.
    #[arg(long, default_value_t = 256)]
    pub tokens: u32,
    /// Seed of a synthetic trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn load_trace(args: &Args, stores: &StoreSet) -> anyhow::Result<RoutingTrace> {
    if let Some(name) = args.trace.strip_prefix("synth:") {
        let family: TraceFamily = name.parse().map_err(anyhow::Error::msg)?;
        return Ok(synth_trace(stores, family, args.tokens, args.seed)?);
    }
    let file = std::fs::File::open(&args.trace)
        .with_context(|| format!("opening trace {}", args.trace))?;
    RoutingTrace::parse(BufReader::new(file))
        .with_context(|| format!("parsing trace {}", args.trace))
}

/// Run `flashtier replay`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let stores = StoreSet::open(&args.store, args.backing == Backing::Mapped)
        .with_context(|| format!("opening store {}", args.store.display()))?;
    let trace = load_trace(&args, &stores)?;
    let backend: Arc<dyn flashtier_io::StorageBackend> =
        open_backend(args.backend, args.queue_depth)?.into();
    let config = ReplayConfig {
        budget_bytes: args.budget,
        policy: args.policy,
        backing: args.backing,
        prefetch: args.prefetch,
        cold_start: !args.warm,
    };
    let bar = count_bar(trace.steps.len() as u64, "replay", !args.json);
    let report = replay(stores, backend, &trace, &config, &mut |done, _| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(r: &ReplayReport) {
    let mb = |b: f64| b / 1e6;
    println!(
        "replay: {} tokens, {} record uses, budget {:.1} MB = {} records of {} KiB ({} backing, policy {})",
        r.tokens,
        r.accesses,
        mb(r.budget_bytes as f64),
        r.capacity_records,
        r.record_bytes / 1024,
        match r.backing {
            Backing::Mapped => "mapped",
            Backing::Slots => "slots",
        },
        r.policy
    );
    println!(
        "hit rate {:.1}%   LRU {:.1}%   Belady (MIN) {:.1}%",
        100.0 * r.hit_rate,
        100.0 * r.lru_hit_rate,
        100.0 * r.belady_hit_rate
    );
    if r.page_cache_records > 0 {
        println!(
            "page cache supplied {} records without a read",
            r.page_cache_records
        );
    }
    println!(
        "read {:.1} MB at {:.1} MB/s; stall {:.3} ms/token; miss latency p50 {:.2} ms p99 {:.2} ms p999 {:.2} ms",
        mb(r.bytes_read as f64),
        mb(r.bytes_per_sec),
        r.stall_ms_per_token,
        r.read_latency_ns_p50 as f64 / 1e6,
        r.read_latency_ns_p99 as f64 / 1e6,
        r.read_latency_ns_p999 as f64 / 1e6
    );
    if r.prefetch_bytes > 0 {
        println!(
            "prefetched {:.1} MB, of which {:.1} MB used",
            mb(r.prefetch_bytes as f64),
            mb(r.prefetch_used_bytes as f64)
        );
    }
}
