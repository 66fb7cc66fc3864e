//! The decode engine's attention (`DecodeKernels::attend` over a
//! `DevKvCache`: the KV append, the split partials and their merge, as a
//! decode step runs them per layer and sequence) against the HBM read
//! bandwidth and a device-to-device copy measured in the same run, and
//! PyTorch SDPA on the same shapes (f32 keys and values, as the engine
//! keeps them).

use std::rc::Rc;

use anyhow::Context;
use flashtier_cuda::measure::{EventTimer, d2d_bytes_per_s};
use flashtier_cuda::ops::DecodeKernels;
use flashtier_cuda::ops::attn::{CHUNK_POSITIONS, DevKvCache, MAX_HEAD_DIM};
use flashtier_cuda::ops::buffers::{ActPool, DevAct};
use flashtier_cuda::{Gpu, UtilKernels};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::{Opts, gbps};

/// Key/value rows uploaded once and appended again and again to fill a
/// cache (the values repeat every this many positions).
const FILL_ROWS: usize = 4096;

/// One shape.
#[derive(Debug, Serialize)]
pub struct Shape {
    /// Sequences, each with its own KV cache, attended one after another
    /// (as a served batch's decode step runs them).
    pub batch: usize,
    /// Positions each sequence attends (the new one included).
    pub context: usize,
    /// Bytes one step must move: every key and value attended (f32), the
    /// queries read, the outputs and the new keys and values written.
    pub bytes: usize,
    /// Sets of caches rotated through (to keep the L2 cache out).
    pub rotation_sets: usize,
    /// Median time of one decode step over the whole batch, µs.
    pub time_us: f64,
    /// bytes / time.
    pub bytes_per_s: f64,
    /// bytes_per_s / the HBM read bandwidth (the bound of a memory-bound
    /// kernel).
    pub ratio_vs_read: f64,
    /// bytes_per_s / the device-to-device copy's bytes/s.
    pub ratio_vs_copy: f64,
    /// Fastest torch SDPA backend on this shape, µs.
    pub torch_us: Option<f64>,
    /// Which backend that was.
    pub torch_backend: Option<String>,
    /// torch_us / time_us.
    pub speedup_vs_torch: Option<f64>,
}

/// The attention result.
#[derive(Debug, Serialize)]
pub struct Attention {
    /// HBM read bandwidth, bytes/s (every word of a 2 GiB buffer read once).
    pub read_bps: f64,
    /// Device-to-device copy, bytes read + written per second.
    pub copy_bps: f64,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// The cache's element type.
    pub kv_dtype: &'static str,
    /// Positions per chunk (one split of the attention, one KV store block).
    pub chunk_positions: usize,
    /// torch version and the script's raw output.
    pub torch: Option<serde_json::Value>,
    /// Every shape.
    pub shapes: Vec<Shape>,
}

/// Run the attention comparison.
pub fn run(gpu: &Gpu, args: &Opts) -> anyhow::Result<Attention> {
    anyhow::ensure!(
        args.kv_heads > 0 && args.q_heads % args.kv_heads == 0,
        "--q-heads {} must be a multiple of --kv-heads {}",
        args.q_heads,
        args.kv_heads
    );
    anyhow::ensure!(
        (1..=MAX_HEAD_DIM).contains(&args.head_dim),
        "--head-dim {} (1 to {MAX_HEAD_DIM})",
        args.head_dim
    );
    let kernels = DecodeKernels::new(gpu)?;
    let util = UtilKernels::new(gpu)?;
    let read_bps = kernels.read_bandwidth(2 << 30, 5)?;
    let copy_bps = d2d_bytes_per_s(gpu, 2 << 30, 5)?;
    let mut shapes = Vec::new();
    for &batch in &args.batches {
        for &context in &args.contexts {
            let shape = bench_shape(&kernels, &util, args, batch, context)
                .with_context(|| format!("attention batch {batch} context {context}"))?;
            shapes.push(Shape {
                ratio_vs_read: shape.bytes_per_s / read_bps,
                ratio_vs_copy: shape.bytes_per_s / copy_bps,
                ..shape
            });
        }
    }
    let torch = match &args.torch_script {
        Some(script) => Some(run_torch(args, script)?),
        None => None,
    };
    if let Some(t) = &torch {
        attach_torch(&mut shapes, t);
    }
    Ok(Attention {
        read_bps,
        copy_bps,
        q_heads: args.q_heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        kv_dtype: "f32",
        chunk_positions: CHUNK_POSITIONS,
        torch,
        shapes,
    })
}

