//! The engine simulator on its own: tokenization, prefix caching, KV events, eviction, reset, SSE.

use std::collections::HashSet;

use kvroute_block_keys::{HashAlgo, VllmHasher};
use kvroute_index_core::event::KvEvent;
use kvroute_tests::harness::{http, tiny_model_dir};
use kvroute_tokenize::ModelTokenizer;
use serde_json::{Value, json};

use clap::Parser as _;
use kvroute_tests::sim::{SimArgs, SimConfig};

use super::common::{
    HISTORY_UNSTABLE_TEMPLATE, events_until, metric, removed_hashes, start_sim, stored,
};

/// About 110 tokens of text: three full 32-token blocks plus a partial one.
const PROMPT_A: &str = "Permission is hereby granted, free of charge, to any person obtaining a copy \
    of this software and associated documentation files, to deal in the Software without \
    restriction, including without limitation the rights to use, copy, modify, merge, publish, \
    distribute, sublicense, and sell copies of the Software, and to permit persons to whom the \
    Software is furnished to do so, subject to the following conditions: the above copyright \
    notice and this permission notice shall be included in all copies of the Software. Quokkas \
    zigzag past xylophones.";

fn tokenizer() -> ModelTokenizer {
    ModelTokenizer::from_dir(tiny_model_dir()).unwrap()
}

async fn post(base: &str, path: &str, body: Value) -> Value {
    let response = http::post_json(&format!("{base}{path}"), &body)
        .await
        .unwrap();
    assert!(
        response.status.is_success(),
        "{path}: {} {}",
        response.status,
        response.text()
    );
    response.json().unwrap()
}

