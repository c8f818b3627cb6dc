//! The edge processes of the reference stack: what the stack itself never meets.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvroute_discovery::testing::{ApiServer, TestPod};
use kvroute_ingest::testing::MockVllmPublisher;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::ext_proc::ExtProcClient;
use kvroute_tests::harness::{http, metrics, reserve_port, tiny_model_dir};
use kvroute_tests::stack::{ExtProcProcess, MODEL, ServerProcess, Stack, pool_schema};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::super::agent::{payload, stored};
use super::super::routing::text;
use super::settle;

/// Kubernetes namespace of the edge ext-proc's discovered pods.
const NS: &str = "llm";
/// The pod the edge ext-proc discovers (its replica id). The edge index knows it by a bound
/// event socket no engine connects to, so it answers for it without vouching (`never_connected`).
const EDGE_POD: &str = "edge-0";
/// The edge ext-proc's second pool (and model): its tokenizer is a render endpoint nothing
/// listens on, so its decisions fall back to the load tier (tokenize fallback).
const BROKEN_POOL: &str = "broken";
/// The edge index's pool that follows the pods too (`pools[].discovery` in kvroute-index).
const WATCHED_POOL: &str = "watched";
/// A pod the edge ext-proc discovers at an address its static config already routes.
const DUPLICATE_POD: &str = "edge-duplicate";

/// The edge processes: a kvroute-ext-proc discovering its pool from the API server double (one
/// ext_proc stream at most) and a kvroute-index whose engines misbehave.
pub(super) struct Edge {
    api: ApiServer,
    pub(super) ext_proc: ExtProcProcess,
    pub(super) index: ServerProcess,
    publisher: MockVllmPublisher,
    bound: SocketAddr,
}

