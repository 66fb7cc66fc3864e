//! Stop strings over streamed text.
//!
//! Invariant: feeding a text through [`StopStrings::push`] in any split,
//! then [`StopStrings::finish`], emits exactly what one scan of the whole
//! text emits: the text before the first occurrence of a stop string (the
//! earliest start; at one start the shortest string, which a stream sees
//! complete first), and `stopped` when there is one; without one, the
//! whole text. Only a suffix that could still begin a stop string is held
//! back, so the held text is always shorter than the longest stop string.
//! A complete match waits while a stop string that would begin before it
//! is still incomplete at the end of the text seen so far.
//!
//! Bounds: at most [`MAX_STOP_STRINGS`] strings of at most
//! [`MAX_STOP_STRING_BYTES`] bytes; a push searches the held text plus the
//! delta once per stop string (a linear-time substring search) and tests at
//! most `longest` suffixes of it against each string, so its work is
//! O(strings × (delta + longest²)) byte comparisons, and the memory held
//! between pushes is under `longest` bytes.

use crate::error::{Result, TextError};

/// The most stop strings one generation may have.
pub const MAX_STOP_STRINGS: usize = 16;

/// The longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// What one push released.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string was found: nothing more will be emitted.
    pub stopped: bool,
}

/// A set of stop strings watching one generation's text.
#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text not yet emitted: a suffix that may begin a stop string.
    held: String,
    /// The index of the stop string that matched, once one has.
    matched: Option<usize>,
}

impl StopStrings {
    /// Checks the strings against the bounds; an empty list never stops.
    pub fn new(stops: Vec<String>) -> Result<StopStrings> {
        if stops.len() > MAX_STOP_STRINGS {
            return Err(TextError::TooManyStopStrings {
                count: stops.len(),
                limit: MAX_STOP_STRINGS,
            });
        }
        for (index, stop) in stops.iter().enumerate() {
            if stop.is_empty() {
                return Err(TextError::EmptyStopString { index });
            }
            if stop.len() > MAX_STOP_STRING_BYTES {
                return Err(TextError::StopStringTooLong {
                    index,
                    len_bytes: stop.len(),
                    limit_bytes: MAX_STOP_STRING_BYTES,
                });
            }
        }
        Ok(StopStrings {
            stops,
            held: String::new(),
            matched: None,
        })
    }

    /// The stop strings.
    pub fn strings(&self) -> &[String] {
        &self.stops
    }

    /// Whether a stop string has been found.
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched
            .and_then(|i| self.stops.get(i))
            .map(String::as_str)
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.matched.is_some() {
            return StopStep {
                text: String::new(),
                stopped: true,
            };
        }
        let mut text = std::mem::take(&mut self.held);
        text.push_str(delta);
        self.scan(text, false)
    }

    /// Ends the text: returns what was held back. The held text can still
    /// hold a complete stop string when a longer one that would have begun
    /// earlier was pending; then the text before it is returned and
    /// [`StopStrings::is_stopped`] turns true. Nothing after a stop.
    pub fn finish(&mut self) -> String {
        if self.matched.is_some() {
            return String::new();
        }
        let text = std::mem::take(&mut self.held);
        self.scan(text, true).text
    }

    /// Splits `text` into what is final and what is held. A complete match
    /// stops the text unless a stop string beginning earlier is still
    /// incomplete at the end of `text` (it would win if it completes).
    fn scan(&mut self, mut text: String, at_end: bool) -> StopStep {
        let pending = if at_end {
            text.len()
        } else {
            self.pending_start(&text)
        };
        if let Some((at, index)) =
            earliest_match(&self.stops, &text).filter(|&(at, _)| at <= pending)
        {
            text.truncate(at);
            self.matched = Some(index);
            return StopStep {
                text,
                stopped: true,
            };
        }
        self.held = text.split_off(pending);
        StopStep {
            text,
            stopped: false,
        }
    }

    /// Where the longest suffix of `text` that is a proper prefix of some
    /// stop string begins (`text.len()` when there is none).
    fn pending_start(&self, text: &str) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let earliest = text.len().saturating_sub(longest.saturating_sub(1));
        text.char_indices()
            .map(|(at, _)| at)
            .filter(|&at| at >= earliest)
            .find(|&at| {
                let suffix = text.get(at..).unwrap_or_default();
                self.stops
                    .iter()
                    .any(|stop| stop.len() > suffix.len() && stop.starts_with(suffix))
            })
            .unwrap_or(text.len())
    }
}

/// The first stop string occurrence in `text`, as `(byte offset, index)`:
/// the earliest start wins; at one start, the shortest string (it is the
/// one a stream sees complete first), then the first listed.
fn earliest_match(stops: &[String], text: &str) -> Option<(usize, usize)> {
    stops
        .iter()
        .enumerate()
        .filter_map(|(i, stop)| text.find(stop.as_str()).map(|at| (at, stop.len(), i)))
        .min()
        .map(|(at, _, i)| (at, i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> StopStrings {
        StopStrings::new(list.iter().map(|s| s.to_string()).collect()).expect("valid stops")
    }

    #[test]
    fn holds_only_what_can_begin_a_stop_string() {
        let mut s = stops(&["</answer>"]);
        let step = s.push("x </ans");
        assert_eq!(step.text, "x ");
        assert!(!step.stopped);
        let step = s.push("wer? no");
        assert_eq!(step.text, "</answer? no");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn bounds_are_enforced() {
        let err = StopStrings::new(vec![String::new()]).expect_err("empty stop");
        assert!(matches!(err, TextError::EmptyStopString { index: 0 }));
        let many = vec!["x".to_string(); MAX_STOP_STRINGS + 1];
        let err = StopStrings::new(many).expect_err("too many");
        assert!(matches!(
            err,
            TextError::TooManyStopStrings {
                count: 17,
                limit: 16
            }
        ));
        let long = vec!["ok".to_string(), "y".repeat(MAX_STOP_STRING_BYTES + 1)];
        let err = StopStrings::new(long).expect_err("too long");
        assert!(matches!(
            err,
            TextError::StopStringTooLong {
                index: 1,
                len_bytes: 257,
                ..
            }
        ));
        assert!(
            StopStrings::new(vec!["y".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS]).is_ok()
        );
    }
}
