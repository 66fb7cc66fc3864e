//! One request's output text: token ids through the streaming detokenizer
//! and the stop strings, with the logprobs a client asked for.

use std::sync::Arc;

use flashtier_engine::sample::Pick;
use flashtier_text::{StopStrings, StreamDecoder, TextModel};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::scheduler::Finish;

/// One output token's logprobs: its text, its logprob, and the
/// alternatives' texts and logprobs.
pub type TokenLogprobs = (String, f32, Vec<(String, f32)>);

/// The text of one generation so far.
pub struct TextOut {
    text_model: Arc<TextModel>,
    decoder: StreamDecoder,
    stops: StopStrings,
    /// Output tokens picked (an EOS included).
    pub tokens: usize,
    /// Prompt positions reused from a kept cache.
    pub cached: usize,
    /// `stop` or `length`, once finished.
    pub finish: Option<&'static str>,
    /// Per token: (token text, logprob, alternatives).
    pub logprobs: Vec<TokenLogprobs>,
}

impl TextOut {
    /// A generation watched by `stops`.
    pub fn new(text_model: Arc<TextModel>, stops: Vec<String>) -> Result<Self, ApiError> {
        let stops =
            StopStrings::new(stops).map_err(|e| ApiError::invalid_param("stop", e.to_string()))?;
        Ok(Self {
            decoder: text_model.stream_decoder(true),
            text_model,
            stops,
            tokens: 0,
            cached: 0,
            finish: None,
            logprobs: Vec::new(),
        })
    }

    fn piece(&self, id: u32) -> String {
        self.text_model.decode(&[id], false).unwrap_or_default()
    }

    /// One picked token: the text it releases (held back while it may
    /// begin a stop string; empty after a stop string matched).
    pub fn push(&mut self, pick: &Pick) -> Result<String, ApiError> {
        if self.finish.is_some() {
            return Ok(String::new());
        }
        self.tokens += 1;
        if let Some(lp) = pick.logprob {
            let top = pick.top.iter().map(|&(t, l)| (self.piece(t), l)).collect();
            self.logprobs.push((self.piece(pick.token), lp, top));
        }
        let delta = self
            .decoder
            .push(pick.token)
            .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
        let step = self.stops.push(&delta);
        if step.stopped {
            self.finish = Some("stop");
        }
        Ok(step.text)
    }

    /// The scheduler's end: the text still held.
    pub fn end(&mut self, f: Finish) -> Result<String, ApiError> {
        if self.finish.is_some() {
            return Ok(String::new());
        }
        if let Finish::Stop(_) = f {
            self.tokens += 1;
        }
        let tail = self
            .decoder
            .finish()
            .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
        let step = self.stops.push(&tail);
        let mut out = step.text;
        if step.stopped {
            self.finish = Some("stop");
            return Ok(out);
        }
        out.push_str(&self.stops.finish());
        self.finish = Some(match f {
            Finish::Stop(_) => "stop",
            Finish::Length => "length",
        });
        Ok(out)
    }

    /// Whether the output ended (a stop string, a stop token or the
    /// length).
    #[must_use]
    pub fn done(&self) -> bool {
        self.finish.is_some()
    }

    /// `usage`.
    #[must_use]
    pub fn usage(&self, prompt: usize) -> Value {
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }

    /// Chat's `logprobs` for the entries from `from` on.
    #[must_use]
    pub fn chat_logprobs(&self, from: usize) -> Value {
        let entry = |t: &str, l: f32| json!({"token": t, "logprob": l, "bytes": t.as_bytes()});
        let content: Vec<Value> = self.logprobs[from.min(self.logprobs.len())..]
            .iter()
            .map(|(t, l, top)| {
                let mut e = entry(t, *l);
                e["top_logprobs"] = top.iter().map(|(t, l)| entry(t, *l)).collect();
                e
            })
            .collect();
        json!({ "content": content })
    }

    /// Completions' legacy `logprobs` for the entries from `from` on.
    #[must_use]
    pub fn completion_logprobs(&self, from: usize) -> Value {
        let slice = &self.logprobs[from.min(self.logprobs.len())..];
        let tokens: Vec<&str> = slice.iter().map(|e| e.0.as_str()).collect();
        let lps: Vec<f32> = slice.iter().map(|e| e.1).collect();
        let tops: Vec<Value> = slice
            .iter()
            .map(|e| {
                let m: serde_json::Map<String, Value> =
                    e.2.iter().map(|(t, l)| (t.clone(), json!(l))).collect();
                Value::Object(m)
            })
            .collect();
        let mut offset = 0usize;
        let offsets: Vec<usize> = slice
            .iter()
            .map(|e| {
                let o = offset;
                offset += e.0.len();
                o
            })
            .collect();
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }
}
