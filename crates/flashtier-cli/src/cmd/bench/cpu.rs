//! `flashtier bench cpu`: the CPU engine's matrix kernels against the
//! machine's memory bandwidth, measured in the same run.
//!
//! The limit is a streaming read of a buffer bigger than the caches on the
//! same thread pool ([`stream_read`]). Each kernel case (shape x stored
//! dtype x instruction set x tokens per weight pass) multiplies a working
//! set of matrix copies of at least `--working-set` bytes, one copy after
//! the other, so every weight byte comes from memory as in a decode step;
//! its weight bytes per second over the limit is its share. Repetitions
//! alternate the limit and every case; medians and p50/p99/p999 of the
//! single products are reported.

use std::time::Instant;

use anyhow::{Context, bail};
use flashtier_engine::device::cpu::ceiling::stream_read;
use flashtier_engine::device::cpu::gemv::matmul_on;
use flashtier_engine::device::cpu::isa::Isa;
use flashtier_engine::matrix::MatRef;
use flashtier_format::Dtype;
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::kit::bench::{check_reps, emit, paired_ratio};
use crate::kit::{Units, median, parse_bytes, progress};

/// Options of `flashtier bench cpu`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Matrix shapes, `ROWSxCOLS` (Qwen3-30B-A3B: an expert's gate/up, its
    /// down, the LM head).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "768x2048,2048x768,151936x2048"
    )]
    pub shapes: Vec<String>,
    /// Stored dtypes: bf16, f16, f32, fp8.
    #[arg(long, value_delimiter = ',', default_value = "bf16,fp8")]
    pub dtypes: Vec<String>,
    /// Instruction sets (default: every one this CPU runs).
    #[arg(long, value_delimiter = ',')]
    pub isas: Vec<String>,
    /// Tokens per pass over the weights (1 = decode; more = a prompt chunk).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub tokens: Vec<usize>,
    /// Weight bytes cycled through per case (K, M, G: powers of 1024); keep
    /// it well above the last-level cache.
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    pub working_set: u64,
    /// Interleaved repetitions; medians reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One kernel case.
#[derive(Clone, Debug)]
struct Case {
    rows: usize,
    cols: usize,
    dtype: Dtype,
    isa: Isa,
    tokens: usize,
}

/// Its measured result.
#[derive(Debug, Serialize)]
struct CaseReport {
    shape: String,
    dtype: &'static str,
    isa: &'static str,
    tokens: usize,
    weight_bytes: u64,
    /// Median weight bytes per second over the repetitions.
    gbps: f64,
    /// Median of the per-repetition `gbps / limit` (paired).
    share_of_memory: Option<f64>,
    /// Median tokens x rows x cols multiply-adds per second, in G.
    gflops: f64,
    product_us_p50: f64,
    product_us_p99: f64,
    product_us_p999: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    threads: usize,
    isa_detected: &'static str,
    working_set_bytes: u64,
    /// Median streaming-read bytes per second (the limit).
    memory_gbps: f64,
    memory_gbps_samples: Vec<f64>,
    cases: Vec<CaseReport>,
}

