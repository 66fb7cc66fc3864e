//! The OpenAI request bodies the server takes, and their checks.
//!
//! Unknown fields are ignored (clients send many: `user`, `store`,
//! `metadata`, ...); a known field with a value the server cannot honour
//! (`n` > 1, `echo`, `suffix`, `best_of` > 1) is a 400 that names it, never
//! silently dropped. Extensions beyond OpenAI's fields, as vLLM names
//! them: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
//! `chat_template_kwargs`, `add_generation_prompt`.

use std::collections::HashMap;

use flashtier_engine::sample::{MAX_TOP_LOGPROBS, SamplingParams};
use flashtier_text::ChatMessage;
use serde::Deserialize;

use crate::error::ApiError;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields both endpoints take.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// The model's name (checked against the served one when given).
    pub model: Option<String>,
    /// Default 1 (OpenAI's default).
    pub temperature: Option<f32>,
    /// Default 1.
    pub top_p: Option<f32>,
    /// 0 or -1: off.
    pub top_k: Option<i64>,
    /// Default 0.
    pub min_p: Option<f32>,
    /// Default 0.
    pub presence_penalty: Option<f32>,
    /// Default 0.
    pub frequency_penalty: Option<f32>,
    /// Default 1.
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string key) to bias.
    pub logit_bias: Option<HashMap<String, f32>>,
    /// Seed of the generator.
    pub seed: Option<i64>,
    /// Only 1.
    pub n: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Keep going past the model's EOS tokens.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Output tokens at most (legacy name).
    pub max_tokens: Option<i64>,
    /// Output tokens at most.
    pub max_completion_tokens: Option<i64>,
    /// Return the chosen tokens' logprobs.
    #[serde(default)]
    pub logprobs: bool,
    /// Alternatives per position (needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// Tool schemas, passed to the chat template.
    pub tools: Option<serde_json::Value>,
    /// Documents, passed to the chat template.
    pub documents: Option<serde_json::Value>,
    /// Default true.
    pub add_generation_prompt: Option<bool>,
    /// Extra names for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// The sampling fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `prompt` of `/v1/completions`: text or token ids, one prompt.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch of texts (only one is served per request).
    Texts(Vec<String>),
    /// A batch of id lists (only one).
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Output tokens at most (default 16, as OpenAI's).
    pub max_tokens: Option<i64>,
    /// Alternatives per position, with the chosen tokens' logprobs.
    pub logprobs: Option<i64>,
    /// Not served: must be false.
    #[serde(default)]
    pub echo: bool,
    /// Not served: must be absent.
    pub suffix: Option<String>,
    /// Not served: must be 1.
    pub best_of: Option<i64>,
    /// The sampling fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Parse a JSON body into `T`, a 400 naming what is wrong.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not a valid request: {e}")))
}

impl SamplingFields {
    /// The engine's sampling parameters (with `logprobs` alternatives when
    /// asked), checked.
    pub fn params(
        &self,
        logprobs: Option<usize>,
        vocab: usize,
    ) -> Result<SamplingParams, ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::invalid_param(
                "n",
                format!("n = {n}: only n = 1 is served"),
            ));
        }
        let top_k = match self.top_k {
            None | Some(0) | Some(-1) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("top_k = {k}: a positive count, or 0 / -1 for off"),
                ));
            }
        };
        let mut logit_bias = Vec::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let token: u32 = k.parse().map_err(|_| {
                ApiError::invalid_param("logit_bias", format!("key `{k}` is not a token id"))
            })?;
            logit_bias.push((token, v));
        }
        logit_bias.sort_by_key(|b| b.0);
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias,
            seed: self.seed.map(|s| s as u64),
            logprobs,
        };
        p.validate(vocab).map_err(|e| {
            let param = match &e {
                flashtier_engine::sample::SampleError::Param { name, .. } => Some(*name),
                flashtier_engine::sample::SampleError::BiasToken { .. } => Some("logit_bias"),
                flashtier_engine::sample::SampleError::Logits { .. } => None,
            };
            ApiError::invalid(e.to_string()).with_param(param)
        })?;
        Ok(p)
    }

    /// The stop strings.
    #[must_use]
    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
    }

    /// Whether the last stream chunk carries the usage.
    #[must_use]
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// `max_tokens`: at least 1, at most what the context leaves (`room`),
/// `default` when absent.
pub fn max_tokens(
    v: Option<i64>,
    name: &'static str,
    default: usize,
    room: usize,
) -> Result<usize, ApiError> {
    match v {
        None => Ok(default.min(room)),
        Some(n) if n >= 1 => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n > room {
                Err(ApiError::invalid_param(
                    name,
                    format!(
                        "{name} = {n}, but the prompt leaves room for {room} tokens in this \
                         server's context"
                    ),
                ))
            } else {
                Ok(n)
            }
        }
        Some(n) => Err(ApiError::invalid_param(
            name,
            format!("{name} = {n}: at least 1"),
        )),
    }
}

/// `top_logprobs` / `logprobs` as a count of alternatives.
pub fn alternatives(v: Option<i64>, name: &'static str) -> Result<usize, ApiError> {
    match v {
        None => Ok(0),
        Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid_param(
            name,
            format!("{name} = {n}: in [0, {MAX_TOP_LOGPROBS}]"),
        )),
    }
}
