//! What `flashtier bench rows` reports: every repetition's samples, their
//! medians, and the ratios against fio (the best fio depth's median, and
//! per repetition against that repetition's best fio, then the median).

use std::collections::BTreeMap;

use serde::Serialize;

use super::Args;
use super::load::{DramHitPath, HitPath, Phase};
use crate::kit::bench::paired_ratio;
use crate::kit::median;

/// The samples of the interleaved repetitions.
#[derive(Default)]
pub struct Interleaved {
    pub cold_iops: Vec<f64>,
    pub cold_p50_us: Vec<f64>,
    pub cold_p99_us: Vec<f64>,
    pub ahead_iops: Vec<f64>,
    pub ahead_p50_us: Vec<f64>,
    pub ahead_p99_us: Vec<f64>,
    pub overlapped_iops: Vec<f64>,
    pub prefill_iops: Vec<f64>,
    pub prefill_unique_rows: Vec<f64>,
    pub prefill_batch_ms: Vec<f64>,
    /// Per fio queue depth, its IOPS per repetition.
    pub fio_iops: Vec<(u32, Vec<f64>)>,
    /// fio in synchronous batches of `--batch` (the single caller's shape).
    pub fio_batched_iops: Vec<f64>,
}

/// Single-caller cold misses.
#[derive(Serialize)]
struct Cold {
    batch: usize,
    read_iops_median: f64,
    read_iops: Vec<f64>,
    batch_us_p50_median: f64,
    batch_us_p99_median: f64,
    ratio_vs_fio: Option<f64>,
    ratio_vs_fio_paired_median: Option<f64>,
    fio_batched_iops_median: f64,
    fio_batched_iops: Vec<f64>,
    ratio_vs_fio_batched_paired_median: Option<f64>,
}

/// One caller prefetching `ahead` batches ahead.
#[derive(Serialize)]
struct Ahead {
    batch: usize,
    ahead: usize,
    read_iops_median: f64,
    read_iops: Vec<f64>,
    batch_us_p50_median: f64,
    batch_us_p99_median: f64,
    ratio_vs_fio: Option<f64>,
    ratio_vs_fio_paired_median: Option<f64>,
}

/// Several callers of cold batches at once.
#[derive(Serialize)]
struct Overlapped {
    batch: usize,
    streams: usize,
    read_iops_median: f64,
    read_iops: Vec<f64>,
    ratio_vs_fio: Option<f64>,
    ratio_vs_fio_paired_median: Option<f64>,
}

/// Deduplicated Zipf batches into an empty cache.
#[derive(Serialize)]
struct Prefill {
    ids: usize,
    unique_rows_median: f64,
    batch_ms_median: f64,
    read_iops_median: f64,
    read_iops: Vec<f64>,
    ratio_vs_fio: Option<f64>,
    ratio_vs_fio_paired_median: Option<f64>,
}

/// fio at one queue depth.
#[derive(Serialize)]
struct FioDepth {
    iops_median: f64,
    iops: Vec<f64>,
}

/// The whole report.
#[derive(Serialize)]
pub struct Report {
    rows: u64,
    backend: String,
    direct: bool,
    batch: usize,
    cache_bytes: u64,
    ways: usize,
    zipf: f64,
    threads: usize,
    rows_per_sec: f64,
    lookups_per_sec: f64,
    read_iops: f64,
    hit_rate: f64,
    batch_us_p50: f64,
    batch_us_p99: f64,
    batch_us_p999: f64,
    cold: Cold,
    cold_lookahead: Ahead,
    cold_overlapped: Overlapped,
    prefill: Prefill,
    fio: BTreeMap<String, FioDepth>,
    fio_best_iops: f64,
    hit_path: HitPath,
    hit_path_dram: DramHitPath,
}

/// The ratios against fio of one phase: of the medians, and paired per
/// repetition with that repetition's best fio.
struct Ratios {
    best: f64,
    best_per_rep: Vec<f64>,
}

