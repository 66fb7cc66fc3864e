//! A load test: 64 streamed completions from 16 client threads (4 each,
//! one after another) against a batch of 8, prompts of 8 to 64 tokens,
//! greedy and seeded sampled. Prints client-side TTFT and inter-chunk
//! gaps (p50/p99) and the aggregate output tokens/s (`--nocapture`);
//! asserts every request ended with the tokens and text it gets alone.
#![allow(clippy::unwrap_used, reason = "test")]

use crate::common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const CLIENTS: usize = 16;
const PER_CLIENT: usize = 4;
const MAX_TOKENS: u64 = 16;

/// Request `i`: a prompt of 8..=64 token ids (none of them special) and,
/// for every third, a seed to sample with.
struct Request {
    prompt: Vec<u32>,
    seed: Option<u64>,
}

fn requests() -> Vec<Request> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..CLIENTS * PER_CLIENT)
        .map(|i| {
            let len = 8 + (i * 37) % 57;
            let prompt = (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((x >> 33) % 381) as u32
                })
                .collect();
            let seed = (i % 3 == 0).then_some(1000 + i as u64);
            Request { prompt, seed }
        })
        .collect()
}

/// What one streamed request gave, and when.
struct Outcome {
    text: String,
    finish: String,
    completion_tokens: u64,
    ttft: Duration,
    gaps: Vec<Duration>,
}

fn run_one(server: &Server, r: &Request) -> Outcome {
    let mut body = json!({
        "model": MODEL, "prompt": r.prompt, "max_tokens": MAX_TOKENS, "stream": true,
        "stream_options": {"include_usage": true}, "temperature": 0,
    });
    if let Some(seed) = r.seed {
        body["temperature"] = json!(0.8);
        body["seed"] = json!(seed);
    }
    let t0 = Instant::now();
    let mut s = open_stream(&server.url("/v1/completions"), &body);
    let (mut text, mut finish, mut usage_chunk) = (String::new(), None, None);
    let (mut first, mut last, mut gaps) = (None, None::<Instant>, Vec::new());
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            break;
        }
        let c: Value = serde_json::from_str(&d).unwrap();
        if c["choices"].as_array().unwrap().is_empty() {
            usage_chunk = Some(c);
            continue;
        }
        let piece = choice(&c)["text"].as_str().unwrap();
        if !piece.is_empty() {
            let now = Instant::now();
            first.get_or_insert(now - t0);
            if let Some(l) = last {
                gaps.push(now - l);
            }
            last = Some(now);
            text.push_str(piece);
        }
        if let Some(f) = choice(&c)["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    let u = usage_chunk.expect("no usage chunk");
    assert_eq!(usage(&u, "prompt_tokens"), r.prompt.len() as u64);
    Outcome {
        text,
        finish: finish.expect("no finish_reason"),
        completion_tokens: usage(&u, "completion_tokens"),
        ttft: first.unwrap_or_else(|| t0.elapsed()),
        gaps,
    }
}

fn percentile_ms(v: &mut [Duration], p: f64) -> f64 {
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

fn config() -> flashtier_serve::SchedulerConfig {
    flashtier_serve::SchedulerConfig {
        max_batch: 8,
        ..default_config()
    }
}

#[test]
fn sixty_four_streams_from_sixteen_clients() {
    let reqs = requests();
    // Each request alone, one after another, on a server of its own (so
    // the load below reuses no cache these runs left).
    let alone: Vec<Outcome> = {
        let s = start(config(), None);
        reqs.iter().map(|r| run_one(&s, r)).collect()
    };

    let s = start(config(), None);
    let barrier = Barrier::new(CLIENTS);
    let t0 = Instant::now();
    let loaded: Vec<(usize, Outcome)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (s, reqs, barrier) = (&s, &reqs, &barrier);
                sc.spawn(move || {
                    barrier.wait();
                    (0..PER_CLIENT)
                        .map(|j| {
                            let i = c * PER_CLIENT + j;
                            (i, run_one(s, &reqs[i]))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let wall = t0.elapsed();
    assert_eq!(loaded.len(), CLIENTS * PER_CLIENT);

    let mut tokens = 0;
    for (i, o) in &loaded {
        let a = &alone[*i];
        let what = if reqs[*i].seed.is_some() {
            "seeded"
        } else {
            "greedy"
        };
        assert!(
            o.finish == "stop" || o.finish == "length",
            "{i}: {}",
            o.finish
        );
        if o.finish == "length" {
            assert_eq!(o.completion_tokens, MAX_TOKENS, "request {i}");
        }
        assert_eq!(
            (o.completion_tokens, o.finish.as_str()),
            (a.completion_tokens, a.finish.as_str()),
            "{what} request {i}: tokens under load"
        );
        assert_eq!(o.text, a.text, "{what} request {i}: text under load");
        tokens += o.completion_tokens;
    }
    let steps = metric(&s, "steps_total");
    let generated = metric(&s, "generation_tokens_total");
    assert_eq!(generated, tokens);
    assert!(
        steps < generated,
        "{steps} steps for {generated} tokens: no step decoded two sequences"
    );

    let mut ttft: Vec<Duration> = loaded.iter().map(|(_, o)| o.ttft).collect();
    let mut itl: Vec<Duration> = loaded.iter().flat_map(|(_, o)| o.gaps.clone()).collect();
    println!(
        "load: {} requests, {CLIENTS} clients, batch {}: TTFT p50 {:.1} ms p99 {:.1} ms; \
         ITL p50 {:.2} ms p99 {:.2} ms; {tokens} tokens in {:.2} s = {:.0} tok/s; \
         {:.2} tokens per step",
        loaded.len(),
        s.limits.max_batch,
        percentile_ms(&mut ttft, 0.5),
        percentile_ms(&mut ttft, 0.99),
        percentile_ms(&mut itl, 0.5),
        percentile_ms(&mut itl, 0.99),
        wall.as_secs_f64(),
        tokens as f64 / wall.as_secs_f64(),
        generated as f64 / steps as f64,
    );
}
