//! StreamDecoder on the fixture's byte-level BPE: the deltas add up to
//! `decode(all ids)` exactly, every partial concatenation is a prefix of
//! it (so no delta shows a U+FFFD that the whole decode does not have at
//! that place), and the window stays bounded.

use std::path::PathBuf;
use std::sync::OnceLock;

use flashtier_text::TextModel;
use flashtier_text::stream::MAX_WINDOW_TOKENS;
use proptest::prelude::*;

fn model() -> &'static TextModel {
    static MODEL: OnceLock<TextModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
        TextModel::open(&dir).expect("the fixture folder opens")
    })
}

/// GPT-2's byte-to-character alphabet: the token string of each byte.
fn byte_token(byte: u8) -> String {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(byte) {
        return char::from(byte).to_string();
    }
    let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + shifted)
        .expect("a valid char")
        .to_string()
}

/// The id of the token that is exactly `byte`.
fn byte_id(byte: u8) -> u32 {
    model()
        .token_to_id(&byte_token(byte))
        .unwrap_or_else(|| panic!("byte {byte:#x} has a token"))
}

/// Streams `ids`, checking each step; returns the deltas.
fn stream(ids: &[u32], skip: bool) -> Vec<String> {
    let m = model();
    let whole = m.decode(ids, skip).expect("decodes");
    let mut decoder = m.stream_decoder(skip);
    let mut deltas = Vec::new();
    let mut shown = String::new();
    for &id in ids {
        let delta = decoder.push(id).expect("pushes");
        shown.push_str(&delta);
        assert!(
            whole.starts_with(&shown),
            "after {} ids the stream shows {shown:?}, not a prefix of {whole:?}",
            deltas.len() + 1
        );
        assert!(decoder.window_len() <= MAX_WINDOW_TOKENS + 1);
        deltas.push(delta);
    }
    let rest = decoder.finish().expect("finishes");
    shown.push_str(&rest);
    deltas.push(rest);
    assert_eq!(shown, whole, "ids {ids:?} skip={skip}");
    deltas
}

#[test]
fn a_character_split_over_byte_tokens_comes_out_whole() {
    let rocket = "🚀"
        .as_bytes()
        .iter()
        .map(|&b| byte_id(b))
        .collect::<Vec<_>>();
    let deltas = stream(&rocket, false);
    assert_eq!(deltas, ["", "", "", "🚀", ""]);
}

#[test]
fn leading_space_tokens_keep_their_space() {
    let ids = model().encode(" the the  cat", false).expect("encodes");
    let deltas = stream(&ids, false);
    assert_eq!(deltas.concat(), " the the  cat");
    assert!(
        deltas.iter().filter(|d| d.starts_with(' ')).count() >= 2,
        "{deltas:?}"
    );
}

#[test]
fn invalid_bytes_come_out_as_replacements_before_the_end() {
    let ff = byte_id(0xff);
    let mut ids = vec![ff; 100];
    ids.extend(model().encode("ok 中", false).expect("encodes"));
    let deltas = stream(&ids, false);
    let shown_by_ten: String = deltas[..10].concat();
    assert!(
        shown_by_ten.chars().filter(|&c| c == '\u{fffd}').count() >= 7,
        "replacements are held back no longer than needed: {shown_by_ten:?}"
    );
}

#[test]
fn a_long_unfinished_tail_restarts_the_window_and_stays_exact() {
    // 0xE4 opens a 3-byte character; each one after it makes the previous
    // one invalid, so the text never ends cleanly until the last completes.
    let mut ids = vec![byte_id(0xe4); 3 * MAX_WINDOW_TOKENS];
    ids.extend([byte_id(0xb8), byte_id(0xad)]);
    let deltas = stream(&ids, false);
    assert!(deltas.concat().ends_with('中'));
}

#[test]
fn skipped_special_tokens_do_not_grow_the_window() {
    let m = model();
    let mut ids = m.encode("Hi", false).expect("encodes");
    ids.extend(std::iter::repeat_n(383, 5 * MAX_WINDOW_TOKENS));
    ids.extend(m.encode(" there 😀", false).expect("encodes"));
    assert_eq!(stream(&ids, true).concat(), "Hi there 😀");
    let with_specials = stream(&ids, false).concat();
    assert_eq!(
        with_specials.matches("<|im_end|>").count(),
        5 * MAX_WINDOW_TOKENS
    );
}

/// Ids weighted towards bytes that open or continue multi-byte characters.
fn awkward_id() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => (0x80u8..=0xff).prop_map(byte_id),
        1 => 0u32..384,
        1 => 381u32..384,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn deltas_add_up_to_the_whole_decode(
        ids in proptest::collection::vec(0u32..384, 0..96),
        skip in any::<bool>(),
    ) {
        stream(&ids, skip);
    }

    #[test]
    fn deltas_add_up_even_for_runs_of_broken_bytes(
        ids in proptest::collection::vec(awkward_id(), 0..200),
        skip in any::<bool>(),
    ) {
        stream(&ids, skip);
    }

    #[test]
    fn encoded_text_streams_back_to_itself(text in "[a-z 世界中文🚀😀é\n]{0,40}") {
        let ids = model().encode(&text, false).expect("encodes");
        let deltas = stream(&ids, false);
        prop_assert_eq!(deltas.concat(), text);
    }
}
