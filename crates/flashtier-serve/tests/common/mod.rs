//! Helpers shared by the server's integration tests: the tiny Qwen3-MoE
//! fixture with the ChatML tokenizer, a server on a free port, and small
//! HTTP helpers over `ureq`.
#![allow(dead_code, reason = "each test binary uses its own subset")]
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use flashtier_engine::engine::{self, Engine, Placement};
use flashtier_engine::load::{GpuOptions, LoadOptions};
use flashtier_pack::pack::{PackOptions, pack_experts};
use flashtier_serve::scheduler::SchedulerThread;
use flashtier_serve::{HttpConfig, Scheduler, SchedulerConfig};
use flashtier_text::TextModel;
use serde_json::{Value, json};

/// The name the test servers serve the model as.
pub const MODEL: &str = "tiny-moe";

/// The model folder (weights, config, tokenizer files) and its packed
/// expert store, made once per test binary.
pub struct Fixture {
    _dir: tempfile::TempDir,
    pub model: PathBuf,
    pub store: PathBuf,
}

fn crate_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The fixture (made on first use, kept until the test binary exits).
pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let root = crate_root().join("..");
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        let weights = root.join("flashtier-engine/tests/fixtures/engine/qwen3_moe");
        let chat = root.join("flashtier-text/tests/fixtures/chat");
        for (from, name) in [
            (&weights, "config.json"),
            (&weights, "model.safetensors"),
            (&chat, "tokenizer.json"),
            (&chat, "tokenizer_config.json"),
            (&chat, "generation_config.json"),
        ] {
            std::fs::copy(from.join(name), model.join(name)).unwrap();
        }
        let store = dir.path().join("experts.ftstore");
        pack_experts(&PackOptions::new(&model, &store), &|_| {}).unwrap();
        Fixture {
            _dir: dir,
            model,
            store,
        }
    })
}

/// The tokenizer and chat template.
pub fn text() -> Arc<TextModel> {
    static TEXT: OnceLock<Arc<TextModel>> = OnceLock::new();
    TEXT.get_or_init(|| Arc::new(TextModel::open(&fixture().model).unwrap()))
        .clone()
}

/// A CPU engine over the fixture (a fresh one per call).
pub fn open_engine() -> Engine {
    let f = fixture();
    let opts = LoadOptions::store(&f.store);
    let (e, chosen) = engine::open(
        &f.model,
        &f.store,
        &opts,
        Placement::Cpu,
        &GpuOptions::default(),
    )
    .unwrap();
    assert_eq!(chosen.device, "cpu");
    e
}

/// The stop tokens the server uses: generation_config.json's and
/// config.json's.
pub fn eos() -> Vec<u32> {
    static EOS: OnceLock<Vec<u32>> = OnceLock::new();
    EOS.get_or_init(|| {
        let mut eos = text().eos_token_ids().to_vec();
        eos.extend_from_slice(open_engine().eos_token_ids());
        eos.sort_unstable();
        eos.dedup();
        assert!(!eos.is_empty(), "the fixture has no EOS token");
        eos
    })
    .clone()
}

/// The limits most tests run under.
pub fn default_config() -> SchedulerConfig {
    SchedulerConfig {
        max_batch: 8,
        max_queue: 64,
        step_rows: 256,
        context: 256,
        prefix_cache_tokens: 4096,
        prefix_spill: None,
    }
}

/// A running server; dropping it stops the HTTP runtime, then the
/// scheduler thread.
pub struct Server {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The limits in force (after the engine's clamps).
    pub limits: SchedulerConfig,
    rt: Option<tokio::runtime::Runtime>,
    sched: Option<Scheduler>,
    thread: Option<SchedulerThread>,
}

impl Server {
    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = &self.sched {
            s.stop();
        }
        // Cancels every connection task, dropping the router's handle.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
        drop(self.sched.take());
        if let Some(t) = self.thread.take() {
            t.join();
        }
    }
}

/// A server over the fixture on a free port.
pub fn start(cfg: SchedulerConfig, api_key: Option<&str>) -> Server {
    start_with(cfg, api_key, 1 << 20)
}

/// [`start`] with a body limit.
pub fn start_with(cfg: SchedulerConfig, api_key: Option<&str>, max_body_bytes: usize) -> Server {
    let http = HttpConfig {
        model_name: MODEL.into(),
        api_key: api_key.map(str::to_owned),
        max_body_bytes,
    };
    start_on(cfg, http, open_engine)
}

/// A server over the engine `open` makes (on the scheduler thread), with
/// the fixture's tokenizer.
pub fn start_on(
    cfg: SchedulerConfig,
    http: HttpConfig,
    open: impl FnOnce() -> Engine + Send + 'static,
) -> Server {
    let (sched, thread) =
        Scheduler::start(|| Ok::<_, String>(open()), cfg).expect("starting the scheduler");
    let limits = thread.config().clone();
    let app = flashtier_serve::router(sched.clone(), text(), eos(), http);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    Server {
        base: format!("http://{addr}"),
        limits,
        rt: Some(rt),
        sched: Some(sched),
        thread: Some(thread),
    }
}

/// An agent that returns every status as a response (no error for 4xx).
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

