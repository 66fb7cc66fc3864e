//! The routes: `POST /v1/chat/completions`, `POST /v1/completions` (each
//! streamed as server-sent events when `stream` is set), `GET /v1/models`,
//! `GET /v1/models/{id}`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! A request's handler renders and tokenizes the prompt, submits it to the
//! scheduler and turns the token events into text ([`TextOut`]). Stop
//! strings end the output in the handler: it then drops the event
//! receiver, which takes the sequence out of the batch. A client that
//! closes its connection mid-stream drops the response stream, and with it
//! the receiver, the same way.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use flashtier_text::{ChatOptions, TextModel};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

mod sse;

use crate::api::{self, ChatRequest, CompletionRequest, PromptInput, SamplingFields};
use crate::error::ApiError;
use crate::metrics;
use crate::scheduler::{Event, Job, Scheduler, SubmitError};
use crate::text_out::TextOut;
use sse::stream_response;

/// What the HTTP layer serves with.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// The model's name in requests and answers.
    pub model_name: String,
    /// Requests must carry `Authorization: Bearer <key>` (not `/health`).
    pub api_key: Option<String>,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
}

/// The shared state of every handler.
pub struct App {
    sched: Scheduler,
    text: Arc<TextModel>,
    cfg: HttpConfig,
    eos: Vec<u32>,
    created: u64,
    ids: AtomicU64,
}

/// The router over `sched` and `text`; `eos` are the model's stop tokens.
pub fn router(sched: Scheduler, text: Arc<TextModel>, eos: Vec<u32>, cfg: HttpConfig) -> Router {
    let limit = cfg.max_body_bytes;
    let created = now();
    let app = Arc::new(App {
        sched,
        text,
        cfg,
        eos,
        created,
        ids: AtomicU64::new(created.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::no_route(uri.path())
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::method(method.as_str(), uri.path())
}

impl App {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.cfg.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Compare every byte whatever the first difference (no timing hint).
        let ok = given.is_some_and(|g| {
            g.len() == key.len()
                && g.bytes()
                    .zip(key.bytes())
                    .fold(0u8, |a, (x, y)| a | (x ^ y))
                    == 0
        });
        if ok {
            Ok(())
        } else {
            Err(ApiError::unauthorized())
        }
    }

    fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            Some(m) if m != self.cfg.model_name => Err(ApiError::no_model(m, &self.cfg.model_name)),
            _ => Ok(()),
        }
    }

    /// What every generation endpoint does first: the API key, the body
    /// within its limit, the JSON parsed as `R`, the model name asked for
    /// (from `R`'s sampling fields).
    fn request<R: serde::de::DeserializeOwned>(
        &self,
        headers: &HeaderMap,
        body: Result<Bytes, BytesRejection>,
        sampling: impl Fn(&R) -> &SamplingFields,
    ) -> Result<R, ApiError> {
        self.authorize(headers)?;
        let body = body_of(body, self.cfg.max_body_bytes)?;
        let req: R = api::parse(&body)?;
        self.check_model(sampling(&req).model.as_deref())?;
        Ok(req)
    }

    /// Tokens the context leaves after `prompt`.
    fn room(&self, prompt: &[u32]) -> usize {
        self.sched.context().saturating_sub(prompt.len())
    }

    fn next_id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        format!("{prefix}-{n:016x}")
    }

    fn stop_ids(&self, s: &SamplingFields) -> Vec<u32> {
        if s.ignore_eos {
            Vec::new()
        } else {
            self.eos.clone()
        }
    }
}

fn body_of(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::invalid(format!("reading the request body: {e}"))
        }
    })
}

/// A request ready for the scheduler.
struct Prepared {
    kind: Kind,
    prompt: Vec<u32>,
    job_max: usize,
    params: flashtier_engine::sample::SamplingParams,
    stop_ids: Vec<u32>,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<Prepared, ApiError> {
        let req: ChatRequest = app.request(&headers, body, |r: &ChatRequest| &r.sampling)?;
        if req.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "messages is empty"));
        }
        if !app.text.has_chat_template() {
            return Err(ApiError::invalid(
                "this model has no chat template (tokenizer_config.json or \
                 chat_template.jinja); use /v1/completions",
            ));
        }
        let options = ChatOptions {
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
            tools: req.tools.clone(),
            documents: req.documents.clone(),
            context: req.chat_template_kwargs.clone().unwrap_or_default(),
        };
        let prompt = app
            .text
            .encode_chat(&req.messages, &options)
            .map_err(|e| ApiError::invalid_param("messages", format!("chat template: {e}")))?;
        let logprobs = if req.logprobs {
            Some(api::alternatives(req.top_logprobs, "top_logprobs")?)
        } else if req.top_logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        } else {
            None
        };
        let room = app.room(&prompt);
        let (v, name) = match req.max_completion_tokens {
            Some(v) => (Some(v), "max_completion_tokens"),
            None => (req.max_tokens, "max_tokens"),
        };
        let job_max = api::max_tokens(v, name, room, room)?;
        prepare(&app, Kind::Chat, prompt, job_max, logprobs, &req.sampling)
    };
    answer(app.clone(), run()).await
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<Prepared, ApiError> {
        let req: CompletionRequest =
            app.request(&headers, body, |r: &CompletionRequest| &r.sampling)?;
        if req.echo {
            return Err(ApiError::invalid_param("echo", "echo is not served"));
        }
        if req.suffix.is_some() {
            return Err(ApiError::invalid_param("suffix", "suffix is not served"));
        }
        if req.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::invalid_param(
                "best_of",
                "only best_of = 1 is served",
            ));
        }
        let one = |n: usize| {
            if n == 1 {
                Ok(())
            } else {
                Err(ApiError::invalid_param(
                    "prompt",
                    format!("{n} prompts in one request; send one per request"),
                ))
            }
        };
        let encode = |s: &str| {
            app.text
                .encode(s, true)
                .map_err(|e| ApiError::invalid_param("prompt", format!("tokenizing: {e}")))
        };
        let prompt = match &req.prompt {
            PromptInput::Text(s) => encode(s)?,
            PromptInput::Ids(ids) => ids.clone(),
            PromptInput::Texts(v) => {
                one(v.len())?;
                encode(&v[0])?
            }
            PromptInput::IdLists(v) => {
                one(v.len())?;
                v[0].clone()
            }
        };
        let logprobs = match req.logprobs {
            None => None,
            n => Some(api::alternatives(n, "logprobs")?),
        };
        let room = app.room(&prompt);
        let job_max = api::max_tokens(req.max_tokens, "max_tokens", 16, room)?;
        prepare(
            &app,
            Kind::Completion,
            prompt,
            job_max,
            logprobs,
            &req.sampling,
        )
    };
    answer(app.clone(), run()).await
}

