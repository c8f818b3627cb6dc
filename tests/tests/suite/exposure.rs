//! What kvroute exposes to the network by default: every listener binds loopback
//! unless configured, so another host cannot reach ext_proc, the admin ports or the index's query
//! API; and through Envoy a client learns nothing about what is cached unless ext-proc's
//! `debug_headers` let it (a trusted token, or a deployment that opts in).
//!
//! A listener's reachability is checked from this host's own non-loopback IPv4 address, found
//! without sending a packet (a UDP socket `connect` only picks the route); a host without one
//! skips that half of the check and says so.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use kvroute_ext_proc::ExtProc;
use kvroute_ext_proc::server::{DECISION_HEADER, PREDICTED_CACHED_HEADER};
use kvroute_test_support::{deadline, poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::harness::http::HttpResponse;
use kvroute_tests::stack::{
    DEBUG_TOKEN_HEADER, DebugHeaders, EXT_PROC_CLUSTER, MODEL, Stack, StackOptions,
};
use serde_json::json;

use super::common::index_blocks;
use super::routing::{route_response, text};

/// How long a connection attempt to our own address may take before it counts as not refused.
fn connect_timeout() -> Duration {
    deadline(Duration::from_secs(2))
}

/// An ext-proc config with nothing but a pool and a replica: every other key at its default.
const EXT_PROC_DEFAULTS: &str = r#"
pools:
- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}
replicas:
- {id: r0, pool: p, address: "127.0.0.1:8000"}
"#;

/// A kvroute-index config with nothing but a pool and a replica (whose engine is absent).
const INDEX_DEFAULTS: &str = r#"
pools:
- {name: m, models: [m], block_size: 16, key_scheme: {kind: token-chain}}
replicas:
- {id: r0, pool: m, events: {endpoint: "tcp://127.0.0.1:9"}}
"#;

/// This host's address on the route to a private network, if it has one that is not loopback.
/// `connect` on a UDP socket sends nothing: it only fixes the local address the kernel would use.
pub fn non_loopback_ipv4() -> Option<Ipv4Addr> {
    ["10.254.254.254:9", "192.168.254.254:9", "172.31.254.254:9"]
        .iter()
        .find_map(|target| {
            let socket = UdpSocket::bind("0.0.0.0:0").ok()?;
            socket.connect(target).ok()?;
            match socket.local_addr().ok()?.ip() {
                IpAddr::V4(ip) if !ip.is_loopback() && !ip.is_unspecified() => Some(ip),
                _ => None,
            }
        })
}

/// Whether a TCP connection to `ip` on `bound`'s port is refused.
fn refused_from(ip: Ipv4Addr, bound: SocketAddr) -> bool {
    let target = SocketAddr::from((ip, bound.port()));
    match TcpStream::connect_timeout(&target, connect_timeout()) {
        Ok(_) => false,
        Err(error) => error.kind() == std::io::ErrorKind::ConnectionRefused,
    }
}

/// The default host of each listener, with port 0 so the test never takes a fixed port.
fn with_ephemeral_port(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip(), 0)
}

/// Checks `bound` listeners are loopback and unreachable from this host's other address.
fn assert_loopback_only(what: &str, bound: &[SocketAddr]) {
    for addr in bound {
        assert!(
            addr.ip().is_loopback(),
            "{what} listens on {addr} by default"
        );
    }
    let Some(ip) = non_loopback_ipv4() else {
        eprintln!("{what}: no non-loopback IPv4 address on this host; reachability not checked");
        return;
    };
    for addr in bound {
        assert!(
            refused_from(ip, *addr),
            "{what}: {ip}:{} was not refused (listening on {addr})",
            addr.port()
        );
    }
}

