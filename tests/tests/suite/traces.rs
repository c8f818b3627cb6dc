//! Traces and JSON logs through a real Envoy: a client's `traceparent` is continued by
//! kvroute-ext-proc (span `gateway.request` and its decision stages, exported over OTLP/gRPC to a
//! receiver on the official protos), by the remote kvroute-index's `Match` (exported over
//! OTLP/HTTP), and by the engine, whose request names kvroute's span as its parent; without a
//! `traceparent` header, a tracing Envoy's context reaches ext-proc on the stream's gRPC
//! metadata; the agent's stream opening is one trace on both sides. With
//! `log.format: json` and no exporter, ext-proc's log lines are JSON, and those logged inside
//! the request carry the client's trace id.

use std::collections::HashMap;
use std::time::Duration;

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::harness::otlp::{OtlpReceiver, ReceivedSpan};
use kvroute_tests::sim::RECEIVED_TRACEPARENT_HEADER;
use kvroute_tests::stack::{Routing, Stack, StackOptions};
use serde_json::{Value, json};

/// A prompt of some twenty blocks, so the decision asks the index.
fn prompt() -> String {
    "Trace context travels with the request from the client through Envoy to kvroute and on \
     to the engine, and every hop adds its span under the client's trace id. "
        .repeat(12)
}

/// A `traceparent` for a trace and span the test makes up.
fn traceparent(trace_id: &str, span_id: &str) -> String {
    format!("00-{trace_id}-{span_id}-01")
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect()
}

/// Sends a completion through Envoy with `headers`; returns the response.
async fn complete(stack: &Stack, headers: &[(&str, &str)]) -> http::HttpResponse {
    let url = format!(
        "{}/v1/completions",
        stack.url(Routing::Kvroute).expect("kvroute listener")
    );
    let body = json!({"model": "tiny", "prompt": prompt(), "max_tokens": 2});
    let response = http::post_json_with_headers(&url, &body, headers)
        .await
        .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    response
}

fn named<'a>(spans: &'a [ReceivedSpan], service: &str, name: &str) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|span| span.service == service && span.span.name == name)
        .collect()
}

