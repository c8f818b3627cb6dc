//! The engine simulator's prefill/decode disaggregation, driven leg by leg with the exact
//! protocol llm-d's pd-sidecar and vLLM's toy proxy send: a prefill leg with
//! `kv_transfer_params: {do_remote_decode: true, ...}`, `stream: false` and both token limits
//! at 1, then a decode leg with the parameters the prefill answered, both with the same
//! `X-Request-Id`.

use std::collections::HashSet;
use std::time::Duration;

use clap::Parser as _;
use kvroute_test_support::{deadline, poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::sim::{EngineSim, SimArgs, SimConfig};
use serde_json::{Value, json};

use super::common::{metric, start_sim};

/// About 110 tokens: three full 32-token blocks and a partial one.
const PROMPT: &str = "Permission is hereby granted, free of charge, to any person obtaining a copy \
    of this software and associated documentation files, to deal in the Software without \
    restriction, including without limitation the rights to use, copy, modify, merge, publish, \
    distribute, sublicense, and sell copies of the Software, and to permit persons to whom the \
    Software is furnished to do so, subject to the following conditions: the above copyright \
    notice and this permission notice shall be included in all copies of the Software.";

const LABELS: &str = "engine=\"0\",model_name=\"tiny\"";

/// A simulator with `NixlConnector` configured: `engine_id` named, `extra` more JSON fields.
async fn pd_sim(engine_id: &str, extra: &str) -> EngineSim {
    let config = format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"{engine_id}"{extra}}}"#
    );
    start_sim(&["--kv-transfer-config", &config]).await
}

fn chat(max_tokens: u32, stream: bool, kv_transfer_params: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens, "max_completion_tokens": max_tokens, "stream": stream,
        "kv_transfer_params": kv_transfer_params});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// The prefill leg's parameters, as the sidecar and the toy proxy send them.
pub(super) fn prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

async fn post(base: &str, path: &str, body: &Value, request_id: &str) -> http::HttpResponse {
    http::post_json_with_headers(
        &format!("{base}{path}"),
        body,
        &[("x-request-id", request_id)],
    )
    .await
    .unwrap()
}

pub(super) async fn get_json(base: &str, path: &str) -> Value {
    http::get(&format!("{base}{path}"))
        .await
        .unwrap()
        .json()
        .unwrap()
}

/// The last request `sim` logged.
async fn last_request(sim: &EngineSim) -> Value {
    let log = get_json(&sim.base_url(), "/debug/requests").await;
    log["requests"].as_array().unwrap().last().unwrap().clone()
}

/// Runs the prefill leg on `prefill`; its answer.
async fn prefill_leg(prefill: &EngineSim, request_id: &str) -> Value {
    let response = post(
        &prefill.base_url(),
        "/v1/chat/completions",
        &chat(1, false, prefill_params()),
        request_id,
    )
    .await;
    assert!(response.status.is_success(), "{}", response.text());
    response.json().unwrap()
}

pub(super) fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

