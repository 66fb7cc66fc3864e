//! Measurements of the scheduler itself (no HTTP): concurrent streams and
//! prompt reuse, for `flashtier bench serve`.
//!
//! A run submits its jobs at once, one thread per job waiting on its
//! events and stamping each token; it reports time to first token, the
//! gaps between tokens, and the aggregate decode rate over the window in
//! which every stream is decoding (from the last stream's first token to
//! the first stream's last token), so prompt steps and stragglers stay out
//! of it. The scheduler's counters give the decode-only steps' expert
//! records (the union the batch read) and bytes read.

use std::sync::atomic::Ordering;
use std::time::Instant;

use flashtier_engine::sample::SamplingParams;

use crate::scheduler::{Event, Finish, Job, Scheduler};

/// What one run of concurrent streams measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StreamsRun {
    /// Streams submitted together.
    pub streams: usize,
    /// Tokens each stream generated.
    pub tokens_each: usize,
    /// From the first submit to the last token, seconds.
    pub wall_secs: f64,
    /// Aggregate decode tokens/s while every stream decodes.
    pub decode_tok_s: f64,
    /// Per stream: its own decode tokens/s (first to last token).
    pub stream_tok_s: Vec<f64>,
    /// Time to first token per stream, ms.
    pub ttft_ms: Vec<f64>,
    /// Every gap between tokens, ms.
    pub itl_ms: Vec<f64>,
    /// Decode-only steps and their mean rows.
    pub decode_steps: u64,
    /// Mean rows of a decode-only step.
    pub rows_per_decode_step: f64,
    /// Mean expert records a decode-only step used (the union over its
    /// rows, summed over layers).
    pub records_per_decode_step: f64,
    /// Mean seconds of a decode-only step (engine time only).
    pub decode_step_secs: f64,
    /// Expert bytes read from the store during the run.
    pub expert_bytes_read: u64,
    /// Tokens generated during the run.
    pub generated: u64,
}

/// `q` quantile (0..=1) of `v` (nearest rank); 0 when empty.
#[must_use]
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

/// Run `prompts` as concurrent greedy streams of `tokens` tokens each (no
/// EOS stop); returns when all end.
pub fn run_streams(
    sched: &Scheduler,
    prompts: &[Vec<u32>],
    tokens: usize,
) -> Result<StreamsRun, String> {
    let c = sched.counters();
    let snap = |c: &crate::scheduler::Counters| {
        [
            c.decode_steps.load(Ordering::Relaxed),
            c.decode_rows.load(Ordering::Relaxed),
            c.decode_step_ns.load(Ordering::Relaxed),
            c.decode_records.load(Ordering::Relaxed),
            c.expert_bytes_read.load(Ordering::Relaxed),
            c.generated_tokens.load(Ordering::Relaxed),
        ]
    };
    let before = snap(c);
    let t0 = Instant::now();
    let mut rxs = Vec::new();
    for p in prompts {
        let job = Job {
            prompt: p.clone(),
            params: SamplingParams::greedy(),
            max_tokens: tokens,
            stop_ids: Vec::new(),
        };
        rxs.push(sched.submit(job).map_err(|e| e.to_string())?);
    }
    let stamps: Vec<Result<Vec<Instant>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = rxs
            .into_iter()
            .map(|mut rx| {
                s.spawn(move || {
                    let mut at = Vec::new();
                    while let Some(ev) = rx.blocking_recv() {
                        match ev {
                            Event::Token(_) => at.push(Instant::now()),
                            Event::Done(Finish::Length) => return Ok(at),
                            Event::Done(f) => return Err(format!("ended early: {f:?}")),
                            Event::Failed(e) => return Err(e),
                            Event::Started { .. } => {}
                        }
                    }
                    Err("the scheduler stopped".to_string())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a stream thread panicked".into()))
            })
            .collect()
    });
    let stamps = stamps.into_iter().collect::<Result<Vec<_>, _>>()?;
    let after = snap(c);
    let d = |i: usize| after[i].saturating_sub(before[i]);
    let secs = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
    let firsts: Vec<Instant> = stamps.iter().filter_map(|s| s.first().copied()).collect();
    let lasts: Vec<Instant> = stamps.iter().filter_map(|s| s.last().copied()).collect();
    let (Some(&start), Some(&end)) = (firsts.iter().max(), lasts.iter().min()) else {
        return Err("a stream generated nothing".into());
    };
    let in_window: usize = stamps
        .iter()
        .map(|s| s.iter().filter(|&&t| t > start && t <= end).count())
        .sum();
    let window = secs(start, end);
    let mut itl = Vec::new();
    for s in &stamps {
        for w in s.windows(2) {
            itl.push(secs(w[0], w[1]) * 1e3);
        }
    }
    let steps = d(0).max(1) as f64;
    Ok(StreamsRun {
        streams: prompts.len(),
        tokens_each: tokens,
        wall_secs: lasts.iter().max().map_or(0.0, |&l| secs(t0, l)),
        decode_tok_s: if window > 0.0 {
            in_window as f64 / window
        } else {
            0.0
        },
        stream_tok_s: stamps
            .iter()
            .map(|s| match (s.first(), s.last()) {
                (Some(&a), Some(&b)) if b > a => (s.len() - 1) as f64 / secs(a, b),
                _ => 0.0,
            })
            .collect(),
        ttft_ms: firsts.iter().map(|&f| secs(t0, f) * 1e3).collect(),
        itl_ms: itl,
        decode_steps: d(0),
        rows_per_decode_step: d(1) as f64 / steps,
        records_per_decode_step: d(3) as f64 / steps,
        decode_step_secs: d(2) as f64 / 1e9 / steps,
        expert_bytes_read: d(4),
        generated: d(5),
    })
}

/// Time to first token of one greedy request of `prompt` (1 token), and
/// the prompt positions it reused.
pub fn first_token(sched: &Scheduler, prompt: &[u32]) -> Result<(f64, usize), String> {
    let t0 = Instant::now();
    let mut rx = sched
        .submit(Job {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_tokens: 1,
            stop_ids: Vec::new(),
        })
        .map_err(|e| e.to_string())?;
    let mut cached = 0;
    let mut first = None;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Started { cached: c } => cached = c,
            Event::Token(_) => first = first.or(Some(t0.elapsed().as_secs_f64())),
            Event::Done(_) => break,
            Event::Failed(e) => return Err(e),
        }
    }
    first
        .map(|f| (f, cached))
        .ok_or_else(|| "no token".to_string())
}
