//! Checks against ids computed by the Python `tokenizers` library (`tests/fixtures/tokenizer-golden.json`,
//! written by `tests/fixtures/make_tokenizer.py`).

use serde_json::json;

use super::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

fn tiny() -> ModelTokenizer {
    ModelTokenizer::from_dir(format!("{FIXTURES}/tiny-model")).unwrap()
}

fn golden() -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{FIXTURES}/tokenizer-golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(value: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

#[test]
fn prompts_encode_like_python_tokenizers() {
    let tokenizer = tiny();
    let golden = golden();
    for case in golden["prompts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let add = case["add_special_tokens"].as_bool().unwrap();
        assert_eq!(
            tokenizer.encode_prompt(text, add).unwrap(),
            ids(&case["ids"]),
            "{text:?} {add}"
        );
    }
}

#[test]
fn chats_render_and_encode_like_python() {
    let tokenizer = tiny();
    let golden = golden();
    for case in golden["chats"].as_array().unwrap() {
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = tokenizer
            .render_chat(&case["messages"], generation)
            .unwrap();
        assert_eq!(rendered, case["text"].as_str().unwrap());
        assert_eq!(
            tokenizer
                .encode_chat(&case["messages"], generation)
                .unwrap(),
            ids(&case["ids"])
        );
    }
}

#[test]
fn chat_has_a_single_bos_and_specials_are_single_tokens() {
    let tokenizer = tiny();
    let chat = tokenizer
        .encode_chat(&json!([{"role": "user", "content": "hi"}]), true)
        .unwrap();
    assert_eq!(chat[..2], [0, 4], "<s> <|user|>");
    assert_eq!(chat.iter().filter(|&&id| id == 0).count(), 1);
    assert_eq!(
        chat[chat.len() - 2..],
        [5, tokenizer.encode_prompt("\n", false).unwrap()[0]]
    );
    assert_eq!(tokenizer.eos_token_id(), Some(1));
}

#[test]
fn text_parts_are_joined_with_newlines() {
    let tokenizer = tiny();
    let parts = json!([{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]);
    let joined = json!([{"role": "user", "content": "first\nsecond"}]);
    assert_eq!(
        tokenizer.render_chat(&parts, false).unwrap(),
        tokenizer.render_chat(&joined, false).unwrap()
    );
}

#[test]
fn bad_messages_are_errors_not_panics() {
    let tokenizer = tiny();
    for bad in [
        json!({"role": "user"}),
        json!([1]),
        json!([{"content": "no role"}]),
        json!([{"role": "user", "content": 5}]),
    ] {
        let err = tokenizer.encode_chat(&bad, true).unwrap_err();
        assert_eq!(err.as_label(), "invalid_messages", "{bad}");
        assert!(err.is_bad_input());
    }
    // Media is not bad input: only the engine's processor knows its placeholder tokens.
    let image =
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
    let err = tokenizer.encode_chat(&image, true).unwrap_err();
    assert_eq!(err.as_label(), "multimodal");
    assert!(!err.is_bad_input());
    // The template's own raise_exception surfaces as a render error.
    let err = tokenizer
        .encode_chat(&json!([{"role": "tool", "content": "x"}]), true)
        .unwrap_err();
    assert_eq!(err.as_label(), "template_render");
}

#[test]
fn hf_template_features_render() {
    let config = json!({
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
            {{ m['content'].strip() | upper }}|{{ m | tojson }}|{{ [1, 2.0, none, true] | tojson }}\n\
            {% endfor %}",
    })
    .to_string();
    let tokenizer_json = std::fs::read(format!("{FIXTURES}/tiny-model/tokenizer.json")).unwrap();
    let tokenizer = ModelTokenizer::from_parts(&tokenizer_json, &config, None).unwrap();
    let messages = json!([{"role": "user", "content": " a<b "}, {"role": "x", "content": "c"},
        {"role": "y", "content": "never"}]);
    assert_eq!(
        tokenizer.render_chat(&messages, false).unwrap(),
        "A<B|{\"role\": \"user\", \"content\": \" a<b \"}|[1, 2.0, null, true]\n\
         C|{\"role\": \"x\", \"content\": \"c\"}|[1, 2.0, null, true]\n"
    );
}

#[test]
fn missing_template_and_bad_files_are_errors() {
    let tokenizer_json = std::fs::read(format!("{FIXTURES}/tiny-model/tokenizer.json")).unwrap();
    let plain = ModelTokenizer::from_parts(&tokenizer_json, "{}", None).unwrap();
    assert!(!plain.has_chat_template());
    let err = plain.encode_chat(&json!([]), true).unwrap_err();
    assert_eq!(err.as_label(), "no_chat_template");
    let err = ModelTokenizer::from_parts(b"not json", "{}", None).unwrap_err();
    assert_eq!(err.as_label(), "tokenizer_json");
    let err = ModelTokenizer::from_parts(&tokenizer_json, r#"{"chat_template": "{% if %}"}"#, None)
        .unwrap_err();
    assert_eq!(err.as_label(), "template_syntax");
    let err = ModelTokenizer::from_dir("/nonexistent-model-dir").unwrap_err();
    assert_eq!(err.as_label(), "io");
}

/// A tokenizer over the tiny model's vocabulary with `template`.
fn with_template(template: &str) -> ModelTokenizer {
    let tokenizer_json = std::fs::read(format!("{FIXTURES}/tiny-model/tokenizer.json")).unwrap();
    let config = json!({"bos_token": "<s>", "chat_template": template}).to_string();
    ModelTokenizer::from_parts(&tokenizer_json, &config, None).unwrap()
}

#[test]
fn messages_are_prepared_as_vllm_prepares_them() {
    let tokenizer = with_template("{{ messages | tojson }}");
    let messages = json!([
        {"role": "system", "content": "s", "extra": 1},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
            "b"], "name": "n"},
        {"role": "assistant", "content": null, "reasoning_content": "r", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [2.0]}"},
             "id": "c1"},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"},
            {"type": "text", "text": "y"}]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ]);
    let rendered = tokenizer
        .render_chat_with(&messages, &ChatOptions::default())
        .unwrap();
    let expected = concat!(
        r#"[{"role": "system", "content": "s"}, "#,
        r#"{"role": "user", "content": "a\nb", "name": "n"}, "#,
        r#"{"role": "assistant", "content": "", "tool_calls": ["#,
        r#"{"id": "c1", "function": {"arguments": {"z": 1, "a": [2.0]}, "name": "f"}, "type": "function"}, "#,
        r#"{"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"}, "#,
        r#"{"id": "c3", "function": {"arguments": {}, "name": "h"}, "type": "function"}], "#,
        r#""reasoning": "r", "reasoning_content": "r"}, "#,
        r#"{"role": "tool", "content": "x\ny", "tool_call_id": "c1"}, "#,
        r#"{"role": "assistant", "content": "ok"}]"#,
    );
    assert_eq!(rendered, expected);
    // Null content is allowed on assistant messages only; tool calls need an id.
    for bad in [
        json!([{"role": "user", "content": null}]),
        json!([{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
    ] {
        let err = tokenizer.render_chat(&bad, true).unwrap_err();
        assert_eq!(err.as_label(), "invalid_messages", "{bad}");
    }
}

#[test]
fn developer_becomes_system_only_where_the_template_lacks_it() {
    let messages = json!([{"role": "system", "content": "a"}, {"role": "user", "content": "u"},
        {"role": "developer", "content": [{"type": "text", "text": "d"}], "tools": []}]);
    let plain = with_template("{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}");
    assert_eq!(
        plain.render_chat(&messages, false).unwrap(),
        "system=a\n\nd;user=u;"
    );
    let aware = with_template(
        "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{{ m.content }};{% endfor %}",
    );
    assert_eq!(aware.render_chat(&messages, false).unwrap(), "a;u;Dd;");
}

#[test]
fn templates_that_loop_over_content_get_parts() {
    let tokenizer = with_template(
        "{% for m in messages %}{% for p in m.content %}[{{ p.text }}{{ p.cache_control | tojson }}]{% endfor %};{% endfor %}",
    );
    assert_eq!(
        tokenizer.chat_template().unwrap().content_format(),
        ContentFormat::OpenAi
    );
    let messages = json!([{"role": "user", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": {"t": 1}}, {"type": "text", "text": ""}]},
        {"role": "assistant", "content": null}]);
    assert_eq!(
        tokenizer.render_chat(&messages, false).unwrap(),
        "[snull];[a{\"t\": 1}][null];;"
    );
}

#[test]
fn request_fields_reach_the_template() {
    let tokenizer = with_template(
        "{{ tools | tojson }}|{{ documents }}|{{ enable_thinking }}|{{ reasoning_effort }}|{{ x }}|\
         {{ add_generation_prompt }}|{% for m in messages %}{{ m.content }}{% endfor %}<end>",
    );
    let messages =
        json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer "}]);
    let options = ChatOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        tools: Some(std::sync::Arc::new(
            json!([{"function": {"name": "f", "parameters": {"b": 1, "a": 2}, "strict": true,
            "extra": 0}, "defer_loading": true}]),
        )),
        documents: Some(json!([{"title": "t"}])),
        reasoning_effort: Some("none".to_owned()),
        chat_template_kwargs: Some(
            json!({"x": "X", "add_generation_prompt": true, "skipped": null})
                .as_object()
                .unwrap()
                .clone(),
        ),
        ..ChatOptions::default()
    };
    // Tools in vLLM's canonical form; the request's own add_generation_prompt wins over the
    // kwarg; continue_final_message cuts the rendering after the final message's text.
    assert_eq!(
        tokenizer.render_chat_with(&messages, &options).unwrap(),
        concat!(
            r#"[{"type": "function", "function": {"name": "f", "description": null, "#,
            r#""parameters": {"b": 1, "a": 2}, "strict": true, "defer_loading": true}, "#,
            r#""defer_loading": true}]|[{'title': 't'}]|False|none|X|False|qThe answer "#
        )
    );
    let both = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: true,
        ..ChatOptions::default()
    };
    assert!(tokenizer.render_chat_with(&messages, &both).is_err());
    let empty_tools = ChatOptions {
        tools: Some(std::sync::Arc::new(json!([]))),
        ..ChatOptions::default()
    };
    let err = tokenizer
        .render_chat_with(&messages, &empty_tools)
        .unwrap_err();
    assert_eq!(err.as_label(), "invalid_tools");
}

#[test]
fn strftime_now_reads_the_clock() {
    let tokenizer = with_template("{{ strftime_now('%d %b %Y') }}");
    tokenizer.chat_template().unwrap().fix_clock(1_722_000_309);
    let messages = json!([{"role": "user", "content": "q"}]);
    assert_eq!(
        tokenizer.render_chat(&messages, false).unwrap(),
        "26 Jul 2024"
    );
}

/// The tiny model (GPT-2 byte-level pipeline): leading tokens are the prompt's first tokens, and
/// a text without a cut after `min_bytes` is encoded whole.
#[test]
fn leading_tokens_are_the_prompts_first_tokens() {
    let tokenizer = ModelTokenizer::from_dir(format!("{FIXTURES}/tiny-model")).unwrap();
    let text = crate::testing::mixed_text(3, 64 * 1024, &[]);
    let whole = tokenizer.encode_prompt(&text, true).unwrap();
    let mut cuts = 0;
    for min in (0..text.len()).step_by(997) {
        let leading = tokenizer.encode_prompt_leading(&text, true, min).unwrap();
        assert!(
            whole.starts_with(&leading.tokens),
            "cut at {}",
            leading.text_bytes
        );
        cuts += usize::from(!leading.complete);
    }
    assert!(cuts > 50, "{cuts} cuts");
    let no_cut = tokenizer.encode_prompt_leading("one two", true, 4).unwrap();
    assert!(no_cut.complete);
    assert_eq!(
        no_cut.tokens,
        tokenizer.encode_prompt("one two", true).unwrap()
    );
    assert_eq!(crate::leading_cut("ab\ncd ef", 0), Some(3));
    assert_eq!(crate::leading_cut("ab\ncd ef", 4), Some(5));
    assert_eq!(crate::leading_cut("ab\n cd", 0), None);
}

fn sglang(options: ChatOptions) -> ChatOptions {
    ChatOptions {
        dialect: Dialect::Sglang,
        ..options
    }
}

#[test]
fn sglang_prepares_messages_as_its_request_models_dump_them() {
    let tokenizer = with_template("{{ messages | tojson }}");
    let messages = json!([
        {"role": "system", "content": "s"},
        {"role": "Developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
            {"type": "text", "text": "b"}], "name": "dropped"},
        {"role": "assistant", "content": null, "reasoning": "dropped", "reasoning_content": "r",
            "tool_calls": [{"id": "c", "type": "function",
                "function": {"arguments": "{\"b\": 1, \"a\": 2}", "name": "f"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "x"}], "tool_call_id": "c"},
        {"role": "assistant", "content": "fin", "tool_calls": []},
    ]);
    let rendered = tokenizer
        .render_chat_with(&messages, &sglang(ChatOptions::default()))
        .unwrap();
    // Parts joined with a space (the empty one too), `developer` kept (lowercased), the user's
    // name and the assistant's `reasoning` gone, tool calls dumped whole with parsed arguments,
    // and the final assistant message a user message of its text.
    assert_eq!(
        rendered,
        concat!(
            r#"[{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, "#,
            r#"{"role": "user", "content": "a  b"}, {"role": "assistant", "content": "", "#,
            r#""reasoning_content": "r", "tool_calls": [{"id": "c", "index": null, "type": "#,
            r#""function", "function": {"name": "f", "arguments": {"b": 1, "a": 2}}}]}, "#,
            r#"{"role": "tool", "content": "x", "tool_call_id": "c"}, "#,
            r#"{"role": "user", "content": "fin"}]"#
        )
    );
    // SGLang refuses these (400): kvroute fails to tokenize them too.
    for bad in [
        json!([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "[1]"}}]}]),
        json!([{"role": "User", "content": "q"}]),
        json!([{"role": "user", "content": [{"type": "thinking", "thinking": "t"}]}]),
        json!([{"role": "user", "content": null}]),
    ] {
        assert!(
            tokenizer
                .render_chat_with(&bad, &sglang(ChatOptions::default()))
                .is_err(),
            "{bad}"
        );
    }
}

