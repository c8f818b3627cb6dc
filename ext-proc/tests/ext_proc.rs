//! The ext_proc server driven over real gRPC the way Envoy drives it, against test doubles: an
//! in-process kvroute-index (tonic `KvIndex` over a map), vLLM-style `/metrics` endpoints, and a
//! byte tokenizer (each byte is a token).

#![expect(
    clippy::disallowed_methods,
    reason = "test doubles and the server under test run detached on the test runtime"
)]
#![allow(
    clippy::unwrap_used,
    reason = "test harness: a failed setup step should panic"
)]

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    body_mutation, processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvroute_block_keys::KeyScheme;
use kvroute_ext_proc::config::DEFAULT_DEBUG_TOKEN_HEADER;
use kvroute_ext_proc::server::{
    CLUSTER_HEADER, DECISION_HEADER, DESTINATION_HEADER, LB_NAMESPACE, PREDICTED_CACHED_HEADER,
    PREFILLER_HEADER, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE,
};
use kvroute_ext_proc::tokenizer::{TokenizeFuture, TokenizeInput};
use kvroute_ext_proc::{Config, ExtProc, Picker, Tokenizer};
use kvroute_index_api::api::kv_index_server::{KvIndex, KvIndexServer};
use kvroute_index_api::api::{
    MatchRequest, MatchResponse, ReplicaCondition, ReplicaMatch, ReplicaStateRequest,
    ReplicaStateResponse,
};
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use parking_lot::Mutex;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;

const BLOCK: usize = 4;

// ---------- test doubles ----------

/// Each byte of the text (or of the messages' JSON) is one token.
#[derive(Debug)]
struct ByteTokenizer;

fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

impl Tokenizer for ByteTokenizer {
    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let tokens = match input.as_ref() {
            TokenizeInput::Text { text, .. } => byte_tokens(text),
            TokenizeInput::Chat { messages, .. } => byte_tokens(messages.get()),
            TokenizeInput::Api { request, .. } => byte_tokens(request.get()),
        };
        Box::pin(async move { Ok(tokens) })
    }
}

#[derive(Debug)]
struct FailingTokenizer;

impl Tokenizer for FailingTokenizer {
    fn tokenize(&self, _model: &str, _input: Arc<TokenizeInput>) -> TokenizeFuture {
        Box::pin(async {
            Err(kvroute_ext_proc::error::TokenizeError::InProcess {
                reason: "boom".into(),
            })
        })
    }
}

/// kvroute-index double: replica id → block keys it holds.
#[derive(Debug, Default, Clone)]
struct FakeIndex {
    held: Arc<Mutex<HashMap<String, HashSet<u64>>>>,
    calls: Arc<Mutex<u32>>,
    /// The `authorization` metadata of each call.
    authorizations: Arc<Mutex<Vec<Option<String>>>>,
    /// Replicas answered as not precise, in this state (0 blocks, as kvroute-index answers).
    untrusted: Arc<Mutex<HashMap<String, ReplicaCondition>>>,
    /// Replica ids left out of every answer (kvroute-index leaves out ids it does not know).
    unknown: Arc<Mutex<HashSet<String>>>,
}

#[tonic::async_trait]
impl KvIndex for FakeIndex {
    async fn r#match(
        &self,
        request: tonic::Request<MatchRequest>,
    ) -> Result<tonic::Response<MatchResponse>, tonic::Status> {
        *self.calls.lock() += 1;
        self.authorizations.lock().push(
            request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        );
        let request = request.into_inner();
        let held = self.held.lock();
        let (untrusted, unknown) = (self.untrusted.lock(), self.unknown.lock());
        let replicas = request
            .candidates
            .iter()
            .filter(|id| !unknown.contains(*id))
            .map(|id| {
                if let Some(&state) = untrusted.get(id) {
                    return ReplicaMatch {
                        replica_id: id.clone(),
                        precise: false,
                        state: state.into(),
                        reason: "block_size_mismatch".into(),
                        ..Default::default()
                    };
                }
                let set = held.get(id);
                let matched = request
                    .keys
                    .iter()
                    .take_while(|k| set.is_some_and(|s| s.contains(k)))
                    .count() as u32;
                ReplicaMatch {
                    replica_id: id.clone(),
                    matched_blocks: matched,
                    gpu_blocks: matched,
                    precise: true,
                    state: ReplicaCondition::Ready.into(),
                    ..Default::default()
                }
            })
            .collect();
        Ok(tonic::Response::new(MatchResponse {
            block_size: request.block_size,
            total_blocks: request.keys.len() as u32,
            replicas,
        }))
    }

    async fn replica_state(
        &self,
        _request: tonic::Request<ReplicaStateRequest>,
    ) -> Result<tonic::Response<ReplicaStateResponse>, tonic::Status> {
        Ok(tonic::Response::new(ReplicaStateResponse::default()))
    }

    type ShareDecisionsStream = std::pin::Pin<
        Box<
            dyn futures::Stream<Item = Result<kvroute_index_api::api::PickerNews, tonic::Status>>
                + Send,
        >,
    >;

    /// This double relays nothing (a real index's relay is tested against the real index).
    async fn share_decisions(
        &self,
        _request: tonic::Request<tonic::Streaming<kvroute_index_api::api::PickerNews>>,
    ) -> Result<tonic::Response<Self::ShareDecisionsStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not relayed by this double"))
    }
}

async fn start_index(index: FakeIndex, stop: CancellationToken) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvIndexServer::new(index))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned()),
    );
    addr
}