#[tokio::test]
async fn a_clients_trace_continues_through_kvroute_and_the_index_to_the_engine() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let grpc = receiver.grpc_endpoint();
    let http_endpoint = receiver.http_endpoint();
    let stack = Stack::start(StackOptions {
        replicas: 2,
        // ext-proc exports over OTLP/gRPC, the index over OTLP/HTTP: both exporters are used.
        ext_proc_env: env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            // The decision's own log line ("routed") is at debug.
            ("RUST_LOG", "info,kvroute_ext_proc=debug"),
        ]),
        ext_proc_extra_config: "log: {format: json}\n".to_owned(),
        index_env: env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &http_endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ]),
        // Replica 1's events come through an agent, whose stream opening is traced too.
        agent_replicas: vec![1],
        agent_env: env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ]),
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let response = complete(
        &stack,
        &[("traceparent", &traceparent(trace_id, client_span))],
    )
    .await;

    // The engine's parent is a kvroute span of the client's trace.
    let received = response.header(RECEIVED_TRACEPARENT_HEADER);
    let fields: Vec<&str> = received.split('-').collect();
    assert_eq!(fields.len(), 4, "the engine got {received:?}");
    assert_eq!(fields[1], trace_id, "the engine's trace is the client's");
    assert_ne!(
        fields[2], client_span,
        "kvroute's span is the engine's parent"
    );
    let engine_parent = fields[2].to_owned();

    let expected = [
        ("kvroute-ext-proc", "gateway.request"),
        ("kvroute-ext-proc", "kvroute.parse"),
        ("kvroute-ext-proc", "kvroute.tokenize"),
        ("kvroute-ext-proc", "kvroute.block_keys"),
        ("kvroute-ext-proc", "kvroute.index_match"),
        ("kvroute-ext-proc", "kvroute.score"),
        ("kvroute-index", "kvroute.index.v1.KvIndex/Match"),
    ];
    let spans = try_poll_until(
        "kvroute's and the index's spans of the client's trace",
        deadline(Duration::from_secs(20)),
        || async {
            let spans = receiver.trace(trace_id);
            expected
                .iter()
                .all(|(service, name)| !named(&spans, service, name).is_empty())
                .then_some(spans)
        },
    )
    .await
    .unwrap_or_else(|error| {
        let seen: Vec<String> = receiver
            .spans()
            .iter()
            .map(|s| format!("{}:{} trace {}", s.service, s.span.name, s.trace_id()))
            .collect();
        panic!("{error}; received {seen:?}\n{}", stack.logs())
    });

    let request = named(&spans, "kvroute-ext-proc", "gateway.request");
    assert_eq!(request.len(), 1, "one server span per request");
    let request = request[0];
    assert_eq!(
        request.parent_span_id(),
        client_span,
        "it continues the client's span"
    );
    assert_eq!(
        request.span_id(),
        engine_parent,
        "it is the engine's parent"
    );
    assert_eq!(
        request.span.kind,
        opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32
    );
    assert_eq!(
        request.attribute("gen_ai.request.model").as_deref(),
        Some("tiny")
    );
    assert_eq!(
        request.attribute("gen_ai.operation.name").as_deref(),
        Some("text_completion")
    );
    let sims: Vec<String> = stack
        .sims()
        .iter()
        .map(|sim| sim.ready.http.to_string())
        .collect();
    let endpoint = request.attribute("kvroute.endpoint").unwrap_or_default();
    assert!(sims.contains(&endpoint), "{endpoint} is one of {sims:?}");
    for key in [
        "kvroute.pool",
        "kvroute.tier",
        "kvroute.reason",
        "kvroute.predicted_cached_tokens",
    ] {
        assert!(request.attribute(key).is_some(), "{key} on {request:?}");
    }

    // Every stage is a child of the request span.
    for (_, name) in &expected[1..6] {
        for stage in named(&spans, "kvroute-ext-proc", name) {
            assert_eq!(stage.parent_span_id(), request.span_id(), "{name}'s parent");
        }
    }
    // The index's `Match` continues the call that asked it.
    let asks: HashMap<String, &ReceivedSpan> =
        named(&spans, "kvroute-ext-proc", "kvroute.index_match")
            .into_iter()
            .map(|span| (span.span_id(), span))
            .collect();
    for answer in named(&spans, "kvroute-index", "kvroute.index.v1.KvIndex/Match") {
        assert!(
            asks.contains_key(&answer.parent_span_id()),
            "the index's Match span's parent is an index_match span of ext-proc"
        );
    }

    // The agent's stream to the index: its opening on the agent and on the index, one trace.
    let stream = "kvroute.index.v1.AgentIngest/AgentStream";
    let (opened, accepted) = try_poll_until(
        "the agent's stream opening on both sides",
        deadline(Duration::from_secs(20)),
        || async {
            let spans = receiver.spans();
            let opened = named(&spans, "kvroute-agent", stream)
                .first()
                .copied()
                .cloned()?;
            let accepted = named(&spans, "kvroute-index", stream)
                .into_iter()
                .find(|span| span.parent_span_id() == opened.span_id())
                .cloned()?;
            Some((opened, accepted))
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}\n{}", stack.logs()));
    assert_eq!(accepted.trace_id(), opened.trace_id());
    assert_eq!(
        opened.span.kind,
        opentelemetry_proto::tonic::trace::v1::span::SpanKind::Client as i32
    );

    // Exported, a JSON line inside the request names kvroute's span too.
    let log = stack.ext_proc_log().unwrap();
    let routed: Vec<Value> = log
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|line| line["message"] == "routed")
        .collect();
    assert_eq!(routed.len(), 1, "{log}");
    assert_eq!(routed[0]["trace_id"], trace_id, "{}", routed[0]);
    assert_eq!(
        routed[0]["span_id"],
        request.span_id().as_str(),
        "{}",
        routed[0]
    );
    receiver.stop().await;
}

