//! Decode attention's achieved HBM bytes/s against a device-to-device copy
//! and PyTorch SDPA, same shapes, same run.

use anyhow::Context;
use flashtier_cuda::measure::{EventTimer, d2d_bytes_per_s};
use flashtier_cuda::{AttnDims, DecodeAttention, Gpu, UtilKernels};
use flashtier_format::kv::KvStrides;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::Serialize;

use super::{Opts, gbps};

/// One shape.
#[derive(Debug, Serialize)]
pub struct Shape {
    /// KV layout.
    pub layout: String,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// KV + q + out bytes one step must move.
    pub bytes: usize,
    /// Input sets rotated through (to keep the L2 cache out).
    pub rotation_sets: usize,
    /// Median time of one decode step (begin + step_tile_final), µs.
    pub time_us: f64,
    /// bytes / time.
    pub bytes_per_s: f64,
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
    /// Device-to-device copy, bytes read + written per second.
    pub copy_bps: f64,
    /// Query heads, KV heads, head dim, block size.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Split CTAs resident per SM.
    pub ctas_per_sm: u32,
    /// cp.async stages per warp.
    pub stages: usize,
    /// torch version and the script's raw output.
    pub torch: Option<serde_json::Value>,
    /// Every shape.
    pub shapes: Vec<Shape>,
}

/// Run the attention comparison.
pub fn run(gpu: &Gpu, args: &Opts) -> anyhow::Result<Attention> {
    let util = UtilKernels::new(gpu)?;
    let copy_bps = d2d_bytes_per_s(gpu, 2 << 30, 5)?;
    let mut shapes = Vec::new();
    let mut ctas_per_sm = 0;
    let mut stages = 0;
    for layout in &args.layouts {
        anyhow::ensure!(
            layout == "paged" || layout == "slot",
            "unknown layout `{layout}` (paged | slot)"
        );
        for &batch in &args.batches {
            for &context in &args.contexts {
                let (shape, occ) = bench_shape(gpu, &util, args, layout, batch, context, copy_bps)
                    .with_context(|| {
                        format!("attention {layout} batch {batch} context {context}")
                    })?;
                (ctas_per_sm, stages) = occ;
                shapes.push(shape);
            }
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
        copy_bps,
        q_heads: args.q_heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        block_size: args.block_size,
        ctas_per_sm,
        stages,
        torch,
        shapes,
    })
}

fn bench_shape(
    gpu: &Gpu,
    util: &UtilKernels,
    args: &Opts,
    layout_name: &str,
    batch: usize,
    context: usize,
    copy_bps: f64,
) -> anyhow::Result<(Shape, (u32, usize))> {
    anyhow::ensure!(
        context % args.block_size == 0,
        "context must be a multiple of the block size"
    );
    let dims = AttnDims {
        max_seqs: batch,
        num_q_heads: args.q_heads,
        num_kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        block_size: args.block_size,
        tile_capacity: context / args.block_size,
    };
    let mut attn = DecodeAttention::new(gpu, dims)?;
    let layout = if layout_name == "slot" {
        KvStrides::slot(&dims)
    } else {
        KvStrides::paged(&dims)
    };
    let kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * 2;
    let io_bytes = 2 * batch * args.q_heads * args.head_dim * 2;
    let l2 = gpu.info().l2_bytes.max(1 << 20);
    let sets = (4 * l2).div_ceil(kv_bytes).clamp(1, 32);
    let blocks_per_set = batch * dims.tile_capacity;
    let pool_len = layout
        .block_end(&dims, sets * blocks_per_set - 1)
        .context("pool size overflows")?;
    let s = gpu.stream();
    let mut k = s.alloc_zeros::<u16>(pool_len)?;
    let mut v = s.alloc_zeros::<u16>(pool_len)?;
    let mut q = s.alloc_zeros::<u16>(batch * args.q_heads * args.head_dim)?;
    let mut out = s.alloc_zeros::<u16>(batch * args.q_heads * args.head_dim)?;
    util.fill_bf16(&mut k, 1, 1.0)?;
    util.fill_bf16(&mut v, 2, 1.0)?;
    util.fill_bf16(&mut q, 3, 1.0)?;
    // Each set: its own blocks, shuffled (a paged pool is not in order).
    let mut rng = rand::rngs::StdRng::seed_from_u64((batch * 1_000_003 + context) as u64);
    let mut tables = Vec::with_capacity(sets);
    for set in 0..sets {
        let mut ids: Vec<u32> = (0..blocks_per_set)
            .map(|b| (set * blocks_per_set + b) as u32)
            .collect();
        ids.shuffle(&mut rng);
        let per_seq: Vec<&[u32]> = ids.chunks(dims.tile_capacity).collect();
        tables.push(attn.tile_table(&per_seq, &vec![args.block_size; batch])?);
    }
    let mut step = |i: usize, attn: &mut DecodeAttention| -> anyhow::Result<()> {
        attn.begin_step(batch)?;
        attn.step_tile_final(&q, &k, &v, layout, &tables[i % sets], &mut out)?;
        Ok(())
    };
    for i in 0..3 {
        step(i, &mut attn)?;
    }
    gpu.synchronize()?;
    let mut times = Vec::with_capacity(args.runs);
    for _ in 0..args.runs.max(1) {
        util.spin(10_000_000)?; // queue the timed steps behind 10 ms of device work
        let timer = EventTimer::start(s)?;
        for i in 0..args.iters.max(1) {
            step(i, &mut attn)?;
        }
        times.push(timer.stop(s)? / args.iters.max(1) as f64);
    }
    let host_out = s.clone_dtoh(&out)?;
    anyhow::ensure!(
        host_out
            .iter()
            .all(|&b| half::bf16::from_bits(b).is_finite()),
        "attention output holds non-finite values"
    );
    let secs = crate::kit::median(&times);
    let bytes = kv_bytes + io_bytes;
    let bps = bytes as f64 / secs;
    Ok((
        Shape {
            layout: layout_name.to_string(),
            batch,
            context,
            bytes,
            rotation_sets: sets,
            time_us: secs * 1e6,
            bytes_per_s: bps,
            ratio_vs_copy: bps / copy_bps,
            torch_us: None,
            torch_backend: None,
            speedup_vs_torch: None,
        },
        (attn.ctas_per_sm(), attn.stages()),
    ))
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
        "\n## decode attention ({} q heads / {} kv heads, head_dim {}, block {}, {} CTAs/SM, {} stages); d2d copy {}",
        a.q_heads,
        a.kv_heads,
        a.head_dim,
        a.block_size,
        a.ctas_per_sm,
        a.stages,
        gbps(a.copy_bps)
    );
    println!(
        "{:>6} {:>5} {:>8} {:>10} {:>12} {:>8} {:>10} {:>10} {:>8}",
        "layout", "batch", "context", "time us", "HBM", "vs copy", "torch us", "backend", "speedup"
    );
    for s in &a.shapes {
        let t = s.torch_us.map_or_else(|| "-".into(), |t| format!("{t:.1}"));
        let sp = s
            .speedup_vs_torch
            .map_or_else(|| "-".into(), |x| format!("{x:.2}x"));
        let be = s.torch_backend.clone().unwrap_or_else(|| "-".into());
        println!(
            "{:>6} {:>5} {:>8} {:>10.1} {:>12} {:>7.1}% {t:>10} {be:>10} {sp:>8}",
            s.layout,
            s.batch,
            s.context,
            s.time_us,
            gbps(s.bytes_per_s),
            100.0 * s.ratio_vs_copy
        );
    }
}
