//! The kvroute proxy-wasm filter in a real Envoy, running the shipped chain
//! `envoy/kvroute-full-chain.yaml` (ports and replica addresses substituted): client header strip →
//! wasm fast path → ext_proc (skipped on the fast-path marker) → wasm fallback → override_host pool.
//!
//! ext_proc is the harness's [`FakeExtProc`], handing out the replicas in rotation in
//! kvroute-ext-proc's shapes (header + `envoy.lb` metadata) and counting its streams; upstream
//! replicas are tiny HTTP servers that answer with their name and remember the headers they saw.
//! The module comes from `$KVROUTE_WASM` (scripts/test.sh builds it), else the default
//! `target/wasm32-wasip1/wasm/kvroute_wasm_filter.wasm`; without it these tests fail with the command
//! that builds it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_ext_proc::server::DESTINATION_HEADER;
use kvroute_tests::harness::ext_proc::{FakeExtProc, FakeRouting};
use kvroute_tests::harness::{Envoy, workspace_root};
use kvroute_wasm_filter::config::{
    DEFAULT_MARKER_HEADER, DEFAULT_PIN_HEADER, DEFAULT_SESSION_HEADER,
};
use kvroute_wasm_filter::decision::rendezvous_pick;
use parking_lot::Mutex;
use tokio_util::task::TaskTracker;

/// Header of the pin's shared secret, as the shipped chain's comment suggests (it has no default).
const PIN_TOKEN_HEADER: &str = "x-kvroute-pin-token";
const PIN_TOKEN: &str = "test-pin-secret";
/// The fast path's `model_header` in the shipped chain.
const MODEL_HEADER: &str = "x-kvroute-model";

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn later_turns_of_a_session_skip_ext_proc_and_keep_their_replica() {
    let chain = Chain::start(&[]).await;

    let mut replica_of = HashMap::new();
    for session in ["s1", "s2", "s3", "s4"] {
        let first = chain.turn(session, &[]).await;
        replica_of.insert(session, first);
    }
    assert_eq!(
        chain.ext_proc.streams(),
        4,
        "every first turn asks ext_proc"
    );
    let used: std::collections::HashSet<_> = replica_of.values().collect();
    assert_eq!(
        used.len(),
        2,
        "ext_proc rotated the sessions over both replicas"
    );

    for round in 0..3 {
        for (session, replica) in &replica_of {
            assert_eq!(
                &chain.turn(session, &[]).await,
                replica,
                "{session} turn {round}"
            );
        }
    }
    assert_eq!(
        chain.ext_proc.streams(),
        4,
        "no ext_proc call after the first turn"
    );
    assert_eq!(chain.stat("fast_path_session_hits_total").await, 12);
    assert_eq!(chain.stat("affinity_learned_total").await, 4);
    assert_eq!(chain.stat("extproc_decisions_total").await, 4);
    assert_eq!(chain.stat("fallback_decisions_total").await, 0);

    // The replica saw the fast-path marker only on the fast-path turns.
    let seen = chain
        .replicas
        .iter()
        .flat_map(|r| r.seen.lock().clone())
        .collect::<Vec<_>>();
    let marked = seen
        .iter()
        .filter(|h| h.get(DEFAULT_MARKER_HEADER).map(String::as_str) == Some("1"));
    assert_eq!(marked.count(), 12);
}

#[tokio::test]
async fn with_ext_proc_stopped_sessions_stick_through_the_fallback_and_nothing_fails() {
    let chain = Chain::start(&[]).await;
    let learned = chain.turn("learned-before-outage", &[]).await;
    chain.ext_proc.stop().await.unwrap();

    assert_eq!(
        chain.turn("learned-before-outage", &[]).await,
        learned,
        "learned sessions keep their replica"
    );
    // Twelve new sessions, chosen (by the filter's own hash over this run's ports) so that both
    // replicas own some: each must land where the hash says and stay there.
    let replicas: Vec<String> = chain.replicas.iter().map(|r| r.addr.to_string()).collect();
    let owner = |session: &str| rendezvous_pick(session, &replicas).map(str::to_owned);
    let mut sessions: Vec<String> = (0..11).map(|i| format!("new-{i}")).collect();
    let first_owner = owner(&sessions[0]);
    let other = (11..)
        .map(|i| format!("new-{i}"))
        .find(|s| owner(s) != first_owner)
        .unwrap();
    sessions.push(other);
    let mut served = std::collections::HashSet::new();
    for session in &sessions {
        let first = chain.turn(session, &[]).await;
        assert_eq!(
            Some(&first),
            owner(session).as_ref(),
            "{session}'s hashed replica"
        );
        for _ in 0..2 {
            assert_eq!(
                chain.turn(session, &[]).await,
                first,
                "{session} moved during the outage"
            );
        }
        served.insert(first);
    }
    assert_eq!(
        served.len(),
        2,
        "the fallback hash spreads sessions over both replicas"
    );
    assert_eq!(chain.stat("fallback_decisions_total").await, 36);
    // A request without any session still gets served (Envoy's own balancing).
    let (status, _) = chain.request(&[]).await;
    assert_eq!(status, 200);
    assert_eq!(chain.stat("fallback_unkeyed_total").await, 1);
    assert_eq!(chain.ext_proc.streams(), 1);
}

