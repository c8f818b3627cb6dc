//! A double of llm-d's `pd-sidecar`, the proxy on every decode pod of an llm-d prefill/decode
//! deployment (Go, not runnable here), speaking its protocol as llm-d documents it
//! (`docs/disaggregation.md`, `pkg/sidecar/proxy/connector_nixlv2.go`) and vLLM's own proxy
//! drives NixlConnector (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):
//!
//! - a request without `x-prefiller-host-port` goes to the local engine as it came;
//! - with it, the header is removed and two legs run: the **prefill leg** to the first `ip:port`
//!   it names, on the request's own path, with the client's body but `kv_transfer_params:
//!   {do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null,
//!   remote_block_ids: null, remote_host: null, remote_port: null}`, `stream: false`,
//!   `stream_options` removed and every token limit (`max_tokens`, `max_completion_tokens`,
//!   `max_output_tokens`) set to 1, retried on 502/503/504; then the **decode leg** to the local
//!   engine with the client's body plus the `kv_transfer_params` the prefill answered, its
//!   answer (stream or not) passed back. Both legs carry one `X-Request-Id`.
//!
//! A prefill leg that fails (after its retries) answers the client 502, as a sidecar that cannot
//! reach its prefiller does; kvroute's part is to name only ready prefill replicas. Every
//! request is recorded ([`PdSidecar::handled`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::HarnessError;

/// The header naming the prefill replica, as llm-d's EPP sets it.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// Attempts of a prefill leg answered 502/503/504.
const PREFILL_ATTEMPTS: usize = 3;
/// Largest request body read.
const MAX_BODY_BYTES: usize = 64 << 20;

/// What the double did with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled {
    /// The request's path.
    pub path: String,
    /// The prefill replica it named (`None`: served by the local engine alone).
    pub prefiller: Option<String>,
    /// The prefill leg's final status (`None` without one, or when it could not connect).
    pub prefill_status: Option<u16>,
    /// The `X-Request-Id` both legs carried.
    pub request_id: Option<String>,
}

#[derive(Debug)]
struct Shared {
    decode: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    handled: Mutex<Vec<Handled>>,
    next_id: AtomicU64,
}

/// A running double in front of one decode engine.
#[derive(Debug)]
pub struct PdSidecar {
    addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl PdSidecar {
    /// Listens on a free 127.0.0.1 port and proxies to the engine at `decode`.
    pub async fn start(decode: SocketAddr) -> Result<Self, HarnessError> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|source| HarnessError::Io {
                path: "pd-sidecar listener".into(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| HarnessError::Io {
            path: "pd-sidecar listener".into(),
            source,
        })?;
        let shared = Arc::new(Shared {
            decode,
            client: Client::builder(TokioExecutor::new()).build_http(),
            handled: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
        });
        let app = axum::Router::new()
            .fallback(proxy)
            .with_state(Arc::clone(&shared));
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        #[expect(
            clippy::disallowed_methods,
            reason = "test double: the task is owned by PdSidecar and aborted on drop"
        )]
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        Ok(Self {
            addr,
            shared,
            cancel,
            task,
        })
    }

    /// Where it listens (the decode replica's address as the proxy and kvroute see it).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every request handled so far, in order.
    pub fn handled(&self) -> Vec<Handled> {
        self.shared.handled.lock().clone()
    }

    /// The last inference request handled: kvroute scrapes the engine's `/metrics` through the
    /// sidecar whenever its scrape loop runs, so the last request of all may be a scrape.
    pub fn last_inference(&self) -> Option<Handled> {
        self.shared
            .handled
            .lock()
            .iter()
            .rev()
            .find(|handled| handled.path != "/metrics")
            .cloned()
    }
}

impl Drop for PdSidecar {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.task.abort();
    }
}

/// The prefill leg's body: the client's, asking for the prompt's KV to be kept for a remote
/// decode and one token.
pub fn prefill_body(client: &Value) -> Value {
    let mut body = client.clone();
    if let Some(object) = body.as_object_mut() {
        object.insert(
            "kv_transfer_params".to_owned(),
            json!({
                "do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null,
            }),
        );
        object.insert("stream".to_owned(), Value::Bool(false));
        object.remove("stream_options");
        for limit in ["max_tokens", "max_completion_tokens", "max_output_tokens"] {
            if object.contains_key(limit) || limit == "max_tokens" {
                object.insert(limit.to_owned(), json!(1));
            }
        }
    }
    body
}

