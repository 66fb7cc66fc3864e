//! Opening model folders: what is found where, what is refused, and that
//! every error names the file and field at fault.

use std::fs;
use std::path::{Path, PathBuf};

use flashtier_text::{ChatMessage, ChatOptions, MAX_CONFIG_BYTES, TextError, TextModel};
use serde_json::json;
use tempfile::TempDir;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(name)
}

/// A folder with the fixture's tokenizer.json and the given files.
fn folder(files: &[(&str, String)]) -> TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    fs::copy(fixture("tokenizer.json"), dir.path().join("tokenizer.json")).expect("copies");
    for (name, text) in files {
        let path = dir.path().join(name);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("creates folders");
        }
        fs::write(path, text).expect("writes");
    }
    dir
}

fn open_err(dir: &Path) -> TextError {
    TextModel::open(dir).expect_err("the folder is refused")
}

#[test]
fn a_missing_tokenizer_names_its_path() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let err = open_err(dir.path());
    let want = dir.path().join("tokenizer.json");
    assert!(
        matches!(&err, TextError::Io { path, .. } if *path == want),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&want.display().to_string()),
        "{err}"
    );
}

#[test]
fn a_broken_tokenizer_names_its_path() {
    let dir = tempfile::tempdir().expect("a temp dir");
    fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").expect("writes");
    let err = open_err(dir.path());
    assert!(
        matches!(&err, TextError::Tokenizer { path, .. } if path.ends_with("tokenizer.json")),
        "{err:?}"
    );
}

