#![allow(
    clippy::unwrap_used,
    reason = "tests: a malformed fixture should panic"
)]

use serde_json::{Value, json};

use super::*;

fn parsed(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap()
}

fn keys(body: &[u8]) -> Vec<String> {
    parsed(body).as_object().unwrap().keys().cloned().collect()
}

#[test]
fn a_streamed_chat_becomes_a_one_token_unstreamed_leg_asking_for_a_remote_decode() {
    let client = br#"{"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \"q\""}],
        "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 200,
        "max_completion_tokens": 200, "min_tokens": 5, "min_completion_tokens": 5,
        "temperature": 1.0, "kv_transfer_params": {"do_remote_prefill": true},
        "seed": 123456789012345678901234567890}"#;
    let leg = prefill_body(client, Endpoint::ChatCompletions).unwrap();
    let body = parsed(&leg);
    assert_eq!(
        body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        "the client's own parameters are replaced"
    );
    assert_eq!(body["stream"], false);
    assert_eq!(body["max_tokens"], 1);
    assert_eq!(body["max_completion_tokens"], 1);
    for removed in ["stream_options", "min_tokens", "min_completion_tokens"] {
        assert!(body.get(removed).is_none(), "{removed} left in {body}");
    }
    assert_eq!(
        keys(&leg),
        [
            "model",
            "messages",
            "temperature",
            "seed",
            "kv_transfer_params",
            "stream",
            "max_tokens",
            "max_completion_tokens"
        ],
        "the client's fields in its order, then the leg's own"
    );
    // Untouched fields go as the client wrote them: escapes, float text, a number beyond u64.
    let text = String::from_utf8(leg).unwrap();
    assert!(text.contains(r#""content": "caf\u00e9 \"q\"""#), "{text}");
    assert!(text.contains(r#""temperature":1.0"#), "{text}");
    assert!(
        text.contains(r#""seed":123456789012345678901234567890"#),
        "{text}"
    );
}

#[test]
fn a_completion_without_a_limit_gets_max_tokens_only() {
    let leg = prefill_body(br#"{"model":"m","prompt":"hi"}"#, Endpoint::Completions).unwrap();
    let body = parsed(&leg);
    assert_eq!(body["max_tokens"], 1);
    assert_eq!(body["stream"], false);
    assert!(body.get("max_completion_tokens").is_none(), "{body}");
    assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
}

#[test]
fn a_responses_request_limits_max_output_tokens() {
    let client = br#"{"model":"m","input":"hi","max_output_tokens":300,"stream":true}"#;
    let body = parsed(&prefill_body(client, Endpoint::Responses).unwrap());
    assert_eq!(body["max_output_tokens"], 1);
    assert!(body.get("max_tokens").is_none(), "{body}");
    assert_eq!(body["stream"], false);
    let unlimited =
        parsed(&prefill_body(br#"{"model":"m","input":"hi"}"#, Endpoint::Responses).unwrap());
    assert_eq!(unlimited["max_output_tokens"], 1);
}

#[test]
fn a_messages_request_limits_max_tokens() {
    let client = br#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
    let body = parsed(&prefill_body(client, Endpoint::Messages).unwrap());
    assert_eq!(body["max_tokens"], 1);
    assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
}

#[test]
fn requests_a_leg_cannot_be_made_of_are_refused() {
    assert!(prefill_body(br#"{"model":"m","input":"x"}"#, Endpoint::Other).is_err());
    assert!(prefill_body(b"[1, 2]", Endpoint::Completions).is_err());
    assert!(prefill_body(b"{\"model\":", Endpoint::Completions).is_err());
    assert!(decode_body(b"\"text\"", raw_params(r#"{}"#).as_ref()).is_err());
}

fn raw_params(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_owned()).unwrap()
}

#[test]
fn the_decode_leg_is_the_client_body_with_the_prefill_params_verbatim() {
    let client = br#"{"model": "m", "kv_transfer_params": {"forged": 1}, "prompt": "hi", "stream": true, "max_tokens": 9}"#;
    let params = r#"{"do_remote_prefill": true, "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.9", "remote_port": 5600}"#;
    let decode = decode_body(client, raw_params(params).as_ref()).unwrap();
    let text = String::from_utf8(decode.clone()).unwrap();
    assert_eq!(
        text,
        format!(
            r#"{{"model":"m","prompt":"hi","stream":true,"max_tokens":9,"kv_transfer_params":{params}}}"#
        )
    );
    assert_eq!(parsed(&decode)["kv_transfer_params"]["remote_port"], 5600);
}

#[test]
fn only_an_answer_carrying_a_params_object_names_a_prefill() {
    let answer = br#"{"id":"cmpl-x","kv_transfer_params":{"remote_engine_id":"e", "remote_block_ids":[[3]]},"usage":{}}"#;
    assert_eq!(
        answer_params(answer).map(RawValue::get),
        Some(r#"{"remote_engine_id":"e", "remote_block_ids":[[3]]}"#)
    );
    for answer in [
        &br#"{"id":"x"}"#[..],
        br#"{"kv_transfer_params":null}"#,
        br#"{"kv_transfer_params":"x"}"#,
        b"not json",
    ] {
        assert!(answer_params(answer).is_none(), "{answer:?}");
    }
}

#[test]
fn request_ids_are_fresh_version_4_uuids() {
    let (a, b) = (fresh_request_id(), fresh_request_id());
    assert_ne!(a, b);
    let groups: Vec<&str> = a.split('-').collect();
    assert_eq!(
        groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12],
        "{a}"
    );
    assert!(groups[2].starts_with('4'), "{a}");
    assert!(matches!(groups[3].as_bytes()[0], b'8'..=b'b'), "{a}");
}
