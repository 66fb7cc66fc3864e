//! The server end to end over HTTP on the tiny Qwen3-MoE fixture: answer
//! shapes, streamed == whole, greedy == `run`, seeds, stop strings,
//! cancellation, 429, every 4xx, prompt reuse, logprobs, the small routes.
#![allow(clippy::unwrap_used, reason = "test")]

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use flashtier_text::{ChatMessage, ChatOptions};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

#[test]
fn chat_shapes_and_stream_equals_whole() {
    let s = start(default_config(), None);
    let body = chat(
        "Tell me a story.",
        json!({"temperature": 0, "max_tokens": 24}),
    );
    let whole = post_ok(&s.url(CHAT), &body);
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(whole["model"], MODEL);
    assert_eq!(choice(&whole)["message"]["role"], "assistant");
    let finish = choice(&whole)["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length", "{whole}");
    assert_usage_shape(&whole);
    assert_eq!(whole["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let chunks = stream_chunks(&s.url(CHAT), &sb);
    assert_eq!(choice(&chunks[0])["delta"]["role"], "assistant");
    let id = &chunks[0]["id"];
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(&c["id"], id);
        assert!(c.get("usage").is_none(), "usage without include_usage: {c}");
    }
    assert!(
        chunks[1..]
            .iter()
            .all(|c| choice(c)["delta"].get("role").is_none())
    );
    assert_eq!(streamed(&chunks), (content(&whole), finish.to_owned()));

    sb["stream_options"] = json!({"include_usage": true});
    let chunks = stream_chunks(&s.url(CHAT), &sb);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage(last, k), usage(&whole, k), "{k}");
    }
    // As OpenAI's: every other chunk says `"usage": null`.
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c.get("usage"), Some(&Value::Null), "{c}");
    }
    assert_eq!(streamed(&chunks[..chunks.len() - 1]).0, content(&whole));
}

