//! `flashtier bench gemm`: the tiled prompt products
//! ([`DecodeKernels::gemm_many`](flashtier_cuda::ops::DecodeKernels::gemm_many))
//! against cuBLAS on the same shapes, same device, same run (issue 14).
//!
//! Per shape `M:N:K` (`out[M, N] = x[M, K] w[N, K]ᵀ`), on seeded random
//! BF16 weights and f32 activations, four products ([`measure::Variant`]):
//! ours (BF16 weights, f32 activations), cuBLAS in f32 on a widened copy of
//! the weights (pedantic: the exact-f32 peer; and the default math mode),
//! and cuBLAS with BF16 inputs and f32 accumulation (tensor cores: the
//! speed transformers runs at, not exact). Reported: the median time of
//! `--reps`, TFLOPS (`2 M N K / time`), the worst error relative to the
//! largest magnitude of an f64 reference on `--sample` outputs, and ours'
//! time over each cuBLAS time (the median of per-repetition ratios).
//!
//! Needs a GPU, NVRTC and libcublas (loaded at run time; a machine without
//! it gets an error naming it). Limits: every operand and output at most
//! [`shape::MAX_ELEMS`] elements, `--sample` at most [`shape::MAX_SAMPLE`].

mod measure;
mod shape;

use anyhow::bail;
use serde::Serialize;

use self::measure::{Bench, Variant};
use self::shape::{DEFAULT_SHAPES, GemmShape, MAX_SAMPLE, Operands};
use crate::kit::bench::{check_reps, emit, paired_ratio};
use crate::kit::median;

/// Options of `flashtier bench gemm`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Shapes `M:N:K` (defaults: Qwen3-30B-A3B's q/k/v, o_proj, expert
    /// gate+up and down at 256 rows, then q/k/v and o_proj at 512).
    #[arg(long, value_delimiter = ',', value_parser = GemmShape::parse, default_value = DEFAULT_SHAPES)]
    pub shapes: Vec<GemmShape>,
    /// Timed repetitions per product; medians reported.
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Untimed rounds of every product first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Outputs compared with the f64 reference per product.
    #[arg(long, default_value_t = 2000)]
    pub sample: usize,
    /// Seed of the operands and the sample.
    #[arg(long, default_value_t = 14)]
    pub seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One product on one shape.
#[derive(Debug, Serialize)]
struct Product {
    variant: Variant,
    /// Median seconds, as µs.
    time_us: f64,
    time_us_samples: Vec<f64>,
    tflops: f64,
    /// Worst |out - ref| over the sample / the largest |ref| there.
    max_rel_err: f64,
    /// Ours' time over this one's (median of per-repetition ratios;
    /// above 1: ours is slower); none for ours.
    ours_over_this: Option<f64>,
}

/// One shape.
#[derive(Debug, Serialize)]
struct ShapeReport {
    #[serde(flatten)]
    shape: GemmShape,
    flops: f64,
    /// Ours' time over cuBLAS f32 pedantic's (the exact-f32 peer).
    ours_over_cublas_f32: Option<f64>,
    products: Vec<Product>,
}

/// The measured result.
#[derive(Debug, Serialize)]
struct Report {
    device: flashtier_cuda::DeviceInfo,
    cublas_version: i32,
    /// Our dense tile, rows x columns.
    tile: String,
    reps: usize,
    warmup: usize,
    sample: usize,
    seed: u64,
    /// Bytes zeroed before each timed product (twice the L2 cache).
    l2_scrub_bytes: usize,
    shapes: Vec<ShapeReport>,
}

/// Run `flashtier bench gemm`.
pub fn run(a: Args) -> anyhow::Result<()> {
    check_reps(a.reps)?;
    if a.sample == 0 || a.sample > MAX_SAMPLE {
        bail!("--sample must be 1..={MAX_SAMPLE}");
    }
    if a.shapes.is_empty() {
        bail!("--shapes is empty");
    }
    let mut bench = Bench::open()?;
    let mut shapes = Vec::with_capacity(a.shapes.len());
    for (i, &shape) in a.shapes.iter().enumerate() {
        let seed = a.seed.wrapping_add(i as u64);
        shapes.push(run_shape(&mut bench, shape, &a, seed)?);
    }
    let report = Report {
        device: bench.gpu.info().clone(),
        cublas_version: bench.blas.version()?,
        tile: bench.tile(),
        reps: a.reps,
        warmup: a.warmup,
        sample: a.sample,
        seed: a.seed,
        l2_scrub_bytes: bench.scrub_bytes(),
        shapes,
    };
    emit(&report, a.json, print)
}

fn run_shape(
    bench: &mut Bench,
    shape: GemmShape,
    a: &Args,
    seed: u64,
) -> anyhow::Result<ShapeReport> {
    let ops = Operands::random(shape, seed);
    let picks = shape::sample_outputs(shape, a.sample, seed ^ 0x5a5a);
    let refs = shape::reference(shape, &ops, &picks);
    let results = bench.run_shape(shape, &ops, a.warmup, a.reps)?;
    let ours_secs = results.first().map(|r| r.0.clone()).unwrap_or_default();
    let products: Vec<Product> = Variant::ALL
        .iter()
        .zip(&results)
        .map(|(&variant, (secs, out))| {
            let time = median(secs);
            Product {
                variant,
                time_us: time * 1e6,
                time_us_samples: secs.iter().map(|s| s * 1e6).collect(),
                tflops: shape.tflops(time),
                max_rel_err: shape::worst_rel_err(shape, out, &picks, &refs),
                ours_over_this: (variant != Variant::Ours)
                    .then(|| paired_ratio(&ours_secs, secs))
                    .flatten(),
            }
        })
        .collect();
    let ours_over_cublas_f32 = products
        .iter()
        .find(|p| p.variant == Variant::CublasF32Pedantic)
        .and_then(|p| p.ours_over_this);
    Ok(ShapeReport {
        shape,
        flops: shape.flops(),
        ours_over_cublas_f32,
        products,
    })
}

fn print(r: &Report) {
    println!(
        "device: {} ({}, {} SMs), cuBLAS {}; our dense tile {}",
        r.device.name,
        r.device.arch(),
        r.device.sm_count,
        r.cublas_version,
        r.tile
    );
    println!(
        "median of {} reps after {} warm-up rounds, {} MiB zeroed before each (L2 cold); \
         rel err: worst |out - ref| / max |ref| over {} outputs, ref in f64 from the BF16 \
         weights and f32 activations; ours/this: time ratio (above 1: ours slower)",
        r.reps,
        r.warmup,
        r.l2_scrub_bytes >> 20,
        r.sample
    );
    println!(
        "{:>5} {:>6} {:>6}  {:<20} {:>9} {:>8} {:>9} {:>9}",
        "M", "N", "K", "product", "time us", "TFLOPS", "rel err", "ours/this"
    );
    for s in &r.shapes {
        for (i, p) in s.products.iter().enumerate() {
            let dims = if i == 0 {
                format!("{:>5} {:>6} {:>6}", s.shape.m, s.shape.n, s.shape.k)
            } else {
                format!("{:>5} {:>6} {:>6}", "", "", "")
            };
            let ratio = p
                .ours_over_this
                .map_or_else(|| "-".into(), |x| format!("{x:.2}"));
            println!(
                "{dims}  {:<20} {:>9.1} {:>8.2} {:>9.1e} {ratio:>9}",
                p.variant.label(),
                p.time_us,
                p.tflops,
                p.max_rel_err
            );
        }
    }
}