/// `/metrics/{replica}` serving vLLM gauges from a shared map (replica → waiting requests).
async fn start_metrics(waiting: Arc<Mutex<HashMap<String, f64>>>) -> SocketAddr {
    use axum::extract::{Path, State};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route(
            "/metrics/{replica}",
            axum::routing::get(|State(w): State<Arc<Mutex<HashMap<String, f64>>>>, Path(r): Path<String>| async move {
                let waiting = w.lock().get(&r).copied().unwrap_or(0.0);
                format!(
                    "vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\nvllm:num_requests_running{{model_name=\"m\"}} 0\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} 0.1\n"
                )
            }),
        )
        .with_state(waiting);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

// ---------- harness ----------

struct Harness {
    grpc: SocketAddr,
    admin: SocketAddr,
    picker: Arc<Picker>,
    stop: CancellationToken,
    served: tokio::task::JoinHandle<()>,
}

impl Harness {
    async fn start(yaml: &str, tokenizer: Arc<dyn Tokenizer>) -> Self {
        let config = Config::from_yaml(yaml).unwrap();
        Self::serve(ExtProc::builder(config).tokenizer(0, tokenizer)).await
    }

    /// ext-proc started from the file at `path`, following it as the binary does.
    async fn start_following(path: &std::path::Path, tokenizer: Arc<dyn Tokenizer>) -> Self {
        let config = Config::from_file(path).unwrap();
        let builder = ExtProc::builder(config)
            .config_path(path.to_owned())
            .tokenizer(0, tokenizer);
        Self::serve(builder).await
    }

    async fn serve(builder: kvroute_ext_proc::ExtProcBuilder) -> Self {
        let server = builder.bind().await.unwrap();
        let grpc = server.grpc_addr().unwrap();
        let admin = server.admin_addr().unwrap();
        let picker = server.picker();
        let stop = CancellationToken::new();
        let until = stop.clone().cancelled_owned();
        let served = tokio::spawn(async move { server.serve(until).await.unwrap() });
        Self {
            grpc,
            admin,
            picker,
            stop,
            served,
        }
    }

    async fn client(&self) -> ExternalProcessorClient<tonic::transport::Channel> {
        ExternalProcessorClient::connect(format!("http://{}", self.grpc))
            .await
            .unwrap()
    }

    async fn shutdown(self) {
        self.stop.cancel();
        tokio::time::timeout(deadline(Duration::from_secs(10)), self.served)
            .await
            .unwrap()
            .unwrap();
    }
}

struct Replicas {
    index: FakeIndex,
    waiting: Arc<Mutex<HashMap<String, f64>>>,
    index_addr: SocketAddr,
    metrics_addr: SocketAddr,
    stop: CancellationToken,
}

impl Replicas {
    async fn start() -> Self {
        let index = FakeIndex::default();
        let stop = CancellationToken::new();
        let index_addr = start_index(index.clone(), stop.clone()).await;
        let waiting = Arc::new(Mutex::new(HashMap::new()));
        let metrics_addr = start_metrics(Arc::clone(&waiting)).await;
        Self {
            index,
            waiting,
            index_addr,
            metrics_addr,
            stop,
        }
    }

    fn yaml(&self, extra: &str) -> String {
        let m = self.metrics_addr;
        format!(
            r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
index: {{addresses: ["http://{index}"], match_timeout: 200ms}}
budgets: {{decision: 500ms, tokenize: 200ms, drain: 2s}}
max_body_bytes: 300000
scrape: {{interval: 20ms, timeout: 200ms}}
scoring: {{prefill_ms_per_token: 0.1, queue_ms_per_request: 50, hotspot_min_ms: 100}}
pools:
- name: p
  models: [m]
  adapters: [m-lora]
  block_size: {BLOCK}
  key_scheme: {{kind: token-chain}}
replicas:
- {{id: r0, pool: p, address: "10.0.0.1:8000", metrics_url: "http://{m}/metrics/r0"}}
- {{id: r1, pool: p, address: "10.0.0.2:8000", metrics_url: "http://{m}/metrics/r1", envoy_cluster: replica_r1}}
- {{id: r2, pool: p, address: "10.0.0.3:8000", metrics_url: "http://{m}/metrics/r2"}}
{extra}"#,
            index = self.index_addr,
        )
    }

    fn hold(&self, replica: &str, prompt: &str) {
        let keys = KeyScheme::TokenChain
            .prompt_keys(&byte_tokens(prompt), BLOCK, None, None)
            .unwrap();
        self.index
            .held
            .lock()
            .entry(replica.to_owned())
            .or_default()
            .extend(keys);
    }
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

fn request_headers(
    path: &str,
    mode: BodySendMode,
    metadata: Option<Metadata>,
) -> ProcessingRequest {
    request_headers_with(path, mode, metadata, &[])
}

/// Request headers with `extra` headers besides the path, method and a spoofed destination.
fn request_headers_with(
    path: &str,
    mode: BodySendMode,
    metadata: Option<Metadata>,
    extra: &[(&str, &str)],
) -> ProcessingRequest {
    let mut headers = vec![
        header(":path", path),
        header(":method", "POST"),
        header(DESTINATION_HEADER, "6.6.6.6:1"),
    ];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: BodySendMode::None as i32,
            ..ProtocolConfiguration::default()
        }),
        metadata_context: metadata,
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn response_headers(served: &str) -> ProcessingRequest {
    let lb = Struct {
        fields: HashMap::from([(
            SERVED_KEY.to_owned(),
            Value {
                kind: Some(Kind::StringValue(served.to_owned())),
            },
        )]),
    };
    ProcessingRequest {
        metadata_context: Some(Metadata {
            filter_metadata: HashMap::from([(LB_NAMESPACE.to_owned(), lb)]),
            ..Metadata::default()
        }),
        request: Some(processing_request::Request::ResponseHeaders(
            HttpHeaders::default(),
        )),
        ..ProcessingRequest::default()
    }
}

/// An open ext_proc stream, as Envoy holds one per HTTP request.
struct Stream {
    tx: tokio::sync::mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(harness: &Harness) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let rx = harness
            .client()
            .await
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }

    async fn send(&self, message: ProcessingRequest) {
        self.tx.send(message).await.unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(deadline(Duration::from_secs(5)), self.rx.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
    }
}

/// What a BUFFERED exchange returned: the routing response (or immediate response).
async fn buffered(
    harness: &Harness,
    path: &str,
    request_body: &[u8],
    metadata: Option<Metadata>,
) -> ProcessingResponse {
    let mut stream = Stream::open(harness).await;
    stream
        .send(request_headers(path, BodySendMode::Buffered, metadata))
        .await;
    let first = stream.recv().await;
    assert!(
        matches!(
            first.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "{first:?}"
    );
    stream.send(body(request_body, true)).await;
    stream.recv().await
}

struct Routed {
    /// The chosen endpoint (the destination list's first entry).
    endpoint: String,
    /// The rest of the list, best first.
    fallbacks: Vec<String>,
    /// The whole header value.
    destination: String,
    /// The whole `envoy.lb` metadata value.
    metadata_destination: String,
    decision: String,
    cluster: Option<String>,
    clear_route_cache: bool,
}

fn set_headers(
    common: &envoy_types::pb::envoy::service::ext_proc::v3::CommonResponse,
) -> HashMap<String, String> {
    common
        .header_mutation
        .as_ref()
        .map(|m| {
            m.set_headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .map(|h| {
                    (
                        h.key.clone(),
                        String::from_utf8(h.raw_value.clone()).unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn routed(response: &ProcessingResponse) -> Routed {
    let common = match &response.response {
        Some(processing_response::Response::RequestBody(b)) => b.response.clone().unwrap(),
        Some(processing_response::Response::RequestHeaders(h)) => h.response.clone().unwrap(),
        other => panic!("not a routing response: {other:?}"),
    };
    let headers = set_headers(&common);
    let lb = match &response.dynamic_metadata.as_ref().unwrap().fields[LB_NAMESPACE].kind {
        Some(Kind::StructValue(s)) => s.clone(),
        other => panic!("bad metadata {other:?}"),
    };
    let metadata_destination = match &lb.fields[DESTINATION_HEADER].kind {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("bad metadata {other:?}"),
    };
    let destination = headers[DESTINATION_HEADER].clone();
    let mut list = destination.split(',').map(str::to_owned);
    Routed {
        endpoint: list.next().unwrap_or_default(),
        fallbacks: list.collect(),
        destination,
        metadata_destination,
        decision: headers[DECISION_HEADER].clone(),
        cluster: headers.get(CLUSTER_HEADER).cloned(),
        clear_route_cache: common.clear_route_cache,
    }
}

fn immediate(response: &ProcessingResponse) -> (i32, serde_json::Value) {
    match &response.response {
        Some(processing_response::Response::ImmediateResponse(r)) => (
            r.status.as_ref().unwrap().code,
            serde_json::from_slice(&r.body).unwrap(),
        ),
        other => panic!("not an immediate response: {other:?}"),
    }
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4}))
        .unwrap()
}

/// How long a test waits for the server to reach a state.
fn within() -> Duration {
    deadline(Duration::from_secs(5))
}

fn long_prefix() -> String {
    "You are a helpful assistant. Here is a long shared document. ".repeat(20)
}

// ---------- tests ----------

#[tokio::test]
async fn buffered_decision_sets_header_and_metadata_and_follows_the_index() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    let prefix = long_prefix();
    replicas.hold("r1", &prefix);

    for question in ["what is a?", "and what is b?"] {
        let response = buffered(
            &harness,
            "/v1/completions",
            &completion(&format!("{prefix}{question}")),
            None,
        )
        .await;
        let r = routed(&response);
        assert_eq!(
            r.endpoint, "10.0.0.2:8000",
            "goes where the index says the prefix is"
        );
        assert_eq!(
            r.metadata_destination, r.destination,
            "header and envoy.lb metadata agree"
        );
        // GIE's fallback list: the two other replicas (epp.fallbacks defaults to 2), once each.
        let mut fallbacks = r.fallbacks.clone();
        fallbacks.sort();
        assert_eq!(
            fallbacks,
            ["10.0.0.1:8000", "10.0.0.3:8000"],
            "{}",
            r.destination
        );
        assert_eq!(r.decision, "precise/cache_hit");
        assert_eq!(r.cluster.as_deref(), Some("replica_r1"));
        assert!(r.clear_route_cache);
    }
    assert!(*replicas.index.calls.lock() >= 2);

    // In-flight accounting: the picker counts the request until Envoy reports response headers.
    let mut stream = Stream::open(&harness).await;
    stream
        .send(request_headers(
            "/v1/chat/completions",
            BodySendMode::Buffered,
            None,
        ))
        .await;
    stream.recv().await;
    let chat = serde_json::json!({"model": "m-lora", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]});
    stream
        .send(body(&serde_json::to_vec(&chat).unwrap(), true))
        .await;
    let r = routed(&stream.recv().await);
    let id = ["r0", "r1", "r2"][["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        .iter()
        .position(|a| *a == r.endpoint)
        .unwrap()];
    let load = harness.picker.loads().replica(id);
    assert_eq!(load.snapshot().inflight_requests, 1.0);
    stream.send(response_headers(&r.endpoint)).await;
    let answer = stream.recv().await;
    assert!(matches!(
        answer.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ));
    poll_until("in-flight released", within(), || async {
        load.snapshot().inflight_requests == 0.0
    })
    .await;

    harness.shutdown().await;
    replicas.stop.cancel();
}

/// The index vouches only for `ready` replicas: one it answers `precise: false` for (r1, flagged,
/// though it holds the prefix) is scored on the approximate tier, and so is one it leaves out
/// (r2, an id it does not know); both are counted per replica. r0 (precise) is kept busy so the
/// choice falls on the other two.
#[tokio::test]
async fn replicas_the_index_does_not_vouch_for_are_approximate_and_counted() {
    let replicas = Replicas::start().await;
    let prefix = long_prefix();
    replicas.hold("r1", &prefix);
    replicas
        .index
        .untrusted
        .lock()
        .insert("r1".into(), ReplicaCondition::Flagged);
    replicas.index.unknown.lock().insert("r2".into());
    replicas.waiting.lock().insert("r0".into(), 40.0);
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    let load = harness.picker.loads().replica("r0");
    poll_until("r0's queue scraped", within(), || async {
        load.snapshot().scraped.waiting == 40.0
    })
    .await;

    let first = routed(&buffered(&harness, "/v1/completions", &completion(&prefix), None).await);
    assert_ne!(first.endpoint, "10.0.0.1:8000");
    assert!(
        first.decision.starts_with("approximate/"),
        "{}",
        first.decision
    );
    // The routed-prefix memory (the approximate tier) follows the first decision.
    let again = routed(
        &buffered(
            &harness,
            "/v1/completions",
            &completion(&format!("{prefix} and more")),
            None,
        )
        .await,
    );
    assert_eq!(again.endpoint, first.endpoint);
    assert_eq!(again.decision, "approximate/cache_hit");
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    for line in [
        "kvroute_extproc_nonprecise_replicas_total{replica=\"r1\",state=\"flagged\"} 2",
        "kvroute_extproc_unknown_replicas_total{replica=\"r2\"} 2",
        "kvroute_extproc_decisions_total{tier=\"approximate\",reason=\"cache_hit\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    assert!(
        !metrics.contains("nonprecise_replicas_total{replica=\"r0\""),
        "{metrics}"
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

/// What vLLM serves is routed: a body naming no model (vLLM serves its base model) goes to the
/// only pool, or to `default_pool` when there are several (without one, 400 naming `model`);
/// a duplicated key keeps its last value, as Python's `json.loads` does for vLLM.
#[tokio::test]
async fn bodies_without_a_model_or_with_a_duplicated_key_are_routed() {
    let replicas = Replicas::start().await;
    let prefix = long_prefix();
    replicas.hold("r1", &prefix);
    let no_model =
        serde_json::to_vec(&serde_json::json!({"prompt": format!("{prefix} q")})).unwrap();
    let duplicated = format!(
        r#"{{"model":"nope","prompt":"unrelated","model":"m","prompt":{}}}"#,
        serde_json::to_string(&format!("{prefix} q")).unwrap()
    );
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    for body in [no_model.as_slice(), duplicated.as_bytes()] {
        let r = routed(&buffered(&harness, "/v1/completions", body, None).await);
        // Tokenized as the pool's model and matched: the prompt that counted is the last one.
        assert_eq!(
            (r.endpoint.as_str(), r.decision.as_str()),
            ("10.0.0.2:8000", "precise/cache_hit")
        );
    }
    harness.shutdown().await;

    // A second pool: which base model a nameless request means needs `default_pool`.
    let other_pool = "- {id: q0, pool: q, address: \"10.0.0.9:8000\"}\n";
    let two_pools = |extra: &str| {
        replicas.yaml(&format!("{other_pool}{extra}")).replacen(
            "replicas:\n",
            "- {name: q, models: [other], block_size: 4, key_scheme: {kind: token-chain}}\nreplicas:\n",
            1,
        )
    };
    let harness = Harness::start(&two_pools(""), Arc::new(ByteTokenizer)).await;
    let (status, json) = immediate(&buffered(&harness, "/v1/completions", &no_model, None).await);
    assert_eq!(
        (status, json["error"]["param"].as_str()),
        (400, Some("model"))
    );
    harness.shutdown().await;
    let harness = Harness::start(&two_pools("default_pool: p\n"), Arc::new(ByteTokenizer)).await;
    let r = routed(&buffered(&harness, "/v1/completions", &no_model, None).await);
    assert_eq!(
        (r.endpoint.as_str(), r.decision.as_str()),
        ("10.0.0.2:8000", "precise/cache_hit")
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn full_duplex_defers_headers_and_echoes_the_body_in_chunks() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    let prompt = "x".repeat(150_000);
    let request_body = completion(&prompt);
    let mut stream = Stream::open(&harness).await;
    stream
        .send(request_headers(
            "/v1/completions",
            BodySendMode::FullDuplexStreamed,
            None,
        ))
        .await;
    let (first, second) = request_body.split_at(70_000);
    stream.send(body(first, false)).await;
    stream.send(body(second, true)).await;

    let headers = stream.recv().await;
    assert!(
        matches!(
            headers.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "header answer comes after the body"
    );
    let r = routed(&headers);
    assert_eq!(r.metadata_destination, r.destination);
    assert!(r.clear_route_cache);
    let mut echoed = Vec::new();
    loop {
        let response = stream.recv().await;
        let Some(processing_response::Response::RequestBody(b)) = response.response else {
            panic!("expected body echo")
        };
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("expected streamed_response")
        };
        assert!(chunk.body.len() <= 62_000);
        echoed.extend_from_slice(&chunk.body);
        if chunk.end_of_stream {
            break;
        }
    }
    assert_eq!(echoed, request_body, "the body is passed on unchanged");
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;

    let (status, json) =
        immediate(&buffered(&harness, "/v1/completions", b"{not json", None).await);
    assert_eq!(status, 400);
    assert_eq!(json["error"]["type"], "invalid_request_error");
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("malformed")
    );

    let (status, json) =
        immediate(&buffered(&harness, "/v1/chat/completions", br#"{"model":"m"}"#, None).await);
    assert_eq!(
        (status, json["error"]["param"].as_str()),
        (400, Some("messages"))
    );

    let unknown =
        serde_json::to_vec(&serde_json::json!({"model": "nope", "prompt": "hi"})).unwrap();
    let (status, json) = immediate(&buffered(&harness, "/v1/completions", &unknown, None).await);
    assert_eq!((status, json["error"]["code"].as_i64()), (404, Some(404)));

    let huge = completion(&"y".repeat(400_000));
    let (status, _) = immediate(&buffered(&harness, "/v1/completions", &huge, None).await);
    assert_eq!(status, 413);

    // Subset hint naming no replica of the pool → 503.
    let hint = Struct {
        fields: HashMap::from([(
            SUBSET_KEY.to_owned(),
            Value {
                kind: Some(Kind::ListValue(ListValue {
                    values: vec![Value {
                        kind: Some(Kind::StringValue("9.9.9.9:1".into())),
                    }],
                })),
            },
        )]),
    };
    let metadata = Metadata {
        filter_metadata: HashMap::from([(SUBSET_NAMESPACE.to_owned(), hint)]),
        ..Metadata::default()
    };
    let (status, json) = immediate(
        &buffered(
            &harness,
            "/v1/completions",
            &completion("hi"),
            Some(metadata),
        )
        .await,
    );
    assert_eq!(status, 503);
    assert_eq!(json["error"]["type"], "ServiceUnavailableError");

    // The service stays up and counts what it refused.
    let ok = buffered(&harness, "/v1/completions", &completion("fine"), None).await;
    routed(&ok);
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    assert!(
        metrics.contains("kvroute_extproc_request_errors_total{kind=\"unknown_model\"} 1"),
        "{metrics}"
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn subset_hint_restricts_candidates() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    let prefix = long_prefix();
    replicas.hold("r1", &prefix);
    let hint = Struct {
        fields: HashMap::from([(
            SUBSET_KEY.to_owned(),
            Value {
                kind: Some(Kind::StringValue("10.0.0.3:8000".into())),
            },
        )]),
    };
    let metadata = Metadata {
        filter_metadata: HashMap::from([(SUBSET_NAMESPACE.to_owned(), hint)]),
        ..Metadata::default()
    };
    let r = routed(
        &buffered(
            &harness,
            "/v1/completions",
            &completion(&prefix),
            Some(metadata),
        )
        .await,
    );
    assert_eq!(
        r.endpoint, "10.0.0.3:8000",
        "only the hinted endpoint may be picked, cache or not"
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

/// The request header mutation of a routing answer: what it sets, what it removes.
fn header_mutation(response: &ProcessingResponse) -> (HashMap<String, String>, Vec<String>) {
    let common = match &response.response {
        Some(processing_response::Response::RequestBody(b)) => b.response.clone().unwrap(),
        other => panic!("not a routing response: {other:?}"),
    };
    let removed = common
        .header_mutation
        .as_ref()
        .map(|m| m.remove_headers.clone())
        .unwrap_or_default();
    (set_headers(&common), removed)
}

#[tokio::test]
async fn a_disaggregated_pool_names_the_prefill_replica_as_the_llm_d_sidecar_reads_it() {
    let replicas = Replicas::start().await;
    // r0 and r1 decode, r2 computes prompts only; a prompt is split from 600 tokens when 300
    // are uncached on its decode replica.
    let yaml = replicas
        .yaml("")
        .replace(
            "  key_scheme: {kind: token-chain}\n",
            "  key_scheme: {kind: token-chain}\n  disaggregation: {mode: sidecar, min_prompt_tokens: 600, min_uncached_tokens: 300}\n",
        )
        .replace(
            "address: \"10.0.0.3:8000\",",
            "address: \"10.0.0.3:8000\", role: prefill,",
        )
        .replace("address: \"10.0.0.1:8000\",", "address: \"10.0.0.1:8000\", role: decode,")
        .replace("address: \"10.0.0.2:8000\",", "address: \"10.0.0.2:8000\", role: decode,");
    let harness = Harness::start(&yaml, Arc::new(ByteTokenizer)).await;
    let document = long_prefix();
    assert!(document.len() >= 600);

    // Long and held by nobody: served by a decode replica, its prompt computed on r2, named
    // `ip:port` in llm-d's header.
    let split = buffered(&harness, "/v1/completions", &completion(&document), None).await;
    let (set, _) = header_mutation(&split);
    assert_eq!(
        set.get(PREFILLER_HEADER).map(String::as_str),
        Some("10.0.0.3:8000"),
        "{set:?}"
    );
    assert_eq!(PREFILLER_HEADER, "x-prefiller-host-port");
    let decode = routed(&split).endpoint;
    assert_ne!(
        decode, "10.0.0.3:8000",
        "a prefill replica serves no request"
    );

    // Held whole by its decode replica now (the index says so): served there whole, and a
    // client's own value of the header is removed.
    let holder = if decode == "10.0.0.1:8000" {
        "r0"
    } else {
        "r1"
    };
    replicas.hold(holder, &document);
    let cached = buffered(&harness, "/v1/completions", &completion(&document), None).await;
    assert_eq!(routed(&cached).endpoint, decode);
    let (set, removed) = header_mutation(&cached);
    assert!(!set.contains_key(PREFILLER_HEADER), "{set:?}");
    assert!(removed.iter().any(|h| h == PREFILLER_HEADER), "{removed:?}");

    // Short: served whole.
    let short = buffered(
        &harness,
        "/v1/completions",
        &completion("hello there"),
        None,
    )
    .await;
    assert!(!header_mutation(&short).0.contains_key(PREFILLER_HEADER));

    // The prefill replica's event stream broke (its engine died): a long prompt is served
    // whole at once, before any scrape finds the replica unready.
    replicas
        .index
        .untrusted
        .lock()
        .insert("r2".to_owned(), ReplicaCondition::Disconnected);
    let other = format!(
        "{} A different document.",
        "Unrelated words again. ".repeat(40)
    );
    let whole = buffered(&harness, "/v1/completions", &completion(&other), None).await;
    assert!(
        !header_mutation(&whole).0.contains_key(PREFILLER_HEADER),
        "no leg to a prefill replica whose engine is gone"
    );

    // A client's own transfer params would name any engine to pull a prompt from: refused.
    let forged = serde_json::json!({"model": "m", "prompt": "hello",
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.9.9.9"}});
    let (status, error) = immediate(
        &buffered(
            &harness,
            "/v1/completions",
            forged.to_string().as_bytes(),
            None,
        )
        .await,
    );
    assert_eq!(status, 400, "{error}");
    assert!(error.to_string().contains("kv_transfer_params"), "{error}");
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn load_beats_cache_on_an_overloaded_replica() {
    let replicas = Replicas::start().await;
    let prefix = long_prefix();
    replicas.hold("r1", &prefix);
    replicas.waiting.lock().insert("r1".into(), 40.0);
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    let load = harness.picker.loads().replica("r1");
    poll_until("r1's queue scraped", within(), || async {
        load.snapshot().scraped.waiting == 40.0
    })
    .await;

    let r = routed(
        &buffered(
            &harness,
            "/v1/completions",
            &completion(&format!("{prefix} q")),
            None,
        )
        .await,
    );
    assert_ne!(
        r.endpoint, "10.0.0.2:8000",
        "r1 holds the prefix but its queue is far too long"
    );
    assert!(
        r.decision == "precise/hotspot_guard" || r.decision == "precise/load_over_cache",
        "{}",
        r.decision
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn index_down_uses_the_approximate_tier_within_budget() {
    let replicas = Replicas::start().await;
    replicas.stop.cancel(); // the index is gone
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let yaml = replicas
        .yaml("")
        .replace(&replicas.index_addr.to_string(), &dead.to_string());
    let harness = Harness::start(&yaml, Arc::new(ByteTokenizer)).await;
    let prefix = long_prefix();

    let first = routed(
        &buffered(
            &harness,
            "/v1/completions",
            &completion(&format!("{prefix} one")),
            None,
        )
        .await,
    );
    for question in [" two", " three", " four"] {
        let started = Instant::now();
        let r = routed(
            &buffered(
                &harness,
                "/v1/completions",
                &completion(&format!("{prefix}{question}")),
                None,
            )
            .await,
        );
        assert!(
            started.elapsed() < Duration::from_millis(500 + 300),
            "decided within the budget"
        );
        assert_eq!(
            r.endpoint, first.endpoint,
            "siblings follow kvroute's own routing memory"
        );
        assert_eq!(r.decision, "approximate/cache_hit");
    }
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    assert!(
        metrics.contains("kvroute_extproc_fallbacks_total{stage=\"index\",cause=\"unavailable\"}"),
        "{metrics}"
    );
    harness.shutdown().await;
}

#[tokio::test]
async fn tokenizer_failure_falls_back_to_load() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(FailingTokenizer)).await;
    let r = routed(
        &buffered(
            &harness,
            "/v1/completions",
            &completion("anything at all"),
            None,
        )
        .await,
    );
    assert_eq!(r.decision, "load/tokenizer_failed");
    // Client-supplied token ids need no tokenizer.
    let ids =
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8]}))
            .unwrap();
    let r = routed(&buffered(&harness, "/v1/completions", &ids, None).await);
    assert!(r.decision.starts_with("precise/"), "{}", r.decision);
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    assert!(
        metrics.contains(
            "kvroute_extproc_decisions_total{tier=\"load\",reason=\"tokenizer_failed\"} 1"
        ),
        "{metrics}"
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn shutdown_reports_not_serving_and_readyz() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", harness.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "envoy.service.ext_proc.v3.ExternalProcessor".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    assert!(
        kvroute_test_support::http_get(harness.admin, "/readyz")
            .await
            .contains("ready")
    );
    assert!(
        kvroute_test_support::http_get(harness.admin, "/healthz")
            .await
            .contains("ok")
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

/// What one decided exchange showed about debug headers.
#[derive(Debug, PartialEq)]
struct DebugExchange {
    /// Request headers removed before the request goes upstream.
    removed: Vec<String>,
    /// Headers set on the client's response.
    response: HashMap<String, String>,
}

/// One request carrying `extra` headers, decided and answered, in `mode`.
async fn debug_exchange(
    harness: &Harness,
    mode: BodySendMode,
    extra: &[(&str, &str)],
) -> DebugExchange {
    let mut stream = Stream::open(harness).await;
    stream
        .send(request_headers_with("/v1/completions", mode, None, extra))
        .await;
    let mut removed = Vec::new();
    let mut collect = |common: &envoy_types::pb::envoy::service::ext_proc::v3::CommonResponse| {
        if let Some(mutation) = &common.header_mutation {
            removed.extend(mutation.remove_headers.iter().cloned());
        }
    };
    if mode == BodySendMode::Buffered {
        match stream.recv().await.response {
            Some(processing_response::Response::RequestHeaders(h)) => {
                collect(&h.response.unwrap_or_default());
            }
            other => panic!("not a headers answer: {other:?}"),
        }
    }
    stream.send(body(&completion(&long_prefix()), true)).await;
    let decided = stream.recv().await;
    let r = routed(&decided);
    match &decided.response {
        Some(processing_response::Response::RequestHeaders(h)) => {
            collect(h.response.as_ref().unwrap());
        }
        Some(processing_response::Response::RequestBody(b)) => {
            collect(b.response.as_ref().unwrap());
        }
        _ => unreachable!("routed() accepted it"),
    }
    if mode == BodySendMode::FullDuplexStreamed {
        // The echoed body.
        stream.recv().await;
    }
    stream.send(response_headers(&r.endpoint)).await;
    let response = match stream.recv().await.response {
        Some(processing_response::Response::ResponseHeaders(h)) => {
            h.response.as_ref().map(set_headers).unwrap_or_default()
        }
        other => panic!("not a response-headers answer: {other:?}"),
    };
    DebugExchange { removed, response }
}

#[tokio::test]
async fn a_changed_config_file_applies_and_a_bad_one_is_counted_and_changes_nothing() {
    let replicas = Replicas::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ext-proc.yaml");
    let yaml = |scrape_interval: &str| {
        replicas.yaml("reload_interval: 20ms\n").replace(
            "interval: 20ms, timeout",
            &format!("interval: {scrape_interval}, timeout"),
        )
    };
    let mut mtime = std::time::SystemTime::UNIX_EPOCH;
    let mut write = |text: &str| {
        std::fs::write(&path, text).unwrap();
        // Explicit and distinct: two writes within the filesystem's timestamp granularity would
        // look like one.
        mtime += Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    };
    write(&yaml("20ms"));
    let harness = Harness::start_following(&path, Arc::new(ByteTokenizer)).await;
    let scrape_interval = || harness.picker.runtime().config.scrape.interval;
    assert_eq!(scrape_interval(), Duration::from_millis(20));

    write(&yaml("30ms"));
    poll_until("the rewritten file applied", within(), || async {
        scrape_interval() == Duration::from_millis(30)
    })
    .await;

    write("pools: [not a pool\n");
    let rejected = "kvroute_extproc_config_reloads_total{kind=\"rejected\"} 1";
    let reloads = try_poll_until(rejected, within(), || async {
        let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
        metrics.contains(rejected).then_some(metrics)
    })
    .await;
    let metrics = match reloads {
        Ok(metrics) => metrics,
        Err(error) => panic!(
            "{error}:\n{}",
            kvroute_test_support::http_get(harness.admin, "/metrics").await
        ),
    };
    assert!(
        metrics.contains("kvroute_extproc_config_reloads_total{kind=\"applied\"} 1"),
        "{metrics}"
    );
    assert_eq!(
        scrape_interval(),
        Duration::from_millis(30),
        "a bad file keeps the running config"
    );
    harness.shutdown().await;
}

#[tokio::test]
async fn debug_headers_are_off_by_default_and_opt_in_by_config_or_token() {
    let replicas = Replicas::start().await;
    let prefix = long_prefix();
    replicas.hold("r1", &prefix);
    let nothing = DebugExchange {
        removed: Vec::new(),
        response: HashMap::new(),
    };

    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let exchange =
            debug_exchange(&harness, mode, &[(DEFAULT_DEBUG_TOKEN_HEADER, "guess")]).await;
        assert_eq!(
            exchange, nothing,
            "{mode:?}: default config exposes nothing"
        );
    }
    harness.shutdown().await;

    let harness = Harness::start(
        &replicas.yaml("debug_headers: {expose: always}\n"),
        Arc::new(ByteTokenizer),
    )
    .await;
    let exchange = debug_exchange(&harness, BodySendMode::Buffered, &[]).await;
    assert_eq!(exchange.response[DECISION_HEADER], "precise/cache_hit");
    assert!(
        exchange.response[PREDICTED_CACHED_HEADER]
            .parse::<u32>()
            .unwrap()
            > 0
    );
    harness.shutdown().await;

    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("debug-token");
    std::fs::write(&token_file, "open-sesame\n").unwrap();
    let yaml = replicas.yaml(&format!(
        "debug_headers: {{expose: token, token_header: x-debug, token_file: \"{}\"}}\n",
        token_file.display()
    ));
    let harness = Harness::start(&yaml, Arc::new(ByteTokenizer)).await;
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let right = debug_exchange(&harness, mode, &[("x-debug", "open-sesame")]).await;
        assert_eq!(
            right.removed,
            ["x-debug"],
            "{mode:?}: the token never goes upstream"
        );
        assert_eq!(
            right.response[DECISION_HEADER], "precise/cache_hit",
            "{mode:?}"
        );
        assert!(right.response.contains_key(PREDICTED_CACHED_HEADER));

        for wrong in ["open-sesam", "open-sesame!", "OPEN-SESAME", ""] {
            let exchange = debug_exchange(&harness, mode, &[("x-debug", wrong)]).await;
            assert_eq!(
                exchange,
                DebugExchange {
                    removed: vec!["x-debug".to_owned()],
                    response: HashMap::new(),
                },
                "{mode:?}: token {wrong:?}"
            );
        }
        assert_eq!(
            debug_exchange(&harness, mode, &[]).await,
            nothing,
            "{mode:?}"
        );
    }
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    for (kind, count) in [("exposed", 2), ("wrong_token", 8), ("no_token", 2)] {
        let line =
            format!("kvroute_extproc_debug_header_requests_total{{kind=\"{kind}\"}} {count}");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn a_stream_held_open_releases_its_inflight_slot_after_the_bound() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(
        &replicas.yaml("limits: {inflight_max_age: 1s, max_streams: 2}\n"),
        Arc::new(ByteTokenizer),
    )
    .await;
    let mut held = Stream::open(&harness).await;
    held.send(request_headers(
        "/v1/completions",
        BodySendMode::Buffered,
        None,
    ))
    .await;
    held.recv().await;
    held.send(body(
        &completion("a request whose response never comes"),
        true,
    ))
    .await;
    let r = routed(&held.recv().await);
    let id = ["r0", "r1", "r2"][["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        .iter()
        .position(|a| *a == r.endpoint)
        .unwrap()];
    let load = harness.picker.loads().replica(id);
    assert_eq!(load.snapshot().inflight_requests, 1.0, "decided and held");

    // Envoy never reports response headers: the slot goes after the bound, the stream stays.
    poll_until(
        "in-flight slot released after the bound",
        within(),
        || async { load.snapshot().inflight_requests == 0.0 },
    )
    .await;
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    let expired = format!("kvroute_extproc_replica_inflight_expired_total{{replica=\"{id}\"}} 1");
    assert!(metrics.contains(&expired), "{expired} in\n{metrics}");

    // A second open stream is admitted, a third refused (limits.max_streams: 2) and counted.
    let mut second = Stream::open(&harness).await;
    second
        .send(request_headers(
            "/v1/completions",
            BodySendMode::Buffered,
            None,
        ))
        .await;
    second.recv().await;
    let (_tx, rx) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
    let third = harness
        .client()
        .await
        .process(ReceiverStream::new(rx))
        .await;
    assert_eq!(
        third.map(|_| ()).unwrap_err().code(),
        tonic::Code::ResourceExhausted
    );
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    assert!(
        metrics.contains("kvroute_extproc_stream_refusals_total{kind=\"max_streams\"} 1"),
        "{metrics}"
    );

    // The held stream still works: its late response is answered, and nothing is released twice.
    held.send(response_headers(&r.endpoint)).await;
    assert!(matches!(
        held.recv().await.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ));
    assert_eq!(load.snapshot().inflight_requests, 0.0);
    drop((held, second));
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn index_calls_carry_the_configured_query_token() {
    let replicas = Replicas::start().await;
    let harness = Harness::start(&replicas.yaml(""), Arc::new(ByteTokenizer)).await;
    buffered(&harness, "/v1/completions", &completion("no token"), None).await;
    harness.shutdown().await;
    assert_eq!(replicas.index.authorizations.lock().as_slice(), [None]);

    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("query-token");
    std::fs::write(&token_file, "q-t0ken\n").unwrap();
    let yaml = replicas.yaml("").replace(
        "match_timeout: 200ms}",
        &format!(
            "match_timeout: 200ms, token_file: \"{}\"}}",
            token_file.display()
        ),
    );
    let harness = Harness::start(&yaml, Arc::new(ByteTokenizer)).await;
    buffered(&harness, "/v1/completions", &completion("with token"), None).await;
    harness.shutdown().await;
    assert_eq!(
        replicas
            .index
            .authorizations
            .lock()
            .last()
            .cloned()
            .flatten()
            .as_deref(),
        Some("Bearer q-t0ken")
    );
    replicas.stop.cancel();
}

/// A prefill engine double for `disaggregation.mode: envoy`: answers each POST with the next
/// scripted status (then 200), a 200 carrying `params` (or no `kv_transfer_params` when `None`),
/// and records what it got: path, headers, body.
#[derive(Clone)]
struct FakePrefill {
    addr: SocketAddr,
    script: Arc<Mutex<std::collections::VecDeque<u16>>>,
    params: Arc<Mutex<Option<serde_json::Value>>>,
    seen: Arc<Mutex<Vec<SeenLeg>>>,
}

#[derive(Debug, Clone)]
struct SeenLeg {
    path: String,
    headers: HashMap<String, String>,
    body: serde_json::Value,
}

impl FakePrefill {
    async fn start(stop: CancellationToken) -> Self {
        use axum::extract::State;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake = Self {
            addr: listener.local_addr().unwrap(),
            script: Arc::default(),
            params: Arc::new(Mutex::new(Some(serde_json::json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "prefill-0",
                "remote_host": "10.0.0.3", "remote_port": 5600, "tp_size": 1})))),
            seen: Arc::default(),
        };
        let app = axum::Router::new()
            .fallback(
                |State(fake): State<FakePrefill>,
                 uri: axum::http::Uri,
                 headers: axum::http::HeaderMap,
                 body: bytes::Bytes| async move {
                    fake.seen.lock().push(SeenLeg {
                        path: uri.path_and_query().unwrap().to_string(),
                        headers: headers
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
                            .collect(),
                        body: serde_json::from_slice(&body).unwrap(),
                    });
                    let status = fake.script.lock().pop_front().unwrap_or(200);
                    let mut answer = serde_json::json!({"id": "chatcmpl-x", "choices": []});
                    if let Some(params) = fake.params.lock().clone() {
                        answer["kv_transfer_params"] = params;
                    }
                    (
                        axum::http::StatusCode::from_u16(status).unwrap(),
                        answer.to_string(),
                    )
                },
            )
            .with_state(fake.clone());
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .unwrap()
        });
        fake
    }

    fn take_seen(&self) -> Vec<SeenLeg> {
        std::mem::take(&mut *self.seen.lock())
    }
}

/// `replicas`' config with r0 and r1 decoding and r2, at `prefill`, computing prompts, split
/// by `disaggregation` from 600 tokens when 300 are uncached.
fn envoy_mode_yaml(replicas: &Replicas, prefill: SocketAddr, disaggregation: &str) -> String {
    replicas
        .yaml("")
        .replace(
            "  key_scheme: {kind: token-chain}\n",
            &format!(
                "  key_scheme: {{kind: token-chain}}\n  disaggregation: {{mode: envoy, \
                 min_prompt_tokens: 600, min_uncached_tokens: 300, {disaggregation}}}\n"
            ),
        )
        .replace(
            "address: \"10.0.0.3:8000\",",
            &format!("address: \"{prefill}\", role: prefill,"),
        )
        .replace(
            "address: \"10.0.0.1:8000\",",
            "address: \"10.0.0.1:8000\", role: decode,",
        )
        .replace(
            "address: \"10.0.0.2:8000\",",
            "address: \"10.0.0.2:8000\", role: decode,",
        )
}

/// A streamed chat of about 800 uncached tokens, distinct per `seed`, with every field the
/// prefill leg changes.
fn long_chat(seed: u32) -> Vec<u8> {
    let document: String = (0..120).map(|i| format!("w{seed}x{i} ")).collect();
    serde_json::to_vec(&serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": document}],
        "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 2, "temperature": 0.5}))
    .unwrap()
}

/// `client` with `params` (JSON text) appended as its `kv_transfer_params`, byte for byte.
fn with_params(client: &[u8], params: &str) -> Vec<u8> {
    let mut expected = client[..client.len() - 1].to_vec();
    expected.extend_from_slice(format!(",\"kv_transfer_params\":{params}}}").as_bytes());
    expected
}

fn prefill_leg_count(metrics: &str, outcome: &str) -> u64 {
    metric_value(
        metrics,
        &format!(
            "kvroute_extproc_disaggregation_prefill_legs_total{{pool=\"p\",outcome=\"{outcome}\"}} "
        ),
    )
}

fn metric_value(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series))
        .map_or(0, |value| value.trim().parse().unwrap())
}

/// Asserts the leg `seen` is the prefill leg of `client` on `path`: NixlConnector's fields, no
/// client header; its request id.
fn assert_prefill_leg(seen: &SeenLeg, client: &[u8], path: &str) -> String {
    assert_eq!(seen.path, path);
    let mut expected: serde_json::Value = serde_json::from_slice(client).unwrap();
    let fields = expected.as_object_mut().unwrap();
    for removed in ["stream_options", "min_tokens"] {
        fields.remove(removed);
    }
    fields.insert("stream".into(), false.into());
    fields.insert("max_tokens".into(), 1.into());
    fields.insert("max_completion_tokens".into(), 1.into());
    fields.insert(
        "kv_transfer_params".into(),
        serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null}),
    );
    assert_eq!(seen.body, expected);
    assert_eq!(seen.headers["content-type"], "application/json");
    assert!(
        !seen.headers.contains_key("authorization"),
        "no client header goes with the leg: {:?}",
        seen.headers
    );
    seen.headers["x-request-id"].clone()
}

#[tokio::test]
async fn envoy_mode_runs_the_prefill_leg_and_the_decode_replica_gets_its_params() {
    let replicas = Replicas::start().await;
    let prefill = FakePrefill::start(replicas.stop.clone()).await;
    let yaml = envoy_mode_yaml(&replicas, prefill.addr, "prefill_retries: 2");
    let harness = Harness::start(&yaml, Arc::new(ByteTokenizer)).await;
    let params = prefill.params.lock().clone().unwrap().to_string();
    let path = "/v1/chat/completions?trace=1";
    let client_headers = [("authorization", "Bearer client-secret")];

    // BUFFERED, the prefill first answering 503: tried again with the same id, then the
    // decode replica gets the client's body plus the parameters, its new length, the same id.
    prefill.script.lock().push_back(503);
    let client = long_chat(1);
    let mut stream = Stream::open(&harness).await;
    stream
        .send(request_headers_with(
            path,
            BodySendMode::Buffered,
            None,
            &client_headers,
        ))
        .await;
    stream.recv().await;
    stream.send(body(&client, true)).await;
    let answer = stream.recv().await;
    let seen = prefill.take_seen();
    assert_eq!(seen.len(), 2, "one retry after the 503: {seen:?}");
    let request_id = assert_prefill_leg(&seen[0], &client, path);
    assert_eq!(assert_prefill_leg(&seen[1], &client, path), request_id);
    let decode = routed(&answer).endpoint;
    assert!(
        ["10.0.0.1:8000", "10.0.0.2:8000"].contains(&decode.as_str()),
        "{decode}"
    );
    let (set, removed) = header_mutation(&answer);
    let expected = with_params(&client, &params);
    assert_eq!(set["x-request-id"], request_id);
    assert_eq!(set["content-length"], expected.len().to_string());
    assert!(!set.contains_key(PREFILLER_HEADER), "{set:?}");
    assert!(removed.iter().any(|h| h == PREFILLER_HEADER), "{removed:?}");
    let Some(processing_response::Response::RequestBody(b)) = &answer.response else {
        panic!("{answer:?}")
    };
    let Some(body_mutation::Mutation::Body(mutated)) = b
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.clone())
    else {
        panic!("no body mutation: {answer:?}")
    };
    assert_eq!(
        String::from_utf8(mutated).unwrap(),
        String::from_utf8(expected).unwrap()
    );

    // FULL_DUPLEX: the echoed body is the decode leg's, content-length removed.
    let client = long_chat(2);
    let mut stream = Stream::open(&harness).await;
    stream
        .send(request_headers_with(
            "/v1/chat/completions",
            BodySendMode::FullDuplexStreamed,
            None,
            &client_headers,
        ))
        .await;
    stream.send(body(&client, true)).await;
    let headers = stream.recv().await;
    let Some(processing_response::Response::RequestHeaders(h)) = &headers.response else {
        panic!("{headers:?}")
    };
    let common = h.response.clone().unwrap();
    let seen = prefill.take_seen();
    assert_eq!(seen.len(), 1);
    let request_id = assert_prefill_leg(&seen[0], &client, "/v1/chat/completions");
    assert_eq!(set_headers(&common)["x-request-id"], request_id);
    let mutation = common.header_mutation.unwrap();
    assert!(
        mutation
            .remove_headers
            .iter()
            .any(|h| h == "content-length")
    );
    let mut echoed = Vec::new();
    loop {
        let Some(processing_response::Response::RequestBody(b)) = stream.recv().await.response
        else {
            panic!("expected the body echo")
        };
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("expected streamed_response")
        };
        echoed.extend_from_slice(&chunk.body);
        if chunk.end_of_stream {
            break;
        }
    }
    assert_eq!(echoed, with_params(&client, &params));

    // A prefill answering without parameters, or an error that is not transient: served whole
    // (no body mutation, no request id), each counted.
    *prefill.params.lock() = None;
    let whole = buffered(&harness, "/v1/chat/completions", &long_chat(3), None).await;
    *prefill.params.lock() = Some(serde_json::from_str(&params).unwrap());
    prefill.script.lock().push_back(500);
    let refused = buffered(&harness, "/v1/chat/completions", &long_chat(4), None).await;
    assert_eq!(prefill.take_seen().len(), 2, "a 500 is not tried again");
    for answer in [&whole, &refused] {
        let (set, _) = header_mutation(answer);
        assert!(!set.contains_key("x-request-id"), "{set:?}");
        let Some(processing_response::Response::RequestBody(b)) = &answer.response else {
            panic!("{answer:?}")
        };
        assert!(b.response.as_ref().unwrap().body_mutation.is_none());
        assert!(["10.0.0.1:8000", "10.0.0.2:8000"].contains(&routed(answer).endpoint.as_str()));
    }

    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    assert_eq!(prefill_leg_count(&metrics, "ok"), 2, "{metrics}");
    assert_eq!(prefill_leg_count(&metrics, "no_kv_transfer_params"), 1);
    assert_eq!(prefill_leg_count(&metrics, "status"), 1);
    assert_eq!(
        metric_value(
            &metrics,
            "kvroute_extproc_disaggregation_prefill_retries_total{pool=\"p\"} "
        ),
        1
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}

#[tokio::test]
async fn envoy_mode_serves_whole_on_the_decode_replica_when_the_prefill_replica_is_dead() {
    let replicas = Replicas::start().await;
    // A port nothing listens on.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let yaml = envoy_mode_yaml(&replicas, dead, "prefill_retries: 2");
    let harness = Harness::start(&yaml, Arc::new(ByteTokenizer)).await;
    let answer = buffered(&harness, "/v1/chat/completions", &long_chat(1), None).await;
    let (set, removed) = header_mutation(&answer);
    assert!(!set.contains_key("x-request-id"), "{set:?}");
    assert!(!set.contains_key(PREFILLER_HEADER), "{set:?}");
    assert!(removed.iter().any(|h| h == PREFILLER_HEADER));
    let Some(processing_response::Response::RequestBody(b)) = &answer.response else {
        panic!("{answer:?}")
    };
    assert!(b.response.as_ref().unwrap().body_mutation.is_none());
    assert!(["10.0.0.1:8000", "10.0.0.2:8000"].contains(&routed(&answer).endpoint.as_str()));
    let metrics = kvroute_test_support::http_get(harness.admin, "/metrics").await;
    assert_eq!(prefill_leg_count(&metrics, "connect_error"), 1, "{metrics}");
    assert_eq!(
        metric_value(
            &metrics,
            "kvroute_extproc_disaggregation_decisions_total{pool=\"p\",decision=\"split\"} "
        ),
        1
    );
    assert_eq!(
        metric_value(
            &metrics,
            "kvroute_extproc_disaggregation_prefill_retries_total{pool=\"p\"} "
        ),
        2,
        "a refused connection is tried again"
    );
    harness.shutdown().await;
    replicas.stop.cancel();
}
