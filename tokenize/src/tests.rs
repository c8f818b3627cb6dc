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
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ] {
        let err = tokenizer.encode_chat(&bad, true).unwrap_err();
        assert_eq!(err.as_label(), "invalid_messages", "{bad}");
        assert!(err.is_bad_input());
    }
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
        "A<B|{\"content\": \" a<b \", \"role\": \"user\"}|[1, 2.0, null, true]\n\
         C|{\"content\": \"c\", \"role\": \"x\"}|[1, 2.0, null, true]\n"
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
