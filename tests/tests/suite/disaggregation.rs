//! Prefill/decode disaggregation through a real Envoy, llm-d's sidecar mode: a decode sim
//! (NixlConnector `kv_consumer`) behind a double of llm-d's `pd-sidecar`, a prefill sim
//! (`kv_producer`), kvroute choosing the decode replica and, for a long prompt mostly uncached
//! there, naming the prefill replica in `x-prefiller-host-port`.
//!
//! What happened is read from the engine side: the sidecar's record of each request, each
//! sim's `/debug/requests` (the exact bodies it received, and how many prompt tokens it
//! computed, found cached or loaded from the prefill engine).

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::harness::pd_sidecar::PdSidecar;
use kvroute_tests::stack::{
    DebugHeaders, EventsMode, ExternalReplica, MODEL, ReplicaRole, Routing, Stack, StackOptions,
    event_topic, start_sims,
};
use serde_json::{Value, json};

use super::routing::{post_raw, text};

/// The last generation request `base`'s sim logged.
async fn last_request(base: &str) -> Value {
    let log = http::get(&format!("{base}/debug/requests"))
        .await
        .unwrap()
        .json()
        .unwrap();
    log["requests"]
        .as_array()
        .and_then(|all| all.last())
        .cloned()
        .unwrap_or(Value::Null)
}

async fn logged_requests(base: &str) -> usize {
    let log = http::get(&format!("{base}/debug/requests"))
        .await
        .unwrap()
        .json()
        .unwrap();
    log["requests"].as_array().map_or(0, Vec::len)
}

/// Sends `body` through kvroute's listener once every replica is idle; asserts a 200.
async fn send_chat(stack: &Stack, url: &str, body: Value) -> http::HttpResponse {
    stack.until_replicas_idle().await.unwrap();
    let response = post_raw(url, body.to_string().into_bytes(), &[]).await;
    assert_eq!(
        response.status,
        200,
        "{}\n{}",
        response.text(),
        stack.logs()
    );
    response
}

fn chat(system: &str, question: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})
}

#[tokio::test]
async fn long_uncached_prompts_split_through_the_sidecar_and_the_rest_stay_whole() {
    let options = StackOptions {
        replicas: 2,
        block_size: 16,
        kv_blocks_per_replica: 1024,
        debug_headers: DebugHeaders::Always,
        pool_extra_config:
            "disaggregation: {mode: sidecar, min_prompt_tokens: 256, min_uncached_tokens: 128}"
                .to_owned(),
        replica_roles: vec![Some(ReplicaRole::Decode), Some(ReplicaRole::Prefill)],
        ..StackOptions::default()
    };
    let mut sims = start_sims(&options).await.unwrap_or_else(|e| panic!("{e}"));
    let sidecar = PdSidecar::start(sims[0].ready.http).await.unwrap();
    let engines: Vec<ExternalReplica> = sims
        .iter()
        .enumerate()
        .map(|(i, sim)| ExternalReplica {
            // The decode replica is its sidecar, as on an llm-d decode pod.
            http: if i == 0 {
                sidecar.addr()
            } else {
                sim.ready.http
            },
            events: sim.ready.kv_events.clone().unwrap(),
            events_mode: EventsMode::Connect,
            replay: sim.ready.replay.clone().unwrap(),
            topic: event_topic(i),
        })
        .collect();
    let stack = Stack::start_external(options, engines)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (decode, prefill) = (sims[0].base_url(), sims[1].base_url());
    let url = format!(
        "{}/v1/chat/completions",
        stack.url(Routing::Kvroute).unwrap()
    );
    let send = |body: Value| send_chat(&stack, &url, body);

    // Long and held nowhere: the sidecar runs the prefill leg on the prefill sim with llm-d's
    // fields, and the decode sim loads the prompt instead of computing it.
    let document = text(7, 400);
    let first = send(chat(&document, "Summarise it.")).await;
    let answer: Value = first.json().unwrap();
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 256, "{prompt_tokens} tokens");
    let handled = sidecar.handled();
    let split = sidecar.last_inference().unwrap();
    assert_eq!(
        split.prefiller.as_deref(),
        Some(sims[1].ready.http.to_string().as_str()),
        "kvroute named the prefill replica: {handled:?}"
    );
    let prefilled = last_request(&prefill).await;
    assert_eq!(prefilled["kv_transfer_role"], "prefill");
    assert_eq!(
        prefilled["body"]["kv_transfer_params"]["do_remote_decode"],
        true
    );
    assert_eq!(prefilled["body"]["stream"], false);
    assert_eq!(prefilled["body"]["max_tokens"], 1);
    assert_eq!(
        prefilled["x_request_id"].as_str(),
        split.request_id.as_deref()
    );
    let decoded = last_request(&decode).await;
    assert_eq!(decoded["kv_transfer_role"], "decode");
    assert!(decoded["body"]["kv_transfer_params"]["remote_block_ids"].is_array());
    assert_eq!(decoded["x_request_id"], prefilled["x_request_id"]);
    assert_eq!(
        decoded["computed_tokens"], 0,
        "the decode replica computed none of the prompt: {decoded}"
    );

    // The same prompt again: the decode replica holds it (its events say so), so it stays
    // whole there.
    let prefill_legs = logged_requests(&prefill).await;
    send(chat(&document, "Summarise it.")).await;
    assert_eq!(sidecar.last_inference().unwrap().prefiller, None);
    assert_eq!(
        logged_requests(&prefill).await,
        prefill_legs,
        "no prefill leg"
    );

    // Short: served whole.
    send(chat("Be brief.", "Hi?")).await;
    assert_eq!(sidecar.last_inference().unwrap().prefiller, None);

    // The prefill replica dies: once ext-proc's scrapes find it gone, long prompts are served
    // whole on the decode replica, with no client error.
    sims[1].kill();
    let admin = stack.ext_proc_admin_url().unwrap();
    try_poll_until(
        "ext-proc to find the prefill replica unready",
        deadline(std::time::Duration::from_secs(20)),
        || async {
            let metrics = http::get(&format!("{admin}/metrics")).await.ok()?.text();
            metrics
                .contains("kvroute_extproc_replica_ready{replica=\"sim-1\"} 0")
                .then_some(())
        },
    )
    .await
    .unwrap();
    send(chat(&text(8, 400), "And this one?")).await;
    assert_eq!(sidecar.last_inference().unwrap().prefiller, None);
    let metrics = http::get(&format!("{admin}/metrics")).await.unwrap().text();
    for decision in ["split", "cached", "short_prompt", "no_prefill_replica"] {
        assert!(
            metrics.contains(&format!(
                "kvroute_extproc_disaggregation_decisions_total{{pool=\"{MODEL}\",decision=\"{decision}\"}} 1"
            )),
            "{decision} counted once:\n{metrics}"
        );
    }
}
