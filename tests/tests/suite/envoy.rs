//! A real Envoy (plain round robin) in front of simulator processes.

use kvroute_tests::harness::{Envoy, SimProcess, http, round_robin_config};
use serde_json::{Value, json};

use super::common::{SIM_BIN, metric, sim_args};

#[tokio::test]
async fn envoy_round_robin_serves_openai_requests_from_two_simulators() {
    let sims = [
        SimProcess::spawn(SIM_BIN, &sim_args(&[])).await.unwrap(),
        SimProcess::spawn(SIM_BIN, &sim_args(&[])).await.unwrap(),
    ];
    let upstreams: Vec<_> = sims.iter().map(|s| s.ready.http).collect();
    let envoy = Envoy::start(&round_robin_config(&upstreams)).await.unwrap();
    let ingress = envoy.listener("ingress").unwrap();
    let url = format!("http://{ingress}/v1/completions");
    let prompt = "Envoy in front of the engine simulator: the same prompt twice reaches the same \
        replica under round robin every other request, and then it reports cached tokens.";

    let mut cached = Vec::new();
    for _ in 0..4 {
        let response = http::post_json(
            &url,
            &json!({"model": "tiny", "prompt": prompt,
            "max_tokens": 3}),
        )
        .await
        .unwrap();
        assert_eq!(response.status, 200, "{}", response.text());
        let body: Value = response.json().unwrap();
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["usage"]["completion_tokens"], 3);
        cached.push(
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    // Requests 1 and 2 are each replica's first sight of the prompt; 3 and 4 hit.
    assert_eq!(cached[0], 0);
    assert_eq!(cached[1], 0);
    assert!(cached[2] > 0 && cached[3] > 0, "{cached:?}");

    let streamed = http::post_json(
        &format!("http://{ingress}/v1/chat/completions"),
        &json!({
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
        "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await
    .unwrap();
    assert_eq!(streamed.status, 200);
    let text = streamed.text();
    assert!(text.starts_with("data: {"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(
        text.matches("chat.completion.chunk").count(),
        6,
        "role + 4 tokens + usage"
    );

    for sim in &sims {
        let metrics = http::get(&format!("{}/metrics", sim.base_url()))
            .await
            .unwrap()
            .text();
        let queries = metric(&metrics, "vllm:prefix_cache_queries_total{");
        assert!(
            queries > 0.0,
            "every replica served traffic:\n{}",
            sim.log()
        );
    }
    assert_eq!(
        envoy
            .stat("cluster.replicas.upstream_rq_200")
            .await
            .unwrap(),
        Some(5)
    );
}
