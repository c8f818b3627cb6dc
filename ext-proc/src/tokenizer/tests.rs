//! The backends, the inputs they are given and the cache keys, on the tiny test model; also the
//! fixtures the token cache's tests share.

use std::sync::Arc;
use std::time::Duration;

use kvroute_tokenize::ModelTokenizer;
use serde_json::value::RawValue;
use tokio_util::task::TaskTracker;

use super::cache_keys::{api_keys, conversation_keys};
use super::input::owned_input;
use super::remote::remote_chat_body;
use super::render::render_token_ids;
use super::{
    ChatInputFields, InProcessTokenizer, RemoteTokenizer, RenderTokenizer, TokenizeInput, Tokenizer,
};
use crate::request::{Endpoint, Prompt, parse};

/// The tiny test model's folder.
pub(super) const TINY_MODEL: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");

/// Three turns of one conversation, each the one before plus an answer and a question.
pub(super) const TURN1: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"Tell me a story"}]}"#;
pub(super) const TURN2: &str = r#"{"model":"m","messages":[{"role":"user","content":"Tell me a story"},{"role":"assistant","content":"Once upon a time"},{"role":"user","content":"More"}]}"#;
pub(super) const TURN3: &str = r#"{"model":"m","messages":[{"role":"user","content":"Tell me a story"},{"role":"assistant","content":"Once upon a time"},{"role":"user","content":"More"},{"role":"assistant","content":"there was a router"},{"role":"user","content":"And then?"}]}"#;
#[tokio::test]
async fn in_process_equals_the_model_tokenizer() {
    let tokenizer = InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap();
    let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
    let text = Arc::new(TokenizeInput::Text {
        text: "Hello world".into(),
        add_special_tokens: true,
    });
    assert_eq!(
        tokenizer.tokenize("m", text).await.unwrap(),
        direct.encode_prompt("Hello world", true).unwrap()
    );
    let messages = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let chat = Arc::new(TokenizeInput::Chat {
        messages: RawValue::from_string(messages.to_string()).unwrap(),
        add_generation_prompt: true,
        fields: ChatInputFields::default(),
    });
    assert_eq!(
        tokenizer.tokenize("m", chat).await.unwrap(),
        direct.encode_chat(&messages, true).unwrap()
    );
}

