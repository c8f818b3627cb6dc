//! Prefill/decode disaggregation driven from Envoy alone (`disaggregation.mode: envoy`), through
//! a real Envoy with the shipped config: sim 0 computes prompts (`role: prefill`, NixlConnector
//! `kv_producer`), sim 1 serves requests (`role: decode`, `kv_consumer`). For a long prompt
//! uncached on the decode replica ext-proc sends the prefill leg itself and Envoy sends the
//! request to the decode replica with the `kv_transfer_params` the prefill answered; both legs
//! are read on the engines' side (`/debug/requests`, the decode's prompt tokens by source).
//! Short or cached prompts stay on the decode replica alone, and with the prefill replica dead
//! every request is still answered, served whole.

use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{MODEL, ReplicaRole, Routing, Stack, StackOptions};
use serde_json::{Value, json};

use super::routing::{post_raw, text};
use super::sim_pd::{get_json, prefill_params, sse_data};

const PREFILL: usize = 0;
const DECODE: usize = 1;

/// The engine's log of the requests it served.
async fn requests(stack: &Stack, sim: usize) -> Vec<Value> {
    get_json(&stack.sims()[sim].base_url(), "/debug/requests").await["requests"]
        .as_array()
        .unwrap()
        .clone()
}

/// The decode engine's prompt tokens by where they came from.
async fn prompt_tokens_by_source(stack: &Stack, source: &str) -> f64 {
    let text = http::get(&format!("{}/metrics", stack.sims()[DECODE].base_url()))
        .await
        .unwrap()
        .text();
    metrics::sample(
        &text,
        &format!(
            "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"{MODEL}\",source=\"{source}\"}}"
        ),
    )
    .unwrap_or(0.0)
}

/// ext-proc's count of `family{pool="tiny",label="value"}`.
async fn ext_proc_count(stack: &Stack, family: &str, label: &str, value: &str) -> f64 {
    let text = http::get(&format!("{}/metrics", stack.ext_proc_admin_url().unwrap()))
        .await
        .unwrap()
        .text();
    metrics::sample(
        &text,
        &format!("{family}{{pool=\"{MODEL}\",{label}=\"{value}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Posts `body` to `path` through kvroute's listener: the answer, which must be a success
/// (a streamed one ending in `[DONE]` without an error event).
async fn ask(stack: &Stack, path: &str, body: &Value) -> Value {
    let url = format!("{}{path}", stack.url(Routing::Kvroute).unwrap());
    let response = post_raw(
        &url,
        body.to_string().into_bytes(),
        &[("authorization", "Bearer client-secret")],
    )
    .await;
    assert_eq!(
        response.status,
        200,
        "{}\n{}",
        response.text(),
        stack.logs()
    );
    if body["stream"] != true {
        return response.json().unwrap();
    }
    let events = sse_data(&response.text());
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{chunks:?}"
    );
    chunks.last().unwrap().clone()
}

fn long_chat(seed: u64) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text(seed, 400)}],
        "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": 8, "min_tokens": 2})
}

/// Asserts the last prefill and decode legs are the split of `client`: the prefill leg with
/// NixlConnector's fields, the decode leg the client's own with the prefill's parameters and the
/// same request id, its whole prompt pulled from the prefill engine.
async fn assert_split(stack: &Stack, client: &Value, prompt_tokens: u64) {
    let prefill_leg = requests(stack, PREFILL).await.pop().unwrap();
    let mut expected = client.clone();
    let fields = expected.as_object_mut().unwrap();
    fields.remove("stream_options");
    fields.remove("min_tokens");
    fields.insert("stream".into(), false.into());
    fields.insert("max_tokens".into(), 1.into());
    fields.insert("kv_transfer_params".into(), prefill_params());
    assert_eq!(prefill_leg["body"], expected);
    assert_eq!(prefill_leg["kv_transfer_role"], "prefill");
    let request_id = prefill_leg["x_request_id"].as_str().unwrap();

    let decode_leg = requests(stack, DECODE).await.pop().unwrap();
    assert_eq!(
        decode_leg["x_request_id"], request_id,
        "one id on both legs"
    );
    let params = &decode_leg["body"]["kv_transfer_params"];
    assert_eq!(params["remote_engine_id"], "sim-0", "{decode_leg}");
    assert!(
        params["remote_request_id"]
            .as_str()
            .unwrap()
            .contains(request_id),
        "{params}"
    );
    let mut sent = decode_leg["body"].clone();
    sent.as_object_mut().unwrap().remove("kv_transfer_params");
    assert_eq!(&sent, client, "the decode leg is the client's request");
    assert_eq!(decode_leg["kv_transfer_role"], "decode");
    assert_eq!(
        (
            &decode_leg["computed_tokens"],
            &decode_leg["external_tokens"]
        ),
        (&json!(0), &json!(prompt_tokens)),
        "the decode engine pulled the prompt instead of computing it"
    );
}