fn stored_hashes(blocks: &Value) -> HashSet<u64> {
    blocks["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["hash"].as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn a_prefill_leg_answers_the_params_and_its_decode_loads_the_prompt_instead_of_computing_it()
{
    let prefill = pd_sim("prefill-0", "").await;
    let decode = pd_sim("decode-0", "").await;
    let answer = prefill_leg(&prefill, "pd-1").await;
    assert_eq!(answer["id"], "chatcmpl-pd-1", "named after X-Request-Id");
    let prompt_len = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_len > 96, "{prompt_len} tokens");
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = answer["kv_transfer_params"].clone();
    let keys: Vec<&str> = params
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "dcp_size",
            "pp_size",
            "remote_num_tokens",
            "remote_blocks_expiry_time",
            "transfer_mode",
            "remote_prefill_cached_tokens",
        ],
        "NixlConnectorScheduler.request_finished's dict, then the scheduler's addition"
    );
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "prefill-0");
    let internal = params["remote_request_id"].as_str().unwrap();
    let suffix = internal.strip_prefix("chatcmpl-pd-1-").unwrap();
    assert!(suffix.len() == 8 && suffix.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], prefill.ready_info().http.port());
    assert_eq!(params["tp_size"], 1);
    assert_eq!(params["remote_num_tokens"], prompt_len);
    assert_eq!(params["transfer_mode"], "pull");
    assert_eq!(params["remote_prefill_cached_tokens"], 0);
    let blocks = params["remote_block_ids"][0].as_array().unwrap();
    assert_eq!(blocks.len() as u64, prompt_len.div_ceil(32));
    assert!(
        blocks.iter().all(|b| b.as_u64().unwrap() >= 1),
        "block 0 is vLLM's null block"
    );

    // The prefill engine saw the exact leg and holds its blocks for the decode.
    let seen = last_request(&prefill).await;
    assert_eq!(seen["x_request_id"], "pd-1");
    assert_eq!(seen["body"]["kv_transfer_params"], prefill_params());
    assert_eq!(
        (
            &seen["body"]["max_tokens"],
            &seen["body"]["max_completion_tokens"]
        ),
        (&json!(1), &json!(1))
    );
    assert_eq!(seen["body"]["stream"], false);
    assert_eq!(seen["kv_transfer_role"], "prefill");
    assert_eq!(seen["computed_tokens"], prompt_len);
    let transfer = get_json(&prefill.base_url(), "/debug/kv_transfer").await;
    assert_eq!(transfer["held"][0]["remote_request_id"], internal);
    assert_eq!(
        transfer["held"][0]["remote_block_ids"],
        params["remote_block_ids"]
    );
    let prefill_blocks = stored_hashes(&get_json(&prefill.base_url(), "/debug/blocks").await);

    // The decode leg: the client's stream and limits, the prefill's parameters verbatim.
    let response = post(
        &decode.base_url(),
        "/v1/chat/completions",
        &chat(8, true, params.clone()),
        "pd-1",
    )
    .await;
    assert!(response.status.is_success(), "{}", response.text());
    let events = sse_data(&response.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let tokens = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert_eq!(tokens, 8, "it streams normally");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_len);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "vLLM reports the prefill's own hits (remote_prefill_cached_tokens)"
    );

    // It computed none of the prompt: every token came from the prefill engine.
    let seen = last_request(&decode).await;
    assert_eq!(seen["kv_transfer_role"], "decode");
    assert_eq!(seen["body"]["kv_transfer_params"], params);
    assert_eq!(seen["x_request_id"], "pd-1");
    assert_eq!(
        (
            &seen["computed_tokens"],
            &seen["local_cached_tokens"],
            &seen["external_tokens"]
        ),
        (&json!(0), &json!(0), &json!(prompt_len))
    );
    let metrics = http::get(&format!("{}/metrics", decode.base_url()))
        .await
        .unwrap()
        .text();
    let by_source = |source: &str| {
        metric(
            &metrics,
            &format!("vllm:prompt_tokens_by_source_total{{{LABELS},source=\"{source}\"}}"),
        )
    };
    assert_eq!(by_source("local_compute"), 0.0);
    assert_eq!(by_source("local_cache_hit"), 0.0);
    assert_eq!(by_source("external_kv_transfer"), prompt_len as f64);
    let total = |name: &str| metric(&metrics, &format!("{name}{{{LABELS}}}"));
    assert_eq!(total("vllm:prompt_tokens_total"), prompt_len as f64);
    assert_eq!(
        total("vllm:external_prefix_cache_hits_total"),
        prompt_len as f64
    );
    assert_eq!(total("vllm:prompt_tokens_cached_total"), prompt_len as f64);
    assert_eq!(total("vllm:prefix_cache_hits_total"), 0.0);

    // The loaded blocks entered the decode's prefix cache under the same hashes.
    let decode_blocks = stored_hashes(&get_json(&decode.base_url(), "/debug/blocks").await);
    assert_eq!(prefill_blocks.len() as u64, prompt_len / 32);
    assert!(prefill_blocks.is_subset(&decode_blocks));
    // The read ended the prefill's hold.
    let transfer = get_json(&prefill.base_url(), "/debug/kv_transfer").await;
    assert_eq!(transfer["held"], json!([]));
    assert_eq!(transfer["reads_served"], 1);
    // The prefill engine counts its leg as an ordinary prefill.
    let metrics = http::get(&format!("{}/metrics", prefill.base_url()))
        .await
        .unwrap()
        .text();
    assert_eq!(
        metric(
            &metrics,
            &format!("vllm:prompt_tokens_by_source_total{{{LABELS},source=\"local_compute\"}}")
        ),
        prompt_len as f64
    );
}