#[test]
fn completion_shapes_text_and_id_prompts() {
    let s = start(default_config(), None);
    let prompt = "The quick brown fox";
    let body = completion(json!(prompt), json!({"temperature": 0, "max_tokens": 20}));
    let whole = post_ok(&s.url(COMPLETIONS), &body);
    assert_eq!(whole["object"], "text_completion");
    assert!(whole["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_usage_shape(&whole);
    let text = choice(&whole)["text"].as_str().unwrap().to_owned();
    let finish = choice(&whole)["finish_reason"].as_str().unwrap().to_owned();

    let ids = text_ids(prompt);
    assert_eq!(usage(&whole, "prompt_tokens"), ids.len() as u64);
    let by_ids = post_ok(
        &s.url(COMPLETIONS),
        &completion(json!(ids), json!({"temperature": 0, "max_tokens": 20})),
    );
    assert_eq!(choice(&by_ids)["text"], text.as_str());
    assert_eq!(
        usage(&by_ids, "completion_tokens"),
        usage(&whole, "completion_tokens")
    );

    for p in [json!(prompt), json!(ids)] {
        let mut sb = completion(
            p,
            json!({"temperature": 0, "max_tokens": 20, "stream": true}),
        );
        let chunks = stream_chunks(&s.url(COMPLETIONS), &sb);
        assert!(
            chunks
                .iter()
                .all(|c| c["object"] == "text_completion" && c.get("usage").is_none())
        );
        assert_eq!(streamed(&chunks), (text.clone(), finish.clone()));
        sb["stream_options"] = json!({"include_usage": true});
        let chunks = stream_chunks(&s.url(COMPLETIONS), &sb);
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(
            usage(last, "completion_tokens"),
            usage(&whole, "completion_tokens")
        );
        for c in &chunks[..chunks.len() - 1] {
            assert_eq!(c.get("usage"), Some(&Value::Null), "{c}");
        }
        assert_eq!(streamed(&chunks[..chunks.len() - 1]).0, text);
    }
}

#[test]
fn greedy_chat_equals_run_on_the_same_ids() {
    let s = start(default_config(), None);
    let mut engine = open_engine();
    let eos = eos();
    let t = text();
    for (q, ignore_eos) in [("Hello!", false), ("What is 2+2?", false), ("Hi", true)] {
        let ids = t
            .encode_chat(&[ChatMessage::new("user", q)], &ChatOptions::default())
            .unwrap();
        let stops: &[u32] = if ignore_eos { &[] } else { &eos };
        let g = engine.generate(&ids, 12, stops, false, |_| {}).unwrap();
        engine.reset().unwrap();
        let ended_on_eos = g.generated_ids.last().is_some_and(|t| stops.contains(t));
        let shown = &g.generated_ids[..g.generated_ids.len() - usize::from(ended_on_eos)];
        let want = t.decode(shown, true).unwrap();
        let extra = json!({"temperature": 0, "max_tokens": 12, "ignore_eos": ignore_eos});
        let v = post_ok(&s.url(CHAT), &chat(q, extra));
        assert_eq!(content(&v), want, "{q}");
        assert_eq!(usage(&v, "prompt_tokens"), ids.len() as u64);
        assert_eq!(
            usage(&v, "completion_tokens"),
            g.generated_ids.len() as u64,
            "{q}"
        );
        let finish = if ended_on_eos { "stop" } else { "length" };
        assert_eq!(choice(&v)["finish_reason"], finish);
        if ignore_eos {
            assert_eq!(g.generated_ids.len(), 12);
        }
    }
}

/// The tiny model never picks an EOS on its own within a few tokens, so
/// a logit bias puts one at position `k`: the bias lies between the
/// margin EOS needs there and the smaller margin it needs at any earlier
/// position (margins from `run`'s logits over the greedy tokens).
#[test]
fn an_eos_ends_the_output_and_counts_as_a_token() {
    let s = start(default_config(), None);
    let mut engine = open_engine();
    let t = text();
    let eos_id = *t.eos_token_ids().first().unwrap();
    let q = "Hello!";
    let ids = t
        .encode_chat(&[ChatMessage::new("user", q)], &ChatOptions::default())
        .unwrap();
    let g = engine.generate(&ids, 12, &[], false, |_| {}).unwrap();
    engine.reset().unwrap();
    let all: Vec<u32> = ids.iter().chain(&g.generated_ids).copied().collect();
    let rows = engine.generate(&all, 1, &[], true, |_| {}).unwrap();
    let margins: Vec<f32> = rows.prompt_logits[ids.len() - 1..all.len() - 1]
        .iter()
        .map(|z| z.iter().copied().fold(f32::MIN, f32::max) - z[eos_id as usize])
        .collect();
    let k = (1..margins.len())
        .min_by(|&a, &b| margins[a].total_cmp(&margins[b]))
        .unwrap();
    let before = margins[..k].iter().copied().fold(f32::MAX, f32::min);
    assert!(
        before - margins[k] > 0.1,
        "no clear position for an EOS: {margins:?}"
    );
    let bias = (before + margins[k]) / 2.0;
    let extra =
        json!({"temperature": 0, "max_tokens": 12, "logit_bias": {eos_id.to_string(): bias}});
    let v = post_ok(&s.url(CHAT), &chat(q, extra));
    assert_eq!(content(&v), t.decode(&g.generated_ids[..k], true).unwrap());
    assert_eq!(usage(&v, "completion_tokens"), k as u64 + 1);
    assert_eq!(choice(&v)["finish_reason"], "stop");
}

fn sampled(s: &Server, seed: u64, q: &str) -> String {
    let extra = json!({"temperature": 1.0, "seed": seed, "max_tokens": 32, "ignore_eos": true});
    content(&post_ok(&s.url(CHAT), &chat(q, extra)))
}

#[test]
fn seeds_repeat_alone_and_in_a_batch() {
    let s = start(default_config(), None);
    let q = "Write a poem.";
    let a = sampled(&s, 42, q);
    assert_eq!(sampled(&s, 42, q), a);
    let texts: BTreeSet<String> = (1..=4).map(|seed| sampled(&s, seed, q)).collect();
    assert!(texts.len() > 1, "four seeds gave one text: {texts:?}");

    // A long stream runs the whole time the seeded request and its
    // neighbours do, so they share steps with it.
    let long = chat(
        "Go on.",
        json!({"stream": true, "ignore_eos": true, "max_tokens": 180}),
    );
    let mut bg = open_stream(&s.url(CHAT), &long);
    bg.next_data().unwrap();
    let srv = &s;
    let seeded = std::thread::scope(|sc| {
        let others: Vec<_> = (0..3)
            .map(|i| sc.spawn(move || sampled(srv, 100 + i, &format!("Other {i}"))))
            .collect();
        let mine = sc.spawn(|| sampled(srv, 42, q));
        for o in others {
            o.join().unwrap();
        }
        mine.join().unwrap()
    });
    // The other ten requests have left the batch; the long one is still in.
    wait_metrics(&s, Duration::from_secs(20), "ten finished", |s| {
        metric(s, "requests_finished_total") >= 10
    });
    assert_eq!(
        metric(&s, "requests_running"),
        1,
        "the long stream ended early"
    );
    assert_eq!(metric(&s, "requests_finished_total"), 10);
    assert_eq!(seeded, a, "a seeded request changed in a batch");
}

/// Two characters from near the middle of `text`, neither blank nor a
/// replacement character.
fn middle_piece(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mid = chars.len() / 2;
    (0..chars.len())
        .flat_map(|d| [mid + d, mid.wrapping_sub(d)])
        .filter(|&i| i + 2 < chars.len() && i > 0)
        .map(|i| chars[i..i + 2].iter().collect::<String>())
        .find(|w: &String| !w.contains('\u{fffd}') && !w.trim().is_empty())
        .expect("no stop string in the greedy output")
}

#[test]
fn stop_strings_cut_whole_and_streamed() {
    let s = start(default_config(), None);
    let extra = json!({"temperature": 0, "max_tokens": 32, "ignore_eos": true});
    let full = content(&post_ok(
        &s.url(CHAT),
        &chat("Count to ten.", extra.clone()),
    ));
    let stop = middle_piece(&full);
    let want = &full[..full.find(&stop).unwrap()];
    let mut e = extra;
    e["stop"] = json!([stop, "never-appears-zz"]);
    let v = post_ok(&s.url(CHAT), &chat("Count to ten.", e.clone()));
    assert_eq!(content(&v), want, "stop {stop:?} in {full:?}");
    assert_eq!(choice(&v)["finish_reason"], "stop");
    e["stream"] = json!(true);
    let chunks = stream_chunks(&s.url(CHAT), &chat("Count to ten.", e));
    assert_eq!(streamed(&chunks), (want.to_owned(), "stop".to_owned()));
}

#[test]
fn a_closed_stream_cancels_its_sequence() {
    let s = start(default_config(), None);
    let body = completion(
        json!("Once upon a time"),
        json!({"stream": true, "ignore_eos": true, "max_tokens": 200}),
    );
    let mut r = open_stream(&s.url(COMPLETIONS), &body);
    r.next_data().unwrap();
    r.next_data().unwrap();
    drop(r);
    wait_metrics(&s, Duration::from_secs(20), "the cancel", |s| {
        metric(s, "requests_cancelled_total") >= 1 && metric(s, "requests_running") == 0
    });
    assert!(
        metric(&s, "generation_tokens_total") < 200,
        "it ran to the end"
    );
}

#[test]
fn a_closed_waiting_stream_leaves_the_queue() {
    let cfg = flashtier_serve::SchedulerConfig {
        max_batch: 1,
        ..default_config()
    };
    let s = start(cfg, None);
    let long = completion(
        json!("a b c"),
        json!({"stream": true, "ignore_eos": true, "max_tokens": 200}),
    );
    let mut running = open_stream(&s.url(COMPLETIONS), &long);
    running.next_data().unwrap();
    let waiting = open_stream(&s.url(COMPLETIONS), &long);
    wait_metrics(&s, Duration::from_secs(20), "one waiting", |s| {
        metric(s, "requests_waiting") == 1
    });
    drop(waiting);
    wait_metrics(
        &s,
        Duration::from_secs(20),
        "the waiting one cancelled",
        |s| metric(s, "requests_cancelled_total") == 1 && metric(s, "requests_waiting") == 0,
    );
    // It never ran: the first stream is still the only one in the batch,
    // and only its prompt was taken.
    assert_eq!(metric(&s, "requests_running"), 1);
    assert_eq!(
        metric(&s, "prompt_tokens_total"),
        text_ids("a b c").len() as u64
    );
    assert_eq!(metric(&s, "requests_finished_total"), 1);
    assert!(running.next_data().is_some());
}

#[test]
fn a_full_queue_answers_429() {
    let cfg = flashtier_serve::SchedulerConfig {
        max_batch: 1,
        max_queue: 1,
        ..default_config()
    };
    let s = start(cfg, None);
    let long = completion(
        json!("a b c"),
        json!({"stream": true, "ignore_eos": true, "max_tokens": 200}),
    );
    let mut first = open_stream(&s.url(COMPLETIONS), &long);
    first.next_data().unwrap();
    let short = completion(json!("x y"), json!({"max_tokens": 3, "ignore_eos": true}));
    std::thread::scope(|sc| {
        let waiter = sc.spawn(|| post_ok(&s.url(COMPLETIONS), &short));
        wait_metrics(
            &s,
            Duration::from_secs(20),
            "one running, one waiting",
            |s| metric(s, "requests_running") == 1 && metric(s, "requests_waiting") == 1,
        );
        let mut r = agent().post(&s.url(COMPLETIONS)).send_json(&short).unwrap();
        assert_eq!(r.headers().get("retry-after").unwrap(), "1");
        let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        assert_error(r.status().as_u16(), &v, 429, None);
        assert_eq!(v["error"]["code"], "queue_full");
        assert_eq!(metric(&s, "requests_rejected_total"), 1);
        drop(first);
        let done = waiter.join().unwrap();
        assert_eq!(usage(&done, "completion_tokens"), 3);
    });
}

#[test]
fn every_client_error_has_the_openai_shape() {
    let s = start_with(default_config(), None, 4096);
    let (st, v) = raw_post(&s.url(CHAT), "{not json", None);
    assert_error(st, &v, 400, None);
    let bad: [(Value, &str); 12] = [
        (chat("hi", json!({"top_p": 0})), "top_p"),
        (chat("hi", json!({"stop": ["ok", ""]})), "stop"),
        (chat("hi", json!({"top_logprobs": 2})), "top_logprobs"),
        (completion(json!("hi"), json!({"echo": true})), "echo"),
        (completion(json!(["a", "b"]), json!({})), "prompt"),
        (chat("hi", json!({"temperature": -1})), "temperature"),
        (chat("hi", json!({"n": 2})), "n"),
        (
            chat("hi", json!({"logprobs": true, "top_logprobs": 50})),
            "top_logprobs",
        ),
        (chat("hi", json!({"max_tokens": 0})), "max_tokens"),
        (json!({"messages": []}), "messages"),
        (
            chat("hi", json!({"logit_bias": {"abc": 1.0}})),
            "logit_bias",
        ),
        (
            completion(json!(vec![5u32; 300]), json!({"max_tokens": 4})),
            "max_tokens",
        ),
    ];
    for (body, param) in bad {
        let url = s.url(if body.get("prompt").is_some() {
            COMPLETIONS
        } else {
            CHAT
        });
        let (st, v) = post(&url, &body);
        assert_error(st, &v, 400, Some(param));
    }
    // A prompt past the context with no max_tokens: still a 400.
    let (st, v) = post(
        &s.url(COMPLETIONS),
        &completion(json!(vec![5u32; 300]), json!({})),
    );
    assert_error(st, &v, 400, None);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("context"),
        "{v}"
    );

    let (st, v) = post(
        &s.url(CHAT),
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_error(st, &v, 404, Some("model"));
    assert_eq!(v["error"]["code"], "model_not_found");
    for path in ["/v1/models/nope", "/v2/nothing"] {
        let (st, t) = get(&s.url(path));
        assert_error(st, &serde_json::from_str(&t).unwrap(), 404, None);
    }
    let (st, t) = get(&s.url(CHAT));
    assert_error(st, &serde_json::from_str(&t).unwrap(), 405, None);
    let big = chat(&"x".repeat(8192), json!({}));
    let (st, v) = raw_post(&s.url(CHAT), &big.to_string(), None);
    assert_error(st, &v, 413, None);
}

#[test]
fn an_api_key_guards_every_route_but_health() {
    let s = start(default_config(), Some("sekrit"));
    let body = chat("hi", json!({"max_tokens": 2})).to_string();
    for auth in [
        None,
        Some("Bearer wrong!"),
        Some("sekrit"),
        Some("Bearer sekri"),
    ] {
        let (st, v) = raw_post(&s.url(CHAT), &body, auth);
        assert_error(st, &v, 401, None);
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let (st, v) = raw_post(&s.url(CHAT), &body, Some("Bearer sekrit"));
    assert_eq!(st, 200, "{v}");
    for path in ["/v1/models", "/metrics"] {
        let (st, t) = get(&s.url(path));
        assert_error(st, &serde_json::from_str(&t).unwrap(), 401, None);
    }
    assert_eq!(
        get(&s.url("/health")),
        (200, r#"{"status":"ok"}"#.to_owned())
    );
}

#[test]
fn a_repeated_prompt_reuses_its_cache() {
    let s = start(default_config(), None);
    let q = "Please summarise the following: ".to_owned() + &"the cat sat on the mat; ".repeat(6);
    let extra = json!({"temperature": 0, "max_tokens": 10});
    let a = post_ok(&s.url(CHAT), &chat(&q, extra.clone()));
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let before = metric(&s, "prompt_tokens_cached_total");
    let b = post_ok(&s.url(CHAT), &chat(&q, extra));
    let prompt = usage(&b, "prompt_tokens");
    assert!(prompt > 40, "a long-ish prompt: {prompt}");
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt - 1
    );
    assert_eq!(content(&b), content(&a));
    assert_eq!(
        usage(&b, "completion_tokens"),
        usage(&a, "completion_tokens")
    );
    assert_eq!(
        metric(&s, "prompt_tokens_cached_total"),
        before + prompt - 1
    );

    // A prompt sharing only a prefix reuses that much, cut back, and still
    // decodes `run`'s greedy tokens.
    let q2 = "Please summarise the following: ".to_owned() + &"the dog ran".repeat(3);
    let t = text();
    let ids = |q: &str| {
        t.encode_chat(&[ChatMessage::new("user", q)], &ChatOptions::default())
            .unwrap()
    };
    let (ids1, ids2) = (ids(&q), ids(&q2));
    let shared = ids1.iter().zip(&ids2).take_while(|(a, b)| a == b).count();
    assert!(shared > 10 && shared < ids2.len(), "{shared}");
    let c = post_ok(
        &s.url(CHAT),
        &chat(
            &q2,
            json!({"temperature": 0, "max_tokens": 10, "ignore_eos": true}),
        ),
    );
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], shared);
    let mut engine = open_engine();
    let g = engine.generate(&ids2, 10, &[], false, |_| {}).unwrap();
    assert_eq!(content(&c), t.decode(&g.generated_ids, true).unwrap());
}

#[test]
fn logprobs_list_each_token_with_sorted_alternatives() {
    let s = start(default_config(), None);
    let base = json!({"temperature": 0, "max_tokens": 8, "ignore_eos": true});
    let plain = post_ok(&s.url(CHAT), &chat("Name a colour.", base.clone()));
    let mut e = base;
    e["logprobs"] = json!(true);
    e["top_logprobs"] = json!(3);
    let v = post_ok(&s.url(CHAT), &chat("Name a colour.", e.clone()));
    // Logits on the host pick the same greedy tokens as the device's argmax.
    assert_eq!(content(&v), content(&plain));
    let entries = choice(&v)["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, usage(&v, "completion_tokens"));
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(lps[0] <= 0.0);
        assert_eq!(e["logprob"].as_f64().unwrap(), lps[0], "{e}");
        assert_eq!(e["token"], top[0]["token"], "{e}");
        assert!(e["bytes"].is_array());
    }
    // Streamed, each chunk carries the entries of its tokens.
    e["stream"] = json!(true);
    let chunks = stream_chunks(&s.url(CHAT), &chat("Name a colour.", e));
    let streamed_entries: Vec<Value> = chunks
        .iter()
        .filter_map(|c| choice(c)["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&streamed_entries, entries);

    // Completions' legacy shape: parallel lists.
    let body = completion(
        json!("red green"),
        json!({"temperature": 0, "max_tokens": 6, "ignore_eos": true, "logprobs": 2}),
    );
    let v = post_ok(&s.url(COMPLETIONS), &body);
    let lp = &choice(&v)["logprobs"];
    let n = usage(&v, "completion_tokens") as usize;
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[k].as_array().unwrap().len(), n, "{k}: {lp}");
    }
    for (l, top) in lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lp["top_logprobs"].as_array().unwrap())
    {
        let best = top
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            !top.as_object().unwrap().is_empty() && top.as_object().unwrap().len() <= 2,
            "{top}"
        );
        assert_eq!(l.as_f64().unwrap(), best, "{lp}");
    }
}