async fn envoy_drives_the_prefill_leg(envoy_full_duplex: bool) {
    let mut stack = Stack::start(StackOptions {
        replicas: 2,
        replica_roles: vec![Some(ReplicaRole::Prefill), Some(ReplicaRole::Decode)],
        pool_extra_config: "disaggregation: {mode: envoy, min_prompt_tokens: 256, \
                            min_uncached_tokens: 128, prefill_retries: 1}"
            .to_owned(),
        envoy_full_duplex,
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // A long streamed chat nobody holds: split.
    let chat = long_chat(1);
    let answer = ask(&stack, "/v1/chat/completions", &chat).await;
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 256, "{answer}");
    assert_split(&stack, &chat, prompt_tokens).await;
    assert_eq!(prompt_tokens_by_source(&stack, "local_compute").await, 0.0);
    assert_eq!(
        prompt_tokens_by_source(&stack, "external_kv_transfer").await,
        prompt_tokens as f64
    );

    // A long completion, unstreamed: split too.
    let completion = json!({"model": MODEL, "prompt": text(2, 400), "max_tokens": 4});
    let answer = ask(&stack, "/v1/completions", &completion).await;
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_split(&stack, &completion, prompt_tokens).await;

    // Short, and cached on the decode replica (the first chat's next turn): the decode replica
    // alone serves them, without parameters; the prefill engine sees nothing.
    let prefill_legs = requests(&stack, PREFILL).await.len();
    let short = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4});
    ask(&stack, "/v1/chat/completions", &short).await;
    let mut next_turn = chat.clone();
    next_turn["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "ok"}),
        json!({"role": "user", "content": "and then?"}),
    ]);
    ask(&stack, "/v1/chat/completions", &next_turn).await;
    let served = requests(&stack, DECODE).await;
    for leg in &served[served.len() - 2..] {
        assert!(leg["body"].get("kv_transfer_params").is_none(), "{leg}");
        assert_eq!(leg["external_tokens"], 0);
    }
    assert!(
        served.last().unwrap()["local_cached_tokens"]
            .as_u64()
            .unwrap()
            >= prompt_tokens / 2,
        "the next turn reuses the decode replica's cache: {}",
        served.last().unwrap()
    );
    assert_eq!(requests(&stack, PREFILL).await.len(), prefill_legs);
    for (decision, count) in [("split", 2.0), ("short_prompt", 1.0), ("cached", 1.0)] {
        assert_eq!(
            ext_proc_count(
                &stack,
                "kvroute_extproc_disaggregation_decisions_total",
                "decision",
                decision
            )
            .await,
            count,
            "{decision}"
        );
    }

    // The prefill replica dies: every long request is still answered, served whole.
    stack.kill_sim(PREFILL).unwrap();
    let served_before = requests(&stack, DECODE).await.len();
    for seed in 10..14 {
        ask(&stack, "/v1/chat/completions", &long_chat(seed)).await;
    }
    let served = requests(&stack, DECODE).await;
    assert_eq!(served.len(), served_before + 4);
    for leg in &served[served_before..] {
        assert!(leg["body"].get("kv_transfer_params").is_none(), "{leg}");
        assert_eq!(leg["computed_tokens"], leg["prompt_tokens"]);
    }
    let failed = ext_proc_count(
        &stack,
        "kvroute_extproc_disaggregation_prefill_legs_total",
        "outcome",
        "connect_error",
    )
    .await;
    let unready = ext_proc_count(
        &stack,
        "kvroute_extproc_disaggregation_decisions_total",
        "decision",
        "no_prefill_replica",
    )
    .await;
    assert_eq!(
        failed + unready,
        4.0,
        "each failed its leg, or found the prefill replica already unready"
    );
    assert_eq!(
        ext_proc_count(
            &stack,
            "kvroute_extproc_disaggregation_prefill_legs_total",
            "outcome",
            "ok"
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn envoy_drives_the_prefill_leg_with_buffered_bodies() {
    envoy_drives_the_prefill_leg(false).await;
}

#[tokio::test]
async fn envoy_drives_the_prefill_leg_with_streamed_bodies() {
    envoy_drives_the_prefill_leg(true).await;
}
