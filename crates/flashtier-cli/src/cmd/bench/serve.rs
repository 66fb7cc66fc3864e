//! `flashtier bench serve`: the server's scheduler on one model, against
//! the bounds that say what it should reach, in one run:
//!
//! - `run`'s own single-sequence greedy decode (tokens/s) on the same
//!   engine, measured first: one stream through the scheduler should be as
//!   fast;
//! - the bytes bound of a batch: a decode step of B streams reads the dense
//!   weights once and the union of the B rows' experts, so B streams can at
//!   most reach `B x bytes(1 stream step) / bytes(B streams step)` times
//!   the single-stream rate, with each step's bytes from the expert records
//!   the steps used (measured, not modelled);
//! - prompt reuse: a prompt of `--prefix` tokens, then the same prefix with
//!   a new tail: the second's time to first token against the first's.
//!   With `--prefix-spill-dir`, every kept cache goes to the drive (the
//!   in-memory prefix budget is one position), so the second prompt's
//!   prefix is restored from the spill file, every block verified.

use std::path::PathBuf;

use anyhow::{Context, bail};
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_format::Dtype;
use flashtier_pack::synth::{SynthArch, SynthSpec};
use flashtier_serve::bench::{StreamsRun, first_token, quantile, run_streams};
use flashtier_serve::{Scheduler, SchedulerConfig};
use serde_json::json;

use crate::kit;
use crate::kit::model::{ModelArgs, load_model};
use flashtier_pack::session::Session;

/// Options of `flashtier bench serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model and its tiers (as for `run`).
    #[command(flatten)]
    pub m: ModelArgs,
    /// Generate a synthetic checkpoint in the family's reference shape into
    /// --model first when it holds no config.json.
    #[arg(long, value_name = "ARCH")]
    pub synth: Option<SynthArch>,
    /// Decoder layers of the synthetic checkpoint.
    #[arg(long, default_value_t = 16)]
    pub layers: u32,
    /// Scale the synthetic checkpoint to about this many bytes (the real
    /// model's proportions, as the demo's) instead of --layers of the
    /// reference shape.
    #[arg(long, value_name = "BYTES", value_parser = kit::parse_bytes)]
    pub synth_bytes: Option<u64>,
    /// Stream counts to run, each a separate batch.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub streams: Vec<usize>,
    /// Prompt tokens of each stream.
    #[arg(long, default_value_t = 16)]
    pub prompt_len: usize,
    /// Tokens each stream generates.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Prompt reuse: tokens of the shared prefix (0: skip).
    #[arg(long, default_value_t = 2048)]
    pub prefix: usize,
    /// Prompt reuse from the drive: spill every kept cache to a KV store
    /// file in DIR and restore the prefix from it (CPU engine only).
    #[arg(long, value_name = "DIR")]
    pub prefix_spill_dir: Option<PathBuf>,
    /// Repetitions of each stream count (the median run is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
}

/// A deterministic prompt of `n` ids below `vocab` (never 0..16, which
/// small vocabularies use for special tokens).
fn prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(16).max(1) as u64;
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (16 + x % span) as u32
        })
        .collect()
}

