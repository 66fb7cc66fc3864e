//! Streamed responses: server-sent events, one per output piece, then the
//! usage and `data: [DONE]`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::{App, Kind, Prepared, now};
use crate::error::ApiError;
use crate::scheduler::Event;
use crate::text_out::TextOut;

/// The state of one streamed answer.
struct Streaming {
    app: Arc<App>,
    p: Prepared,
    rx: Option<UnboundedReceiver<Event>>,
    out: TextOut,
    id: String,
    created: u64,
    sent_role: bool,
    logprobs_sent: usize,
    ended: bool,
}

impl Streaming {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        let out = &self.out;
        let want_lp = self.p.params.logprobs.is_some();
        let mut v = match self.p.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if !self.sent_role {
                    delta["role"] = json!("assistant");
                }
                if !text.is_empty() || !self.sent_role {
                    delta["content"] = json!(text);
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.app.cfg.model_name,
                    "choices": [{
                        "index": 0, "delta": delta,
                        "logprobs": if want_lp { out.chat_logprobs(self.logprobs_sent) } else { Value::Null },
                        "finish_reason": finish,
                    }],
                })
            }
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.app.cfg.model_name,
                "choices": [{
                    "index": 0, "text": text,
                    "logprobs": if want_lp { out.completion_logprobs(self.logprobs_sent) } else { Value::Null },
                    "finish_reason": finish,
                }],
            }),
        };
        // OpenAI: with `include_usage`, every other chunk has `"usage": null`.
        if self.p.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn usage_chunk(&self) -> Value {
        let out = &self.out;
        let object = match self.p.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.app.cfg.model_name, "choices": [],
            "usage": out.usage(self.p.prompt.len()),
        })
    }
}

fn sse_json(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

pub(super) fn stream_response(
    app: Arc<App>,
    p: Prepared,
    rx: UnboundedReceiver<Event>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let id = app.next_id(match p.kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    });
    // The stop strings were checked when the request was prepared.
    let out = TextOut::new(app.text.clone(), p.stops.clone())?;
    let st = Streaming {
        app,
        p,
        rx: Some(rx),
        out,
        id,
        created: now(),
        sent_role: false,
        logprobs_sent: 0,
        ended: false,
    };
    let events = stream::unfold(st, |mut st| async move {
        if st.ended {
            return None;
        }
        let batch = next_events(&mut st).await;
        Some((stream::iter(batch.into_iter().map(Ok)), st))
    })
    .flatten();
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// The next events: the role chunk first (chat), then a chunk per piece
/// of text, then the finish chunk, the usage chunk when asked for, and
/// `[DONE]`.
async fn next_events(st: &mut Streaming) -> Vec<SseEvent> {
    let mut batch = Vec::new();
    if !st.sent_role && st.p.kind == Kind::Chat {
        batch.push(sse_json(&st.chunk("", None)));
        st.sent_role = true;
        return batch;
    }
    st.sent_role = true;
    let fail = |st: &mut Streaming, e: ApiError| {
        st.rx = None;
        st.ended = true;
        vec![sse_json(&e.body()), SseEvent::default().data("[DONE]")]
    };
    loop {
        let Some(rx) = st.rx.as_mut() else {
            st.ended = true;
            return batch;
        };
        let Some(ev) = rx.recv().await else {
            return fail(
                st,
                ApiError::internal("the scheduler stopped before the output ended"),
            );
        };
        let text = match ev {
            Event::Started { cached } => {
                st.out.cached = cached;
                continue;
            }
            Event::Token(pick) => st.out.push(&pick),
            Event::Done(f) => st.out.end(f),
            Event::Failed(why) => return fail(st, ApiError::internal(why)),
        };
        let text = match text {
            Ok(t) => t,
            Err(e) => return fail(st, e),
        };
        if !text.is_empty() {
            batch.push(sse_json(&st.chunk(&text, None)));
            st.logprobs_sent = st.out.logprobs.len();
        }
        if st.out.done() {
            // Dropping the receiver takes the sequence out of the batch
            // (a stop string ends it here, before the scheduler knows).
            st.rx = None;
            let finish = st.out.finish;
            batch.push(sse_json(&st.chunk("", finish)));
            if st.p.include_usage {
                batch.push(sse_json(&st.usage_chunk()));
            }
            batch.push(SseEvent::default().data("[DONE]"));
            st.ended = true;
        }
        if !batch.is_empty() {
            return batch;
        }
    }
}