#[tokio::test]
async fn spoofed_pins_and_routing_headers_from_untrusted_clients_are_ignored() {
    let chain = Chain::start(&[]).await;
    let [a, b] = [
        chain.replicas[0].addr.to_string(),
        chain.replicas[1].addr.to_string(),
    ];

    // No token: the pin is ignored and ext_proc decides. Spoofed decision/marker headers are
    // stripped before the fast path, so they neither route nor skip ext_proc.
    for (i, target) in [&a, &b, &a, &b].into_iter().enumerate() {
        let session = format!("spoof-{i}");
        let headers = [
            (DEFAULT_PIN_HEADER, target.as_str()),
            (DESTINATION_HEADER, target.as_str()),
            (DEFAULT_MARKER_HEADER, "1"),
            (DEFAULT_SESSION_HEADER, session.as_str()),
        ];
        let (status, served) = chain.request(&headers).await;
        assert_eq!(status, 200);
        assert_eq!(
            Some(served),
            chain.ext_proc.last_decision(),
            "ext_proc, not the client, chose"
        );
    }
    assert_eq!(chain.ext_proc.streams(), 4);
    assert_eq!(chain.stat("pins_ignored_total").await, 4);
    assert_eq!(chain.stat("pins_honoured_total").await, 0);

    // With the token the pin routes directly, and neither pin nor token reaches the replica.
    for target in [&a, &b] {
        let headers = [
            (DEFAULT_PIN_HEADER, target.as_str()),
            (PIN_TOKEN_HEADER, PIN_TOKEN),
        ];
        let (status, served) = chain.request(&headers).await;
        assert_eq!((status, &served), (200, target));
    }
    assert_eq!(chain.ext_proc.streams(), 4, "honoured pins skip ext_proc");
    assert_eq!(chain.stat("pins_honoured_total").await, 2);
    for replica in &chain.replicas {
        for headers in replica.seen.lock().iter() {
            assert!(
                !headers.contains_key(DEFAULT_PIN_HEADER)
                    && !headers.contains_key(PIN_TOKEN_HEADER)
            );
        }
    }
}

#[tokio::test]
async fn model_header_routes_to_its_pool_without_ext_proc() {
    // The shipped config maps `text-embedding-small` to cluster `kvroute_embeddings` (replica A here).
    let chain = Chain::start(&[]).await;
    let (status, served) = chain
        .request(&[(MODEL_HEADER, "text-embedding-small")])
        .await;
    assert_eq!((status, served), (200, chain.replicas[0].addr.to_string()));
    assert_eq!(chain.ext_proc.streams(), 0);
    assert_eq!(chain.stat("fast_path_model_routes_total").await, 1);
    // Another model is not a fast-path route.
    let (status, _) = chain.request(&[(MODEL_HEADER, "chat-large")]).await;
    assert_eq!(status, 200);
    assert_eq!(chain.ext_proc.streams(), 1);
    assert_eq!(chain.stat("fast_path_misses_total").await, 1);
}