#[tokio::test]
async fn ext_proc_listens_on_loopback_only_by_default() {
    let mut config = kvroute_ext_proc::Config::from_yaml(EXT_PROC_DEFAULTS).unwrap();
    config.grpc_addr = with_ephemeral_port(config.grpc_addr);
    config.admin_addr = with_ephemeral_port(config.admin_addr);
    let server = ExtProc::builder(config).bind().await.unwrap();
    let bound = [server.grpc_addr().unwrap(), server.admin_addr().unwrap()];
    assert_loopback_only("kvroute-ext-proc", &bound);

    // The check can fail: the same server told to listen everywhere is reachable.
    let Some(ip) = non_loopback_ipv4() else {
        return;
    };
    let mut open = kvroute_ext_proc::Config::from_yaml(EXT_PROC_DEFAULTS).unwrap();
    open.grpc_addr = "0.0.0.0:0".parse().unwrap();
    open.admin_addr = "0.0.0.0:0".parse().unwrap();
    let server = ExtProc::builder(open).bind().await.unwrap();
    assert!(!refused_from(ip, server.grpc_addr().unwrap()));
}

#[tokio::test]
async fn index_listens_on_loopback_only_by_default() {
    let mut config = kvroute_index::config::Config::from_yaml(INDEX_DEFAULTS).unwrap();
    config.grpc_addr = with_ephemeral_port(config.grpc_addr);
    config.admin_addr = with_ephemeral_port(config.admin_addr);
    let index = kvroute_index::server::IndexServer::start(config)
        .await
        .unwrap();
    assert_loopback_only("kvroute-index", &[index.grpc_addr(), index.admin_addr()]);
    index.shutdown().await;

    let agent_admin: SocketAddr = kvroute_agent::config::DEFAULT_ADMIN_ADDR.parse().unwrap();
    assert!(
        agent_admin.ip().is_loopback(),
        "kvroute-agent's admin default is {agent_admin}"
    );
}

/// Response headers whose values differ between any two responses, cached or not.
const VOLATILE_HEADERS: [&str; 3] = ["date", "x-envoy-upstream-service-time", "content-length"];
/// How long the index may take to hold the first request's blocks.
fn indexed() -> Duration {
    deadline(Duration::from_secs(20))
}

/// A stack of two sims behind the production Envoy config, with `debug_headers`.
async fn start(debug_headers: DebugHeaders) -> Stack {
    Stack::start(StackOptions {
        replicas: 2,
        debug_headers,
        ..StackOptions::default()
    })
    .await
    .unwrap()
}

/// One completion through kvroute: the replica that served it, the response, and the prompt
/// tokens the engine found cached (the engine's own count, in its body).
async fn complete(
    stack: &Stack,
    prompt: &str,
    headers: &[(&str, &str)],
) -> (usize, HttpResponse, u64) {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let (replica, response) = route_response(stack, "/v1/completions", &body, headers).await;
    let cached = response.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (replica, response, cached)
}

/// Warms a prefix on one replica and waits until the index holds its blocks, so the next
/// sibling is a precise cache hit; returns the prefix and the miss's response.
async fn warm(stack: &Stack, seed: u64, headers: &[(&str, &str)]) -> (String, HttpResponse) {
    let prefix = text(seed, 150);
    let (replica, miss, cached) = complete(stack, &format!("{prefix} q0"), headers).await;
    assert_eq!(
        cached, 0,
        "the first request of a new prefix found it cached"
    );
    let admin = stack.index_admin_url().unwrap();
    let id = &stack.replica_ids()[replica];
    poll_until("the index holds the warmed prefix", indexed(), || async {
        index_blocks(&admin, id).await.filter(|b| !b.is_empty())
    })
    .await;
    (prefix, miss)
}

/// Every response header but the volatile ones, by name.
fn stable_headers(response: &HttpResponse) -> BTreeMap<String, String> {
    response
        .headers
        .iter()
        .filter(|(name, _)| !VOLATILE_HEADERS.contains(&name.as_str()))
        .map(|(name, value)| {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            (name.as_str().to_owned(), value)
        })
        .collect()
}