/// A generation request's response: the generation, or the error that
/// stopped it before anything ran.
async fn answer(app: Arc<App>, prepared: Result<Prepared, ApiError>) -> Response {
    match prepared {
        Ok(p) => generate(app, p).await,
        Err(e) => e.into_response(),
    }
}

fn prepare(
    app: &App,
    kind: Kind,
    prompt: Vec<u32>,
    job_max: usize,
    logprobs: Option<usize>,
    s: &SamplingFields,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "the prompt has no tokens",
        ));
    }
    let vocab = app
        .text
        .vocab_size()
        .max(app.eos.iter().map(|&e| e as usize + 1).max().unwrap_or(0));
    let params = s.params(logprobs, vocab)?;
    let stops = s.stops();
    // Checked here so a bad list is a 400 before anything runs.
    flashtier_text::StopStrings::new(stops.clone())
        .map_err(|e| ApiError::invalid_param("stop", e.to_string()))?;
    Ok(Prepared {
        kind,
        prompt,
        job_max: job_max.max(1),
        params,
        stop_ids: app.stop_ids(s),
        stops,
        stream: s.stream,
        include_usage: s.include_usage(),
    })
}

fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => ApiError::busy(e.to_string()),
        SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        SubmitError::Invalid(m) => ApiError::invalid(m),
    }
}

async fn generate(app: Arc<App>, p: Prepared) -> Response {
    let job = Job {
        prompt: p.prompt.clone(),
        params: p.params.clone(),
        max_tokens: p.job_max,
        stop_ids: p.stop_ids.clone(),
    };
    let rx = match app.sched.submit(job) {
        Ok(rx) => rx,
        Err(e) => return submit_error(e).into_response(),
    };
    if p.stream {
        match stream_response(app, p, rx) {
            Ok(s) => s.into_response(),
            Err(e) => e.into_response(),
        }
    } else {
        match whole(&app, &p, rx).await {
            Ok(v) => Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// Wait for the whole output.
async fn whole(
    app: &App,
    p: &Prepared,
    mut rx: UnboundedReceiver<Event>,
) -> Result<Value, ApiError> {
    let mut out = TextOut::new(app.text.clone(), p.stops.clone())?;
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached } => out.cached = cached,
            Event::Token(pick) => text.push_str(&out.push(&pick)?),
            Event::Done(f) => text.push_str(&out.end(f)?),
            Event::Failed(why) => return Err(ApiError::internal(why)),
        }
        if out.done() {
            break;
        }
    }
    drop(rx);
    let Some(finish) = out.finish else {
        return Err(ApiError::internal(
            "the scheduler stopped before the output ended",
        ));
    };
    let usage = out.usage(p.prompt.len());
    let want_lp = p.params.logprobs.is_some();
    Ok(match p.kind {
        Kind::Chat => json!({
            "id": app.next_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": app.cfg.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": if want_lp { out.chat_logprobs(0) } else { Value::Null },
                "finish_reason": finish,
            }],
            "usage": usage,
        }),
        Kind::Completion => json!({
            "id": app.next_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": app.cfg.model_name,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": if want_lp { out.completion_logprobs(0) } else { Value::Null },
                "finish_reason": finish,
            }],
            "usage": usage,
        }),
    })
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [model_card(&app)]})).into_response()
}

fn model_card(app: &App) -> Value {
    json!({
        "id": app.cfg.model_name, "object": "model", "created": app.created,
        "owned_by": "flashtier", "max_model_len": app.sched.context(),
    })
}

async fn model_one(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = app.authorize(&headers) {
        return e.into_response();
    }
    if id != app.cfg.model_name {
        return ApiError::no_model(&id, &app.cfg.model_name).into_response();
    }
    Json(model_card(&app)).into_response()
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn metrics_text(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.authorize(&headers) {
        return e.into_response();
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics::render(app.sched.counters()),
    )
        .into_response()
}