/// POST `body` as JSON: the status and the parsed body.
pub fn post(url: &str, body: &Value) -> (u16, Value) {
    let mut r = agent().post(url).send_json(body).unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

/// POST `body`, asserting a 200: the parsed body.
pub fn post_ok(url: &str, body: &Value) -> Value {
    let (status, v) = post(url, body);
    assert_eq!(status, 200, "{v}");
    v
}

/// GET: the status and the text.
pub fn get(url: &str) -> (u16, String) {
    let mut r = agent().get(url).call().unwrap();
    let status = r.status().as_u16();
    (status, r.body_mut().read_to_string().unwrap())
}

/// An open server-sent event stream.
pub struct SseReader {
    lines: std::io::Lines<BufReader<Box<dyn Read + Send>>>,
}

impl SseReader {
    /// The next event's data (`[DONE]` included); `None` at the end of the
    /// body.
    pub fn next_data(&mut self) -> Option<String> {
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if let Some(d) = line.strip_prefix("data:") {
                return Some(d.trim_start().to_owned());
            }
        }
        None
    }
}

/// POST `body` (with `"stream": true`), asserting a 200 with an event
/// stream.
pub fn open_stream(url: &str, body: &Value) -> SseReader {
    let mut r = agent().post(url).send_json(body).unwrap();
    if r.status().as_u16() != 200 {
        let text = r.body_mut().read_to_string().unwrap();
        panic!("status {}: {text}", r.status());
    }
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
    let reader: Box<dyn Read + Send> = Box::new(r.into_body().into_reader());
    SseReader {
        lines: BufReader::new(reader).lines(),
    }
}

/// Every event of a stream: the JSON chunks, after asserting the last
/// event is `[DONE]` and nothing follows it.
pub fn stream_chunks(url: &str, body: &Value) -> Vec<Value> {
    let mut s = open_stream(url, body);
    let mut chunks = Vec::new();
    loop {
        let d = s
            .next_data()
            .expect("the stream ended without `data: [DONE]`");
        if d == "[DONE]" {
            break;
        }
        chunks.push(serde_json::from_str(&d).unwrap_or_else(|e| panic!("{e}: {d}")));
    }
    assert_eq!(s.next_data(), None, "events after [DONE]");
    chunks
}

/// The value of the metric `name` (`flashtier_` + name) in `/metrics`.
pub fn metric(server: &Server, name: &str) -> u64 {
    let (status, text) = get(&server.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    let key = format!("flashtier_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Poll `/metrics` until `ok` holds of it, or panic after `limit`.
pub fn wait_metrics(server: &Server, limit: Duration, what: &str, ok: impl Fn(&Server) -> bool) {
    let t0 = Instant::now();
    while !ok(server) {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `choices[0]` of an answer.
pub fn choice(v: &Value) -> &Value {
    &v["choices"][0]
}

/// `usage[key]` as a number.
pub fn usage(v: &Value, key: &str) -> u64 {
    v["usage"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.{key} in {v}"))
}

/// A chat body with one user message, merged with `extra`.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": content}]});
    merge(&mut b, extra);
    b
}

/// A completion body, merged with `extra`.
pub fn completion(prompt: Value, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "prompt": prompt});
    merge(&mut b, extra);
    b
}

/// `extra`'s keys set on `b`.
pub fn merge(b: &mut Value, extra: Value) {
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
}

/// The streamed text of chat chunks (`delta.content`) or completion chunks
/// (`text`), and the one finish reason.
pub fn streamed(chunks: &[Value]) -> (String, String) {
    let mut text = String::new();
    let mut finish = Vec::new();
    for c in chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
    {
        let ch = choice(c);
        let piece = ch["delta"]["content"].as_str().or(ch["text"].as_str());
        text.push_str(piece.unwrap_or(""));
        if let Some(f) = ch["finish_reason"].as_str() {
            finish.push(f.to_owned());
        }
    }
    assert_eq!(finish.len(), 1, "one finish_reason: {chunks:?}");
    (text, finish.remove(0))
}

/// `choices[0].message.content` of a chat answer.
pub fn content(v: &Value) -> String {
    choice(v)["message"]["content"].as_str().unwrap().to_owned()
}

/// `usage` has its four numbers, and the total adds up.
pub fn assert_usage_shape(v: &Value) {
    let (p, c) = (usage(v, "prompt_tokens"), usage(v, "completion_tokens"));
    assert!(p > 0 && c > 0, "{v}");
    assert_eq!(usage(v, "total_tokens"), p + c);
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
}

/// Every key of OpenAI's error body, and the status.
pub fn assert_error(status: u16, v: &Value, want: u16, param: Option<&str>) {
    assert_eq!(status, want, "{v}");
    let e = &v["error"];
    assert!(!e["message"].as_str().unwrap().is_empty(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    let o = e.as_object().unwrap();
    assert!(o.contains_key("param") && o.contains_key("code"), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

/// `s` tokenized as `/v1/completions` tokenizes a text prompt.
pub fn text_ids(s: &str) -> Vec<u32> {
    text().encode(s, true).unwrap()
}

/// POST `body` as it is (JSON or not), with an `Authorization` header
/// when given: the status and the parsed body.
pub fn raw_post(url: &str, body: &str, auth: Option<&str>) -> (u16, Value) {
    let mut req = agent().post(url).header("content-type", "application/json");
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let mut r = req.send(body).unwrap();
    let text = r.body_mut().read_to_string().unwrap();
    (
        r.status().as_u16(),
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}
