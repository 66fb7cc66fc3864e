//! The text layer's one error type.
//!
//! Every variant names what is at fault: the file (`path`), the JSON field
//! inside it (`field`), or the chat template (`template`, the file it came
//! from, e.g. `.../chat_template.jinja` or `.../tokenizer_config.json`).

use std::path::PathBuf;

/// Everything that can go wrong loading a model folder's text files,
/// rendering a chat, or (de)tokenizing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TextError {
    /// A file could not be opened, inspected or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },

    /// The path names a FIFO, a device node, a socket or a folder.
    #[error("{path} is not a regular file (FIFOs, devices and folders are refused)")]
    NotRegularFile {
        /// The path.
        path: PathBuf,
    },

    /// The file is larger than its cap (checked before reading it).
    #[error("{path} has {len_bytes} bytes, over the {limit_bytes}-byte cap for this file")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (or the bytes seen before the cap was passed).
        len_bytes: u64,
        /// The cap.
        limit_bytes: u64,
    },

    /// The file is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error (with line and column).
        source: serde_json::Error,
    },

    /// A JSON field has the wrong shape.
    #[error("{path}: field `{field}` {reason}")]
    BadField {
        /// The file.
        path: PathBuf,
        /// The field (a dotted path such as `chat_template[1].name`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// `tokenizer.json` exists but the `tokenizers` crate refused it.
    #[error("{path}: the tokenizer cannot be loaded: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The `tokenizers` crate's message.
        message: String,
    },

    /// `chat_template` is a list of named templates and none is `default`.
    #[error("{path}: `chat_template` lists templates {names:?} but none named \"default\"")]
    NoDefaultTemplate {
        /// The file.
        path: PathBuf,
        /// The names it has.
        names: Vec<String>,
    },

    /// `additional_chat_templates/` holds more templates than
    /// [`crate::config::MAX_NAMED_TEMPLATES`].
    #[error("{path} holds more than {limit} templates")]
    TooManyTemplates {
        /// The folder.
        path: PathBuf,
        /// The limit.
        limit: usize,
    },

    /// An end-of-sequence id is not in the tokenizer's vocabulary.
    #[error(
        "{path}: `{field}` holds id {id}, outside the tokenizer's {vocab_size}-token vocabulary"
    )]
    IdOutOfVocab {
        /// The config file.
        path: PathBuf,
        /// The field (`eos_token_id`, `text_config.eos_token_id`).
        field: String,
        /// The id.
        id: i64,
        /// The tokenizer's vocabulary size (added tokens included).
        vocab_size: usize,
    },

    /// Rendering was asked for but the folder has no chat template.
    #[error(
        "{dir} has no chat template (no chat_template.jinja, no `chat_template` in tokenizer_config.json)"
    )]
    NoChatTemplate {
        /// The model folder.
        dir: PathBuf,
    },

    /// The template does not parse.
    #[error("chat template {template}: syntax error at line {line}: {message}")]
    TemplateSyntax {
        /// Where the template came from.
        template: String,
        /// The 1-based line (0 when the engine gave none).
        line: usize,
        /// The engine's message.
        message: String,
    },

    /// The template failed while rendering (an undefined attribute, a bad
    /// operand, ...).
    #[error("chat template {template}: render error at line {line}: {message}")]
    TemplateRender {
        /// Where the template came from.
        template: String,
        /// The 1-based line (0 when the engine gave none).
        line: usize,
        /// The engine's message.
        message: String,
    },

    /// The template called `raise_exception(message)`: `message` is the
    /// template's own text, as transformers' `TemplateError` carries it.
    #[error("chat template {template} refused the conversation: {message}")]
    TemplateRaised {
        /// Where the template came from.
        template: String,
        /// The text the template passed to `raise_exception`.
        message: String,
    },

    /// The render ran past its fuel (instructions and bytes allocated).
    #[error(
        "chat template {template} ran out of its fuel of {fuel} (a loop or output too large for the input)"
    )]
    TemplateOutOfFuel {
        /// Where the template came from.
        template: String,
        /// The budget it had.
        fuel: u64,
    },

    /// The conversation has no messages (transformers refuses it too).
    #[error("cannot render an empty conversation")]
    EmptyConversation,

    /// `ChatOptions::context` sets a name the renderer owns.
    #[error(
        "context key `{key}` is reserved for the renderer (messages, tools, documents, add_generation_prompt)"
    )]
    ReservedContextKey {
        /// The key.
        key: String,
    },

    /// The tokenizer failed to encode text.
    #[error("encoding {len_bytes} bytes of text failed: {message}")]
    Encode {
        /// The text's length.
        len_bytes: usize,
        /// The `tokenizers` crate's message.
        message: String,
    },

    /// The tokenizer failed to decode ids.
    #[error("decoding {count} ids failed: {message}")]
    Decode {
        /// How many ids were given.
        count: usize,
        /// The `tokenizers` crate's message.
        message: String,
    },

    /// More stop strings than [`crate::MAX_STOP_STRINGS`].
    #[error("{count} stop strings given, at most {limit} are allowed")]
    TooManyStopStrings {
        /// How many were given.
        count: usize,
        /// The limit.
        limit: usize,
    },

    /// A stop string is longer than [`crate::MAX_STOP_STRING_BYTES`].
    #[error("stop string {index} has {len_bytes} bytes, at most {limit_bytes} are allowed")]
    StopStringTooLong {
        /// Its position in the list.
        index: usize,
        /// Its length.
        len_bytes: usize,
        /// The limit.
        limit_bytes: usize,
    },

    /// A stop string is empty (it would stop before the first byte).
    #[error("stop string {index} is empty")]
    EmptyStopString {
        /// Its position in the list.
        index: usize,
    },
}

/// The crate's result type.
pub type Result<T, E = TextError> = std::result::Result<T, E>;