#[tokio::test]
async fn learned_table_keeps_its_bound_inside_envoy() {
    // One bucket of two entries: the third distinct session evicts the oldest.
    let chain = Chain::start(&[(r#""slots":16384,"ways":4"#, r#""slots":1,"ways":2"#)]).await;
    for i in 0..10 {
        chain.turn(&format!("bounded-{i}"), &[]).await;
    }
    assert_eq!(chain.stat("affinity_learned_total").await, 10);
    assert_eq!(chain.stat("affinity_evictions_total").await, 8);
    // The newest two are remembered; the first was evicted and goes back to ext_proc.
    chain.turn("bounded-9", &[]).await;
    assert_eq!(chain.ext_proc.streams(), 10);
    chain.turn("bounded-0", &[]).await;
    assert_eq!(chain.ext_proc.streams(), 11);
}

// ---------------------------------------------------------------------------------------------
// The chain under test

struct Chain {
    envoy: Envoy,
    ingress: SocketAddr,
    replicas: Vec<Replica>,
    ext_proc: FakeExtProc,
    _tasks: TaskTracker,
}

impl Chain {
    /// Starts replicas, ext_proc and Envoy with the shipped chain; `edits` are extra (from, to)
    /// replacements applied to the config text.
    async fn start(edits: &[(&str, &str)]) -> Chain {
        let tasks = TaskTracker::new();
        let replicas = vec![Replica::start(&tasks).await, Replica::start(&tasks).await];
        let decisions = replicas.iter().map(|r| r.addr.to_string()).collect();
        let ext_proc = FakeExtProc::start(FakeRouting::RoundRobin(decisions))
            .await
            .unwrap();

        let shipped = workspace_root().join("envoy/kvroute-full-chain.yaml");
        let mut config = std::fs::read_to_string(&shipped).unwrap();
        let pin = format!(
            r#"{{"role":"fast_path","pin":{{"token_header":"{PIN_TOKEN_HEADER}","token":"{PIN_TOKEN}"}},"#
        );
        let substitutions = [
            (
                "WASM_FILTER_PATH".to_owned(),
                wasm_module().display().to_string(),
            ),
            ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
            ("port_value: 8080".to_owned(), "port_value: 0".to_owned()),
            ("18001".to_owned(), replicas[0].addr.port().to_string()),
            ("18002".to_owned(), replicas[1].addr.port().to_string()),
            ("18003".to_owned(), replicas[0].addr.port().to_string()),
            ("50051".to_owned(), ext_proc.addr().port().to_string()),
            (r#"{"role":"fast_path","#.to_owned(), pin),
        ];
        let extra = edits
            .iter()
            .map(|(from, to)| ((*from).to_owned(), (*to).to_owned()));
        for (from, to) in substitutions.into_iter().chain(extra) {
            assert!(
                config.contains(&from),
                "{} no longer contains {from:?}",
                shipped.display()
            );
            config = config.replace(&from, &to);
        }

        let envoy = Envoy::start(&config).await.unwrap();
        let ingress = envoy.listener("kvroute").unwrap();
        Chain {
            envoy,
            ingress,
            replicas,
            ext_proc,
            _tasks: tasks,
        }
    }

    /// One chat turn of `session`; asserts success and returns the replica address that served it.
    async fn turn(&self, session: &str, extra: &[(&str, &str)]) -> String {
        let mut headers = vec![(DEFAULT_SESSION_HEADER, session)];
        headers.extend_from_slice(extra);
        let (status, served) = self.request(&headers).await;
        assert_eq!(status, 200, "turn of {session}\n{}", self.envoy.log());
        served
    }

    /// POSTs a small chat request with `headers`; returns status and the serving replica's address.
    async fn request(&self, headers: &[(&str, &str)]) -> (u16, String) {
        let mut request =
            hyper::Request::post(format!("http://{}/v1/chat/completions", self.ingress))
                .header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let body = r#"{"model":"tiny","messages":[{"role":"user","content":"hello"}]}"#;
        let request = request
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let response = tokio::time::timeout(
            kvroute_test_support::deadline(Duration::from_secs(10)),
            client.request(request),
        )
        .await
        .expect("Envoy answers in time")
        .unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// `wasmcustom.kvroute_wasm_<name>` (0 while undefined).
    async fn stat(&self, name: &str) -> u64 {
        self.envoy
            .stat(&format!("wasmcustom.kvroute_wasm_{name}"))
            .await
            .unwrap()
            .unwrap_or(0)
    }
}

fn wasm_module() -> PathBuf {
    let path = std::env::var_os("KVROUTE_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            workspace_root().join("target/wasm32-wasip1/wasm/kvroute_wasm_filter.wasm")
        });
    assert!(
        path.is_file(),
        "{} missing: cargo build --profile wasm --target wasm32-wasip1 -p kvroute-wasm-filter",
        path.display()
    );
    path
}

// ---------------------------------------------------------------------------------------------
// Upstream replica: answers with its own address, remembers request headers.

struct Replica {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<HashMap<String, String>>>>,
}

impl Replica {
    async fn start(tasks: &TaskTracker) -> Replica {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let app = axum::Router::new().fallback(move |headers: axum::http::HeaderMap| {
            let record = Arc::clone(&record);
            async move {
                let headers = headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().to_owned(),
                            v.to_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect();
                record.lock().push(headers);
                addr.to_string()
            }
        });
        tasks.spawn(async move { axum::serve(listener, app).await.unwrap() });
        Replica { addr, seen }
    }
}