#[tokio::test]
async fn a_decode_whose_prefill_no_longer_holds_the_blocks_fails_or_recomputes_by_policy() {
    let prefill = pd_sim("prefill-0", "").await;
    let fail = pd_sim("decode-fail", "").await;
    let recompute = pd_sim(
        "decode-recompute",
        r#","kv_load_failure_policy":"recompute""#,
    )
    .await;
    let params = prefill_leg(&prefill, "pd-2").await["kv_transfer_params"].clone();
    let first = post(
        &fail.base_url(),
        "/v1/chat/completions",
        &chat(2, false, params.clone()),
        "pd-2",
    )
    .await;
    assert!(first.status.is_success(), "{}", first.text());

    // The blocks were read once: the same parameters again name blocks no longer held.
    let again = post(
        &fail.base_url(),
        "/v1/chat/completions",
        &chat(2, false, params.clone()),
        "pd-2",
    )
    .await;
    assert_eq!(again.status.as_u16(), 500, "{}", again.text());
    assert_eq!(
        again.json().unwrap()["error"]["message"],
        "Internal server error"
    );
    let seen = last_request(&fail).await;
    assert!(
        seen["kv_load_failure"].as_str().unwrap().contains("404"),
        "{seen}"
    );
    // Streamed, vLLM's error event after the role delta, then [DONE].
    let streamed = post(
        &fail.base_url(),
        "/v1/chat/completions",
        &chat(2, true, params.clone()),
        "pd-2",
    )
    .await;
    assert!(streamed.status.is_success());
    let events = sse_data(&streamed.text());
    assert_eq!(events.len(), 3, "{events:?}");
    let error: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error"]["type"], "InternalServerError");
    assert_eq!(events[2], "[DONE]");
    let transfer = get_json(&fail.base_url(), "/debug/kv_transfer").await;
    assert_eq!(transfer["load_failures"], 2);

    // Under `recompute` the decode computes the prompt itself and claims no loaded tokens.
    let answer = post(
        &recompute.base_url(),
        "/v1/chat/completions",
        &chat(2, false, params.clone()),
        "pd-2",
    )
    .await;
    assert!(answer.status.is_success(), "{}", answer.text());
    let prompt_len = answer.json().unwrap()["usage"]["prompt_tokens"].clone();
    let seen = last_request(&recompute).await;
    assert_eq!(
        (&seen["computed_tokens"], &seen["external_tokens"]),
        (&prompt_len, &json!(0))
    );
    assert!(seen["kv_load_failure"].is_string());

    // A lease that ends before any decode reads the blocks frees them.
    let short = pd_sim(
        "prefill-short",
        r#","kv_connector_extra_config":{"kv_lease_duration":0.2}"#,
    )
    .await;
    let params = prefill_leg(&short, "pd-3").await["kv_transfer_params"].clone();
    let base = short.base_url();
    poll_until(
        "the lease to expire",
        deadline(Duration::from_secs(10)),
        || async {
            let transfer = get_json(&base, "/debug/kv_transfer").await;
            (transfer["leases_expired"] == 1 && transfer["held"] == json!([])).then_some(())
        },
    )
    .await;
    let late = post(
        &fail.base_url(),
        "/v1/chat/completions",
        &chat(2, false, params),
        "pd-3",
    )
    .await;
    assert_eq!(late.status.as_u16(), 500);
}