#[test]
fn an_oversize_config_is_refused_before_reading() {
    let dir = folder(&[]);
    let path = dir.path().join("tokenizer_config.json");
    let file = fs::File::create(&path).expect("creates");
    file.set_len(MAX_CONFIG_BYTES + 1).expect("a sparse file"); // never read: refused on its size
    match open_err(dir.path()) {
        TextError::TooLarge {
            path: at,
            len_bytes,
            limit_bytes,
        } => {
            assert_eq!(at, path);
            assert_eq!(
                (len_bytes, limit_bytes),
                (MAX_CONFIG_BYTES + 1, MAX_CONFIG_BYTES)
            );
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn an_oversize_tokenizer_is_refused_before_reading() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("tokenizer.json");
    let file = fs::File::create(&path).expect("creates");
    file.set_len(flashtier_text::MAX_TOKENIZER_BYTES + 1)
        .expect("a sparse file");
    assert!(matches!(open_err(dir.path()), TextError::TooLarge { path: at, .. } if at == path));
}

#[test]
fn device_nodes_and_fifos_are_refused() {
    let dir = folder(&[]);
    let config = dir.path().join("config.json");
    std::os::unix::fs::symlink("/dev/zero", &config).expect("symlinks");
    assert!(matches!(open_err(dir.path()), TextError::NotRegularFile { path } if path == config));

    let dir = folder(&[]);
    let fifo = dir.path().join("generation_config.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("skipped the FIFO case: mkfifo is not available here");
        return;
    }
    assert!(matches!(open_err(dir.path()), TextError::NotRegularFile { path } if path == fifo));
}

#[test]
fn invalid_json_names_the_file() {
    let dir = folder(&[("config.json", "{\"eos_token_id\": ".into())]);
    let err = open_err(dir.path());
    assert!(
        matches!(&err, TextError::Json { path, .. } if path.ends_with("config.json")),
        "{err:?}"
    );
}

fn eos_of(files: &[(&str, String)]) -> Vec<u32> {
    let dir = folder(files);
    TextModel::open(dir.path())
        .expect("opens")
        .eos_token_ids()
        .to_vec()
}

#[test]
fn eos_ids_resolve_as_generate_does() {
    let generation = |v: serde_json::Value| {
        (
            "generation_config.json",
            json!({ "eos_token_id": v }).to_string(),
        )
    };
    let config = |v: serde_json::Value| ("config.json", json!({ "eos_token_id": v }).to_string());
    // generation_config.json wins over config.json.
    assert_eq!(
        eos_of(&[generation(json!([383, 381])), config(json!(381))]),
        [383, 381]
    );
    // A null or absent field there falls back to config.json.
    assert_eq!(
        eos_of(&[generation(json!(null)), config(json!(381))]),
        [381]
    );
    let bare = (
        "generation_config.json",
        "{\"do_sample\": true}".to_string(),
    );
    assert_eq!(eos_of(&[bare, config(json!([381, 383, 381]))]), [381, 383]);
    // config.json: an int, a list, null, or inside text_config.
    assert_eq!(eos_of(&[config(json!(383))]), [383]);
    assert_eq!(eos_of(&[config(json!(null))]), Vec::<u32>::new());
    let nested = (
        "config.json",
        json!({ "text_config": { "eos_token_id": [382] } }).to_string(),
    );
    assert_eq!(eos_of(&[nested]), [382]);
    assert_eq!(eos_of(&[]), Vec::<u32>::new());
}

#[test]
fn eos_ids_outside_the_vocabulary_name_file_and_field() {
    let dir = folder(&[(
        "generation_config.json",
        json!({ "eos_token_id": [383, 384] }).to_string(),
    )]);
    match open_err(dir.path()) {
        TextError::IdOutOfVocab {
            path,
            field,
            id,
            vocab_size,
        } => {
            assert!(path.ends_with("generation_config.json"));
            assert_eq!((field.as_str(), id, vocab_size), ("eos_token_id", 384, 384));
        }
        other => panic!("wrong error: {other:?}"),
    }
    let dir = folder(&[("config.json", json!({ "eos_token_id": [-1] }).to_string())]);
    assert!(matches!(
        open_err(dir.path()),
        TextError::IdOutOfVocab { id: -1, .. }
    ));
    let dir = folder(&[("config.json", json!({ "eos_token_id": "2" }).to_string())]);
    assert!(
        matches!(open_err(dir.path()), TextError::BadField { field, .. } if field == "eos_token_id")
    );
}

#[test]
fn special_tokens_are_strings_or_added_tokens() {
    let config = json!({
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": true},
        "eos_token": "<|im_end|>",
        "unk_token": null,
        "add_bos_token": false,
    });
    let dir = folder(&[("tokenizer_config.json", config.to_string())]);
    let m = TextModel::open(dir.path()).expect("opens");
    assert_eq!(m.special_tokens().bos.as_deref(), Some("<|im_start|>"));
    assert_eq!(m.special_tokens().eos.as_deref(), Some("<|im_end|>"));
    assert_eq!(m.special_tokens().unk, None);
    assert_eq!((m.add_bos_token(), m.add_eos_token()), (Some(false), None));

    let dir = folder(&[(
        "tokenizer_config.json",
        json!({ "pad_token": 7 }).to_string(),
    )]);
    assert!(
        matches!(open_err(dir.path()), TextError::BadField { field, .. } if field == "pad_token")
    );
}

#[test]
fn legacy_folders_take_special_tokens_from_special_tokens_map() {
    let dir = folder(&[
        (
            "tokenizer_config.json",
            json!({ "eos_token": "<|endoftext|>" }).to_string(),
        ),
        (
            "special_tokens_map.json",
            json!({ "eos_token": {"content": "<|im_end|>"} }).to_string(),
        ),
    ]);
    let m = TextModel::open(dir.path()).expect("opens");
    assert_eq!(m.special_tokens().eos.as_deref(), Some("<|im_end|>"));
}

fn render(dir: &Path, options: &ChatOptions) -> Result<String, TextError> {
    TextModel::open(dir)?.render_chat(&[ChatMessage::user("hi")], options)
}

#[test]
fn templates_come_from_the_jinja_file_before_the_config() {
    let config = json!({ "chat_template": "config {{ messages[0].content }}" }).to_string();
    let dir = folder(&[("tokenizer_config.json", config.clone())]);
    assert_eq!(
        render(dir.path(), &ChatOptions::default()).expect("renders"),
        "config hi"
    );
    let dir = folder(&[
        ("tokenizer_config.json", config),
        (
            "chat_template.jinja",
            "file {{ messages[0].content }}\n".into(),
        ),
    ]);
    // Jinja2 drops the source's one trailing newline, and so do we.
    assert_eq!(
        render(dir.path(), &ChatOptions::default()).expect("renders"),
        "file hi"
    );
}

#[test]
fn named_templates_need_a_default_and_tools_pick_tool_use() {
    let list = json!({ "chat_template": [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools={{ tools | length }}"},
    ]});
    let dir = folder(&[("tokenizer_config.json", list.to_string())]);
    assert_eq!(
        render(dir.path(), &ChatOptions::default()).expect("renders"),
        "plain"
    );
    let with_tools = ChatOptions {
        tools: Some(json!([{"type": "function"}])),
        ..ChatOptions::default()
    };
    assert_eq!(render(dir.path(), &with_tools).expect("renders"), "tools=1");

    let list = json!({ "chat_template": [
        {"name": "tool_use", "template": "a"}, {"name": "rag", "template": "b"},
    ]});
    let dir = folder(&[("tokenizer_config.json", list.to_string())]);
    match open_err(dir.path()) {
        TextError::NoDefaultTemplate { names, .. } => assert_eq!(names, ["rag", "tool_use"]),
        other => panic!("wrong error: {other:?}"),
    }
    let dir = folder(&[("additional_chat_templates/rag.jinja", "r".into())]);
    assert!(
        matches!(open_err(dir.path()), TextError::NoDefaultTemplate { names, .. } if names == ["rag"])
    );
}

#[test]
fn a_folder_without_a_template_still_tokenizes() {
    let dir = folder(&[]);
    let m = TextModel::open(dir.path()).expect("opens");
    assert!(!m.has_chat_template());
    assert_eq!(
        m.decode(&m.encode("hi", false).expect("encodes"), false)
            .expect("decodes"),
        "hi"
    );
    let err = m
        .render_chat(&[ChatMessage::user("hi")], &ChatOptions::default())
        .expect_err("no template");
    assert!(matches!(err, TextError::NoChatTemplate { dir: at } if at == dir.path()));
}

#[test]
fn a_template_syntax_error_names_the_file_and_line() {
    let dir = folder(&[(
        "chat_template.jinja",
        "ok\nok\n{% for m in messages %}\n{{ m.content }".into(),
    )]);
    match open_err(dir.path()) {
        TextError::TemplateSyntax { template, line, .. } => {
            assert!(template.ends_with("chat_template.jinja"), "{template}");
            assert_eq!(line, 4);
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn a_folder_of_too_many_templates_is_refused() {
    let names: Vec<String> = (0..=flashtier_text::config::MAX_NAMED_TEMPLATES)
        .map(|i| format!("additional_chat_templates/t{i}.jinja"))
        .collect();
    let files: Vec<(&str, String)> = names
        .iter()
        .map(|n| (n.as_str(), "x".to_string()))
        .collect();
    let dir = folder(&files);
    let err = open_err(dir.path());
    assert!(
        matches!(&err, TextError::TooManyTemplates { path, limit: 64 } if path.ends_with("additional_chat_templates")),
        "{err:?}"
    );
}