fn header<'a>(response: &'a HttpResponse, name: &str) -> Option<&'a str> {
    response.headers.get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test]
async fn default_config_tells_a_client_nothing_about_cache_state() {
    let stack = start(DebugHeaders::Off).await;
    let (prefix, miss) = warm(&stack, 131, &[]).await;
    let (_, hit, cached) = complete(&stack, &format!("{prefix} q1"), &[]).await;
    assert!(
        cached > 0,
        "the sibling was not a cache hit\n{}",
        stack.logs()
    );
    let metrics = http::get(&format!("{}/metrics", stack.ext_proc_admin_url().unwrap()))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("reason=\"cache_hit\""),
        "kvroute did not decide on a cache hit, so the comparison shows nothing\n{metrics}"
    );

    for response in [&miss, &hit] {
        let leaked: Vec<&str> = response
            .headers
            .keys()
            .map(|name| name.as_str())
            .filter(|name| name.starts_with("x-kvroute") || name.starts_with("x-gateway"))
            .collect();
        assert!(
            leaked.is_empty(),
            "routing headers on a response: {leaked:?}"
        );
    }
    assert_eq!(
        stable_headers(&miss),
        stable_headers(&hit),
        "a miss and a hit differ in what the client sees"
    );
}

#[tokio::test]
async fn debug_headers_need_the_configured_token() {
    const TOKEN: &str = "t0ken-for-tests";
    let stack = start(DebugHeaders::Token(TOKEN.to_owned())).await;
    let (prefix, _) = warm(&stack, 137, &[]).await;

    let (_, trusted, _) = complete(
        &stack,
        &format!("{prefix} q1"),
        &[(DEBUG_TOKEN_HEADER, TOKEN)],
    )
    .await;
    let decision = header(&trusted, DECISION_HEADER).unwrap_or_default();
    assert!(
        decision.starts_with("precise/"),
        "decision {decision:?}\n{}",
        stack.logs()
    );
    let predicted: u64 = header(&trusted, PREDICTED_CACHED_HEADER)
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(predicted > 0);

    for presented in [
        &[(DEBUG_TOKEN_HEADER, "t0ken-for-test")][..],
        &[(DEBUG_TOKEN_HEADER, "")],
        &[],
    ] {
        let (_, response, _) = complete(&stack, &format!("{prefix} q2"), presented).await;
        for name in [DECISION_HEADER, PREDICTED_CACHED_HEADER] {
            assert_eq!(header(&response, name), None, "{name} with {presented:?}");
        }
    }
    let metrics = http::get(&format!("{}/metrics", stack.ext_proc_admin_url().unwrap()))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("kvroute_extproc_debug_header_requests_total{kind=\"wrong_token\"} 2"),
        "{metrics}"
    );
}

/// A kvroute-index on loopback whose query API needs `token`; its admin URL and gRPC address.
async fn index_with_query_token(
    dir: &std::path::Path,
    token: &str,
) -> kvroute_index::server::IndexServer {
    let token_file = dir.join("query-token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let yaml = format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n{INDEX_DEFAULTS}\
         query_auth: {{token_file: \"{}\"}}\n\
         readiness: {{min_ready_replicas: 0}}\n",
        token_file.display()
    );
    kvroute_index::server::IndexServer::start(
        kvroute_index::config::Config::from_yaml(&yaml).unwrap(),
    )
    .await
    .unwrap()
}

