//! Both ends of the ext_proc protocol, as test doubles:
//!
//! - [`ExtProcClient`] drives kvroute-ext-proc as Envoy's `BUFFERED` body mode does: one stream
//!   per HTTP request, request headers, then the whole body in one message; the answer to the
//!   body is the routing decision (header mutations) or an immediate response;
//! - [`FakeExtProc`] stands in for kvroute-ext-proc behind a real Envoy: a no-op, or endpoints in
//!   turn answered in kvroute-ext-proc's own shapes ([`FakeRouting`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, TrailersResponse,
    processing_request, processing_response,
};
use futures::{Stream, StreamExt as _};
use kvroute_ext_proc::server::{
    DECISION_HEADER, DESTINATION_HEADER, PREDICTED_CACHED_HEADER, destination_metadata, set_header,
};
use kvroute_test_support::{deadline, try_poll_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::server::TcpIncoming;

use super::HarnessError;

/// Largest ext_proc message either side sends (Envoy buffers bodies up to its own limit).
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// What ext-proc answered to a request's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtProcAnswer {
    /// Routed: the headers it set on the upstream request (`x-gateway-destination-endpoint`,
    /// `x-kvroute-decision: tier/reason`, ...).
    Routed(Vec<(String, String)>),
    /// Refused with this HTTP status.
    Immediate(u32),
}

impl ExtProcAnswer {
    /// The value of a header it set, if routed.
    pub fn header(&self, name: &str) -> Option<&str> {
        match self {
            Self::Routed(headers) => headers
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.as_str()),
            Self::Immediate(_) => None,
        }
    }
}

/// A client of one ext-proc's gRPC listener (one HTTP/2 connection, shared by its streams).
#[derive(Debug, Clone)]
pub struct ExtProcClient {
    client: ExternalProcessorClient<tonic::transport::Channel>,
    timeout: Duration,
}

impl ExtProcClient {
    /// Connects to `grpc`; every exchange must finish within `timeout`.
    pub async fn connect(grpc: SocketAddr, timeout: Duration) -> Result<Self, HarnessError> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .map_err(|e| protocol(grpc, e.to_string()))?
            .connect()
            .await
            .map_err(|e| protocol(grpc, e.to_string()))?;
        let client = ExternalProcessorClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self { client, timeout })
    }

    /// One `POST path` with `body`, as Envoy sends it in `BUFFERED` mode.
    pub async fn buffered(&self, path: &str, body: Vec<u8>) -> Result<ExtProcAnswer, HarnessError> {
        tokio::time::timeout(self.timeout, self.exchange(path, body))
            .await
            .map_err(|_| HarnessError::Timeout {
                what: format!("ext_proc answer to POST {path}"),
                after: self.timeout,
            })?
    }

    async fn exchange(&self, path: &str, body: Vec<u8>) -> Result<ExtProcAnswer, HarnessError> {
        let bad = |detail: String| HarnessError::Protocol {
            what: "ext_proc stream".to_owned(),
            detail,
        };
        let header = |key: &str, value: &str| HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        };
        let headers = ProcessingRequest {
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: BodySendMode::Buffered as i32,
                response_body_mode: BodySendMode::None as i32,
                ..ProtocolConfiguration::default()
            }),
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":path", path),
                        header(":method", "POST"),
                        header("content-type", "application/json"),
                    ],
                }),
                end_of_stream: false,
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        };
        let body = ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body,
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        };
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        tx.send(headers)
            .await
            .map_err(|_| bad("stream closed".into()))?;
        let mut responses = self
            .client
            .clone()
            .process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|e| bad(e.to_string()))?
            .into_inner();
        match next(&mut responses).await?.response {
            Some(processing_response::Response::RequestHeaders(_)) => {}
            Some(processing_response::Response::ImmediateResponse(refused)) => {
                return Ok(ExtProcAnswer::Immediate(
                    refused.status.map_or(0, |s| s.code as u32),
                ));
            }
            other => return Err(bad(format!("answer to the headers: {other:?}"))),
        }
        tx.send(body)
            .await
            .map_err(|_| bad("stream closed".into()))?;
        match next(&mut responses).await?.response {
            Some(processing_response::Response::RequestBody(answer)) => {
                let set = answer
                    .response
                    .and_then(|common| common.header_mutation)
                    .map(|mutation| mutation.set_headers)
                    .unwrap_or_default();
                Ok(ExtProcAnswer::Routed(
                    set.into_iter()
                        .filter_map(|option| option.header)
                        .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                        .collect(),
                ))
            }
            Some(processing_response::Response::ImmediateResponse(refused)) => Ok(
                ExtProcAnswer::Immediate(refused.status.map_or(0, |s| s.code as u32)),
            ),
            other => Err(bad(format!("answer to the body: {other:?}"))),
        }
    }
}

