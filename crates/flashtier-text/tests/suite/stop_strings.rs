//! StopStrings: any split of a text into deltas emits what one scan of the
//! whole text emits, with the same stop decision.

use flashtier_text::{StopStep, StopStrings};
use proptest::prelude::*;

/// The reference: scan start positions left to right; at each, the
/// shortest stop string that begins there (then the first listed).
fn scan_whole(stops: &[String], text: &str) -> (String, Option<usize>) {
    for (at, _) in text.char_indices() {
        let rest = &text[at..];
        let mut found: Option<(usize, usize)> = None;
        for (i, stop) in stops.iter().enumerate() {
            if rest.starts_with(stop.as_str()) && found.is_none_or(|(len, _)| stop.len() < len) {
                found = Some((stop.len(), i));
            }
        }
        if let Some((_, i)) = found {
            return (text[..at].to_owned(), Some(i));
        }
    }
    (text.to_owned(), None)
}

/// Feeds `deltas` and finishes; returns the emitted text and the match.
fn feed(stops: &[String], deltas: &[&str]) -> (String, Option<usize>) {
    let mut watcher = StopStrings::new(stops.to_vec()).expect("valid stops");
    let mut out = String::new();
    for delta in deltas {
        let StopStep { text, stopped } = watcher.push(delta);
        out.push_str(&text);
        assert_eq!(stopped, watcher.is_stopped());
        if stopped {
            assert_eq!(
                watcher.push("more text"),
                StopStep {
                    text: String::new(),
                    stopped: true
                }
            );
            break;
        }
    }
    out.push_str(&watcher.finish());
    let matched = watcher
        .matched()
        .map(|m| stops.iter().position(|s| s == m).expect("a listed stop"));
    (out, matched)
}

fn owned(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_stop_string_split_across_three_deltas() {
    let stops = owned(&["<|end|>"]);
    let mut watcher = StopStrings::new(stops).expect("valid");
    assert_eq!(watcher.push("answer <|").text, "answer ");
    assert_eq!(watcher.push("en").text, "");
    let last = watcher.push("d|> trailing");
    assert_eq!(
        last,
        StopStep {
            text: String::new(),
            stopped: true
        }
    );
    assert_eq!(watcher.matched(), Some("<|end|>"));
    assert_eq!(watcher.finish(), "");
}

#[test]
fn overlapping_candidates_pick_the_earliest_start() {
    let stops = owned(&["abc", "ab", "bca"]);
    // "ab" and "abc" both start at 1: the shorter one completes first.
    assert_eq!(feed(&stops, &["x", "a", "bc"]), ("x".to_owned(), Some(1)));
    // "bca" (at 1) starts before the "ab" (at 3) that completes with it.
    assert_eq!(feed(&stops, &["zb", "ca", "b"]), ("z".to_owned(), Some(2)));
    // A prefix of "bca" that never completes is released at the end.
    assert_eq!(feed(&stops, &["b", "c"]), ("bc".to_owned(), None));
}

#[test]
fn a_longer_stop_that_starts_earlier_waits_for_its_end() {
    let stops = owned(&["abcd", "bc"]);
    let mut watcher = StopStrings::new(stops.clone()).expect("valid");
    let step = watcher.push("abc");
    assert_eq!(
        step,
        StopStep {
            text: String::new(),
            stopped: false
        }
    );
    let step = watcher.push("d");
    assert_eq!(
        step,
        StopStep {
            text: String::new(),
            stopped: true
        }
    );
    assert_eq!(watcher.matched(), Some("abcd"));
    // When the longer one does not complete, the shorter one still stops,
    // at the end of the text if need be.
    assert_eq!(feed(&stops, &["abc", "x"]), ("a".to_owned(), Some(1)));
    assert_eq!(feed(&stops, &["abc"]), ("a".to_owned(), Some(1)));
}

#[test]
fn a_stop_at_the_very_start_emits_nothing() {
    let stops = owned(&["STOP"]);
    assert_eq!(feed(&stops, &["STOP and more"]), (String::new(), Some(0)));
    assert_eq!(feed(&stops, &["ST", "OP"]), (String::new(), Some(0)));
}

#[test]
fn unicode_stop_strings_split_inside_the_stream() {
    let stops = owned(&["。\n", "🛑"]);
    assert_eq!(
        feed(&stops, &["你好", "。", "\n再见"]),
        ("你好".to_owned(), Some(0))
    );
    assert_eq!(
        feed(&stops, &["go 🚀", "🛑 no"]),
        ("go 🚀".to_owned(), Some(1))
    );
    // A held prefix is released whole when it turns out not to be a stop.
    let mut watcher = StopStrings::new(stops).expect("valid");
    assert_eq!(watcher.push("end。").text, "end");
    assert_eq!(watcher.push("x").text, "。x");
}

#[test]
fn without_a_stop_finish_releases_the_held_text() {
    let stops = owned(&["</s>"]);
    let mut watcher = StopStrings::new(stops).expect("valid");
    assert_eq!(watcher.push("done </").text, "done ");
    assert_eq!(watcher.finish(), "</");
    assert!(!watcher.is_stopped());
    let mut none = StopStrings::new(Vec::new()).expect("no stops");
    assert_eq!(
        none.push("anything"),
        StopStep {
            text: "anything".into(),
            stopped: false
        }
    );
    assert_eq!(none.finish(), "");
}

/// A text and the byte offsets (on character boundaries) to cut it at.
fn text_and_cuts() -> impl Strategy<Value = (String, Vec<usize>)> {
    "[abcé😀]{0,24}".prop_flat_map(|text| {
        let bounds: Vec<usize> = text.char_indices().map(|(at, _)| at).collect();
        let cuts = proptest::sample::subsequence(bounds.clone(), 0..=bounds.len());
        (Just(text), cuts)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn any_split_emits_what_a_whole_scan_emits(
        stops in proptest::collection::vec("[abcé😀]{1,4}", 0..5),
        (text, cuts) in text_and_cuts(),
    ) {
        let mut deltas = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain(std::iter::once(&text.len())) {
            deltas.push(&text[from..cut]);
            from = cut;
        }
        prop_assert_eq!(feed(&stops, &deltas), scan_whole(&stops, &text));
    }
}