/// `rows x cols` of values in [-1, 1).
fn random_act(
    k: &DecodeKernels,
    pool: &Rc<ActPool>,
    rng: &mut StdRng,
    rows: usize,
    cols: usize,
) -> anyhow::Result<DevAct> {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut a = pool.take(k.gpu(), rows, cols)?;
    a.upload(k.gpu().stream(), &vals)?;
    Ok(a)
}

/// A one-layer cache of `context` positions holding `context - 1` (the
/// step appends the last), filled from `fill` (`FILL_ROWS` key rows and
/// value rows) and `tail` (the last `(context - 1) % FILL_ROWS` rows).
fn filled_cache(
    k: &DecodeKernels,
    context: usize,
    (kvh, d): (usize, usize),
    fill: &(DevAct, DevAct),
    tail: Option<&(DevAct, DevAct)>,
) -> anyhow::Result<DevKvCache> {
    let mut kv = DevKvCache::new(k.gpu(), 1, kvh, d, context)?;
    let held = context - 1;
    for _ in 0..held / FILL_ROWS {
        k.kv_push(&mut kv, 0, &fill.0, &fill.1)?;
    }
    if let Some((kt, vt)) = tail {
        k.kv_push(&mut kv, 0, kt, vt)?;
    }
    kv.advance(held);
    anyhow::ensure!(kv.len() == held, "filled {} of {held} positions", kv.len());
    Ok(kv)
}

fn bench_shape(
    k: &DecodeKernels,
    util: &UtilKernels,
    args: &Opts,
    batch: usize,
    context: usize,
) -> anyhow::Result<Shape> {
    anyhow::ensure!(
        batch > 0 && context > 1,
        "batch and context must be at least 1 and 2"
    );
    let gpu = k.gpu();
    let (qh, kvh, d) = (args.q_heads, args.kv_heads, args.head_dim);
    let f32_bytes = std::mem::size_of::<f32>();
    let kv_bytes = batch * 2 * context * kvh * d * f32_bytes;
    let io_bytes = batch * (2 * qh * d + 2 * kvh * d) * f32_bytes;
    let l2 = gpu.info().l2_bytes.max(1 << 20);
    let sets = (4 * l2).div_ceil(kv_bytes).clamp(1, 32);
    let pool = ActPool::new();
    let mut rng = StdRng::seed_from_u64((batch * 1_000_003 + context) as u64);
    let width = kvh * d;
    let fill = (
        random_act(k, &pool, &mut rng, FILL_ROWS, width)?,
        random_act(k, &pool, &mut rng, FILL_ROWS, width)?,
    );
    let rest = (context - 1) % FILL_ROWS;
    let tail = if rest > 0 {
        Some((
            random_act(k, &pool, &mut rng, rest, width)?,
            random_act(k, &pool, &mut rng, rest, width)?,
        ))
    } else {
        None
    };
    let mut caches = Vec::with_capacity(sets * batch);
    for _ in 0..sets * batch {
        caches.push(filled_cache(k, context, (kvh, d), &fill, tail.as_ref())?);
    }
    let q = random_act(k, &pool, &mut rng, 1, qh * d)?;
    let (k_new, v_new) = (
        random_act(k, &pool, &mut rng, 1, width)?,
        random_act(k, &pool, &mut rng, 1, width)?,
    );
    let mut out = pool.take(gpu, 1, qh * d)?;
    let scale = 1.0 / (d as f32).sqrt();
    // One decode step of set `i % sets`: each sequence appends its new key
    // and value and attends; the position is then taken back, so every
    // step attends `context` positions.
    let mut step = |i: usize| -> anyhow::Result<()> {
        let set = i % sets;
        for kv in &mut caches[set * batch..(set + 1) * batch] {
            k.attend(kv, 0, qh, &q, &k_new, &v_new, scale, &mut out)?;
            kv.advance(1);
            kv.rewind(1)?;
        }
        Ok(())
    };
    for i in 0..3 {
        step(i)?;
    }
    gpu.synchronize()?;
    let s = gpu.stream();
    let iters = args.iters.max(1);
    let mut times = Vec::with_capacity(args.runs.max(1));
    for _ in 0..args.runs.max(1) {
        util.spin(10_000_000)?; // queue the timed steps behind 10 ms of device work
        let timer = EventTimer::start(s)?;
        for i in 0..iters {
            step(i)?;
        }
        times.push(timer.stop(s)? / iters as f64);
    }
    let host_out = out.to_host(s)?;
    anyhow::ensure!(
        host_out.iter().all(|v| v.is_finite()),
        "attention output holds non-finite values"
    );
    let secs = crate::kit::median(&times);
    let bytes = kv_bytes + io_bytes;
    let bps = bytes as f64 / secs;
    Ok(Shape {
        batch,
        context,
        bytes,
        rotation_sets: sets,
        time_us: secs * 1e6,
        bytes_per_s: bps,
        ratio_vs_read: 0.0,
        ratio_vs_copy: 0.0,
        torch_us: None,
        torch_backend: None,
        speedup_vs_torch: None,
    })
}