/// `GET`/`POST` `url` with an optional `authorization` value: the status code.
async fn admin_status(url: &str, post: Option<&str>, authorization: Option<&str>) -> u16 {
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let mut request = match post {
        Some(_) => hyper::Request::post(url).header("content-type", "application/json"),
        None => hyper::Request::get(url),
    };
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let body = Full::new(bytes::Bytes::from(post.unwrap_or_default().to_owned()));
    let client = Client::builder(TokioExecutor::new()).build_http();
    client
        .request(request.body(body).unwrap())
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn index_query_api_needs_the_token_when_configured() {
    use kvroute_index_api::api::kv_index_client::KvIndexClient;
    use kvroute_index_api::api::{MatchRequest, ReplicaStateRequest};

    const TOKEN: &str = "query-t0ken";
    let dir = tempfile::tempdir().unwrap();
    let index = index_with_query_token(dir.path(), TOKEN).await;
    let admin = format!("http://{}", index.admin_addr());
    let right = format!("Bearer {TOKEN}");

    // gRPC: Match and ReplicaState answer only with the token.
    let mut client = KvIndexClient::connect(format!("http://{}", index.grpc_addr()))
        .await
        .unwrap();
    let ask = |authorization: Option<&str>| {
        let mut request = tonic::Request::new(MatchRequest {
            model: "m".to_owned(),
            keys: vec![1, 2, 3],
            ..MatchRequest::default()
        });
        if let Some(value) = authorization {
            request
                .metadata_mut()
                .insert("authorization", value.parse().unwrap());
        }
        request
    };
    for (authorization, allowed) in [
        (None, false),
        (Some("query-t0ken"), false),
        (Some("Bearer query-t0ke"), false),
        (Some(right.as_str()), true),
    ] {
        let answer = client.r#match(ask(authorization)).await;
        match (allowed, answer) {
            (true, Ok(_)) => {}
            (false, Err(status)) => assert_eq!(status.code(), tonic::Code::Unauthenticated),
            (allowed, answer) => panic!("{authorization:?}: allowed {allowed}, got {answer:?}"),
        }
    }
    let status = client
        .replica_state(ReplicaStateRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let mut with_token = tonic::Request::new(ReplicaStateRequest::default());
    with_token
        .metadata_mut()
        .insert("authorization", right.parse().unwrap());
    assert_eq!(
        client
            .replica_state(with_token)
            .await
            .unwrap()
            .into_inner()
            .replicas
            .len(),
        1
    );

    // Admin: the cache-state endpoints need it, the probes and /metrics do not.
    let matched = r#"{"model":"m","prompt_keys":[1,2,3]}"#;
    for (path, post) in [
        ("/v1/replicas", None),
        ("/v1/replicas/r0/blocks", None),
        ("/v1/replicas/r0/groups", None),
        ("/v1/match", Some(matched)),
    ] {
        let url = format!("{admin}{path}");
        assert_eq!(admin_status(&url, post, None).await, 401, "{path}");
        assert_eq!(
            admin_status(&url, post, Some("Bearer nope")).await,
            401,
            "{path}"
        );
        assert_eq!(admin_status(&url, post, Some(&right)).await, 200, "{path}");
    }
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(
            admin_status(&format!("{admin}{path}"), None, None).await,
            200,
            "{path}"
        );
    }

    // ext-proc's index client sends the token from its config, and only the right one passes.
    let uri: hyper::Uri = format!("http://{}", index.grpc_addr()).parse().unwrap();
    let asked = |token: &'static str| {
        let uri = uri.clone();
        async move {
            let token = kvroute_runtime::token::AgentToken::from_literal(token);
            let client = kvroute_ext_proc::index_client::IndexClient::new(
                &[uri],
                Duration::from_secs(1),
                None,
            )
            .with_token(Some(&token));
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            client.match_prefix(ask(None).into_inner(), deadline).await
        }
    };
    assert!(asked(TOKEN).await.is_ok());
    assert!(asked("wrong").await.is_err());

    let metrics = http::get(&format!("{admin}/metrics")).await.unwrap().text();
    for (api, reason, count) in [
        ("grpc", "missing", 2),
        ("grpc", "malformed", 1),
        // One from this test's client, two from ext-proc's (its last-resort pass retries the
        // address that just failed).
        ("grpc", "wrong_token", 3),
        // One per admin `/v1/*` path above.
        ("http", "missing", 4),
        ("http", "wrong_token", 4),
    ] {
        let line = format!(
            "kvroute_index_query_auth_refusals_total{{api=\"{api}\",reason=\"{reason}\"}} {count}"
        );
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    index.shutdown().await;
}

/// A CA, a `localhost` server certificate and a client certificate it signs, as PEM files.
struct Pki {
    ca: std::path::PathBuf,
    server_cert: std::path::PathBuf,
    server_key: std::path::PathBuf,
    client_cert: std::path::PathBuf,
    client_key: std::path::PathBuf,
}

fn pki(dir: &std::path::Path) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    // Distinct subject names: with rcgen's shared default, BoringSSL (Envoy) takes a leaf for
    // self-signed and refuses it.
    let named = |names: Vec<String>, cn: &str| {
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = named(Vec::new(), "kvroute test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = named(vec![name.to_owned()], name)
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf("localhost");
    let (client_cert, client_key) = leaf("envoy");
    let pki = Pki {
        ca: dir.join("ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server-key.pem"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client-key.pem"),
    };
    for (path, pem) in [
        (&pki.ca, ca.pem()),
        (&pki.server_cert, server_cert),
        (&pki.server_key, server_key),
        (&pki.client_cert, client_cert),
        (&pki.client_key, client_key),
    ] {
        std::fs::write(path, pem).unwrap();
    }
    pki
}

/// An upstream answering every request with the `x-kvroute-decision` it was sent (JSON).
async fn decision_echo(tasks: &tokio_util::task::TaskTracker) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|headers: axum::http::HeaderMap| async move {
        let decision = headers
            .get(DECISION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        axum::Json(json!({ "decision": decision }))
    });
    tasks.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// The production override_host config with ext-proc reached over mutual TLS.
fn envoy_over_tls(upstream: SocketAddr, ext_proc: SocketAddr, pki: &Pki) -> String {
    let text = std::fs::read_to_string(
        kvroute_tests::harness::workspace_root().join(kvroute_tests::stack::OVERRIDE_HOST_CONFIG),
    )
    .unwrap();
    let rendered = kvroute_tests::stack::render_envoy_config(&text, &[upstream], ext_proc).unwrap();
    let mut config: serde_yaml::Value = serde_yaml::from_str(&rendered).unwrap();
    let transport_socket: serde_yaml::Value = serde_yaml::from_str(&format!(
        r#"
name: envoy.transport_sockets.tls
typed_config:
  "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
  sni: localhost
  common_tls_context:
    alpn_protocols: [h2]
    tls_certificates:
    - certificate_chain: {{filename: "{cert}"}}
      private_key: {{filename: "{key}"}}
    validation_context:
      trusted_ca: {{filename: "{ca}"}}
      match_typed_subject_alt_names: [{{san_type: DNS, matcher: {{exact: localhost}}}}]
"#,
        cert = pki.client_cert.display(),
        key = pki.client_key.display(),
        ca = pki.ca.display(),
    ))
    .unwrap();
    let clusters = config["static_resources"]["clusters"]
        .as_sequence_mut()
        .unwrap();
    let cluster = clusters
        .iter_mut()
        .find(|c| c["name"] == "kvroute_ext_proc")
        .unwrap();
    cluster["transport_socket"] = transport_socket;
    serde_yaml::to_string(&config).unwrap()
}

/// Whether an ext_proc stream can be opened with `channel` (a refused handshake fails it).
async fn ext_proc_answers(
    channel: Result<tonic::transport::Channel, tonic::transport::Error>,
) -> bool {
    use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    let Ok(channel) = channel else {
        return false;
    };
    let (_tx, rx) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
    let mut client = ExternalProcessorClient::new(channel);
    let call = client.process(tokio_stream::wrappers::ReceiverStream::new(rx));
    matches!(
        tokio::time::timeout(connect_timeout(), call).await,
        Ok(Ok(_))
    )
}

#[tokio::test]
async fn ext_proc_over_mutual_tls_routes_for_envoy_and_refuses_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let tasks = tokio_util::task::TaskTracker::new();
    let upstream = decision_echo(&tasks).await;
    let yaml = format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\", \
         tls: {{cert: \"{}\", key: \"{}\", client_ca: \"{}\"}}}}\n\
         pools:\n- {{name: p, models: [m], block_size: 16, key_scheme: {{kind: token-chain}}}}\n\
         replicas:\n- {{id: r0, pool: p, address: \"{upstream}\"}}\n",
        pki.server_cert.display(),
        pki.server_key.display(),
        pki.ca.display(),
    );
    let server = ExtProc::builder(kvroute_ext_proc::Config::from_yaml(&yaml).unwrap())
        .bind()
        .await
        .unwrap();
    let grpc = server.grpc_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let until = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        let _ = server.serve(until).await;
    });

    // Envoy with a client certificate: its ext_proc calls decide over TLS (a failed handshake
    // would fail open, and the upstream would see no decision).
    let envoy = kvroute_tests::harness::Envoy::start(&envoy_over_tls(upstream, grpc, &pki))
        .await
        .unwrap();
    let admin = format!("http://{}", envoy.admin);
    let ready = envoy
        .wait_endpoint_healthy(EXT_PROC_CLUSTER, grpc, indexed())
        .await;
    if let Err(error) = ready {
        let stats = http::get(&format!("{admin}/stats?filter=kvroute_ext_proc"))
            .await
            .map(|r| r.text())
            .unwrap_or_default();
        panic!("{error}\n{stats}\n{}", envoy.log());
    }
    let url = format!(
        "http://{}/v1/completions",
        envoy
            .listener(kvroute_tests::stack::KVROUTE_LISTENER)
            .unwrap()
    );
    let response = http::post_json(
        &url,
        &json!({"model": "m", "prompt": "hello", "max_tokens": 1}),
    )
    .await
    .unwrap();
    let decision = response.json().unwrap()["decision"].clone();
    assert!(
        decision.as_str().is_some_and(|d| d.starts_with("load/")),
        "upstream saw decision {decision}\n{}",
        envoy.log()
    );

    // Plaintext, and TLS without a client certificate, are refused.
    let plaintext = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await;
    assert!(
        !ext_proc_answers(plaintext).await,
        "a plaintext client got a stream"
    );
    let anonymous = kvroute_runtime::tls::ClientTls::load(
        &kvroute_config::RawClientTls {
            ca: pki.ca.display().to_string(),
            server_name: Some("localhost".to_owned()),
            ..kvroute_config::RawClientTls::default()
        },
        "tls",
    )
    .unwrap();
    let https = tonic::transport::Endpoint::from_shared(format!("https://{grpc}")).unwrap();
    let no_client_cert = match anonymous.apply(https.clone()) {
        Ok(endpoint) => endpoint.connect().await,
        Err(error) => Err(error),
    };
    assert!(
        !ext_proc_answers(no_client_cert).await,
        "a client without a certificate got a stream"
    );
    // The same client with the certificate gets one (the refusals above are about credentials).
    let identified = kvroute_runtime::tls::ClientTls::load(
        &kvroute_config::RawClientTls {
            ca: pki.ca.display().to_string(),
            server_name: Some("localhost".to_owned()),
            cert: Some(pki.client_cert.display().to_string()),
            key: Some(pki.client_key.display().to_string()),
        },
        "tls",
    )
    .unwrap();
    let channel = match identified.apply(https) {
        Ok(endpoint) => endpoint.connect().await,
        Err(error) => Err(error),
    };
    assert!(ext_proc_answers(channel).await);

    stop.cancel();
    drop(envoy);
    tasks.close();
}
