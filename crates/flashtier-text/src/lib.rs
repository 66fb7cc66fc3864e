//! flashtier's text layer: everything between a model folder's text files
//! and token ids, for `flashtier run --prompt` and `flashtier serve`.
//!
//! - [`TextModel::open`] loads `tokenizer.json` (required), the chat
//!   template (`chat_template.jinja`, else tokenizer_config.json's
//!   `chat_template`), the special tokens and the end-of-sequence ids
//!   (generation_config.json over config.json, as `generate` resolves them);
//!   the rules are in [`config`]. Every file is size-capped before it is
//!   read and FIFOs or device nodes are refused.
//! - [`TextModel::render_chat`] renders a conversation byte for byte as
//!   transformers' `apply_chat_template(..., tokenize=False)`, and
//!   [`TextModel::encode_chat`] as `tokenize=True`; the bound on a render
//!   (fuel proportional to its input) is in [`chat`].
//! - [`StreamDecoder`] turns ids into text deltas that never split a
//!   character and add up to `decode(all ids)`; its window bound is in
//!   [`stream`].
//! - [`StopStrings`] cuts a stream at the first stop string, whatever the
//!   delta boundaries; bounds in [`stop`].
//!
//! ```
//! use flashtier_text::{ChatMessage, ChatOptions, StopStrings, TextModel};
//!
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
//! let model = TextModel::open(&dir)?;
//!
//! // The prompt, as transformers renders and tokenizes it.
//! let messages = [ChatMessage::user("Hello there!")];
//! let prompt = model.render_chat(&messages, &ChatOptions::default())?;
//! assert!(prompt.ends_with("<|im_start|>user\nHello there!\n<|im_end|>\n<|im_start|>assistant\n"));
//! let ids = model.encode_chat(&messages, &ChatOptions::default())?;
//! assert_eq!(model.decode(&ids, false)?, prompt);
//! assert_eq!(model.eos_token_ids(), [383, 381]); // <|im_end|>, <|endoftext|>
//!
//! // Streaming a generation through the detokenizer and a stop string.
//! let mut stream = model.stream_decoder(true);
//! let mut stop = StopStrings::new(vec!["world".to_string()])?;
//! let mut shown = String::new();
//! for id in model.encode("Hello, 世界 and world!", false)? {
//!     let step = stop.push(&stream.push(id)?);
//!     shown.push_str(&step.text);
//!     if step.stopped {
//!         break;
//!     }
//! }
//! assert_eq!(shown, "Hello, 世界 and ");
//! # Ok::<(), flashtier_text::TextError>(())
//! ```
//!
//! Where rendering can still differ from transformers (none of the common
//! model templates relies on these): `strftime_now` uses UTC rather than
//! local time; Python methods beyond minijinja-contrib's pycompat set fail
//! as unknown methods; `repr` of a string prints unassigned code points
//! that Python would escape. Without serde_json's `preserve_order` feature
//! (off in this workspace), JSON objects passed in (tools, message fields)
//! reach the template with their keys sorted, where transformers keeps the
//! caller's order; objects built inside templates keep their order.

pub mod chat;
pub mod config;
mod error;
mod files;
mod model;
pub mod stop;
pub mod stream;

pub use chat::{
    ChatMessage, ChatOptions, ChatTemplate, RENDER_FUEL_BASE, RENDER_FUEL_PER_INPUT_BYTE,
};
pub use config::SpecialTokens;
pub use error::{Result, TextError};
pub use files::{MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES};
pub use model::TextModel;
pub use stop::{MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, StopStep, StopStrings};
pub use stream::StreamDecoder;