/// Run `flashtier bench serve`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if !args.m.model.join("config.json").exists() {
        let Some(arch) = args.synth else {
            bail!(
                "{} holds no config.json (give --synth to generate one)",
                args.m.model.display()
            );
        };
        let spec = match args.synth_bytes {
            Some(b) => SynthSpec::scaled_to(arch, Dtype::Bf16, b, 1),
            None => SynthSpec::reference(arch, Dtype::Bf16, 1).with_layers(args.layers),
        };
        kit::synth_with_bar(&spec, &args.m.model, true)?;
    }
    let mut m = args.m.clone();
    if m.store.is_none() {
        m.store = Some(m.model.with_extension("ftstore"));
    }
    let ckpt = Checkpoint::open(&m.model)?;
    let cfg = flashtier_engine::ModelConfig::from_file(&m.model.join("config.json"))?;
    let (resident, chosen) = flashtier_engine::load::weight_bytes_split(&cfg, &ckpt);
    drop(ckpt);
    let vocab = cfg.vocab_size;
    let tokens = args.tokens.max(2);
    let (tx, rx) = std::sync::mpsc::channel();
    let run_prompt = prompt(99, args.prompt_len, vocab);
    let max_streams = args.streams.iter().copied().max().unwrap_or(1);
    let sched_cfg = SchedulerConfig {
        max_batch: max_streams,
        max_queue: max_streams + 4,
        step_rows: 256,
        context: (args.prefix + 64).max(args.prompt_len + tokens + 8),
        // With a spill folder, one position in memory: every kept cache
        // longer than that goes to the drive.
        prefix_cache_tokens: if args.prefix_spill_dir.is_some() {
            1
        } else {
            4 * (args.prefix + 64)
        },
        prefix_spill: args.prefix_spill_dir.as_ref().map(|dir| {
            flashtier_serve::prefix::SpillConfig::new(dir.clone(), 4 * (args.prefix + 64))
        }),
    };
    let (sched, thread) = Scheduler::start(
        move || {
            let Session {
                mut engine,
                chosen: chosen_dev,
                ..
            } = load_model(&m, false).map_err(|e| format!("{e:#}"))?;
            // `run`'s decode on this engine, warm: the single-stream bar.
            let mut tps = Vec::new();
            for _ in 0..3 {
                engine.reset().map_err(|e| e.to_string())?;
                let g = engine
                    .generate(&run_prompt, tokens, &[], false, |_| {})
                    .map_err(|e| e.to_string())?;
                tps.push(g.tokens_per_sec());
            }
            engine.reset().map_err(|e| e.to_string())?;
            let _ = tx.send((chosen_dev, tps));
            Ok::<_, String>(engine)
        },
        sched_cfg,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let (chosen_dev, mut run_tps) = rx.recv().context("the engine did not start")?;
    run_tps.sort_by(f64::total_cmp);
    let run_median = kit::median(&run_tps);
    eprintln!(
        "bench serve on {}: run decodes {run_median:.1} tok/s (median of {:?})",
        chosen_dev.gpu_name.as_deref().unwrap_or(chosen_dev.device),
        run_tps
            .iter()
            .map(|t| format!("{t:.1}"))
            .collect::<Vec<_>>()
    );
    let mut results: Vec<(usize, StreamsRun)> = Vec::new();
    for &s in &args.streams {
        let mut reps = Vec::new();
        for rep in 0..args.reps.max(1) {
            let prompts: Vec<Vec<u32>> = (0..s)
                .map(|i| prompt(1000 * rep as u64 + i as u64 + 1, args.prompt_len, vocab))
                .collect();
            let r = run_streams(&sched, &prompts, tokens).map_err(|e| anyhow::anyhow!(e))?;
            eprintln!(
                "  {s} streams: {:.1} tok/s aggregate, {:.1} records/step, TTFT p50 {:.1} ms, ITL p50 {:.2} p99 {:.2} ms",
                r.decode_tok_s,
                r.records_per_decode_step,
                quantile(&r.ttft_ms, 0.5),
                quantile(&r.itl_ms, 0.5),
                quantile(&r.itl_ms, 0.99)
            );
            reps.push(r);
        }
        reps.sort_by(|a, b| a.decode_tok_s.total_cmp(&b.decode_tok_s));
        let mid = reps.swap_remove(reps.len() / 2);
        results.push((s, mid));
    }
    // Bytes per decode step from the records the steps used.
    let one = results
        .iter()
        .find(|(s, _)| *s == 1)
        .map(|(_, r)| r.clone());
    let bytes_step = |r: &StreamsRun, base: &StreamsRun| {
        let per_record = chosen as f64 / base.records_per_decode_step.max(1.0);
        resident as f64 + per_record * r.records_per_decode_step
    };
    let mut rows = Vec::new();
    for (s, r) in &results {
        let mut row = json!({
            "streams": s, "decode_tok_s": r.decode_tok_s,
            "stream_tok_s_median": quantile(&r.stream_tok_s, 0.5),
            "ttft_ms_p50": quantile(&r.ttft_ms, 0.5), "ttft_ms_p99": quantile(&r.ttft_ms, 0.99),
            "itl_ms_p50": quantile(&r.itl_ms, 0.5), "itl_ms_p99": quantile(&r.itl_ms, 0.99),
            "itl_ms_p999": quantile(&r.itl_ms, 0.999),
            "records_per_decode_step": r.records_per_decode_step,
            "rows_per_decode_step": r.rows_per_decode_step,
            "decode_step_ms": r.decode_step_secs * 1e3,
            "expert_bytes_read_per_token": r.expert_bytes_read as f64 / r.generated.max(1) as f64,
        });
        if let Some(base) = &one {
            let speedup = r.decode_tok_s / base.decode_tok_s.max(1e-9);
            row["speedup_vs_1_stream"] = json!(speedup);
            // With every expert resident the steps read no records, so the
            // union a step uses is not seen here: the same prompts with the
            // experts streamed give the bound.
            if base.records_per_decode_step > 0.0 {
                let b1 = bytes_step(base, base);
                let bs = bytes_step(r, base);
                let bound = *s as f64 * b1 / bs;
                row["bytes_per_step"] = json!(bs);
                row["bytes_bound_x"] = json!(bound);
                row["of_bytes_bound"] = json!(speedup / bound);
                eprintln!(
                    "  {s} streams: {speedup:.2}x one stream; bytes bound {bound:.2}x ({:.0}% of it); {:.0} expert bytes read per token",
                    100.0 * speedup / bound,
                    r.expert_bytes_read as f64 / r.generated.max(1) as f64
                );
            } else {
                eprintln!(
                    "  {s} streams: {speedup:.2}x one stream; bytes bound not measured (every expert resident: the steps read no records; run the same prompts streamed)"
                );
            }
        }
        rows.push(row);
    }
    let single = one.as_ref().map(|r| quantile(&r.stream_tok_s, 0.5));
    if let Some(t) = single {
        eprintln!(
            "  one stream through the scheduler: {t:.1} tok/s = {:.3} of run",
            t / run_median
        );
    }
    let mut reuse = serde_json::Value::Null;
    if args.prefix > 0 {
        // Seeds no stream prompt uses: nothing kept shares its first tokens.
        let base = prompt(1 << 40, args.prefix, vocab);
        let (cold, c0) = first_token(&sched, &base).map_err(|e| anyhow::anyhow!(e))?;
        let mut again = base.clone();
        again.extend(prompt((1 << 40) + 1, 16, vocab));
        let (warm, c1) = first_token(&sched, &again).map_err(|e| anyhow::anyhow!(e))?;
        eprintln!(
            "  prompt reuse{}: {}-token prompt first token in {:.1} ms ({:.0} prompt tok/s); the same prefix + 16 in {:.1} ms ({c1} reused): {:.1}x",
            if args.prefix_spill_dir.is_some() {
                " from the drive"
            } else {
                ""
            },
            args.prefix,
            cold * 1e3,
            args.prefix as f64 / cold,
            warm * 1e3,
            cold / warm
        );
        reuse = json!({
            "prefix_tokens": args.prefix, "cold_ttft_ms": cold * 1e3, "cold_cached": c0,
            "prefill_tok_s": args.prefix as f64 / cold,
            "warm_ttft_ms": warm * 1e3, "warm_cached": c1, "speedup": cold / warm,
            "from_drive": args.prefix_spill_dir.is_some(),
        });
    }
    let report = json!({
        "device": chosen_dev.device, "gpu": chosen_dev.gpu_name,
        "model": args.m.model, "resident_bytes_per_step": resident,
        "chosen_expert_bytes_per_token": chosen,
        "run_tok_s": run_median, "run_tok_s_all": run_tps,
        "single_stream_of_run": single.map(|t| t / run_median),
        "streams": rows, "prompt_reuse": reuse,
        "budget_hbm": args.m.budget_hbm, "budget": args.m.budget,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(p) = &args.json_out {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    drop(sched);
    thread.join();
    Ok(())
}
