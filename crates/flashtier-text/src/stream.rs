//! Incremental detokenization for streaming: one id in, the new text out.
//!
//! Invariant: the concatenation of every [`StreamDecoder::push`] result and
//! the [`StreamDecoder::finish`] result equals `decode(all ids)` exactly,
//! for decoders whose output for a token sequence is a stable prefix of
//! the output for any extension of it once the text ends on a character
//! boundary (byte-level BPE, Metaspace, WordPiece). No delta ends inside a
//! character: text is held back while the decoded tail ends in U+FFFD,
//! since a replacement character there may be an incomplete UTF-8 sequence
//! that the next token completes. A genuine U+FFFD (invalid bytes, or the
//! character itself) comes out as soon as anything decodes after it, or at
//! `finish`; at most [`MAX_HELD_REPLACEMENTS`] are held at a time.
//!
//! Bound: the decoder keeps a window of recent ids that starts at a
//! character boundary: the ids since the last point where the text ended
//! cleanly, plus the ones before it back to the previous such point (the
//! context that lets decoders that treat the first token specially, such
//! as Metaspace stripping its leading space, decode the new ids as they do
//! in the whole sequence). Each push decodes that window at most three
//! times, and the window holds at most [`MAX_WINDOW_TOKENS`] ids: past
//! that (only when that many ids in a row leave the tail unfinished, or
//! decode to nothing) the window restarts from its last
//! [`RESTART_CONTEXT_TOKENS`] ids when their text is a suffix of the
//! window's and covers the held text, else the held text is released.

use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::error::{Result, TextError};

/// The most trailing U+FFFD characters held back (a byte-fallback decoder
/// writes one per byte of an incomplete 4-byte sequence, so up to three).
pub const MAX_HELD_REPLACEMENTS: usize = 3;

/// The most ids the decoding window holds.
pub const MAX_WINDOW_TOKENS: usize = 64;

/// How many ids a full window restarts from.
pub const RESTART_CONTEXT_TOKENS: usize = 4;

/// Streams the text of ids one at a time (from
/// [`TextModel::stream_decoder`](crate::TextModel::stream_decoder)).
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// Ids from the window's start (a character boundary) to now.
    window: Vec<u32>,
    /// How many leading ids of `window` are context from before the last
    /// clean point (dropped at the next one).
    context_len: usize,
    /// Bytes of `decode(window)` already returned (or covered by context).
    sent_bytes: usize,
}

/// The byte length of `text` without its trailing run of U+FFFD (at most
/// [`MAX_HELD_REPLACEMENTS`] of them).
fn stable_len(text: &str) -> usize {
    let held = text
        .chars()
        .rev()
        .take(MAX_HELD_REPLACEMENTS)
        .take_while(|&c| c == char::REPLACEMENT_CHARACTER)
        .count();
    text.len() - held * char::REPLACEMENT_CHARACTER.len_utf8()
}

impl StreamDecoder {
    pub(crate) fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder {
            tokenizer,
            skip_special_tokens,
            window: Vec::with_capacity(MAX_WINDOW_TOKENS + 1),
            context_len: 0,
            sent_bytes: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        decode_ids(&self.tokenizer, ids, self.skip_special_tokens)
    }

    /// Adds one id; returns the text that became final with it (often
    /// empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.window.push(id);
        let text = self.decode(&self.window)?;
        let stable = stable_len(&text);
        let delta = text
            .get(self.sent_bytes..stable)
            .map(str::to_owned)
            .unwrap_or_default();
        self.sent_bytes = self.sent_bytes.max(stable);
        if stable == text.len() {
            self.reanchor()?;
        } else if self.window.len() > MAX_WINDOW_TOKENS {
            return self.restart(text, delta);
        }
        Ok(delta)
    }

    /// The text ended cleanly: the ids since the previous clean point
    /// become the context for what follows.
    fn reanchor(&mut self) -> Result<()> {
        if self.context_len == 0 {
            self.context_len = self.window.len();
            return Ok(());
        }
        let context = self.window.get(self.context_len..).unwrap_or_default();
        let context_text = self.decode(context)?;
        if context_text.is_empty() {
            // Ids that decode to nothing (skipped special tokens) make no
            // context: keep the old one while the window has room, else
            // restart from the last id.
            if self.window.len() > MAX_WINDOW_TOKENS {
                let last = self.window.len() - 1;
                let last_text = self.decode(self.window.get(last..).unwrap_or_default())?;
                self.keep_tail(last, last_text.len());
            }
            return Ok(());
        }
        self.window.drain(..self.context_len);
        self.context_len = self.window.len();
        self.sent_bytes = context_text.len();
        Ok(())
    }

    /// Keeps `window[tail_start..]` as the whole window, `sent` bytes of
    /// its text counted as returned.
    fn keep_tail(&mut self, tail_start: usize, sent: usize) {
        self.window.drain(..tail_start);
        self.context_len = 0;
        self.sent_bytes = sent;
    }

    /// The window is full and its text still ends unfinished.
    fn restart(&mut self, text: String, mut delta: String) -> Result<String> {
        let tail_start = self.window.len().saturating_sub(RESTART_CONTEXT_TOKENS);
        let tail = self.window.get(tail_start..).unwrap_or_default();
        let tail_text = self.decode(tail)?;
        let offset = text.len().saturating_sub(tail_text.len());
        if text.ends_with(&tail_text) && offset <= self.sent_bytes {
            let sent = self.sent_bytes - offset;
            self.keep_tail(tail_start, sent);
            return Ok(delta);
        }
        // No consistent restart point: release the held text as it is.
        delta.push_str(text.get(self.sent_bytes..).unwrap_or_default());
        let last = self.window.len().saturating_sub(1);
        let last_text = self.decode(self.window.get(last..).unwrap_or_default())?;
        self.keep_tail(last, last_text.len());
        Ok(delta)
    }

    /// How many ids the decoder holds now (at most [`MAX_WINDOW_TOKENS`]
    /// + 1, whatever the length of the stream).
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    /// Ends the stream: returns the held text (trailing U+FFFD of an
    /// unfinished character) and resets the decoder.
    pub fn finish(&mut self) -> Result<String> {
        let text = self.decode(&self.window)?;
        let rest = text.get(self.sent_bytes..).unwrap_or_default().to_owned();
        self.window.clear();
        self.context_len = 0;
        self.sent_bytes = 0;
        Ok(rest)
    }
}

/// Decodes with the `tokenizers` crate, mapping its error. Ids outside the
/// vocabulary are skipped, as transformers' `decode` skips them.
pub(crate) fn decode_ids(
    tokenizer: &Tokenizer,
    ids: &[u32],
    skip_special_tokens: bool,
) -> Result<String> {
    tokenizer
        .decode(ids, skip_special_tokens)
        .map_err(|err| TextError::Decode {
            count: ids.len(),
            message: err.to_string(),
        })
}
