//! Chat rendering as transformers' `apply_chat_template(messages,
//! tokenize=False, add_generation_prompt=...)` renders it (transformers 5.x).
//!
//! What the template sees, as transformers builds it:
//! - `messages`: each message as a dict, keys whose value is null dropped
//!   (transformers 5 drops them so templates do not print "None"), and when
//!   the message carries `reasoning_content`, `thinking` or `reasoning`,
//!   the first of those copied to both `thinking` and `reasoning_content`;
//! - `tools` and `documents`: the given JSON, or `None` (defined, falsy);
//! - `add_generation_prompt`;
//! - the named special tokens that are set (`bos_token`, `eos_token`,
//!   `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`), as
//!   strings; unset ones stay undefined;
//! - [`ChatOptions::context`]'s extra names (they override special tokens).
//!
//! Bound: a render runs on a fuel of [`RENDER_FUEL_BASE`] +
//! [`RENDER_FUEL_PER_INPUT_BYTE`] × (bytes of the template source, plus the
//! messages, tools, documents and context as JSON). minijinja charges fuel
//! per instruction and per byte it allocates (output included), so the
//! budget bounds both time and memory; a template that loops forever or
//! grows its output without end fails with
//! [`TextError::TemplateOutOfFuel`]. Printing values nests at most
//! 256 levels; macros recurse at most minijinja's default
//! 500 levels.

mod clock;
mod env;
mod pyfmt;

use minijinja::value::Serde;
use minijinja::{Environment, Value};
use serde::{Deserialize, Serialize};
use serde_json::Map;

use crate::config::SpecialTokens;
use crate::error::{Result, TextError};

/// Fuel every render gets, whatever its input (about a million engine
/// instructions).
pub const RENDER_FUEL_BASE: u64 = 1_000_000;

/// Fuel added per byte of input (template source, messages, tools,
/// documents and context, measured as JSON).
pub const RENDER_FUEL_PER_INPUT_BYTE: u64 = 32;

/// Names the renderer sets itself; [`ChatOptions::context`] may not.
const RESERVED_NAMES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// The fields transformers reads a message's reasoning from, in order.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// One chat message as OpenAI-style clients send it.
///
/// `content` is usually a string; it may be a list of content parts or
/// anything else JSON, which reaches the template as it is. Every other key
/// (`tool_calls`, `tool_call_id`, `reasoning_content`, ...) lands in
/// `extra` and reaches the template too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text, or structured content; `None` when absent or null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<serde_json::Value>,
    /// The participant's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Every other key, passed through to the template.
    #[serde(flatten)]
    pub extra: Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(serde_json::Value::String(content.into())),
            name: None,
            extra: Map::new(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }

    /// The message as the template sees it (see the module docs).
    fn template_value(&self) -> Value {
        let mut pairs: Vec<(String, Value)> =
            vec![("role".to_owned(), Value::from(self.role.as_str()))];
        if let Some(content) = self.content.as_ref().filter(|c| !c.is_null()) {
            pairs.push(("content".to_owned(), Value::from(Serde(content))));
        }
        if let Some(name) = &self.name {
            pairs.push(("name".to_owned(), Value::from(name.as_str())));
        }
        for (key, value) in &self.extra {
            let shadowed = matches!(key.as_str(), "role" | "content" | "name");
            if !value.is_null() && !shadowed {
                pairs.push((key.clone(), Value::from(Serde(value))));
            }
        }
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|field| pairs.iter().find(|(key, _)| key == field))
            .map(|(_, value)| value.clone());
        if let Some(reasoning) = reasoning {
            // {"thinking": r, **message, "reasoning_content": r}
            let mut aliased = vec![("thinking".to_owned(), reasoning.clone())];
            for (key, value) in pairs {
                match aliased.iter_mut().find(|(k, _)| *k == key) {
                    Some(slot) => slot.1 = value,
                    None => aliased.push((key, value)),
                }
            }
            match aliased.iter_mut().find(|(k, _)| k == "reasoning_content") {
                Some(slot) => slot.1 = reasoning,
                None => aliased.push(("reasoning_content".to_owned(), reasoning)),
            }
            pairs = aliased;
        }
        Value::from_pairs(pairs)
    }
}

/// How to render a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Append the assistant header so the model answers next.
    pub add_generation_prompt: bool,
    /// Tool schemas (usually a list of `{"type": "function", ...}`).
    pub tools: Option<serde_json::Value>,
    /// Documents for retrieval-augmented templates (a list of dicts).
    pub documents: Option<serde_json::Value>,
    /// Extra names for the template (`enable_thinking`, ...).
    pub context: Map<String, serde_json::Value>,
}