#[test]
fn models_health_and_metrics() {
    let s = start(default_config(), None);
    let (st, t) = get(&s.url("/v1/models"));
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["max_model_len"], s.limits.context);
    let (st, t) = get(&s.url(&format!("/v1/models/{MODEL}")));
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_str::<Value>(&t).unwrap(), v["data"][0]);
    assert_eq!(
        get(&s.url("/health")),
        (200, r#"{"status":"ok"}"#.to_owned())
    );

    let r = post_ok(
        &s.url(COMPLETIONS),
        &completion(json!("hi"), json!({"max_tokens": 5, "ignore_eos": true})),
    );
    let (st, t) = get(&s.url("/metrics"));
    assert_eq!(st, 200);
    for l in t.lines().filter(|l| !l.starts_with('#')) {
        let (name, v) = l.split_once(' ').unwrap();
        assert!(name.starts_with("flashtier_"), "{l}");
        v.parse::<u64>().unwrap();
    }
    assert!(t.contains("# TYPE flashtier_requests_total counter"));
    assert_eq!(metric(&s, "requests_total"), 1);
    wait_metrics(&s, Duration::from_secs(20), "the request to finish", |s| {
        metric(s, "requests_finished_total") == 1
    });
    assert_eq!(metric(&s, "generation_tokens_total"), 5);
    assert_eq!(
        metric(&s, "prompt_tokens_total"),
        usage(&r, "prompt_tokens")
    );
    assert!(metric(&s, "steps_total") >= 5);
}
