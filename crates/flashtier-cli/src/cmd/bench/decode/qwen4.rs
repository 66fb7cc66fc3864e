//! `bench decode` on a Qwen4-Exp checkpoint: its resident decode on the
//! GPU against the HBM read bound measured in the same run.
//!
//! Every expert sits in HBM and every PLE row in the row store's RAM cache
//! (a first pass over the same prompt and tokens reads them; the timed
//! pass repeats it, so no row is read from the drive). The bound is the
//! weight bytes one token reads (the resident weights, one embedding row,
//! its top-k experts of every layer and its PLE rows) over the HBM read
//! bandwidth; the fraction is the measured step time against it. The
//! streamed tiers (experts and rows from the drive) are measured by
//! `flashtier demo --arch qwen4_exp`, which holds both tiers' reads against
//! the drive in the same run.
//!
//! The prefill runs twice: first with its PLE rows read from the drive
//! (none of the prompt's n-grams was seen: a 512-token prompt reads 16
//! rows per token and PLE layer, each a 4 KiB block), then again with
//! them cached, which is the compute's figure.

use std::path::Path;

use anyhow::Context;
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_engine::engine::{Engine, Placement, Qwen4Engine};
use flashtier_engine::load::row_table_bytes;
use flashtier_pack::session::{RowStore, SessionOptions, StoreSource};
use serde::Serialize;

use super::measure::{
    ClassRow, Limits, Roofline, StepKernels, measure_limits, profile_pass, profile_steps,
};
use super::report::emit_json;
use super::{Args, count_step_kernels, prompt};

/// What `bench decode` measured on a Qwen4-Exp checkpoint.
#[derive(Debug, Serialize)]
struct Qwen4Report {
    family: &'static str,
    limits: Limits,
    layers: usize,
    experts: usize,
    top_k: usize,
    /// Weight bytes one decode token reads.
    bytes_per_token: u64,
    tokens: usize,
    tokens_per_sec: f64,
    /// `bytes_per_token / hbm_read_bytes_per_sec` over the measured step.
    roofline_fraction: f64,
    expert_hit_rate: f64,
    row_hit_rate: Option<f64>,
    /// The kernels of one more decode step, as the launch path counted them.
    step_kernels: StepKernels,
    /// Device time per kernel class over `--profile-tokens` steps launched
    /// one by one (the gap to the measured step is the host's share).
    roofline: Roofline,
    prefill_tokens: usize,
    /// The prefill with its rows cached (the second pass).
    prefill_tokens_per_sec: Option<f64>,
    /// The first pass, its rows read from the drive.
    prefill_cold_rows_tokens_per_sec: Option<f64>,
    /// Device time per kernel class over one profiled prefill, per token.
    prefill_classes: Option<Vec<ClassRow>>,
}