impl Edge {
    pub(super) async fn start(stack: &Stack) -> Self {
        let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
        let bound: SocketAddr = ([127, 0, 0, 1], reserve_port().unwrap()).into();
        let options = stack.options();
        let api = ApiServer::start().await.unwrap();
        let index = ServerProcess::start_index_listening(
            &format!(
                "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
                 reload_interval: 100ms\n\
                 pools:\n- {{{schema}, verify_hashes: off}}\n\
                 - {{name: {WATCHED_POOL}, models: [{WATCHED_POOL}], block_size: {block_size}, \
                 key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}, \
                 discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: sim}}, \
                 target_port: http, api_url: \"{api}\"}}}}}}\n\
                 replicas:\n\
                 - {{id: published, pool: {MODEL}, events: {{endpoint: \"{live}\", \
                 replay_endpoint: \"{replay}\"}}}}\n\
                 - {{id: {EDGE_POD}, pool: {MODEL}, events: {{endpoint: \"tcp://{bound}\", \
                 mode: bind}}}}\n",
                schema = pool_schema(options),
                block_size = options.block_size,
                api = api.url(),
                live = publisher.pub_endpoint().unwrap(),
                replay = publisher.replay_endpoint().unwrap(),
            ),
            None,
        )
        .await
        .unwrap();
        let pod = |name: &str, port_name: &str, port: u16| {
            TestPod::new(name)
                .label("app", "sim")
                .ip("127.0.0.1")
                .ready(true)
                .node("node-0")
                .port(port_name, port)
        };
        let (discovered, broken) = (stack.sims()[0].ready.http, stack.sims()[1].ready.http);
        api.apply_pod(NS, &pod(EDGE_POD, "http", discovered.port()));
        // Another pod at the address of the broken pool's static replica: left out of routing
        // (`duplicate_address`).
        api.apply_pod(NS, &pod(DUPLICATE_POD, "http", broken.port()));
        // A Ready pod without the named port: refused by discovery (`pods_refused`).
        api.apply_pod(NS, &pod("edge-portless", "metrics", broken.port()));
        // Nothing listens there: the broken pool's tokenizer and its second replica (never
        // ready: its metrics cannot be scraped).
        let unreachable = SocketAddr::from(([127, 0, 0, 1], reserve_port().unwrap()));
        let ext_proc = ExtProcProcess::start(
            &format!(
                "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
                 index: {{addresses: [\"http://{index}\"]}}\n\
                 limits: {{max_streams: 1}}\n\
                 reload_interval: 100ms\n\
                 scrape: {{interval: 200ms}}\n\
                 pools:\n- {{{schema}, tokenizer: {{model_dir: \"{model}\"}},\n   \
                 discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: sim}}, \
                 target_port: http, api_url: \"{api}\"}}}}}}\n\
                 - {{name: {BROKEN_POOL}, models: [{BROKEN_POOL}], block_size: {block_size}, \
                 events: false, tokenizer: {{render: \"http://{unreachable}\", timeout: 1s}}}}\n\
                 replicas:\n\
                 - {{id: {BROKEN_POOL}-0, pool: {BROKEN_POOL}, address: \"{broken}\", \
                 metrics_url: \"http://{broken}/metrics\"}}\n\
                 - {{id: {BROKEN_POOL}-1, pool: {BROKEN_POOL}, address: \"{unreachable}\", \
                 metrics_url: \"http://{unreachable}/metrics\"}}\n",
                block_size = options.block_size,
                index = index.grpc(),
                schema = pool_schema(options),
                model = tiny_model_dir().display(),
                api = api.url(),
            ),
            None,
        )
        .await
        .unwrap();
        Edge {
            api,
            ext_proc,
            index,
            publisher,
            bound,
        }
    }

    /// Meets every error path the edge is there for, each confirmed in its `/metrics`.
    pub(super) async fn misbehave(&self) {
        // A sequence gap on the live stream (repaired by replay).
        let index_metrics = format!("{}/metrics", self.index.admin_url());
        try_poll_until("a gap counted by the edge index", settle(), || {
            let url = index_metrics.clone();
            async move {
                self.publisher.publish(payload(stored(&[11]))).await.ok()?;
                self.publisher.skip_seq(payload(stored(&[12]))).await;
                self.publisher.publish(payload(stored(&[13]))).await.ok()?;
                let text = http::get(&url).await.ok()?.text();
                (metrics::sum(&text, "kvroute_index_ingest_gaps_total", &[]) > 0.0).then_some(())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.index.log()));
        // A peer that is no ZMTP engine on the bound SUB socket.
        let bound = self.bound;
        try_poll_until("a refused peer counted by the edge index", settle(), || {
            let url = index_metrics.clone();
            async move {
                // A whole greeting's worth of bytes (64) that is no ZMTP greeting; the index
                // closes the connection, which the read waits for.
                if let Ok(mut stream) = tokio::net::TcpStream::connect(bound).await {
                    let mut request = b"GET / HTTP/1.1\r\nHost: kvroute\r\n".to_vec();
                    request.resize(64, b' ');
                    if stream.write_all(&request).await.is_ok() {
                        let mut rest = Vec::new();
                        let closed = deadline(Duration::from_secs(5));
                        let _ = tokio::time::timeout(closed, stream.read_to_end(&mut rest)).await;
                    }
                }
                let text = http::get(&url).await.ok()?.text();
                (metrics::sum(&text, "kvroute_index_ingest_refused_total", &[]) > 0.0).then_some(())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.index.log()));

        // A message that is no event batch, then an engine restart (sequence from 0 again).
        let undecodable = vec![
            Vec::new(),
            self.publisher.next_seq().to_be_bytes().to_vec(),
            vec![0xc1],
        ];
        self.publisher.send_raw(undecodable).await.unwrap();
        self.publisher.restart().await;
        try_poll_until(
            "a decode error and a reset counted by the edge index",
            settle(),
            || {
                let url = index_metrics.clone();
                async move {
                    self.publisher.publish(payload(stored(&[21]))).await.ok()?;
                    let text = http::get(&url).await.ok()?.text();
                    let errors =
                        metrics::sum(&text, "kvroute_index_ingest_decode_errors_total", &[]);
                    let resets = metrics::sum(&text, "kvroute_index_ingest_resets_total", &[]);
                    (errors > 0.0 && resets > 0.0).then_some(())
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.index.log()));
        // A Match for a model the index does not serve.
        let refused = http::post_json(
            &format!("{}/v1/match", self.index.admin_url()),
            &serde_json::json!({"model": "unserved", "token_ids": [1, 2, 3]}),
        )
        .await
        .unwrap();
        assert_ne!(refused.status, 200, "{}", refused.text());
        // Both config files rewritten (a comment more): each process reloads it.
        for (process, family) in [
            (&self.index, "kvroute_index_config_reloads_total"),
            (&self.ext_proc, "kvroute_extproc_config_reloads_total"),
        ] {
            let path = process.config_path();
            let text = std::fs::read_to_string(&path).unwrap();
            std::fs::write(&path, format!("{text}\n# rewritten\n")).unwrap();
            let url = format!("{}/metrics", process.admin_url());
            try_poll_until("a config reload counted", settle(), || {
                let url = url.clone();
                async move {
                    let text = http::get(&url).await.ok()?.text();
                    (metrics::sum(&text, family, &[]) > 0.0).then_some(())
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}: {family}\n{}", process.log()));
        }

        // Every watch expires (410 Gone): counted as an error, then a relist.
        let ext_proc_metrics = format!("{}/metrics", self.ext_proc.admin_url());
        self.api.expire_watches();
        for (url, errors, log) in [
            (
                &ext_proc_metrics,
                "kvroute_extproc_discovery_watch_errors_total",
                self.ext_proc.log(),
            ),
            (
                &index_metrics,
                "kvroute_index_discovery_watch_errors_total",
                self.index.log(),
            ),
        ] {
            try_poll_until(
                "discovery relisted after 410 Gone",
                settle(),
                || async move {
                    let text = http::get(url).await.ok()?.text();
                    (metrics::sum(&text, errors, &["reason=\"gone\""]) > 0.0).then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}: {errors}\n{log}"));
        }

        // Decisions on the edge: one with tokens (the index does not vouch for the replica), one
        // without (its pool's tokenizer is unreachable).
        let routable = "kvroute_extproc_discovery_routable_replicas";
        try_poll_until(
            "the edge ext-proc routes its discovered pod",
            settle(),
            || {
                let url = ext_proc_metrics.clone();
                async move {
                    let text = http::get(&url).await.ok()?.text();
                    (metrics::sum(&text, routable, &[]) >= 1.0).then_some(())
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.ext_proc.log()));
        let client = ExtProcClient::connect(self.ext_proc.grpc(), settle())
            .await
            .unwrap();
        // Each decision is retried until its counter shows: on a loaded host the index lookup
        // may time out first, which is counted as an index fallback instead.
        for (model, family, labels) in [
            (
                MODEL,
                "kvroute_extproc_nonprecise_replicas_total",
                &["state=\"never_connected\""][..],
            ),
            (
                BROKEN_POOL,
                "kvroute_extproc_fallbacks_total",
                &["stage=\"tokenize\""][..],
            ),
        ] {
            let body = serde_json::json!({"model": model, "prompt": text(5, 20), "max_tokens": 1});
            // One stream at a time: the previous one may not be released yet.
            try_poll_until("an edge decision counted", settle(), || {
                let (client, body) = (client.clone(), body.to_string().into_bytes());
                let url = ext_proc_metrics.clone();
                async move {
                    client.buffered("/v1/completions", body).await.ok()?;
                    let text = http::get(&url).await.ok()?.text();
                    (metrics::sum(&text, family, labels) > 0.0).then_some(())
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}: no {family} {labels:?}\n{}", self.ext_proc.log()));
        }

        // A second ext_proc stream while one is open (`limits.max_streams: 1`) is refused.
        let mut raw = ExternalProcessorClient::connect(format!("http://{}", self.ext_proc.grpc()))
            .await
            .unwrap();
        // The edge decisions' streams may not be released yet: retried until one is taken.
        let _held = try_poll_until("an ext_proc stream held open", settle(), || {
            let mut client = raw.clone();
            async move {
                let (open, held) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
                let stream = tokio_stream::wrappers::ReceiverStream::new(held);
                let response = client.process(stream).await.ok()?;
                Some((open, response))
            }
        })
        .await
        .unwrap();
        let second = raw.process(futures::stream::pending()).await;
        assert!(
            second.is_err(),
            "a second stream was accepted past max_streams: 1"
        );
        let text = http::get(&ext_proc_metrics).await.unwrap().text();
        assert!(
            metrics::sum(&text, "kvroute_extproc_stream_refusals_total", &[]) > 0.0,
            "{text}"
        );
    }
}