#[test]
fn remote_chat_body_carries_every_prompt_field_as_tokenize_takes_them() {
    let body = r#"{"model":"m","messages":[{"role":"assistant","content":"a","reasoning_content":"r"}],"tools":[{"type":"function","function":{"name":"f"}}],"documents":[{"title":"t"}],"reasoning_effort":"low","chat_template_kwargs":{"x":1},"continue_final_message":true,"add_generation_prompt":false,"add_special_tokens":true}"#;
    let parsed = parse(body.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let TokenizeInput::Chat {
        messages,
        add_generation_prompt,
        fields,
    } = owned_input(&parsed.prompt)
    else {
        panic!("not chat")
    };
    let remote = remote_chat_body("m", &messages, add_generation_prompt, &fields);
    assert_eq!(
        remote,
        serde_json::json!({
            "model": "m",
            "add_generation_prompt": false,
            "continue_final_message": true,
            "add_special_tokens": true,
            "messages": [{"role": "assistant", "content": "a", "reasoning": "r"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template_kwargs": {"x": 1, "documents": [{"title": "t"}],
                "enable_thinking": true, "reasoning_effort": "low"},
        })
    );
}

#[test]
fn every_prompt_field_is_part_of_the_cache_key() {
    let base = r#"{"model":"m","messages":[{"role":"user","content":"q"}]"#;
    let variants = [
        "",
        r#","tools":[{"type":"function","function":{"name":"f"}}]"#,
        r#","documents":[{"title":"t"}]"#,
        r#","chat_template_kwargs":{"enable_thinking":false}"#,
        r#","reasoning_effort":"low""#,
        r#","continue_final_message":true"#,
        r#","add_special_tokens":true"#,
        r#","add_generation_prompt":false"#,
        // They change the engine's image identifiers, so render mode's cached keys.
        r#","mm_processor_kwargs":{"max_pixels":1024}"#,
        r#","media_io_kwargs":{"image":{"mode":"RGB"}}"#,
    ];
    let mut keys = std::collections::HashSet::new();
    for variant in variants {
        let body = format!("{base}{variant}}}");
        let parsed = parse(body.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let Prompt::Chat {
            messages,
            add_generation_prompt,
            fields,
            ..
        } = &parsed.prompt
        else {
            panic!("not chat")
        };
        let key = conversation_keys(
            0,
            messages,
            *add_generation_prompt,
            &ChatInputFields::from_request(fields),
        );
        assert!(keys.insert(key[0].0), "{variant} changes the key");
    }
}

#[test]
fn render_answers_and_endpoints() {
    assert_eq!(
        render_token_ids(br#"{"request_id":"r","token_ids":[1,2,3],"sampling_params":{}}"#),
        Ok(vec![1, 2, 3])
    );
    assert_eq!(
        render_token_ids(br#"[{"token_ids":[4,5]},{"token_ids":[6]}]"#),
        Ok(vec![4, 5])
    );
    for bad in [
        &b"[]"[..],
        br#"{"token_ids":[]}"#,
        br#"{"tokens":[1]}"#,
        b"{",
    ] {
        assert!(render_token_ids(bad).is_err());
    }
    let render = RenderTokenizer::new(
        "http://10.0.0.5:8000/engine/".parse().unwrap(),
        Duration::from_millis(50),
    );
    let url = |body: &str, endpoint| {
        let parsed = parse(body.as_bytes(), endpoint).unwrap();
        let input = owned_input(&parsed.prompt);
        render.endpoint_url(&input).unwrap().to_string()
    };
    let base = "http://10.0.0.5:8000/engine/v1";
    assert_eq!(
        url(r#"{"model":"m","prompt":"p"}"#, Endpoint::Completions),
        format!("{base}/completions/render")
    );
    assert_eq!(
        url(TURN1, Endpoint::ChatCompletions),
        format!("{base}/chat/completions/render")
    );
    assert_eq!(
        url(r#"{"model":"m","input":"q"}"#, Endpoint::Responses),
        format!("{base}/responses/render")
    );
    assert_eq!(
        url(
            r#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#,
            Endpoint::Messages
        ),
        format!("{base}/messages/render")
    );
}

#[tokio::test]
async fn api_requests_tokenize_as_their_chat_and_key_every_prompt_field() {
    let tokenizer = InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap();
    let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
    let chat = serde_json::json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Hi"}
    ]);
    let as_chat = direct.encode_chat(&chat, true).unwrap();
    // vLLM encodes a Responses prompt with add_special_tokens (a chat's default is off).
    let with_special_tokens = kvroute_tokenize::ChatOptions {
        add_special_tokens: true,
        ..kvroute_tokenize::ChatOptions::default()
    };
    let as_responses = direct
        .encode_chat_with(&chat, &with_special_tokens)
        .unwrap();
    for (body, endpoint, expected) in [
        (
            r#"{"model":"m","instructions":"be brief","input":"Hi"}"#,
            Endpoint::Responses,
            &as_responses,
        ),
        (
            r#"{"model":"m","max_tokens":5,"system":"be brief","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]}"#,
            Endpoint::Messages,
            &as_chat,
        ),
    ] {
        let parsed = parse(body.as_bytes(), endpoint).unwrap();
        let input = Arc::new(owned_input(&parsed.prompt));
        assert_eq!(
            &tokenizer.tokenize("m", Arc::clone(&input)).await.unwrap(),
            expected,
            "{body}"
        );
        // The /tokenize body is the converted chat.
        let remote = RemoteTokenizer::request_body("m", &input).unwrap();
        assert_eq!(remote["messages"], chat, "{body}");
    }
    let base = r#"{"model":"m","input":[{"role":"user","content":"q"}]"#;
    let mut keys = std::collections::HashSet::new();
    for variant in [
        "",
        r#","instructions":"i""#,
        r#","tools":[{"type":"function","name":"f"}]"#,
        r#","reasoning":{"effort":"low"}"#,
        r#","chat_template_kwargs":{"enable_thinking":false}"#,
        r#","previous_response_id":"r""#,
    ] {
        let body = format!("{base}{variant}}}");
        let parsed = parse(body.as_bytes(), Endpoint::Responses).unwrap();
        let Prompt::Api {
            api, items, fields, ..
        } = &parsed.prompt
        else {
            panic!("not an API prompt")
        };
        let key = api_keys(0, *api, items, fields);
        assert!(keys.insert(key[0].0), "{variant} changes the key");
    }
    let unchanged = format!(r#"{base},"temperature":0.1,"stream":true}}"#);
    let parsed = parse(unchanged.as_bytes(), Endpoint::Responses).unwrap();
    let Prompt::Api {
        api, items, fields, ..
    } = &parsed.prompt
    else {
        panic!("not an API prompt")
    };
    assert!(
        keys.contains(&api_keys(0, *api, items, fields)[0].0),
        "sampling fields are not"
    );
}

#[test]
fn render_answers_carry_their_media_items_apart_from_their_tokens() {
    use super::render::render_answer;
    let text = render_answer(br#"{"token_ids":[1,2,3],"features":null}"#).unwrap();
    assert_eq!((text.tokens, text.multimodal), (vec![1, 2, 3], Ok(None)));
    let image = render_answer(
        br#"{"token_ids":[1,7,7,7,2],"features":{"mm_hashes":{"image":["abc"]},
            "mm_placeholders":{"image":[{"offset":1,"length":3}]},"kwargs_data":null,
            "mm_metadata":null}}"#,
    )
    .unwrap();
    let places = image.multimodal.unwrap().unwrap();
    assert_eq!(
        places.items(),
        [super::PlacedItem {
            identifier: "abc".into(),
            offset: 1,
            length: 3
        }]
    );
    // Malformed features are their own error; the tokens alone still parse.
    for features in [
        r#"{"mm_hashes":{"image":["abc"]},"mm_placeholders":{"image":[{"offset":4,"length":3}]}}"#,
        r#"{"mm_hashes":{"image":["abc"]}}"#,
        r#""features""#,
    ] {
        let answer = format!(r#"{{"token_ids":[1,7,7,7,2],"features":{features}}}"#);
        let parsed = render_answer(answer.as_bytes()).unwrap();
        assert!(parsed.multimodal.is_err(), "{features}");
    }
}

#[test]
fn every_render_body_asks_for_no_media_tensors() {
    use super::render::with_no_media_payload;
    for (body, expected) in [
        (r#"{"model":"m"}"#, r#"{"model":"m","mm_payload":"none"}"#),
        ("{}", r#"{"mm_payload":"none"}"#),
        (" { \n} \n", " { \n\"mm_payload\":\"none\"}"),
        (
            r#"{"mm_payload":"tensors","a":[{}]}  "#,
            r#"{"mm_payload":"tensors","a":[{}],"mm_payload":"none"}"#,
        ),
    ] {
        let mut bytes = body.as_bytes().to_vec();
        assert!(with_no_media_payload(&mut bytes), "{body}");
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), expected);
        // A repeated key keeps its last value, in Python as in serde_json.
        let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(parsed["mm_payload"], "none");
    }
    for body in ["[1]", "", "  ", "\"x\""] {
        assert!(
            !with_no_media_payload(&mut body.as_bytes().to_vec()),
            "{body}"
        );
    }
}

/// An HTTP server answering every request with `answer` (200, JSON), keeping the bodies it got.
async fn answering_server(
    tasks: &TaskTracker,
    answer: String,
) -> (String, Arc<parking_lot::Mutex<Vec<Vec<u8>>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let bodies = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = Arc::clone(&bodies);
    tasks.spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            let body = loop {
                let Ok(n) = socket.read(&mut buffer).await else {
                    break None;
                };
                if n == 0 {
                    break None;
                }
                request.extend_from_slice(&buffer[..n]);
                let text = String::from_utf8_lossy(&request);
                let Some(end) = text.find("\r\n\r\n") else {
                    continue;
                };
                let length = text[..end]
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(str::to_owned))
                    .and_then(|l| l.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if request.len() >= end + 4 + length {
                    break Some(request[end + 4..end + 4 + length].to_vec());
                }
            };
            let Some(body) = body else { continue };
            seen.lock().push(body);
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
        }
    });
    (url, bodies)
}

#[tokio::test]
async fn render_mode_places_images_and_refuses_malformed_features() {
    let tasks = TaskTracker::new();
    let body = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/a.png"},"uuid":"photo-1"}]}]}"#;
    let parsed = parse(body, Endpoint::ChatCompletions).unwrap();
    let input = Arc::new(owned_input(&parsed.prompt));
    let good = r#"{"token_ids":[1,7,7,2],"features":{"mm_hashes":{"image":["photo-1"]},"mm_placeholders":{"image":[{"offset":1,"length":2}]},"kwargs_data":null,"mm_metadata":null}}"#;
    let (url, bodies) = answering_server(&tasks, good.to_owned()).await;
    let render = RenderTokenizer::new(url.parse().unwrap(), Duration::from_secs(5));
    let rendered = render
        .tokenize_request("m", Arc::clone(&input), body)
        .await
        .unwrap();
    assert_eq!(rendered.tokens, [1, 7, 7, 2]);
    let places = rendered.multimodal.unwrap();
    assert_eq!(&*places.items()[0].identifier, "photo-1");
    // The client's body went as sent (its uuid included), asking for no tensors.
    let sent: serde_json::Value = serde_json::from_slice(&bodies.lock()[0]).unwrap();
    assert_eq!(sent["mm_payload"], "none");
    assert_eq!(sent["messages"][0]["content"][0]["uuid"], "photo-1");
    // Tokens alone would match any image of that size: refused.
    assert!(matches!(
        render.tokenize("m", Arc::clone(&input)).await,
        Err(crate::error::TokenizeError::MultiModal { .. })
    ));

    let bad = r#"{"token_ids":[1,7,7,2],"features":{"mm_hashes":{"image":["a","b"]},"mm_placeholders":{"image":[{"offset":1,"length":2}]}}}"#;
    let (url, _) = answering_server(&tasks, bad.to_owned()).await;
    let render = RenderTokenizer::new(url.parse().unwrap(), Duration::from_secs(5));
    let error = render.tokenize_request("m", input, body).await.unwrap_err();
    assert_eq!(error.as_label(), "multimodal_features", "{error}");
    tasks.close();
}

#[tokio::test]
async fn remote_mode_refuses_images_as_multimodal() {
    // Nothing listens: an image request must be refused before any call.
    let remote = RemoteTokenizer::new(
        "http://127.0.0.1:9/tokenize".parse().unwrap(),
        Duration::from_millis(50),
    );
    for (body, endpoint) in [
        (
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"q"},{"type":"image_url","image_url":{"url":"data:image/png;base64,QUJD"}}]}]}"#,
            Endpoint::ChatCompletions,
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":[{"image_url":"http://x/a.png","uuid":"u"}]}]}"#,
            Endpoint::ChatCompletions,
        ),
        (
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"http://x/a.png"}]}]}"#,
            Endpoint::Responses,
        ),
        (
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"http://x/a.png"}}]}]}"#,
            Endpoint::Messages,
        ),
    ] {
        let parsed = parse(body.as_bytes(), endpoint).unwrap();
        let input = Arc::new(owned_input(&parsed.prompt));
        let error = remote.tokenize("m", input).await.unwrap_err();
        assert_eq!(error.as_label(), "multimodal", "{body}: {error}");
    }
}