impl Default for ChatOptions {
    fn default() -> ChatOptions {
        ChatOptions {
            add_generation_prompt: true,
            tools: None,
            documents: None,
            context: Map::new(),
        }
    }
}

/// Counts bytes written (the input's JSON size, without building it).
struct ByteCount(u64);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn json_len<T: Serialize + ?Sized>(value: &T) -> u64 {
    let mut count = ByteCount(0);
    // Serializing plain data into a counter cannot fail; a failure would
    // only mean a smaller budget.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// `None` for a missing or null JSON value, else the value.
fn json_or_none(value: Option<&serde_json::Value>) -> Value {
    match value.filter(|v| !v.is_null()) {
        Some(value) => Value::from(Serde(value)),
        None => Value::from(()),
    }
}

/// A compiled chat template, ready to render.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    label: String,
    env: Environment<'static>,
    source_len_bytes: u64,
}

impl ChatTemplate {
    /// Compiles `source`; `label` names it in errors (usually its file).
    pub fn compile(label: impl Into<String>, source: impl Into<String>) -> Result<ChatTemplate> {
        let label = label.into();
        let source = source.into();
        let source_len_bytes = source.len() as u64;
        let mut env = env::environment().map_err(|err| syntax_error(&label, &err))?;
        env.add_template_owned(label.clone(), source)
            .map_err(|err| syntax_error(&label, &err))?;
        Ok(ChatTemplate {
            label,
            env,
            source_len_bytes,
        })
    }

    /// Where the template came from.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The fuel a render of this input gets (see the module docs).
    pub fn render_fuel(&self, messages: &[ChatMessage], options: &ChatOptions) -> u64 {
        let input_bytes = self.source_len_bytes
            + json_len(messages)
            + options.tools.as_ref().map_or(0, json_len)
            + options.documents.as_ref().map_or(0, json_len)
            + json_len(&options.context);
        RENDER_FUEL_BASE.saturating_add(input_bytes.saturating_mul(RENDER_FUEL_PER_INPUT_BYTE))
    }

    /// Renders the conversation with `specials` as the special tokens.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
        specials: &SpecialTokens,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(TextError::EmptyConversation);
        }
        if let Some(key) = options
            .context
            .keys()
            .find(|k| RESERVED_NAMES.contains(&k.as_str()))
        {
            return Err(TextError::ReservedContextKey { key: key.clone() });
        }
        let fuel = self.render_fuel(messages, options);
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let template = env
            .get_template(&self.label)
            .map_err(|err| render_error(&self.label, fuel, &err))?;

        let messages: Vec<Value> = messages.iter().map(ChatMessage::template_value).collect();
        let mut names: Vec<(String, Value)> = vec![
            ("messages".to_owned(), Value::from(messages)),
            ("tools".to_owned(), json_or_none(options.tools.as_ref())),
            (
                "documents".to_owned(),
                json_or_none(options.documents.as_ref()),
            ),
            (
                "add_generation_prompt".to_owned(),
                Value::from(options.add_generation_prompt),
            ),
        ];
        for (field, token) in specials.named() {
            if let Some(token) = token {
                names.push((field.to_owned(), Value::from(token)));
            }
        }
        for (key, value) in &options.context {
            let value = Value::from(Serde(value));
            match names.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = value,
                None => names.push((key.clone(), value)),
            }
        }
        template
            .render(Value::from_pairs(names))
            .map_err(|err| render_error(&self.label, fuel, &err))
    }
}

/// The engine's message: its kind and detail, without the location (the
/// variants carry that).
fn describe(err: &minijinja::Error) -> String {
    match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    }
}

fn syntax_error(label: &str, err: &minijinja::Error) -> TextError {
    TextError::TemplateSyntax {
        template: label.to_owned(),
        line: err.line().unwrap_or(0),
        message: describe(err),
    }
}

fn render_error(label: &str, fuel: u64, err: &minijinja::Error) -> TextError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = cause {
        if let Some(raised) = current.downcast_ref::<env::Raised>() {
            return TextError::TemplateRaised {
                template: label.to_owned(),
                message: raised.0.clone(),
            };
        }
        cause = current.source();
    }
    if err.kind() == minijinja::ErrorKind::OutOfFuel {
        return TextError::TemplateOutOfFuel {
            template: label.to_owned(),
            fuel,
        };
    }
    TextError::TemplateRender {
        template: label.to_owned(),
        line: err.line().unwrap_or(0),
        message: describe(err),
    }
}

#[cfg(test)]
mod tests;