async fn next(
    responses: &mut tonic::Streaming<ProcessingResponse>,
) -> Result<ProcessingResponse, HarnessError> {
    let bad = |detail: String| HarnessError::Protocol {
        what: "ext_proc stream".to_owned(),
        detail,
    };
    responses
        .message()
        .await
        .map_err(|e| bad(e.to_string()))?
        .ok_or_else(|| bad("stream ended".into()))
}

fn protocol(grpc: SocketAddr, detail: String) -> HarnessError {
    HarnessError::Protocol {
        what: format!("ext_proc at {grpc}"),
        detail,
    }
}

// ---------------------------------------------------------------------------------------------
// The fake ext_proc

/// What a [`FakeExtProc`] decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeRouting {
    /// Nothing: an empty `CommonResponse` to every message, so what Envoy spends is the ext_proc
    /// round trip alone.
    Noop,
    /// Each stream (one HTTP request) goes to the next of these endpoints in turn, answered in
    /// kvroute-ext-proc's shapes: on the request body (or bodyless request headers) the
    /// destination header and `envoy.lb` metadata with `clear_route_cache` and the decision
    /// header `fixed/turn`; on the response headers the debug headers. What Envoy spends obeying
    /// an endpoint picker, apart from any decision's cost.
    RoundRobin(Vec<String>),
}

/// The decision header value of [`FakeRouting::RoundRobin`].
pub const FAKE_DECISION: &str = "fixed/turn";

/// An ext_proc server on `127.0.0.1:0` that decides without reading the request
/// ([`FakeRouting`]), gRPC health `SERVING`, counting its streams. It runs on the runtime it is
/// started on; stopped by [`FakeExtProc::stop`] or on drop.
#[derive(Debug)]
pub struct FakeExtProc {
    addr: SocketAddr,
    state: Arc<FakeState>,
    stop: CancellationToken,
    tasks: TaskTracker,
}

#[derive(Debug)]
struct FakeState {
    routing: FakeRouting,
    streams: AtomicUsize,
    last_decision: parking_lot::Mutex<Option<String>>,
}

impl FakeExtProc {
    /// Binds and serves.
    pub async fn start(routing: FakeRouting) -> Result<Self, HarnessError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(listen_error)?;
        let addr = listener.local_addr().map_err(listen_error)?;
        let state = Arc::new(FakeState {
            routing,
            streams: AtomicUsize::new(0),
            last_decision: parking_lot::Mutex::new(None),
        });
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<ExternalProcessorServer<FakeProcessor>>()
            .await;
        let stop = CancellationToken::new();
        let server = tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(ExternalProcessorServer::new(FakeProcessor(Arc::clone(
                &state,
            ))))
            .serve_with_incoming_shutdown(
                // tonic ignores `Server::tcp_nodelay` for an incoming stream passed in; without it
                // every reply waits for a delayed ACK.
                TcpIncoming::from(listener).with_nodelay(Some(true)),
                stop.clone().cancelled_owned(),
            );
        let tasks = TaskTracker::new();
        tasks.spawn(async move {
            if let Err(error) = server.await {
                eprintln!("fake ext_proc at {addr} failed: {error}");
            }
        });
        Ok(Self {
            addr,
            state,
            stop,
            tasks,
        })
    }

    /// Its gRPC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Streams (HTTP requests) it has answered.
    pub fn streams(&self) -> usize {
        self.state.streams.load(Ordering::SeqCst)
    }

    /// The endpoint of the latest stream ([`FakeRouting::RoundRobin`]).
    pub fn last_decision(&self) -> Option<String> {
        self.state.last_decision.lock().clone()
    }

    /// Stops serving and waits until the port refuses connections.
    pub async fn stop(&self) -> Result<(), HarnessError> {
        let stop_timeout = deadline(Duration::from_secs(10));
        self.stop.cancel();
        self.tasks.close();
        tokio::time::timeout(stop_timeout, self.tasks.wait())
            .await
            .map_err(|_| HarnessError::Timeout {
                what: format!("fake ext_proc at {} to stop", self.addr),
                after: stop_timeout,
            })?;
        let addr = self.addr;
        try_poll_until("fake ext_proc port closed", stop_timeout, || async move {
            tokio::net::TcpStream::connect(addr)
                .await
                .is_err()
                .then_some(())
        })
        .await
        .map_err(HarnessError::from)
    }
}