fn run_torch(args: &Opts, script: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    let join = |v: &[usize]| {
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let out = std::process::Command::new(&args.python)
        .arg(script)
        .args([
            "--batches",
            &join(&args.batches),
            "--contexts",
            &join(&args.contexts),
        ])
        .args([
            "--q-heads",
            &args.q_heads.to_string(),
            "--kv-heads",
            &args.kv_heads.to_string(),
        ])
        .args([
            "--head-dim",
            &args.head_dim.to_string(),
            "--iters",
            &args.iters.to_string(),
        ])
        .args(["--reps", &args.runs.to_string()])
        .args(["--dtype", "float32"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("run {} {}", args.python, script.display()))?;
    anyhow::ensure!(out.status.success(), "torch script failed ({})", out.status);
    serde_json::from_slice(&out.stdout).context("parse the torch script's JSON")
}

fn attach_torch(shapes: &mut [Shape], torch: &serde_json::Value) {
    let Some(rows) = torch.get("shapes").and_then(|v| v.as_array()) else {
        return;
    };
    for row in rows {
        let key = |k: &str| row.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
        let (b, c) = (key("batch"), key("context"));
        let us = row.get("best_us").and_then(serde_json::Value::as_f64);
        for s in shapes.iter_mut().filter(|s| s.batch == b && s.context == c) {
            s.torch_us = us;
            s.torch_backend = row
                .get("best_backend")
                .and_then(|v| v.as_str())
                .map(str::to_string);
            s.speedup_vs_torch = us.map(|t| t / s.time_us);
        }
    }
}

/// Print the attention table.
pub fn print(a: &Attention) {
    println!(
        "\n## decode attention, the engine's ({} q heads / {} kv heads, head_dim {}, {} KV in chunks of {}); HBM read {}, d2d copy {}",
        a.q_heads,
        a.kv_heads,
        a.head_dim,
        a.kv_dtype,
        a.chunk_positions,
        gbps(a.read_bps),
        gbps(a.copy_bps)
    );
    println!(
        "{:>5} {:>8} {:>10} {:>12} {:>8} {:>8} {:>10} {:>10} {:>8}",
        "batch",
        "context",
        "time us",
        "HBM",
        "vs read",
        "vs copy",
        "torch us",
        "backend",
        "speedup"
    );
    for s in &a.shapes {
        let t = s.torch_us.map_or_else(|| "-".into(), |t| format!("{t:.1}"));
        let sp = s
            .speedup_vs_torch
            .map_or_else(|| "-".into(), |x| format!("{x:.2}x"));
        let be = s.torch_backend.clone().unwrap_or_else(|| "-".into());
        println!(
            "{:>5} {:>8} {:>10.1} {:>12} {:>7.1}% {:>7.1}% {t:>10} {be:>10} {sp:>8}",
            s.batch,
            s.context,
            s.time_us,
            gbps(s.bytes_per_s),
            100.0 * s.ratio_vs_read,
            100.0 * s.ratio_vs_copy
        );
    }
}