/// The Qwen4-Exp run of `bench decode` (its `resident` mode).
pub(super) fn run(args: &Args, store: &Path, show: bool) -> anyhow::Result<()> {
    let dev = CudaDevice::open(0).context("bench decode needs a GPU")?;
    let limits = measure_limits(&dev)?;
    drop(dev);
    let tables = row_table_bytes(&Checkpoint::open(&args.model)?);
    let mut opts = SessionOptions::new(&args.model);
    opts.store = StoreSource::File(store.to_path_buf());
    opts.placement = Placement::Cuda(0);
    opts.queue_depth = args.queue_depth;
    opts.rows = Some(RowStore {
        budget_bytes: tables,
        dir: None,
    });
    if show {
        eprintln!(
            "loading Qwen4-Exp: every expert in HBM, {:.2} GiB of PLE rows cached",
            tables as f64 / f64::from(1u32 << 30)
        );
    }
    let session = opts.open(&|_| {})?;
    let bytes_per_token = session.weight_bytes_per_token;
    let Engine::Qwen4(engine) = session.engine else {
        anyhow::bail!("{} is not a Qwen4-Exp checkpoint", args.model.display());
    };
    let Qwen4Engine::Cuda(mut m) = *engine else {
        anyhow::bail!("the session opened the CPU, not the GPU");
    };
    let cfg = m.config().clone();
    let p = prompt(args.prompt_len, cfg.vocab_size);
    // The first pass reads the rows into the cache; the second is timed.
    m.generate(&p, args.tokens, &[], false)?;
    m.reset()?;
    let out = m.generate(&p, args.tokens, &[], false)?;
    let tokens_per_sec = out.tokens_per_sec();
    let roofline_fraction =
        bytes_per_token as f64 * tokens_per_sec / limits.hbm_read_bytes_per_sec.max(1.0);
    let row_hit_rate = out
        .decode_rows
        .map(|r| r.hits as f64 / r.lookups.max(1) as f64);
    let last = out.generated_ids.last().copied().unwrap_or(0);
    let step_kernels = count_step_kernels(
        &mut m,
        |m| m.device(),
        |m| {
            m.forward(&[last], false)?;
            Ok(())
        },
    )?;
    let roofline = profile_steps(
        &mut m,
        |m| m.device(),
        args.profile_tokens,
        (&limits, tokens_per_sec, cfg.vocab_size),
        |m, t| {
            m.forward(&[t], false)?;
            Ok(())
        },
    )?;
    let (prefill_tokens_per_sec, prefill_cold, prefill_classes) = if args.prefill > 0 {
        m.reset()?;
        let long = prompt(args.prefill, cfg.vocab_size);
        let rate = |o: &flashtier_engine::Generation| long.len() as f64 / o.prefill_secs.max(1e-9);
        let cold = rate(&m.generate(&long, 0, &[], false)?);
        m.reset()?;
        let o = m.generate(&long, 0, &[], false)?;
        m.reset()?;
        let classes = profile_pass(
            &mut m,
            |m| m.device(),
            (long.len(), &limits),
            |m| {
                m.generate(&long, 0, &[], false)?;
                Ok(())
            },
        )?;
        (Some(rate(&o)), Some(cold), Some(classes))
    } else {
        (None, None, None)
    };
    let r = Qwen4Report {
        family: "qwen4_exp",
        limits,
        layers: cfg.layers.len(),
        experts: cfg.num_experts,
        top_k: cfg.top_k,
        bytes_per_token,
        tokens: out.generated_ids.len(),
        tokens_per_sec,
        roofline_fraction,
        expert_hit_rate: out.decode_experts.hit_rate(),
        row_hit_rate,
        step_kernels,
        roofline,
        prefill_tokens: args.prefill,
        prefill_tokens_per_sec,
        prefill_cold_rows_tokens_per_sec: prefill_cold,
        prefill_classes,
    };
    emit(args, &r)
}

fn emit(args: &Args, r: &Qwen4Report) -> anyhow::Result<()> {
    if emit_json(args, r)? {
        return Ok(());
    }
    println!(
        "{}: HBM read {:.0} GB/s",
        r.limits.gpu,
        r.limits.hbm_read_bytes_per_sec / 1e9
    );
    println!(
        "qwen4_exp resident ({} layers, {} experts, top-{}): {:.1} tok/s, {:.1} MB read/token, \
         {:.1}% of the HBM roofline, expert hit rate {:.3}, row hit rate {}",
        r.layers,
        r.experts,
        r.top_k,
        r.tokens_per_sec,
        r.bytes_per_token as f64 / 1e6,
        100.0 * r.roofline_fraction,
        r.expert_hit_rate,
        r.row_hit_rate.map_or("-".to_owned(), |h| format!("{h:.3}"))
    );
    println!(
        "one step: {} kernels ({} inside {} graph launches)",
        r.step_kernels.kernels, r.step_kernels.in_graphs, r.step_kernels.graph_launches
    );
    print_classes("decode, device time per token", &r.roofline.classes);
    println!(
        "  sum {:.1} us of a measured {:.1} us step (the rest: the host and launch gaps)",
        1e6 * r
            .roofline
            .classes
            .iter()
            .map(|c| c.secs_per_token)
            .sum::<f64>(),
        1e6 * r.roofline.measured_secs_per_token
    );
    if let (Some(p), Some(cold)) = (r.prefill_tokens_per_sec, r.prefill_cold_rows_tokens_per_sec) {
        println!(
            "prefill of {} tokens: {p:.0} tok/s with its PLE rows cached ({cold:.0} tok/s reading them from the drive first)",
            r.prefill_tokens
        );
    }
    if let Some(c) = &r.prefill_classes {
        print_classes("prefill, device time per prompt token", c);
    }
    Ok(())
}

fn print_classes(title: &str, rows: &[ClassRow]) {
    println!("{title}:");
    for c in rows {
        println!(
            "  {:<12} {:>9.2} us  {:>5} ops  {:>5.1}% of the read bandwidth",
            format!("{:?}", c.time.class),
            1e6 * c.secs_per_token,
            c.time.ops,
            100.0 * c.fraction_of_read_bandwidth
        );
    }
}
