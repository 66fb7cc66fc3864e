//! The fixture folder against what transformers itself produced for it
//! (tests/fixtures/chat/reference.json, made by tools/make_chat_fixture.py):
//! chat renders and their ids, encodings and decodings, byte for byte.

use std::path::PathBuf;

use flashtier_text::{ChatMessage, ChatOptions, ChatTemplate, TextError, TextModel};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn reference() -> Value {
    let path = fixture_dir().join("reference.json");
    let text = std::fs::read_to_string(&path).expect("reference.json is readable");
    serde_json::from_str(&text).expect("reference.json parses")
}

fn model() -> TextModel {
    TextModel::open(&fixture_dir()).expect("the fixture folder opens")
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an id list")
        .iter()
        .map(|v| u32::try_from(v.as_u64().expect("an id")).expect("a u32 id"))
        .collect()
}

fn text(value: &Value) -> &str {
    value.as_str().expect("a string")
}

/// Whether serde_json keeps object keys in document order (its
/// `preserve_order` feature, off in this workspace at the time of writing).
fn serde_json_keeps_key_order() -> bool {
    let parsed: Value = serde_json::from_str(r#"{"b": 1, "a": 2}"#).expect("parses");
    parsed
        .as_object()
        .and_then(|o| o.keys().next())
        .is_some_and(|k| k == "b")
}

#[test]
fn the_folder_loads_as_transformers_loads_it() {
    let r = reference();
    let m = model();
    eprintln!("references from {}", r["versions"]);
    assert_eq!(
        m.vocab_size() as u64,
        r["len_tokenizer"].as_u64().expect("len")
    );
    assert_eq!(m.vocab_size(), 384);
    assert_eq!(m.eos_token_ids(), ids(&r["eos_token_id"]).as_slice());
    let (origin, field) = m.eos_token_ids_origin().expect("eos ids have an origin");
    assert!(origin.ends_with("generation_config.json"));
    assert_eq!(field, "eos_token_id");

    let expected = r["special_tokens_map"].as_object().expect("a map");
    for (field, token) in m.special_tokens().named() {
        assert_eq!(
            token,
            expected.get(field).and_then(Value::as_str),
            "{field}"
        );
    }
    assert_eq!(m.token_to_id("<|im_end|>"), Some(383));
    assert_eq!(m.id_to_token(381).as_deref(), Some("<|endoftext|>"));
    assert!(m.has_chat_template());
}

#[test]
fn chat_renders_match_transformers() {
    let r = reference();
    let m = model();
    let keeps_order = serde_json_keeps_key_order();
    let mut checked = 0;
    for case in r["chat_cases"].as_array().expect("chat cases") {
        let name = text(&case["name"]);
        if case["needs_preserve_order"].as_bool() == Some(true) && !keeps_order {
            eprintln!(
                "skipped {name}: serde_json without preserve_order sorts the tool schema's keys"
            );
            continue;
        }
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages parse");
        let options = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().expect("a bool"),
            tools: Some(case["tools"].clone()).filter(|t| !t.is_null()),
            ..ChatOptions::default()
        };
        let template_name = text(&case["template"]);
        let rendered = match &r["templates"][template_name] {
            Value::Null => m.render_chat(&messages, &options),
            Value::String(source) => ChatTemplate::compile(template_name, source.as_str())
                .expect("the reference template compiles")
                .render(&messages, &options, m.special_tokens()),
            other => panic!("{name}: template {other}"),
        };
        if let Some(message) = case.get("error") {
            match rendered {
                Err(TextError::TemplateRaised { message: got, .. }) => {
                    assert_eq!(got, text(message), "{name}")
                }
                other => panic!("{name}: expected the template's error, got {other:?}"),
            }
        } else {
            let rendered = rendered.unwrap_or_else(|err| panic!("{name}: {err}"));
            assert_eq!(rendered, text(&case["text"]), "{name}: rendered text");
            let encoded = m.encode(&rendered, false).expect("encodes");
            assert_eq!(encoded, ids(&case["ids"]), "{name}: ids");
            if template_name == "main" {
                assert_eq!(
                    m.encode_chat(&messages, &options).expect("encodes"),
                    encoded
                );
            }
        }
        checked += 1;
    }
    assert!(checked >= 18, "only {checked} chat cases checked");
}

#[test]
fn encodings_and_decodings_match_transformers() {
    let r = reference();
    let m = model();
    for case in r["text_cases"].as_array().expect("text cases") {
        let name = text(&case["name"]);
        let input = text(&case["text"]);
        let want = ids(&case["ids"]);
        assert_eq!(m.encode(input, false).expect("encodes"), want, "{name}");
        assert_eq!(
            m.encode(input, true).expect("encodes"),
            ids(&case["ids_with_specials"]),
            "{name} with special tokens"
        );
        assert_eq!(
            m.decode(&want, false).expect("decodes"),
            text(&case["decode"]),
            "{name}"
        );
        assert_eq!(
            m.decode(&want, true).expect("decodes"),
            text(&case["decode_skip_special"]),
            "{name} skipping special tokens"
        );
    }
}

#[test]
fn cut_sequences_decode_as_transformers_does() {
    let r = reference();
    let m = model();
    let cases = r["cut_cases"].as_array().expect("cut cases");
    assert!(cases.len() >= 10);
    for case in cases {
        let cut = ids(&case["ids"]);
        assert_eq!(
            m.decode(&cut, false).expect("decodes"),
            text(&case["decode"]),
            "{cut:?}"
        );
    }
}

#[test]
fn streaming_the_reference_ids_gives_transformers_decode() {
    let r = reference();
    let m = model();
    let sequences = r["text_cases"]
        .as_array()
        .expect("text cases")
        .iter()
        .map(|c| {
            (
                ids(&c["ids"]),
                [text(&c["decode"]), text(&c["decode_skip_special"])],
            )
        })
        .chain(
            r["cut_cases"]
                .as_array()
                .expect("cut cases")
                .iter()
                .map(|c| {
                    let decoded = text(&c["decode"]);
                    (ids(&c["ids"]), [decoded, decoded])
                }),
        );
    for (sequence, want) in sequences {
        for (skip, want) in [false, true].into_iter().zip(want) {
            let mut stream = m.stream_decoder(skip);
            let mut got = String::new();
            for &id in &sequence {
                got.push_str(&stream.push(id).expect("pushes"));
            }
            got.push_str(&stream.finish().expect("finishes"));
            assert_eq!(got, want, "{sequence:?} skip={skip}");
        }
    }
}