async fn proxy(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| "/".to_owned(), ToString::to_string);
    let body = match http_body_util::Limited::new(body, MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(error) => return (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
    };
    let prefiller = parts
        .headers
        .get(PREFILLER_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .map(|v| v.trim().to_owned());
    let mut headers = parts.headers.clone();
    headers.remove(PREFILLER_HEADER);
    headers.remove(hyper::header::HOST);
    headers.remove(hyper::header::CONTENT_LENGTH);
    let mut handled = Handled {
        path: parts.uri.path().to_owned(),
        prefiller: prefiller.clone(),
        prefill_status: None,
        request_id: None,
    };
    let mut decode_body = body.clone();
    if let Some(prefiller) = prefiller {
        let request_id = headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map_or_else(
                || format!("pd-{}", shared.next_id.fetch_add(1, Ordering::Relaxed)),
                str::to_owned,
            );
        if let Ok(value) = HeaderValue::from_str(&request_id) {
            headers.insert("x-request-id", value);
        }
        handled.request_id = Some(request_id);
        let client_body: Value = match serde_json::from_slice(&body) {
            Ok(value) => value,
            Err(error) => return (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
        };
        let prefill = prefill_leg(&shared, &prefiller, &path, &headers, &client_body).await;
        handled.prefill_status = prefill.status;
        let Some(params) = prefill.params else {
            shared.handled.lock().push(handled);
            return (
                StatusCode::BAD_GATEWAY,
                format!("prefill leg to {prefiller} failed"),
            )
                .into_response();
        };
        let mut with_params = client_body;
        if let Some(object) = with_params.as_object_mut() {
            object.insert("kv_transfer_params".to_owned(), params);
        }
        decode_body = Bytes::from(with_params.to_string());
    }
    shared.handled.lock().push(handled);
    let url = format!("http://{}{path}", shared.decode);
    send(&shared, parts.method, &url, &headers, decode_body).await
}

/// What the prefill leg got: its final status, and the transfer params it answered.
struct PrefillOutcome {
    status: Option<u16>,
    params: Option<Value>,
}

async fn prefill_leg(
    shared: &Shared,
    prefiller: &str,
    path: &str,
    headers: &hyper::HeaderMap,
    client_body: &Value,
) -> PrefillOutcome {
    let body = Bytes::from(prefill_body(client_body).to_string());
    let url = format!("http://{prefiller}{path}");
    let mut outcome = PrefillOutcome {
        status: None,
        params: None,
    };
    for attempt in 0..PREFILL_ATTEMPTS {
        let mut request = hyper::Request::post(&url);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let Ok(request) = request.body(Full::new(body.clone())) else {
            return outcome;
        };
        let Ok(response) = shared.client.request(request).await else {
            return outcome;
        };
        let status = response.status();
        outcome.status = Some(status.as_u16());
        let transient = matches!(status.as_u16(), 502..=504);
        if transient && attempt + 1 < PREFILL_ATTEMPTS {
            tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
            continue;
        }
        if !status.is_success() {
            return outcome;
        }
        let Ok(answer) = response.into_body().collect().await else {
            return outcome;
        };
        outcome.params = serde_json::from_slice::<Value>(&answer.to_bytes())
            .ok()
            .map(|answer| answer["kv_transfer_params"].clone())
            .filter(|params| params.is_object());
        return outcome;
    }
    outcome
}

/// Sends one request to the local engine and passes its answer back as it streams.
async fn send(
    shared: &Shared,
    method: hyper::Method,
    url: &str,
    headers: &hyper::HeaderMap,
    body: Bytes,
) -> Response {
    let mut request = hyper::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let Ok(request) = request.body(Full::new(body)) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    match shared.client.request(request).await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            Response::from_parts(parts, Body::new(body))
        }
        Err(error) => (StatusCode::BAD_GATEWAY, error.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_body_asks_for_one_token_kept_for_a_remote_decode() {
        let client = json!({"model": "m", "messages": [], "stream": true,
            "stream_options": {"include_usage": true}, "max_completion_tokens": 64});
        let body = prefill_body(&client);
        assert_eq!(body["stream"], false);
        assert!(body.get("stream_options").is_none());
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["max_completion_tokens"], 1);
        assert!(body.get("max_output_tokens").is_none());
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(body["kv_transfer_params"]["do_remote_prefill"], false);
        assert!(body["kv_transfer_params"]["remote_block_ids"].is_null());
    }
}