/// A pool's engine family decides how its in-process tokenizer builds prompts.
#[tokio::test]
async fn the_pool_engine_picks_the_prompt_dialect() {
    use crate::config::{Engine, TokenizerSource};
    let tasks = TaskTracker::new();
    let source = TokenizerSource::ModelDir(TINY_MODEL.into());
    let of = |engine| {
        super::from_source(&source, engine, 0, &tasks)
            .unwrap()
            .unwrap()
    };
    let (vllm, sglang) = (of(Engine::Vllm), of(Engine::Sglang));
    // SGLang's completions have no `add_special_tokens`: bos is always added.
    let bare = Arc::new(TokenizeInput::Text {
        text: "Hello world".into(),
        add_special_tokens: false,
    });
    let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
    assert_eq!(
        vllm.tokenize("m", Arc::clone(&bare)).await.unwrap(),
        direct.encode_prompt("Hello world", false).unwrap()
    );
    assert_eq!(
        sglang.tokenize("m", bare).await.unwrap(),
        direct.encode_prompt("Hello world", true).unwrap()
    );
    // SGLang ignores `add_generation_prompt: false` and makes a final assistant message a user's.
    let body = br#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Yo"}],"add_generation_prompt":false}"#;
    let parsed = parse(body, Endpoint::ChatCompletions).unwrap();
    let input = Arc::new(owned_input(&parsed.prompt));
    let as_user = serde_json::json!([{"role": "user", "content": "Hi"},
        {"role": "user", "content": "Yo"}]);
    assert_eq!(
        sglang.tokenize("m", Arc::clone(&input)).await.unwrap(),
        direct.encode_chat(&as_user, true).unwrap()
    );
    assert_ne!(
        vllm.tokenize("m", input).await.unwrap(),
        direct.encode_chat(&as_user, true).unwrap()
    );
}