#[test]
fn sglang_reads_its_own_request_fields() {
    let tokenizer = with_template(
        "{{ tools | tojson }}|{{ add_generation_prompt }}|{{ enable_thinking }}|\
         {{ reasoning_effort }}|{{ documents }}",
    );
    let messages = json!([{"role": "user", "content": "q"}]);
    let tools = json!([
        {"type": "function", "function": {"parameters": {"type": "object"}, "name": "f",
            "extra": 1}},
        {"type": "function", "defer_loading": true, "function": {"name": "g", "strict": true}},
    ]);
    let options = sglang(ChatOptions {
        add_generation_prompt: false,
        tools: Some(std::sync::Arc::new(tools.clone())),
        documents: Some(json!([{"text": "ignored"}])),
        reasoning_effort: Some("none".to_owned()),
        ..ChatOptions::default()
    });
    assert_eq!(
        tokenizer.render_chat_with(&messages, &options).unwrap(),
        concat!(
            r#"[{"type": "function", "function": {"parameters": {"type": "object"}, "name": "f", "#,
            r#""description": null}, "defer_loading": null}, {"type": "function", "function": "#,
            r#"{"name": "g", "strict": true, "description": null, "parameters": null, "#,
            r#""defer_loading": true}, "defer_loading": true}]|True|False|none|None"#
        )
    );
    let render = |tool_choice: serde_json::Value| {
        let options = sglang(ChatOptions {
            tools: Some(std::sync::Arc::new(tools.clone())),
            tool_choice: Some(tool_choice),
            ..ChatOptions::default()
        });
        tokenizer.render_chat_with(&messages, &options).unwrap()
    };
    assert!(render(json!("none")).starts_with("null|"));
    assert!(
        render(json!({"type": "function", "function": {"name": "g"}}))
            .starts_with(r#"[{"type": "function", "function": {"name": "g","#)
    );
    // Kwargs SGLang also passes to `apply_chat_template` itself fail there (a 500).
    for key in ["tokenize", "tools", "add_generation_prompt"] {
        let mut kwargs = serde_json::Map::new();
        kwargs.insert(key.to_owned(), json!(true));
        let options = sglang(ChatOptions {
            chat_template_kwargs: Some(kwargs),
            ..ChatOptions::default()
        });
        assert!(
            tokenizer.render_chat_with(&messages, &options).is_err(),
            "{key}"
        );
    }
    assert!(Dialect::Sglang.completion_special_tokens(false));
    assert!(!Dialect::Vllm.completion_special_tokens(false));
}

#[test]
fn sglang_continues_a_final_message_after_the_generation_prompt() {
    let tokenizer = tiny();
    let history = json!([{"role": "user", "content": "Hello world"}]);
    let continued = json!([{"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": "The answer"}]);
    let options = sglang(ChatOptions {
        continue_final_message: true,
        add_generation_prompt: false,
        ..ChatOptions::default()
    });
    let tokens = tokenizer.encode_chat_with(&continued, &options).unwrap();
    // The prompt without the message, with the generation prompt and no bos added (the tiny
    // tokenizer adds one to any text, so SGLang encodes the chat without special tokens), then
    // the message's text encoded apart, its bos dropped.
    let mut expected = tokenizer
        .encode_prompt(&tokenizer.render_chat(&history, true).unwrap(), false)
        .unwrap();
    let prefix = tokenizer.encode_prompt("The answer", true).unwrap();
    assert_eq!(prefix[0], 0, "the tiny tokenizer adds <s>");
    expected.extend(&prefix[1..]);
    assert_eq!(tokens, expected);
    let leading = tokenizer
        .encode_chat_leading(&continued, &options, 1)
        .unwrap();
    assert!(leading.complete && leading.tokens == expected);
    let resumable = tokenizer
        .encode_chat_resumable(&continued, &options, None)
        .unwrap();
    assert_eq!(resumable.tokens, expected);
    assert!(resumable.resume.is_none());
}