#[tokio::test]
async fn without_a_traceparent_header_kvroute_continues_envoys_trace_from_the_stream_metadata() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let grpc = receiver.grpc_endpoint();
    let stack = Stack::start(StackOptions {
        replicas: 2,
        ext_proc_env: env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ]),
        envoy_tracing: Some(receiver.grpc_addr()),
        ..StackOptions::default()
    })
    .await
    .unwrap();
    // The client sends no trace context: Envoy starts the trace and hands its span to ext_proc
    // on the stream's gRPC metadata.
    let response = complete(&stack, &[]).await;
    let (request, envoy_spans) = try_poll_until(
        "kvroute's span under one of Envoy's",
        deadline(Duration::from_secs(20)),
        || async {
            let spans = receiver.spans();
            let request = named(&spans, "kvroute-ext-proc", "gateway.request")
                .first()
                .copied()
                .cloned()?;
            let envoy: Vec<ReceivedSpan> = spans
                .iter()
                .filter(|span| span.service == "envoy" && span.trace_id() == request.trace_id())
                .cloned()
                .collect();
            envoy
                .iter()
                .any(|span| span.span_id() == request.parent_span_id())
                .then_some((request, envoy))
        },
    )
    .await
    .unwrap_or_else(|error| {
        let seen: Vec<String> = receiver
            .spans()
            .iter()
            .map(|s| {
                format!(
                    "{}:{} trace {} span {} parent {}",
                    s.service,
                    s.span.name,
                    s.trace_id(),
                    s.span_id(),
                    s.parent_span_id()
                )
            })
            .collect();
        panic!("{error}; received {seen:#?}\n{}", stack.logs())
    });
    let parent = envoy_spans
        .iter()
        .find(|span| span.span_id() == request.parent_span_id())
        .unwrap();
    assert!(
        parent.span.name.contains("ExternalProcessor"),
        "kvroute's parent is Envoy's ext_proc call (its metadata), not {:?}",
        parent.span.name
    );
    // Envoy's router sets the upstream context last, so a tracing Envoy names its own span as
    // the engine's parent: the trace is still the one kvroute's span is part of.
    let engine = response.header(RECEIVED_TRACEPARENT_HEADER);
    assert_eq!(
        engine.split('-').nth(1),
        Some(request.trace_id().as_str()),
        "{engine}"
    );
    receiver.stop().await;
}

#[tokio::test]
async fn json_log_lines_inside_a_request_carry_its_trace_id_without_an_exporter() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        ext_proc_extra_config: "log: {format: json}\n".to_owned(),
        // The decision's own line ("routed") is at debug.
        ext_proc_env: env(&[("RUST_LOG", "info,kvroute_ext_proc=debug")]),
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let parent = traceparent(trace_id, "b7ad6b7169203331");
    let response = complete(&stack, &[("traceparent", &parent)]).await;
    // Nothing is exported, so kvroute passes the client's context on untouched.
    assert_eq!(response.header(RECEIVED_TRACEPARENT_HEADER), parent);
    // A malformed one is ignored: the request is served.
    complete(&stack, &[("traceparent", "00-not-a-trace-01")]).await;

    let lines = try_poll_until(
        "ext-proc's line about the traced request",
        deadline(Duration::from_secs(10)),
        || async {
            let log = stack.ext_proc_log().unwrap();
            // Whole lines only: the last one may be still being written.
            let lines: Vec<Value> = log
                .split_inclusive('\n')
                .filter(|line| line.ends_with('\n'))
                .map(|line| {
                    serde_json::from_str(line)
                        .unwrap_or_else(|error| panic!("not a JSON line ({error}): {line:?}"))
                })
                .collect();
            lines
                .iter()
                .any(|line| line["message"] == "routed" && line["trace_id"] == trace_id)
                .then_some(lines)
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}\n{}", stack.logs()));
    for line in &lines {
        for key in ["timestamp", "level", "target", "message", "fields"] {
            assert!(!line[key].is_null(), "{key} missing in {line}");
        }
    }
    let traced: Vec<&Value> = lines
        .iter()
        .filter(|line| line["trace_id"] == trace_id)
        .collect();
    assert!(
        traced.iter().all(|line| line["span_id"].is_null()),
        "without export there is no kvroute span to name: {traced:?}"
    );
    let routed: Vec<&Value> = lines
        .iter()
        .filter(|line| line["message"] == "routed")
        .collect();
    assert_eq!(routed.len(), 2, "{routed:?}");
    assert!(
        routed.iter().any(|line| line["trace_id"].is_null()),
        "the request with a malformed traceparent has no trace id: {routed:?}"
    );
    assert!(
        lines
            .iter()
            .filter(|line| line["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("malformed traceparent")))
            .count()
            == 1,
        "a malformed traceparent is logged once"
    );
}
