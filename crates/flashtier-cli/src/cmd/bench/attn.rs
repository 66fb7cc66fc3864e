//! `flashtier bench attn`: the CPU engine's prompt attention alone, as a
//! prefill runs it (a prompt of `--rows` positions in chunks of `--chunk`:
//! each chunk pushes its keys and values, then attends all its rows, each
//! over the positions up to its own).
//!
//! One layer of a KV cache of the given shape; only the attention calls are
//! timed (the pushes are not). The work is counted as multiply-adds of the
//! scores and of the value sums over the stored head width (`Bf16x2`
//! stores twice the head width), so the GFLOP/s compare kernels, not
//! models. The instruction set is the engine's ([`Isa::configured`]:
//! `FLASHTIER_CPU_ISA` picks another). There is no device limit to report
//! against: the kernel is compute-bound on data that sits in the caches.
//! Repetitions each start a fresh cache; medians and every sample are
//! reported.

use std::time::Instant;

use anyhow::{Context, bail};
use flashtier_engine::device::cpu::isa::Isa;
use flashtier_engine::device::cpu::kv::KvCache;
use flashtier_engine::device::{KvPrecision, KvSpec, KvState};
use serde::Serialize;

use crate::kit::bench::{check_reps, emit};
use crate::kit::median;

/// Options of `flashtier bench attn` (defaults: Qwen3-30B-A3B's attention).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Prompt positions.
    #[arg(long, default_value_t = 512)]
    pub rows: usize,
    /// Rows per prompt chunk (the engine's prefill chunk is 256).
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub q_heads: usize,
    /// KV heads.
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    /// Elements per head.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// KV precision: bf16x2 (the engine's default) or bf16.
    #[arg(long, default_value = "bf16x2")]
    pub precision: String,
    /// Repetitions; medians reported.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The measured result.
#[derive(Debug, Serialize)]
struct Report {
    threads: usize,
    isa: &'static str,
    rows: usize,
    chunk: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    precision: String,
    /// Multiply-adds of one prompt (scores and value sums).
    macs: u64,
    /// Median seconds of the whole prompt's attention.
    prompt_ms: f64,
    prompt_ms_samples: Vec<f64>,
    /// Prompt rows attended per second (median).
    rows_per_sec: f64,
    gflops: f64,
}

/// Run `flashtier bench attn`.
pub fn run(a: Args) -> anyhow::Result<()> {
    check_reps(a.reps)?;
    if a.rows == 0 || a.chunk == 0 || a.rows > 1 << 16 {
        bail!(
            "--rows must be 1 to 65536 and --chunk at least 1, got {} and {}",
            a.rows,
            a.chunk
        );
    }
    let precision = match a.precision.as_str() {
        "bf16x2" => KvPrecision::Bf16x2,
        "bf16" => KvPrecision::Bf16,
        other => bail!("unknown KV precision `{other}` (bf16x2 or bf16)"),
    };
    let spec = KvSpec {
        layers: 1,
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        capacity: a.rows,
        precision,
    };
    let mut samples = Vec::with_capacity(a.reps);
    for _ in 0..a.reps {
        samples.push(time_prompt(&spec, a.chunk)?);
    }
    let ms: Vec<f64> = samples.iter().map(|s| s * 1e3).collect();
    let secs = median(&ms) / 1e3;
    let width = match precision {
        KvPrecision::Bf16x2 => 2 * a.head_dim,
        _ => a.head_dim,
    };
    let seen = (a.rows * (a.rows + 1) / 2) as u64;
    let macs = 2 * seen * (a.q_heads * width) as u64;
    let report = Report {
        threads: rayon::current_num_threads(),
        isa: Isa::configured()?.name(),
        rows: a.rows,
        chunk: a.chunk,
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        precision: precision.to_string(),
        macs,
        prompt_ms: secs * 1e3,
        prompt_ms_samples: ms,
        rows_per_sec: a.rows as f64 / secs,
        gflops: 2.0 * macs as f64 / secs / 1e9,
    };
    emit(&report, a.json, print)
}

fn value(i: usize, salt: f32) -> f32 {
    (i as f32 * 0.618 + salt).sin()
}

/// Seconds of the attention calls of one prompt on a fresh cache.
fn time_prompt(spec: &KvSpec, chunk: usize) -> anyhow::Result<f64> {
    let mut cache = KvCache::new(spec).context("sizing the KV cache")?;
    let (kw, qw) = (spec.kv_heads * spec.head_dim, spec.q_heads * spec.head_dim);
    let mut secs = 0.0;
    let mut first = 0;
    while first < spec.capacity {
        let n = chunk.min(spec.capacity - first);
        for p in first..first + n {
            let k: Vec<f32> = (p * kw..(p + 1) * kw).map(|i| value(i, 0.3)).collect();
            let v: Vec<f32> = (p * kw..(p + 1) * kw).map(|i| value(i, 1.1)).collect();
            cache.push(0, &k, &v).context("pushing keys and values")?;
        }
        let q: Vec<f32> = (first * qw..(first + n) * qw)
            .map(|i| value(i, 2.0))
            .collect();
        let mut out = vec![0f32; q.len()];
        let t = Instant::now();
        cache.attend(0, &q, &mut out).context("attending")?;
        secs += t.elapsed().as_secs_f64();
        std::hint::black_box(&out);
        cache.advance(n);
        first += n;
    }
    Ok(secs)
}

fn print(r: &Report) {
    println!(
        "attention of a {}-row prompt in chunks of {}: {}/{} heads of {} ({}), {} threads, {}",
        r.rows, r.chunk, r.q_heads, r.kv_heads, r.head_dim, r.precision, r.threads, r.isa
    );
    println!(
        "{:.1} ms per prompt ({:.0} rows/s, {:.1} GFLOP/s); samples {}",
        r.prompt_ms,
        r.rows_per_sec,
        r.gflops,
        r.prompt_ms_samples
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
