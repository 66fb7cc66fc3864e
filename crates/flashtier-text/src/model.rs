//! [`TextModel`]: a model folder's tokenizer, chat template, special tokens
//! and end-of-sequence ids, loaded once and shared.
//!
//! Invariants: every id in [`TextModel::eos_token_ids`] is in the
//! tokenizer's vocabulary (checked at open); the tokenizer runs with no
//! truncation and no padding (tokenizer.json may configure both; transformers
//! turns them off for a plain call, and so do we); every file read is
//! capped ([`crate::MAX_CONFIG_BYTES`], [`crate::MAX_TOKENIZER_BYTES`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
use crate::config::{self, SpecialTokens};
use crate::error::{Result, TextError};
use crate::files::{self, MAX_TOKENIZER_BYTES};
use crate::stream::{StreamDecoder, decode_ids};

/// The text side of one model folder.
#[derive(Debug, Clone)]
pub struct TextModel {
    dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    specials: SpecialTokens,
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
    template: Option<ChatTemplate>,
    tool_template: Option<ChatTemplate>,
    eos_ids: Vec<u32>,
    eos_origin: Option<(PathBuf, String)>,
}

fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let bytes = files::read_capped(path, MAX_TOKENIZER_BYTES)?;
    let refused = |err: tokenizers::Error| TextError::Tokenizer {
        path: path.to_path_buf(),
        message: err.to_string(),
    };
    let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(refused)?;
    tokenizer.with_truncation(None).map_err(refused)?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

impl TextModel {
    /// Loads `dir/tokenizer.json` (required), the chat template, the special
    /// tokens and the end-of-sequence ids (see [`crate::config`]'s rules).
    pub fn open(dir: &Path) -> Result<TextModel> {
        let tokenizer = load_tokenizer(&dir.join("tokenizer.json"))?;
        let text_config = config::tokenizer_config(dir)?;
        let compile = |source: Option<config::TemplateSource>| {
            source
                .map(|s| ChatTemplate::compile(s.label, s.source))
                .transpose()
        };
        let template = compile(text_config.templates.default)?;
        let tool_template = compile(text_config.templates.tool_use)?;
        let vocab_size = tokenizer.get_vocab_size(true);
        let eos = config::eos_ids(dir, vocab_size, |id| tokenizer.id_to_token(id).is_some())?;
        Ok(TextModel {
            dir: dir.to_path_buf(),
            tokenizer: Arc::new(tokenizer),
            specials: text_config.specials,
            add_bos_token: text_config.add_bos_token,
            add_eos_token: text_config.add_eos_token,
            template,
            tool_template,
            eos_ids: eos.ids,
            eos_origin: eos.origin,
        })
    }

    /// The folder this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Token ids of `text`; `add_special_tokens` runs tokenizer.json's post
    /// processor (a BOS, for instance), as transformers' `encode` does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|err| TextError::Encode {
                len_bytes: text.len(),
                message: err.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`; invalid UTF-8 comes out as U+FFFD, ids outside the
    /// vocabulary are skipped (both as transformers does). No
    /// `clean_up_tokenization_spaces` pass is applied.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        decode_ids(&self.tokenizer, ids, skip_special_tokens)
    }

    /// The vocabulary size, added tokens included (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id of a token (its vocabulary string, e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The vocabulary string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// The named special tokens from tokenizer_config.json.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.specials
    }

    /// tokenizer_config.json's `add_bos_token`, if present. Informational:
    /// with a tokenizer.json, [`TextModel::encode`] adds what its post
    /// processor adds (transformers 5 ignores the flag then too).
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos_token
    }

    /// tokenizer_config.json's `add_eos_token`, if present (informational,
    /// like [`TextModel::add_bos_token`]).
    pub fn add_eos_token(&self) -> Option<bool> {
        self.add_eos_token
    }

    /// The ids that end a generation (duplicates removed, file order kept);
    /// empty when no config names any.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The file and field the end-of-sequence ids came from.
    pub fn eos_token_ids_origin(&self) -> Option<(&Path, &str)> {
        self.eos_origin
            .as_ref()
            .map(|(path, field)| (path.as_path(), field.as_str()))
    }

    /// Whether the folder has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The default chat template.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Replaces the folder's chat templates with `template` (a server's
    /// `--chat-template` option); the folder's `tool_use` template goes too.
    pub fn set_chat_template(&mut self, template: ChatTemplate) {
        self.template = Some(template);
        self.tool_template = None;
    }

    /// The template a render uses: `tool_use` when tools are given and the
    /// folder has one (transformers' rule), else the default.
    fn template_for(&self, options: &ChatOptions) -> Result<&ChatTemplate> {
        let tools_given = options.tools.as_ref().is_some_and(|t| !t.is_null());
        let tool_template = self.tool_template.as_ref().filter(|_| tools_given);
        tool_template
            .or(self.template.as_ref())
            .ok_or_else(|| TextError::NoChatTemplate {
                dir: self.dir.clone(),
            })
    }

    /// Renders a conversation as transformers' `apply_chat_template(...,
    /// tokenize=False)` does (see [`crate::chat`]).
    pub fn render_chat(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String> {
        self.template_for(options)?
            .render(messages, options, &self.specials)
    }

    /// Renders, then encodes without adding special tokens (the rendered
    /// text carries them), as `apply_chat_template(..., tokenize=True)` does.
    pub fn encode_chat(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, options)?;
        self.encode(&text, false)
    }

    /// A decoder that streams the text of ids as they are generated.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(Arc::clone(&self.tokenizer), skip_special_tokens)
    }
}