impl Drop for FakeExtProc {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Debug)]
struct FakeProcessor(Arc<FakeState>);

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for FakeProcessor {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<ReplyStream>, tonic::Status> {
        let state = &self.0;
        let turn = state.streams.fetch_add(1, Ordering::SeqCst);
        let endpoint = match &state.routing {
            FakeRouting::Noop => None,
            FakeRouting::RoundRobin(endpoints) if endpoints.is_empty() => None,
            FakeRouting::RoundRobin(endpoints) => {
                let endpoint = endpoints[turn % endpoints.len()].clone();
                *state.last_decision.lock() = Some(endpoint.clone());
                Some(endpoint)
            }
        };
        // BUFFERED: exactly one reply per message, so the reply stream is a map of the input.
        let replies = request
            .into_inner()
            .map(move |message| Ok(fake_reply(message?.request, endpoint.as_deref())));
        Ok(tonic::Response::new(Box::pin(replies)))
    }
}

/// The answer to one message of `phase`, routing to `endpoint` if any.
fn fake_reply(phase: Option<Phase>, endpoint: Option<&str>) -> ProcessingResponse {
    let pass = || Some(CommonResponse::default());
    let decide = |endpoint: &str| {
        Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: vec![
                    set_header(DESTINATION_HEADER, endpoint),
                    set_header(DECISION_HEADER, FAKE_DECISION),
                ],
                ..HeaderMutation::default()
            }),
            clear_route_cache: true,
            ..CommonResponse::default()
        })
    };
    let mut decided = None;
    let reply = match (phase, endpoint) {
        (Some(Phase::RequestHeaders(headers)), Some(endpoint)) if headers.end_of_stream => {
            decided = Some(endpoint);
            Reply::RequestHeaders(HeadersResponse {
                response: decide(endpoint),
            })
        }
        (Some(Phase::RequestHeaders(_)), _) => {
            Reply::RequestHeaders(HeadersResponse { response: pass() })
        }
        (Some(Phase::RequestBody(_)), Some(endpoint)) => {
            decided = Some(endpoint);
            Reply::RequestBody(BodyResponse {
                response: decide(endpoint),
            })
        }
        (Some(Phase::RequestBody(_)), None) => {
            Reply::RequestBody(BodyResponse { response: pass() })
        }
        (Some(Phase::ResponseHeaders(_)), Some(_)) => Reply::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![
                        set_header(DECISION_HEADER, FAKE_DECISION),
                        set_header(PREDICTED_CACHED_HEADER, "0"),
                    ],
                    ..HeaderMutation::default()
                }),
                ..CommonResponse::default()
            }),
        }),
        (Some(Phase::ResponseHeaders(_)), None) => {
            Reply::ResponseHeaders(HeadersResponse { response: pass() })
        }
        (Some(Phase::ResponseBody(_)), _) => Reply::ResponseBody(BodyResponse { response: pass() }),
        (Some(Phase::RequestTrailers(_)), _) => Reply::RequestTrailers(TrailersResponse::default()),
        (Some(Phase::ResponseTrailers(_)) | None, _) => {
            Reply::ResponseTrailers(TrailersResponse::default())
        }
    };
    ProcessingResponse {
        response: Some(reply),
        dynamic_metadata: decided.map(destination_metadata),
        ..ProcessingResponse::default()
    }
}

fn listen_error(error: std::io::Error) -> HarnessError {
    HarnessError::Protocol {
        what: "a fake ext_proc's listener on 127.0.0.1:0".to_owned(),
        detail: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout() -> Duration {
        deadline(Duration::from_secs(10))
    }

    #[tokio::test]
    async fn the_fake_routes_in_turn_and_the_noop_decides_nothing() {
        let endpoints = vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()];
        let fake = FakeExtProc::start(FakeRouting::RoundRobin(endpoints.clone()))
            .await
            .unwrap();
        let client = ExtProcClient::connect(fake.addr(), timeout())
            .await
            .unwrap();
        for turn in 0..3 {
            let answer = client
                .buffered("/v1/completions", b"{}".to_vec())
                .await
                .unwrap();
            assert_eq!(
                answer.header(DESTINATION_HEADER),
                Some(endpoints[turn % 2].as_str())
            );
            assert_eq!(answer.header(DECISION_HEADER), Some(FAKE_DECISION));
        }
        assert_eq!(fake.streams(), 3);
        assert_eq!(fake.last_decision(), Some(endpoints[0].clone()));
        fake.stop().await.unwrap();

        let noop = FakeExtProc::start(FakeRouting::Noop).await.unwrap();
        let client = ExtProcClient::connect(noop.addr(), timeout())
            .await
            .unwrap();
        let answer = client
            .buffered("/v1/completions", b"{}".to_vec())
            .await
            .unwrap();
        assert_eq!(answer, ExtProcAnswer::Routed(Vec::new()));
        assert_eq!((noop.streams(), noop.last_decision()), (1, None));
        noop.stop().await.unwrap();
    }
}
