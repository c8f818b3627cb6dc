//! A real Envoy (plain round robin) in front of three simulator processes: OpenAI completions
//! and chat, plain and streamed (SSE), well formed; a prompt's second visit to a replica hits its
//! prefix cache.

use kvroute_tests::harness::{Envoy, SimProcess, http, round_robin_config};
use serde_json::{Value, json};

use super::common::{SIM_BIN, family_total, sim_args};

const REPLICAS: usize = 3;
const PROMPT: &str = "Envoy in front of the engine simulator: the same prompt sent once per replica \
    and then once more reaches every replica twice under round robin, and each second visit \
    reports cached tokens from the prefix cache of that replica.";

fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {usage}"))
}

/// Checks the usage block and returns its cached tokens.
fn check_usage(usage: &Value, completion_tokens: u64) -> u64 {
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 32, "{usage}");
    assert_eq!(usage["completion_tokens"], completion_tokens);
    assert_eq!(usage["total_tokens"], prompt + completion_tokens);
    cached_tokens(usage)
}

/// The JSON chunks of an SSE body, which must end with `data: [DONE]`.
fn sse_chunks(text: &str) -> Vec<Value> {
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {e:?} in {text}"))
        })
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

async fn post(url: &str, body: &Value) -> http::HttpResponse {
    let response = http::post_json(url, body).await.unwrap();
    assert_eq!(response.status, 200, "{url}: {}", response.text());
    response
}

#[tokio::test]
async fn envoy_round_robin_serves_openai_requests_from_three_simulators() {
    let mut sims = Vec::new();
    for _ in 0..REPLICAS {
        sims.push(SimProcess::spawn(SIM_BIN, &sim_args(&[])).await.unwrap());
    }
    let upstreams: Vec<_> = sims.iter().map(|s| s.ready.http).collect();
    let envoy = Envoy::start(&round_robin_config(&upstreams)).await.unwrap();
    let ingress = envoy.listener("ingress").unwrap();
    let completions = format!("http://{ingress}/v1/completions");
    let chat = format!("http://{ingress}/v1/chat/completions");
    let messages = json!([{"role": "user", "content": PROMPT}]);
    let mut requests = 0;

    // Completions: each replica's first sight of the prompt misses, the second hits.
    let mut cached = Vec::new();
    for _ in 0..2 * REPLICAS {
        let body: Value = post(
            &completions,
            &json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 3}),
        )
        .await
        .json()
        .unwrap();
        requests += 1;
        assert_eq!(body["object"], "text_completion");
        assert!(body["id"].as_str().unwrap().starts_with("cmpl-"), "{body}");
        assert_eq!(body["model"], "tiny");
        assert!(body["choices"][0]["text"].is_string(), "{body}");
        assert_eq!(body["choices"][0]["index"], 0);
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        cached.push(check_usage(&body["usage"], 3));
    }
    assert!(cached[..REPLICAS].iter().all(|&c| c == 0), "{cached:?}");
    assert!(cached[REPLICAS..].iter().all(|&c| c > 0), "{cached:?}");

    // Chat: a first round, non-streaming, then the same messages streamed, which hit.
    for _ in 0..REPLICAS {
        let body: Value = post(
            &chat,
            &json!({"model": "tiny", "messages": messages, "max_tokens": 2}),
        )
        .await
        .json()
        .unwrap();
        requests += 1;
        assert_eq!(body["object"], "chat.completion");
        assert!(
            body["id"].as_str().unwrap().starts_with("chatcmpl-"),
            "{body}"
        );
        assert_eq!(body["choices"][0]["message"]["role"], "assistant");
        assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "{body}"
        );
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        check_usage(&body["usage"], 2);
    }
    for _ in 0..REPLICAS {
        let response = post(
            &chat,
            &json!({"model": "tiny", "messages": messages, "max_tokens": 4, "stream": true,
                "stream_options": {"include_usage": true}}),
        )
        .await;
        requests += 1;
        assert!(
            response.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let chunks = sse_chunks(&response.text());
        assert_eq!(chunks.len(), 6, "role + 4 tokens + usage: {chunks:?}");
        for chunk in &chunks {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["id"], chunks[0]["id"]);
        }
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        for chunk in &chunks[1..5] {
            assert!(
                chunk["choices"][0]["delta"]["content"].is_string(),
                "{chunk}"
            );
        }
        assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
        assert_eq!(chunks[5]["choices"], json!([]));
        assert!(check_usage(&chunks[5]["usage"], 4) > 0, "{}", chunks[5]);
    }

    // Streamed completions.
    let response = post(
        &completions,
        &json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": true,
            "stream_options": {"include_usage": true}}),
    )
    .await;
    requests += 1;
    let chunks = sse_chunks(&response.text());
    assert_eq!(chunks.len(), 4, "3 tokens + usage: {chunks:?}");
    for chunk in &chunks[..3] {
        assert_eq!(chunk["object"], "text_completion");
        assert!(chunk["choices"][0]["text"].is_string(), "{chunk}");
    }
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert!(check_usage(&chunks[3]["usage"], 3) > 0, "{}", chunks[3]);

    for sim in &sims {
        let metrics = http::get(&format!("{}/metrics", sim.base_url()))
            .await
            .unwrap()
            .text();
        let hits = family_total(&metrics, "vllm:prefix_cache_hits_total");
        assert!(hits > 0.0, "every replica served a hit:\n{}", sim.log());
    }
    assert_eq!(
        envoy
            .stat("cluster.replicas.upstream_rq_200")
            .await
            .unwrap(),
        Some(requests)
    );
}