impl Ratios {
    fn new(r: &Interleaved, reps: usize) -> Self {
        let best = r
            .fio_iops
            .iter()
            .map(|(_, v)| median(v))
            .fold(0.0, f64::max);
        let best_per_rep = (0..reps)
            .map(|i| {
                r.fio_iops
                    .iter()
                    .filter_map(|(_, v)| v.get(i).copied())
                    .fold(0.0, f64::max)
            })
            .collect();
        Self { best, best_per_rep }
    }

    fn of_median(&self, ours: f64) -> Option<f64> {
        (self.best > 0.0).then(|| ours / self.best)
    }

    fn paired(&self, ours: &[f64]) -> Option<f64> {
        paired_ratio(ours, &self.best_per_rep)
    }
}

/// The report of one run.
pub fn build(
    a: &Args,
    (rows, direct): (u64, bool),
    r: Interleaved,
    steady: &Phase,
    (hit_path, hit_path_dram): (HitPath, DramHitPath),
) -> Report {
    let x = Ratios::new(&r, a.reps);
    let cold = median(&r.cold_iops);
    let ahead = median(&r.ahead_iops);
    let over = median(&r.overlapped_iops);
    let pre = median(&r.prefill_iops);
    Report {
        rows,
        backend: a.backend.clone(),
        direct,
        batch: a.batch,
        cache_bytes: a.cache,
        ways: a.ways,
        zipf: a.zipf,
        threads: a.threads,
        rows_per_sec: steady.rows_per_sec(),
        lookups_per_sec: steady.lookups_per_sec(),
        read_iops: steady.read_iops(),
        hit_rate: steady.hit_rate(),
        batch_us_p50: steady.batch_us_p50,
        batch_us_p99: steady.batch_us_p99,
        batch_us_p999: steady.batch_us_p999,
        cold: Cold {
            batch: a.batch,
            read_iops_median: cold,
            batch_us_p50_median: median(&r.cold_p50_us),
            batch_us_p99_median: median(&r.cold_p99_us),
            ratio_vs_fio: x.of_median(cold),
            ratio_vs_fio_paired_median: x.paired(&r.cold_iops),
            fio_batched_iops_median: median(&r.fio_batched_iops),
            ratio_vs_fio_batched_paired_median: paired_ratio(&r.cold_iops, &r.fio_batched_iops),
            fio_batched_iops: r.fio_batched_iops,
            read_iops: r.cold_iops,
        },
        cold_lookahead: Ahead {
            batch: a.batch,
            ahead: a.lookahead,
            read_iops_median: ahead,
            batch_us_p50_median: median(&r.ahead_p50_us),
            batch_us_p99_median: median(&r.ahead_p99_us),
            ratio_vs_fio: x.of_median(ahead),
            ratio_vs_fio_paired_median: x.paired(&r.ahead_iops),
            read_iops: r.ahead_iops,
        },
        cold_overlapped: Overlapped {
            batch: a.batch,
            streams: a.cold_streams,
            read_iops_median: over,
            ratio_vs_fio: x.of_median(over),
            ratio_vs_fio_paired_median: x.paired(&r.overlapped_iops),
            read_iops: r.overlapped_iops,
        },
        prefill: Prefill {
            ids: a.prefill,
            unique_rows_median: median(&r.prefill_unique_rows),
            batch_ms_median: median(&r.prefill_batch_ms),
            read_iops_median: pre,
            ratio_vs_fio: x.of_median(pre),
            ratio_vs_fio_paired_median: x.paired(&r.prefill_iops),
            read_iops: r.prefill_iops,
        },
        fio: r
            .fio_iops
            .into_iter()
            .map(|(q, iops)| {
                let d = FioDepth {
                    iops_median: median(&iops),
                    iops,
                };
                (format!("qd{q}"), d)
            })
            .collect(),
        fio_best_iops: x.best,
        hit_path,
        hit_path_dram,
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or("n/a (no fio)".to_string(), |x| format!("{:.1}%", x * 100.0))
}

/// The report as text.
pub fn print(r: &Report) {
    println!(
        "row store bench: {} rows, {} backend, batch {}, cache {} bytes x {} ways, zipf {}, {} threads",
        r.rows, r.backend, r.batch, r.cache_bytes, r.ways, r.zipf, r.threads
    );
    println!(
        "steady state: {:.0} lookups/s, {:.0} rows/s, {:.0} reads/s, hit rate {:.3}, batch p50 {:.1} us, p99 {:.1} us, p999 {:.1} us",
        r.lookups_per_sec,
        r.rows_per_sec,
        r.read_iops,
        r.hit_rate,
        r.batch_us_p50,
        r.batch_us_p99,
        r.batch_us_p999
    );
    for (q, d) in &r.fio {
        println!(
            "fio 4 KiB randread {q}: median {:.0} IOPS ({} runs)",
            d.iops_median,
            d.iops.len()
        );
    }
    let c = &r.cold;
    println!(
        "cold misses, batch {}: median {:.0} IOPS = {} of the best fio median; paired per rep: {} (p50 {:.0} us, p99 {:.0} us per batch)",
        c.batch,
        c.read_iops_median,
        pct(c.ratio_vs_fio),
        pct(c.ratio_vs_fio_paired_median),
        c.batch_us_p50_median,
        c.batch_us_p99_median
    );
    if !c.fio_batched_iops.is_empty() {
        println!(
            "  fio in the same synchronous batches of {}: median {:.0} IOPS; cold over it, paired per rep: {}",
            c.batch,
            c.fio_batched_iops_median,
            pct(c.ratio_vs_fio_batched_paired_median)
        );
    }
    print_parallel(r);
    let p = &r.prefill;
    println!(
        "prefill {} ids (~{:.0} distinct): median {:.0} IOPS = {}; paired per rep: {}",
        p.ids,
        p.unique_rows_median,
        p.read_iops_median,
        pct(p.ratio_vs_fio),
        pct(p.ratio_vs_fio_paired_median)
    );
    print_hit_paths(&r.hit_path, &r.hit_path_dram);
}

/// The look-ahead and overlapped cold phases, when they ran.
fn print_parallel(r: &Report) {
    let h = &r.cold_lookahead;
    if h.ahead > 0 {
        println!(
            "cold misses, one caller prefetching {} batch(es) ahead: median {:.0} IOPS = {}; paired per rep: {} (p50 {:.0} us, p99 {:.0} us per step)",
            h.ahead,
            h.read_iops_median,
            pct(h.ratio_vs_fio),
            pct(h.ratio_vs_fio_paired_median),
            h.batch_us_p50_median,
            h.batch_us_p99_median
        );
    }
    let o = &r.cold_overlapped;
    if o.streams > 0 {
        println!(
            "cold misses, {} callers of batch {} at once: median {:.0} IOPS = {}; paired per rep: {}",
            o.streams,
            o.batch,
            o.read_iops_median,
            pct(o.ratio_vs_fio),
            pct(o.ratio_vs_fio_paired_median)
        );
    }
}

/// The two hit paths against plain copies.
pub fn print_hit_paths(hits: &HitPath, dram: &DramHitPath) {
    println!(
        "hit path, {} rows: {:.1} ns/row; memcpy gather {:.1} ns/row ({:.2}x), contiguous memcpy {:.1} ns/row ({:.2}x)",
        hits.batch,
        hits.lookup_ns_per_row,
        hits.memcpy_gather_ns_per_row,
        hits.ratio_vs_gather,
        hits.memcpy_contiguous_ns_per_row,
        hits.ratio_vs_contiguous
    );
    println!(
        "hit path from DRAM, batches of {} of {} cached rows: {:.1} ns/row; memcpy gather from a {} MiB table {:.1} ns/row ({:.2}x)",
        dram.batch,
        dram.pool_rows,
        dram.lookup_ns_per_row,
        dram.table_bytes >> 20,
        dram.memcpy_gather_ns_per_row,
        dram.ratio_vs_gather
    );
}