fn cached_tokens(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn tokenize_equals_the_shared_tokenizer() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let tokenizer = tokenizer();
    let answer = post(
        &base,
        "/tokenize",
        json!({"model": "tiny", "prompt": PROMPT_A}),
    )
    .await;
    let expected = tokenizer.encode_prompt(PROMPT_A, true).unwrap();
    assert_eq!(answer["tokens"], json!(expected));
    assert_eq!(answer["count"], json!(expected.len()));
    assert_eq!(answer["max_model_len"], json!(2048));
    assert_eq!(answer["token_strs"], Value::Null);

    let messages = json!([{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": PROMPT_A}]}]);
    let answer = post(&base, "/tokenize", json!({"messages": messages})).await;
    assert_eq!(
        answer["tokens"],
        json!(tokenizer.encode_chat(&messages, true).unwrap())
    );

    let unknown = http::post_json(
        &format!("{base}/tokenize"),
        &json!({"model": "x", "prompt": "a"}),
    )
    .await
    .unwrap();
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json().unwrap()["error"]["type"], "NotFoundError");
    let malformed = http::post_json(&format!("{base}/v1/completions"), &json!({"prompt": 5}))
        .await
        .unwrap();
    assert_eq!(malformed.status, 400);
}

#[tokio::test]
async fn chat_template_flag_replaces_the_model_template_as_a_file_or_literal() {
    let messages = json!([{"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPT_A}]);
    let expected = tokenizer()
        .with_chat_template(HISTORY_UNSTABLE_TEMPLATE.to_owned())
        .unwrap()
        .encode_chat(&messages, true)
        .unwrap();
    assert_ne!(expected, tokenizer().encode_chat(&messages, true).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("template.jinja");
    std::fs::write(&file, HISTORY_UNSTABLE_TEMPLATE).unwrap();
    for flag in [
        HISTORY_UNSTABLE_TEMPLATE.to_owned(),
        file.display().to_string(),
    ] {
        let sim = start_sim(&["--chat-template", &flag]).await;
        let answer = post(&sim.base_url(), "/tokenize", json!({"messages": messages})).await;
        assert_eq!(answer["tokens"], json!(expected), "--chat-template {flag}");
        let chat = post(
            &sim.base_url(),
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": messages, "max_tokens": 1}),
        )
        .await;
        assert_eq!(chat["usage"]["prompt_tokens"], json!(expected.len()));
    }
    // Neither a file nor a template: refused, as vLLM refuses it.
    let argv = [
        "kvroute-engine-sim",
        "--model",
        "m",
        "--chat-template",
        "no-such-template",
    ];
    let refused = SimConfig::try_from(SimArgs::parse_from(argv)).unwrap_err();
    assert_eq!(refused.flag, "chat-template");
}

#[tokio::test]
async fn render_endpoints_answer_vllms_generate_request_shape() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let tokenizer = tokenizer();
    let answer = post(
        &base,
        "/v1/completions/render",
        json!({"model": "tiny", "prompt": PROMPT_A, "max_tokens": 3}),
    )
    .await;
    let expected = tokenizer.encode_prompt(PROMPT_A, true).unwrap();
    assert_eq!(
        answer[0]["token_ids"],
        json!(expected),
        "a list for completions"
    );
    assert_eq!(answer[0]["model"], "tiny");

    let messages = json!([{"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPT_A}]);
    let chat = json!(tokenizer.encode_chat(&messages, true).unwrap());
    let answer = post(
        &base,
        "/v1/chat/completions/render",
        json!({"messages": messages}),
    )
    .await;
    assert_eq!(answer["token_ids"], chat);
    let answer = post(
        &base,
        "/v1/messages/render",
        json!({"max_tokens": 3, "system": "Be brief.", "messages": [{"role": "user", "content": PROMPT_A}]}),
    )
    .await;
    assert_eq!(answer["token_ids"], chat, "Messages render as their chat");
    let answer = post(
        &base,
        "/v1/responses/render",
        json!({"instructions": "Be brief.", "input": PROMPT_A}),
    )
    .await;
    assert!(
        answer["token_ids"]
            .as_array()
            .is_some_and(|ids| !ids.is_empty())
    );

    // What vLLM refuses, the double refuses: a stored conversation it cannot know.
    let refused = http::post_json(
        &format!("{base}/v1/responses/render"),
        &json!({"input": "a", "previous_response_id": "resp_1"}),
    )
    .await
    .unwrap();
    assert_eq!(refused.status, 400);
}

#[tokio::test]
async fn repeated_prompt_hits_full_blocks_and_publishes_hashes_vllm_would() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let replay = sim.ready_info().replay.clone().unwrap();
    let prompt = tokenizer().encode_prompt(PROMPT_A, true).unwrap();
    let full_blocks = prompt.len() / 32;
    assert!(full_blocks >= 3, "prompt of {} tokens", prompt.len());
    // The last prompt token is always recomputed, so a hit covers at most len - 1 tokens.
    let hit_tokens = ((prompt.len() - 1) / 32 * 32) as u64;

    let request = json!({"model": "tiny", "prompt": PROMPT_A, "max_tokens": 4});
    let first = post(&base, "/v1/completions", request.clone()).await;
    assert_eq!(first["usage"]["prompt_tokens"], json!(prompt.len()));
    assert_eq!(first["usage"]["completion_tokens"], json!(4));
    assert_eq!(cached_tokens(&first), 0);
    let second = post(&base, "/v1/completions", request).await;
    assert_eq!(cached_tokens(&second), hit_tokens);

    let metrics = http::get(&format!("{base}/metrics")).await.unwrap().text();
    let labels = "{engine=\"0\",model_name=\"tiny\"}";
    assert_eq!(
        metric(
            &metrics,
            &format!("vllm:prefix_cache_queries_total{labels}")
        ),
        2.0 * prompt.len() as f64
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:prefix_cache_hits_total{labels}")),
        hit_tokens as f64
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:num_requests_running{labels}")),
        0.0
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:num_requests_waiting{labels}")),
        0.0
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:kv_cache_usage_perc{labels}")),
        0.0
    );
    assert!(
        metrics.contains("vllm:cache_config_info{block_size=\"32\""),
        "{metrics}"
    );
    assert!(metrics.contains("prefix_caching_hash_algo=\"sha256_cbor\""));

    // The cache hit publishes nothing (vLLM's incremental mode): one BlockStored with every full
    // prompt block, hashes equal to an independent recomputation of vLLM's chain.
    let events = events_until(&replay, |e| !e.is_empty()).await;
    let stored = stored(&events);
    assert_eq!(stored.len(), 1, "{events:?}");
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let expected: Vec<u64> = hasher
        .chain(None, &prompt, 32, |_| None)
        .unwrap()
        .iter()
        .map(|d| d.published_u64())
        .collect();
    assert_eq!(stored[0].block_hashes, expected);
    assert_eq!(stored[0].parent_block_hash, None);
    assert_eq!(stored[0].token_ids, prompt[..full_blocks * 32]);
    assert_eq!(stored[0].block_size, 32);
    assert_eq!(stored[0].group_idx, Some(0));

    let blocks = http::get(&format!("{base}/debug/blocks"))
        .await
        .unwrap()
        .json()
        .unwrap();
    let held: HashSet<u64> = blocks["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["hash"].as_u64().unwrap())
        .collect();
    assert_eq!(held, expected.into_iter().collect());
    assert_eq!(blocks["blocks"][0]["medium"], "GPU");
    // The batch count read with the blocks is every batch the engine published (its replay
    // buffer holds them all here).
    assert_eq!(
        blocks["published_batches"],
        super::common::replay_all(&replay).await.len() as u64
    );
}

#[tokio::test]
async fn decode_fills_blocks_chained_to_the_prompt() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let replay = sim.ready_info().replay.clone().unwrap();
    let response = post(
        &base,
        "/v1/completions",
        json!({"prompt": PROMPT_A, "max_tokens": 70}),
    )
    .await;
    let prompt = tokenizer().encode_prompt(PROMPT_A, true).unwrap();
    // prompt + 69 computed output tokens (the last sampled one has no KV).
    let total_full = (prompt.len() + 69) / 32;
    let events = events_until(&replay, |e| {
        stored(e)
            .iter()
            .map(|s| s.block_hashes.len())
            .sum::<usize>()
            == total_full
    })
    .await;
    let stored = stored(&events);
    assert!(stored.len() > 1);
    for pair in stored.windows(2) {
        assert_eq!(
            pair[1].parent_block_hash,
            pair[0].block_hashes.last().copied()
        );
    }
    assert_eq!(response["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_small_cache_evicts_least_recently_used_blocks() {
    let sim = start_sim(&["--num-blocks", "8"]).await;
    let base = sim.base_url();
    let replay = sim.ready_info().replay.clone().unwrap();
    for i in 0..6 {
        let prompt: Vec<u32> = (0..96).map(|t| 10 + i * 100 + t).collect();
        post(
            &base,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    }
    // 6 prompts × 3 blocks into 8 blocks: at least 10 evictions, each of a stored hash.
    let events = events_until(&replay, |e| removed_hashes(e).len() >= 10).await;
    let stored_hashes: HashSet<u64> = stored(&events)
        .iter()
        .flat_map(|s| s.block_hashes.clone())
        .collect();
    let removed = removed_hashes(&events);
    assert!(removed.iter().all(|h| stored_hashes.contains(h)));
    // The oldest prompt went first.
    let first_prompt: Vec<u32> = (10..106).collect();
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let first_hashes: HashSet<u64> = hasher
        .chain(None, &first_prompt, 32, |_| None)
        .unwrap()
        .iter()
        .map(|d| d.published_u64())
        .collect();
    assert!(
        removed[..3].iter().all(|h| first_hashes.contains(h)),
        "{removed:?}"
    );

    let blocks = http::get(&format!("{base}/debug/blocks"))
        .await
        .unwrap()
        .json()
        .unwrap();
    let held: HashSet<u64> = blocks["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["hash"].as_u64().unwrap())
        .collect();
    let removed_set: HashSet<u64> = removed.iter().copied().collect();
    assert_eq!(held, &stored_hashes - &removed_set);
    assert!(held.len() <= 8);
}

#[tokio::test]
async fn reset_publishes_all_blocks_cleared_and_forgets_everything() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let replay = sim.ready_info().replay.clone().unwrap();
    let request = json!({"prompt": PROMPT_A, "max_tokens": 2});
    post(&base, "/v1/completions", request.clone()).await;
    let answer = post(&base, "/reset_prefix_cache", json!({})).await;
    assert_eq!(answer, json!({"success": true}));
    let events = events_until(&replay, |e| e.contains(&KvEvent::AllBlocksCleared)).await;
    assert!(matches!(events.last(), Some(KvEvent::AllBlocksCleared)));
    let blocks = http::get(&format!("{base}/debug/blocks"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(blocks["blocks"], json!([]));
    let again = post(&base, "/v1/completions", request).await;
    assert_eq!(cached_tokens(&again), 0);
}

fn sse_events(text: &str) -> Vec<&str> {
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {e:?}"))
        })
        .collect()
}

#[tokio::test]
async fn streaming_uses_vllm_chunk_format() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let response = http::post_json(
        &format!("{base}/v1/completions"),
        &json!({
        "prompt": PROMPT_A, "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}}),
    )
    .await
    .unwrap();
    assert_eq!(response.status, 200);
    assert!(
        response.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = response.text();
    let events = sse_events(&text);
    assert_eq!(events.len(), 5, "3 tokens, usage, [DONE]: {text}");
    let chunks: Vec<Value> = events[..4]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for (i, chunk) in chunks[..3].iter().enumerate() {
        assert_eq!(chunk["object"], "text_completion");
        assert!(chunk["id"].as_str().unwrap().starts_with("cmpl-"));
        let finish = if i == 2 { json!("length") } else { Value::Null };
        assert_eq!(chunk["choices"][0]["finish_reason"], finish);
        assert!(chunk["choices"][0]["text"].is_string());
    }
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(chunks[3]["usage"]["completion_tokens"], 3);

    let response = http::post_json(
        &format!("{base}/v1/chat/completions"),
        &json!({
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "stream": true}),
    )
    .await
    .unwrap();
    let text = response.text();
    let events = sse_events(&text);
    assert_eq!(events.len(), 4, "role, 2 tokens, [DONE]: {text}");
    let first: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let last: Value = serde_json::from_str(events[2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none());

    let chat = post(
        &base,
        "/v1/chat/completions",
        json!({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["usage"]["completion_tokens"], 2);
    let models = http::get(&format!("{base}/v1/models"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
}

/// The named events of a Responses or Messages stream: (`event:` name, `data:` JSON).
fn named_sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("bad SSE event {e:?}"));
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name, "the event line names the data's type");
            (name.to_owned(), data)
        })
        .collect()
}

async fn stream(base: &str, path: &str, body: Value) -> Vec<(String, Value)> {
    let response = http::post_json(&format!("{base}{path}"), &body)
        .await
        .unwrap();
    assert_eq!(response.status, 200, "{path}: {}", response.text());
    assert!(
        response.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    named_sse_events(&response.text())
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(name, _)| name.as_str()).collect()
}

#[tokio::test]
async fn responses_stream_as_vllm_does() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let body = json!({"model": "tiny", "input": PROMPT_A, "max_output_tokens": 3, "stream": true});
    let plain = post(
        &base,
        "/v1/responses",
        json!({"input": PROMPT_A, "max_output_tokens": 3}),
    )
    .await;
    let events = stream(&base, "/v1/responses", body).await;
    assert_eq!(
        names(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], json!(i));
    }
    let started = &events[0].1["response"];
    assert_eq!(started["status"], "in_progress");
    assert_eq!(
        (&started["output"], &started["usage"]),
        (&json!([]), &Value::Null)
    );
    let item_id = &events[2].1["item"]["id"];
    let text: String = events[4..7]
        .iter()
        .map(|(_, data)| {
            assert_eq!(&data["item_id"], item_id);
            data["delta"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        text,
        plain["output"][0]["content"][0]["text"].as_str().unwrap()
    );
    assert_eq!(events[7].1["text"], text);
    assert_eq!(events[9].1["item"]["status"], "completed");
    let done = &events[10].1["response"];
    assert_eq!(done["status"], "incomplete");
    assert_eq!(done["output"][0], events[9].1["item"]);
    // The same prompt again: the same accounting as the plain request, all but the partial
    // last block cached.
    let usage = &done["usage"];
    assert_eq!(usage["input_tokens"], plain["usage"]["input_tokens"]);
    assert_eq!(usage["output_tokens"], 3);
    let cached = usage["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let input = usage["input_tokens"].as_u64().unwrap();
    assert_eq!(cached, input - input % 32, "32-token blocks: {usage}");
}

#[tokio::test]
async fn messages_stream_as_vllm_does() {
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let messages = json!([{"role": "user", "content": PROMPT_A}]);
    let plain = post(
        &base,
        "/v1/messages",
        json!({"model": "tiny", "messages": messages, "max_tokens": 2}),
    )
    .await;
    let prompt_tokens = plain["usage"]["input_tokens"].as_u64().unwrap();
    assert_eq!(plain["usage"]["cache_read_input_tokens"], 0);
    let events = stream(
        &base,
        "/v1/messages",
        json!({"model": "tiny", "messages": messages, "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(
        names(&events),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let message = &events[0].1["message"];
    assert_eq!(
        (&message["type"], &message["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert!(message["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(
        message["usage"],
        json!({"input_tokens": prompt_tokens, "output_tokens": 0})
    );
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = events[2..4]
        .iter()
        .map(|(_, data)| {
            assert_eq!(data["index"], 0);
            assert_eq!(data["delta"]["type"], "text_delta");
            data["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(text, plain["content"][0]["text"].as_str().unwrap());
    assert_eq!(
        events[5].1["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    // Anthropic counts input tokens beside cache reads, as vLLM converts them.
    let usage = &events[5].1["usage"];
    let cached = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt_tokens, "{usage}");
    assert_eq!(usage["input_tokens"], json!(prompt_tokens - cached));
    assert_eq!(usage["output_tokens"], 2);
    assert_eq!(events[6].1, json!({"type": "message_stop"}));
}

#[tokio::test]
async fn legacy_array_encoding_decodes_to_the_same_events() {
    let sim = start_sim(&["--kv-events-encoding", "array"]).await;
    let replay = sim.ready_info().replay.clone().unwrap();
    post(
        &sim.base_url(),
        "/v1/completions",
        json!({"prompt": PROMPT_A, "max_tokens": 1}),
    )
    .await;
    let events = events_until(&replay, |e| !e.is_empty()).await;
    let prompt = tokenizer().encode_prompt(PROMPT_A, true).unwrap();
    assert_eq!(
        stored(&events)[0].token_ids,
        prompt[..(prompt.len() / 32) * 32]
    );
}