/// Run `flashtier bench cpu`.
pub fn run(a: Args) -> anyhow::Result<()> {
    // A bad FLASHTIER_CPU_ISA is an error here, not a silent fallback.
    Isa::configured()?;
    check_reps(a.reps)?;
    let cases = cases(&a)?;
    let ws = usize::try_from(a.working_set).context("--working-set does not fit in memory")?;
    if ws < 1 << 20 {
        bail!(
            "--working-set must be at least 1M, got {} bytes",
            a.working_set
        );
    }
    let mut buf = memmap2::MmapMut::map_anon(ws).context("mapping the working set")?;
    let bar = progress(
        Units::Items,
        (a.reps * (cases.len() + 1)) as u64,
        "bench cpu",
        !a.json,
    );
    let mut limit = Vec::new();
    let mut samples: Vec<Vec<Sample>> = cases.iter().map(|_| Vec::new()).collect();
    for _ in 0..a.reps {
        fill(&mut buf, Dtype::U8);
        limit.push(memory_gbps(&buf));
        bar.inc(1);
        let mut filled = Dtype::U8;
        for (case, out) in cases.iter().zip(&mut samples) {
            if case.dtype != filled {
                fill(&mut buf, case.dtype);
                filled = case.dtype;
            }
            out.push(time_case(case, &buf)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let report = Report {
        threads: rayon::current_num_threads(),
        isa_detected: Isa::detect().name(),
        working_set_bytes: a.working_set,
        memory_gbps: median(&limit),
        memory_gbps_samples: limit.clone(),
        cases: cases
            .iter()
            .zip(&samples)
            .map(|(c, s)| summarize(c, s, &limit))
            .collect::<anyhow::Result<_>>()?,
    };
    emit(&report, a.json, print)
}

fn cases(a: &Args) -> anyhow::Result<Vec<Case>> {
    let isas: Vec<Isa> = if a.isas.is_empty() {
        Isa::available()
    } else {
        a.isas
            .iter()
            .map(|name| {
                Isa::available()
                    .into_iter()
                    .find(|i| i.name() == name)
                    .with_context(|| format!("this CPU does not run the instruction set `{name}`"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let mut out = Vec::new();
    for shape in &a.shapes {
        let (rows, cols) = parse_shape(shape)?;
        for name in &a.dtypes {
            let dtype = match name.as_str() {
                "bf16" => Dtype::Bf16,
                "f16" => Dtype::F16,
                "f32" => Dtype::F32,
                "fp8" => Dtype::F8E4M3,
                other => bail!("unknown dtype `{other}` (bf16, f16, f32 or fp8)"),
            };
            for &isa in &isas {
                for &tokens in &a.tokens {
                    if tokens == 0 || tokens > 4096 {
                        bail!("--tokens must be 1 to 4096, got {tokens}");
                    }
                    out.push(Case {
                        rows,
                        cols,
                        dtype,
                        isa,
                        tokens,
                    });
                }
            }
        }
    }
    Ok(out)
}

fn parse_shape(s: &str) -> anyhow::Result<(usize, usize)> {
    let parsed = s
        .split_once('x')
        .and_then(|(r, c)| Some((r.trim().parse().ok()?, c.trim().parse().ok()?)));
    match parsed {
        Some((r, c)) if r > 0 && c > 0 && r <= 1 << 24 && c <= 1 << 24 => Ok((r, c)),
        _ => bail!("shape `{s}` is not ROWSxCOLS with each from 1 to 2^24"),
    }
}

/// Weight-like bytes: BF16/F16 values of magnitude at most 0.06 (no
/// subnormals, no NaN), FP8 codes without the NaN codes, small f32s.
fn fill(buf: &mut [u8], dtype: Dtype) {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let value = |r: u64| (r >> 40) as f32 / (1u64 << 24) as f32 * 0.12 - 0.06;
    match dtype {
        Dtype::Bf16 | Dtype::F16 => {
            for w in buf.chunks_exact_mut(2) {
                let v = value(next());
                let bits = if dtype == Dtype::Bf16 {
                    half::bf16::from_f32(v).to_bits()
                } else {
                    half::f16::from_f32(v).to_bits()
                };
                w.copy_from_slice(&bits.to_le_bytes());
            }
        }
        Dtype::F32 => {
            for w in buf.chunks_exact_mut(4) {
                w.copy_from_slice(&value(next()).to_le_bytes());
            }
        }
        _ => {
            for b in buf.iter_mut() {
                let c = next() as u8;
                *b = if c & 0x7F == 0x7F { c - 1 } else { c };
            }
        }
    }
}

fn memory_gbps(buf: &[u8]) -> f64 {
    let isa = Isa::current();
    // One untimed pass faults the pages in; the best of three timed ones
    // is the limit.
    std::hint::black_box(stream_read(isa, buf));
    (0..3)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(stream_read(isa, buf));
            buf.len() as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// One repetition of a case: seconds per product, over every copy.
struct Sample {
    gbps: f64,
    gflops: f64,
    product_s: Vec<f64>,
}

fn time_case(c: &Case, buf: &[u8]) -> anyhow::Result<Sample> {
    let elem = c.dtype.size_bytes() as usize;
    let mat_bytes = c.rows * c.cols * elem;
    let copies = (buf.len() / mat_bytes).max(1);
    if mat_bytes > buf.len() {
        bail!(
            "a {}x{} {} matrix ({mat_bytes} bytes) does not fit the working set of {} bytes",
            c.rows,
            c.cols,
            c.dtype.name(),
            buf.len()
        );
    }
    let xs: Vec<f32> = (0..c.tokens * c.cols)
        .map(|i| (i as f32 * 0.013).sin())
        .collect();
    let mut out = vec![0f32; c.tokens * c.rows];
    let mut product_s = Vec::with_capacity(copies);
    let t0 = Instant::now();
    for k in 0..copies {
        let bytes = &buf[k * mat_bytes..(k + 1) * mat_bytes];
        let m = MatRef::Raw(bytes, c.dtype);
        let t = Instant::now();
        matmul_on(c.isa, &mut out, m, &xs, c.tokens);
        product_s.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&out);
    }
    let secs = t0.elapsed().as_secs_f64();
    let total = (copies * mat_bytes) as f64;
    let macs = (copies * c.rows * c.cols * c.tokens) as f64;
    Ok(Sample {
        gbps: total / secs / 1e9,
        gflops: 2.0 * macs / secs / 1e9,
        product_s,
    })
}

fn summarize(c: &Case, s: &[Sample], limit: &[f64]) -> anyhow::Result<CaseReport> {
    let mut hist = Histogram::<u64>::new(3)?;
    for sample in s {
        for secs in &sample.product_s {
            hist.record(((secs * 1e9) as u64).max(1))?;
        }
    }
    let gbps: Vec<f64> = s.iter().map(|x| x.gbps).collect();
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    Ok(CaseReport {
        shape: format!("{}x{}", c.rows, c.cols),
        dtype: c.dtype.name(),
        isa: c.isa.name(),
        tokens: c.tokens,
        weight_bytes: (c.rows * c.cols) as u64 * c.dtype.size_bytes(),
        gbps: median(&gbps),
        share_of_memory: paired_ratio(&gbps, limit),
        gflops: median(&s.iter().map(|x| x.gflops).collect::<Vec<_>>()),
        product_us_p50: us(0.5),
        product_us_p99: us(0.99),
        product_us_p999: us(0.999),
    })
}

fn print(r: &Report) {
    println!(
        "memory (streaming read, {} threads, {}): {:.1} GB/s (samples {})",
        r.threads,
        r.isa_detected,
        r.memory_gbps,
        r.memory_gbps_samples
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "{:<14} {:<5} {:<7} {:>6} {:>8} {:>7} {:>8} {:>9} {:>9} {:>9}",
        "shape",
        "dtype",
        "isa",
        "tokens",
        "GB/s",
        "share",
        "GFLOP/s",
        "p50 us",
        "p99 us",
        "p999 us"
    );
    for c in &r.cases {
        println!(
            "{:<14} {:<5} {:<7} {:>6} {:>8.1} {:>6.0}% {:>8.1} {:>9.1} {:>9.1} {:>9.1}",
            c.shape,
            c.dtype,
            c.isa,
            c.tokens,
            c.gbps,
            c.share_of_memory.unwrap_or(0.0) * 100.0,
            c.gflops,
            c.product_us_p50,
            c.product_us_p99,
            c.product_us_p999
        );
    }
}