#[tokio::test]
async fn transfer_params_are_ignored_without_a_connector_and_refused_when_they_name_no_source() {
    // Without a connector vLLM serves the request whole and answers no parameters.
    let plain = start_sim(&[]).await;
    let answer = post(
        &plain.base_url(),
        "/v1/chat/completions",
        &chat(1, false, prefill_params()),
        "x",
    )
    .await;
    assert!(answer.status.is_success());
    assert_eq!(answer.json().unwrap()["kv_transfer_params"], Value::Null);
    let transfer = get_json(&plain.base_url(), "/debug/kv_transfer").await;
    assert_eq!(
        (&transfer["params_ignored"], &transfer["held"]),
        (&json!(1), &json!([]))
    );

    let sim = pd_sim("engine-0", "").await;
    let base = sim.base_url();
    let missing = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [], "remote_engine_id": "e", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": 1});
    let refused = post(&base, "/v1/chat/completions", &chat(1, false, missing), "y").await;
    assert_eq!(refused.status.as_u16(), 400, "{}", refused.text());

    // Every API answers a prefill leg's parameters; completions name theirs per prompt.
    let completion = post(
        &base,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
            "kv_transfer_params": prefill_params()}),
        "c-1",
    )
    .await
    .json()
    .unwrap();
    assert_eq!(completion["id"], "cmpl-c-1");
    let internal = completion["kv_transfer_params"]["remote_request_id"]
        .as_str()
        .unwrap();
    assert!(internal.starts_with("cmpl-c-1-0-"), "{internal}");
    for (path, body) in [
        (
            "/v1/responses",
            json!({"model": "tiny", "input": PROMPT, "max_output_tokens": 1,
            "kv_transfer_params": prefill_params()}),
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 1,
            "messages": [{"role": "user", "content": PROMPT}],
            "kv_transfer_params": prefill_params()}),
        ),
    ] {
        let answer = post(&base, path, &body, "z").await.json().unwrap();
        assert_eq!(
            answer["kv_transfer_params"]["do_remote_prefill"], true,
            "{path}: {answer}"
        );
    }
    // Without prefill parameters a Messages answer has no such field (vLLM drops nulls).
    let whole = post(
        &base,
        "/v1/messages",
        &json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
        "w",
    )
    .await
    .json()
    .unwrap();
    assert!(whole.get("kv_transfer_params").is_none(), "{whole}");
    // Nobody read those blocks: three holds wait for decodes that never come.
    let transfer = get_json(&base, "/debug/kv_transfer").await;
    assert_eq!(transfer["held"].as_array().unwrap().len(), 3);
}

#[test]
fn kv_transfer_config_is_checked_as_vllm_checks_it() {
    let refused = |json: &str| {
        let argv = [
            "kvroute-engine-sim",
            "--model",
            "m",
            "--kv-transfer-config",
            json,
        ];
        SimConfig::try_from(SimArgs::parse_from(argv))
            .unwrap_err()
            .to_string()
    };
    assert!(refused(r#"{"kv_connector":"NixlConnector"}"#).contains("kv_role is required"));
    assert!(
        refused(r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#)
            .contains("NixlConnector only")
    );
    assert!(refused(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"}"#).contains("fail or recompute"));
    let argv = [
        "kvroute-engine-sim",
        "--model",
        "m",
        "--kv-transfer-config",
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}"#,
    ];
    let config = SimConfig::try_from(SimArgs::parse_from(argv)).unwrap();
    let kv = config.kv_transfer.unwrap();
    assert_eq!(kv.engine_id.len(), 36, "a UUID-shaped default engine id");
    assert_eq!(kv.lease, Duration::from_secs(30));
}
