//! Renderer behaviour that the transformers references do not reach:
//! errors, bounds, and the context's construction.

use serde_json::json;

use super::*;

fn specials() -> SpecialTokens {
    SpecialTokens {
        eos: Some("<|im_end|>".to_owned()),
        ..SpecialTokens::default()
    }
}

fn render(source: &str, messages: &[ChatMessage], options: &ChatOptions) -> Result<String> {
    ChatTemplate::compile("test.jinja", source)?.render(messages, options, &specials())
}

#[test]
fn raise_exception_carries_the_templates_message() {
    let source = "{% for m in messages %}{% if m.role == 'bot' %}{{ raise_exception('no bots: ' ~ m.content) }}{% endif %}{% endfor %}";
    let err = render(
        source,
        &[ChatMessage::new("bot", "beep")],
        &ChatOptions::default(),
    )
    .expect_err("the template refuses");
    match err {
        TextError::TemplateRaised { template, message } => {
            assert_eq!(template, "test.jinja");
            assert_eq!(message, "no bots: beep");
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn syntax_errors_name_the_template_and_line() {
    let err = ChatTemplate::compile("/m/chat_template.jinja", "line one\n{% if x %}\nno end")
        .expect_err("unclosed block");
    match err {
        TextError::TemplateSyntax {
            template,
            line,
            message,
        } => {
            assert_eq!(template, "/m/chat_template.jinja");
            assert!(line >= 2, "line {line}");
            assert!(message.contains("syntax error"), "{message}");
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn render_errors_name_the_line() {
    let err = render(
        "ok\n{{ messages[0].content.nope.deeper }}",
        &[ChatMessage::user("x")],
        &ChatOptions::default(),
    )
    .expect_err("attribute of undefined");
    assert!(
        matches!(err, TextError::TemplateRender { line: 2, .. }),
        "{err:?}"
    );
}

#[test]
fn an_endless_loop_runs_out_of_fuel() {
    // A loop over a huge range, and output doubled until it is enormous.
    for source in [
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    ] {
        let err = render(source, &[ChatMessage::user("hi")], &ChatOptions::default())
            .expect_err("bounded");
        assert!(
            matches!(err, TextError::TemplateOutOfFuel { .. }),
            "{err:?}"
        );
    }
}

#[test]
fn fuel_grows_with_the_input_so_large_conversations_render() {
    let template = ChatTemplate::compile(
        "t",
        "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}</{{ m.role }}>\n{% endfor %}",
    )
    .expect("compiles");
    let big = "word ".repeat(200_000); // 1 MB of content
    let messages = vec![ChatMessage::user(big.clone()), ChatMessage::assistant(big)];
    let options = ChatOptions::default();
    assert!(template.render_fuel(&messages, &options) > RENDER_FUEL_BASE + 2_000_000 * 32);
    let text = template
        .render(&messages, &options, &specials())
        .expect("fits its fuel");
    assert_eq!(
        text.len(),
        2 * 999_999 + "<user></user>\n<assistant></assistant>\n".len()
    );
}

#[test]
fn null_fields_are_dropped_and_reasoning_is_aliased() {
    let message: ChatMessage = serde_json::from_value(json!({
        "role": "assistant", "content": null, "tool_calls": null, "reasoning": "r1", "id": 7
    }))
    .expect("parses");
    let text = render("{{ messages[0] }}", &[message], &ChatOptions::default()).expect("renders");
    assert_eq!(
        text,
        "{'thinking': 'r1', 'role': 'assistant', 'id': 7, 'reasoning': 'r1', 'reasoning_content': 'r1'}"
    );
}

#[test]
fn context_names_follow_transformers() {
    let source = "{{ tools is none }} {{ documents is none }} {{ bos_token is defined }} [{{ eos_token }}] {{ enable_thinking }} {{ add_generation_prompt }}";
    let mut options = ChatOptions {
        add_generation_prompt: false,
        ..ChatOptions::default()
    };
    options
        .context
        .insert("enable_thinking".into(), json!(false));
    let text = render(source, &[ChatMessage::user("hi")], &options).expect("renders");
    assert_eq!(text, "True True False [<|im_end|>] False False");

    options.context.insert("eos_token".into(), json!("<eos>"));
    let text = render("{{ eos_token }}", &[ChatMessage::user("hi")], &options).expect("renders");
    assert_eq!(text, "<eos>", "context overrides a special token");

    options.context.insert("messages".into(), json!([]));
    let err = render("x", &[ChatMessage::user("hi")], &options).expect_err("reserved");
    assert!(matches!(err, TextError::ReservedContextKey { ref key } if key == "messages"));
}

#[test]
fn an_empty_conversation_is_refused() {
    let err = render("x", &[], &ChatOptions::default()).expect_err("empty");
    assert!(matches!(err, TextError::EmptyConversation));
}

#[test]
fn strftime_now_writes_the_current_utc_year() {
    let text = render(
        "{{ strftime_now('%Y') }}",
        &[ChatMessage::user("hi")],
        &ChatOptions::default(),
    )
    .expect("renders");
    let year = clock::CivilTime::now().year.to_string();
    assert_eq!(text, year);
}

#[test]
fn tojson_takes_pythons_arguments() {
    let source = "{{ {'k': [1, 'é']} | tojson }}|{{ {'k': 1} | tojson(true, 1) }}|{{ 'é' | tojson(ensure_ascii=true) }}|{{ [1] | tojson(separators=[';', '=']) }}";
    let text =
        render(source, &[ChatMessage::user("hi")], &ChatOptions::default()).expect("renders");
    assert_eq!(text, "{\"k\": [1, \"é\"]}|{\n \"k\": 1\n}|\"\\u00e9\"|[1]");
    let err = render(
        "{{ 1 | tojson(colour=1) }}",
        &[ChatMessage::user("hi")],
        &ChatOptions::default(),
    )
    .expect_err("unknown keyword");
    assert!(matches!(err, TextError::TemplateRender { .. }), "{err:?}");
    let err = render(
        "{{ nothing | tojson }}",
        &[ChatMessage::user("hi")],
        &ChatOptions::default(),
    )
    .expect_err("undefined is not JSON");
    assert!(format!("{err}").contains("not JSON serializable"), "{err}");
}
