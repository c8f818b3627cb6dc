//! The `envoy.service.ext_proc.v3.ExternalProcessor` service: one response stream per HTTP request.
//!
//! Message flow (the body mode comes from `protocol_config` on the first message, else the
//! configured `default_body_mode`):
//!
//! - **BUFFERED**: request headers → empty `HeadersResponse`; request body (whole) → decide →
//!   `BodyResponse{header_mutation, clear_route_cache}` + `dynamic_metadata`.
//! - **FULL_DUPLEX_STREAMED**: request headers are *not* answered until the body is complete; then
//!   `HeadersResponse{header_mutation, clear_route_cache}` + `dynamic_metadata`, followed by the body
//!   echoed as `streamed_response` chunks of at most 62 000 bytes.
//! - Response headers: in-flight accounting ends; the served endpoint
//!   (`envoy.lb/x-gateway-destination-endpoint-served`) is compared with the decision. Only when
//!   `debug_headers` allows it (never by default) the client response gets `x-kvroute-decision`
//!   and `x-kvroute-predicted-cached-tokens`: they reveal whether a prompt was cached, so a client
//!   guessing another user's prompt would learn if it guessed right. With `expose: token` the
//!   request's token header is checked in constant time and removed before the request goes
//!   upstream.
//!
//! - A decided request holds its in-flight slot until its response headers, or
//!   `limits.inflight_max_age` (a stream kept open forever no longer inflates the replica's load);
//!   expiries are counted in `kvroute_extproc_replica_inflight_expired`. More than
//!   `limits.max_streams` open streams are refused with RESOURCE_EXHAUSTED (Envoy fails open).
//!
//! The decision is `x-gateway-destination-endpoint: ip:port[,ip:port…]` (the chosen endpoint, then
//! `epp.fallbacks` more, best first, for a proxy's retries) and the same value in `envoy.lb`
//! metadata (GIE endpoint-picker protocol), plus `x-kvroute-cluster` when the replica has an
//! Envoy cluster, `x-data-parallel-rank` when it is one of several data-parallel ranks behind one
//! address (vLLM serves the request on that rank; a client's own value is replaced),
//! `x-prefiller-host-port: ip:port` when a disaggregated pool splits the request (llm-d's
//! `pd-sidecar` on the decode replica runs the prefill leg there; a client's own value is
//! replaced, or removed when there is none; in `disaggregation.mode: envoy` ext-proc runs the
//! prefill leg itself (`prefill`) and the answer carries the decode leg instead: the body with
//! the prefill's `kv_transfer_params`, its `x-request-id` and `content-length`), and
//! `x-kvroute-decision: tier/reason` on the upstream request for logs. Refused
//! requests get an `ImmediateResponse` with an OpenAI-style JSON error: 400/404/413 for bad
//! requests, 503 with no ready replica, 429 when `epp.shedding` finds the pool saturated. A
//! request without a body (headers with end of stream) is routed on load in the headers answer;
//! when no pool can be inferred (several pools, no `default_pool`) it goes on without a decision
//! (Envoy balances it), counted in `request_errors_total{kind="missing_field"}`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, Metadata, header_value_option,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::StreamExt as _;
use kvroute_runtime::telemetry;
use kvroute_runtime::trace_context::{RemoteContext, TRACEPARENT, TRACESTATE};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use kvroute_index_core::throttle::LogThrottle;

use crate::config::{BodyMode, DebugHeaders, DisaggregationMode, PoolMode};
use crate::error::RequestError;
use crate::picker::{Decision, Explain, Picker};
use crate::prefill::{DecodeLeg, Prefiller, REQUEST_ID_HEADER};
use crate::records::EXPLAIN_HEADER;
use crate::request::{self, Endpoint};

/// Request header naming a split request's prefill replica, `ip:port`, as llm-d's `pd-sidecar`
/// on the decode replica reads it (llm-d's `PrefillEndpointHeader`).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// Header and `envoy.lb` metadata key carrying the chosen endpoint (GIE protocol).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Metadata namespace read by Envoy's override_host LB policy.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Subset hint key: the endpoints the picker may choose from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Key Envoy writes with the endpoint it actually served (override_host `selected_host_key`).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Header naming the replica's Envoy cluster, for `cluster_header` routes.
pub const CLUSTER_HEADER: &str = "x-kvroute-cluster";
/// Header describing the decision (`tier/reason`), for logs and tests.
pub const DECISION_HEADER: &str = "x-kvroute-decision";
/// Debug response header: prompt tokens the decision predicted cached on the chosen replica, to
/// compare with the engine's `usage.prompt_tokens_details.cached_tokens`.
pub const PREDICTED_CACHED_HEADER: &str = "x-kvroute-predicted-cached-tokens";
/// Largest body chunk echoed in FULL_DUPLEX_STREAMED mode (Envoy's limit is ~64 KiB; GIE uses this).
pub const MAX_STREAMED_CHUNK: usize = 62_000;

/// The ext_proc gRPC service.
#[derive(Debug, Clone)]
pub struct ExtProcService {
    picker: Arc<Picker>,
    prefiller: Arc<Prefiller>,
    logs: Arc<StreamLogs>,
}

impl ExtProcService {
    /// A service deciding with `picker`.
    pub fn new(picker: Arc<Picker>) -> Self {
        Self {
            prefiller: Arc::new(Prefiller::new(picker.metrics().clone())),
            picker,
            logs: Arc::default(),
        }
    }
}

/// Throttles of the warnings streams log for events a peer can repeat at will.
#[derive(Debug, Default)]
struct StreamLogs {
    wrong_debug_token: LogThrottle,
    inflight_expired: LogThrottle,
    stream_refused: LogThrottle,
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let metrics = self.picker.metrics();
        let limit = self.picker.runtime().config.max_streams;
        let Some(active) = ActiveStream::admit(metrics.streams_active.clone(), limit) else {
            metrics
                .stream_refusals
                .get_or_create(&crate::metrics::KindLabel {
                    kind: "max_streams",
                })
                .inc();
            if let Some(suppressed) = self.logs.stream_refused.allow() {
                tracing::warn!(
                    limit,
                    suppressed,
                    "ext_proc stream refused: limits.max_streams open already"
                );
            }
            return Err(Status::resource_exhausted(
                "too many open ext_proc streams (limits.max_streams)",
            ));
        };
        // Envoy puts its own span's context on the stream when its tracing is on; a request's
        // `traceparent` header wins over it.
        let stream_trace = if telemetry::request_spans() {
            let metadata = request.metadata();
            metadata
                .get(TRACEPARENT)
                .and_then(|value| value.to_str().ok())
                .map(|parent| {
                    (
                        parent.to_owned(),
                        metadata
                            .get(TRACESTATE)
                            .and_then(|value| value.to_str().ok())
                            .map(str::to_owned),
                    )
                })
        } else {
            None
        };
        let stream = StreamTask {
            stream_trace,
            span: tracing::Span::none(),
            outbox: Vec::new(),
            state: StreamState::default(),
            _active: active,
            picker: Arc::clone(&self.picker),
            prefiller: Arc::clone(&self.prefiller),
            logs: Arc::clone(&self.logs),
        };
        Ok(Response::new(stream.responses(request.into_inner())))
    }
}

/// Counts a stream in `streams_active` while it lives.
#[derive(Debug)]
struct ActiveStream(prometheus_client::metrics::gauge::Gauge);

impl ActiveStream {
    /// Counts a new stream, unless `limit` streams are open already.
    fn admit(gauge: prometheus_client::metrics::gauge::Gauge, limit: usize) -> Option<Self> {
        let open_before = gauge.inc();
        if usize::try_from(open_before).is_ok_and(|open| open >= limit) {
            gauge.dec();
            return None;
        }
        Some(Self(gauge))
    }
}

impl Drop for ActiveStream {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[derive(Debug, Default)]
struct StreamState {
    request_mode: Option<BodyMode>,
    response_body_full_duplex: bool,
    /// The request's `:path` (a prefill leg goes to the same one).
    path: String,
    endpoint: Option<Endpoint>,
    subset: Option<Vec<SocketAddr>>,
    body: Vec<u8>,
    /// FULL_DUPLEX: the request-headers answer is owed until the body is complete.
    headers_answer_owed: bool,
    decision: Option<Decision>,
    /// When the decision's in-flight slot is released if the response has not begun.
    inflight_deadline: Option<tokio::time::Instant>,
    /// Whether this request gets the debug response headers (`debug_headers`).
    expose_debug: bool,
    /// The debug-token header, to remove before the request goes upstream.
    strip_header: Option<String>,
}

struct StreamTask {
    /// `traceparent` and `tracestate` of the stream's gRPC metadata (only kept when request
    /// spans are on).
    stream_trace: Option<(String, Option<String>)>,
    /// The request's server span (`gateway.request`); `Span::none()` unless request spans are on.
    span: tracing::Span,
    picker: Arc<Picker>,
    prefiller: Arc<Prefiller>,
    logs: Arc<StreamLogs>,
    /// Responses to the message being handled.
    outbox: Vec<ProcessingResponse>,
    state: StreamState,
    _active: ActiveStream,
}

/// The response stream of one ext_proc call.
pub type ResponseStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// Whether the stream goes on after a message.
enum Flow {
    Continue,
    Stop,
}

impl StreamTask {
    /// The responses to `inbound`, in order: each message is handled when Envoy's side of the
    /// stream polls for the next response, on the connection's own task — no task or channel hop
    /// per message (they cost more than a decision on a busy host).
    fn responses(self, inbound: Streaming<ProcessingRequest>) -> ResponseStream {
        let stream = futures::stream::unfold(Some((self, inbound)), |next| async move {
            let (mut task, mut inbound) = next?;
            loop {
                let received = match task.state.inflight_deadline {
                    None => inbound.message().await,
                    Some(deadline) => tokio::select! {
                        biased;
                        received = inbound.message() => received,
                        () = tokio::time::sleep_until(deadline) => {
                            task.expire_inflight();
                            continue;
                        }
                    },
                };
                let message = match received {
                    Ok(Some(message)) => message,
                    Ok(None) => return None,
                    // Envoy resets the stream (h2 RST_STREAM) once the HTTP request is done: EOF.
                    Err(status) => {
                        tracing::debug!(code = ?status.code(), message = status.message(), "ext_proc stream ended");
                        return None;
                    }
                };
                let flow = task.handle(message).await;
                let replies = std::mem::take(&mut task.outbox);
                match flow {
                    Flow::Continue if replies.is_empty() => continue,
                    Flow::Continue => {
                        let replies = futures::stream::iter(replies.into_iter().map(Ok));
                        return Some((replies, Some((task, inbound))));
                    }
                    Flow::Stop => {
                        return Some((futures::stream::iter(replies.into_iter().map(Ok)), None));
                    }
                }
            }
        });
        Box::pin(stream.flatten())
    }

    /// Queues a response; the stream yields it once the current message is handled.
    fn send(&mut self, response: ProcessingResponse) -> Flow {
        self.outbox.push(response);
        Flow::Continue
    }

    async fn handle(&mut self, message: ProcessingRequest) -> Flow {
        if !telemetry::request_spans() {
            return self.handle_message(message).await;
        }
        if let Some(processing_request::Request::RequestHeaders(headers)) = &message.request {
            self.span = self.request_span(headers);
        }
        let span = self.span.clone();
        self.handle_message(message).instrument(span).await
    }

    /// The request's server span, continuing the trace of its `traceparent` header, else of the
    /// stream's metadata.
    fn request_span(&self, headers: &HttpHeaders) -> tracing::Span {
        let endpoint = Endpoint::from_path(&header(headers, ":path").unwrap_or_default());
        let span = kvroute_runtime::trace_span!(
            "gateway.request",
            otel.kind = "server",
            gen_ai.operation.name = endpoint.gen_ai_operation(),
            gen_ai.request.model = tracing::field::Empty,
            kvroute.pool = tracing::field::Empty,
            kvroute.tier = tracing::field::Empty,
            kvroute.reason = tracing::field::Empty,
            kvroute.endpoint = tracing::field::Empty,
            kvroute.predicted_cached_tokens = tracing::field::Empty,
        );
        let parent = header(headers, TRACEPARENT);
        let state = header(headers, TRACESTATE);
        let remote = RemoteContext::from_header_or_metadata(
            parent.as_deref().map(|parent| (parent, state.as_deref())),
            self.stream_trace
                .as_ref()
                .map(|(parent, state)| (parent.as_str(), state.as_deref())),
        );
        telemetry::continue_trace(&span, remote.as_ref());
        span
    }

    /// Records the decision on the request span and names that span as the parent of the
    /// upstream request (`traceparent`, `tracestate`), so the engine's spans join the trace.
    fn trace_decision(&self, decision: &Decision, mutation: &mut HeaderMutation) {
        let span = &self.span;
        if span.is_none() {
            return;
        }
        span.record("kvroute.tier", decision.tier.as_label());
        span.record("kvroute.reason", decision.reason);
        span.record(
            "kvroute.endpoint",
            tracing::field::display(decision.address),
        );
        span.record(
            "kvroute.predicted_cached_tokens",
            decision.predicted_cached_tokens,
        );
        if let Some((parent, state)) = telemetry::outgoing_context(span) {
            // Replaces the caller's: the engine's parent is kvroute's span.
            mutation
                .set_headers
                .push(overwrite_header(TRACEPARENT, &parent));
            if let Some(state) = state {
                mutation
                    .set_headers
                    .push(overwrite_header(TRACESTATE, &state));
            }
        }
    }

    async fn handle_message(&mut self, message: ProcessingRequest) -> Flow {
        if self.state.request_mode.is_none() {
            let default = self.picker.runtime().config.default_body_mode;
            self.state.request_mode = Some(match &message.protocol_config {
                Some(p) if p.request_body_mode == BodySendMode::FullDuplexStreamed as i32 => {
                    BodyMode::FullDuplexStreamed
                }
                Some(_) => BodyMode::Buffered,
                None => default,
            });
            self.state.response_body_full_duplex = message
                .protocol_config
                .as_ref()
                .is_some_and(|p| p.response_body_mode == BodySendMode::FullDuplexStreamed as i32);
        }
        if self.state.subset.is_none() {
            self.state.subset = subset_hint(message.metadata_context.as_ref());
        }
        let full_duplex = self.state.request_mode == Some(BodyMode::FullDuplexStreamed);
        let Some(request) = message.request else {
            return Flow::Continue;
        };
        match request {
            processing_request::Request::RequestHeaders(headers) => {
                let path = header(&headers, ":path").unwrap_or_default();
                self.state.endpoint = Some(Endpoint::from_path(&path));
                self.state.path = path;
                self.check_debug_token(&headers);
                if headers.end_of_stream {
                    return self.route_bodyless().await;
                }
                if !full_duplex {
                    // BUFFERED: answer now, decide on the body.
                    let strip = self.state.strip_header.take();
                    return self.send(headers_response(CommonResponse {
                        header_mutation: strip.map(|name| HeaderMutation {
                            remove_headers: vec![name],
                            ..HeaderMutation::default()
                        }),
                        ..CommonResponse::default()
                    }));
                }
                self.state.headers_answer_owed = true;
                Flow::Continue
            }
            processing_request::Request::RequestBody(chunk) => {
                let limit = self.picker.runtime().config.max_body_bytes;
                if self.state.body.len() + chunk.body.len() > limit {
                    let error = RequestError::BodyTooLarge {
                        size: self.state.body.len() + chunk.body.len(),
                        limit,
                    };
                    self.picker
                        .metrics()
                        .request_errors
                        .get_or_create(&crate::metrics::KindLabel {
                            kind: error.as_label(),
                        })
                        .inc();
                    self.send(immediate_error(&error));
                    return Flow::Stop;
                }
                if self.state.body.is_empty() {
                    // A BUFFERED body arrives in one message: keep its buffer, no copy.
                    self.state.body = chunk.body;
                } else {
                    self.state.body.extend_from_slice(&chunk.body);
                }
                if chunk.end_of_stream {
                    return self.finish_request(false).await;
                }
                if full_duplex {
                    Flow::Continue
                } else {
                    // STREAMED / BUFFERED_PARTIAL: each chunk is answered; routing waits for the end.
                    self.send(body_response(CommonResponse::default()))
                }
            }
            processing_request::Request::RequestTrailers(_) => {
                if self.state.headers_answer_owed
                    && let Flow::Stop = self.finish_request(true).await
                {
                    return Flow::Stop;
                }
                self.send(ProcessingResponse {
                    response: Some(processing_response::Response::RequestTrailers(
                        TrailersResponse::default(),
                    )),
                    ..ProcessingResponse::default()
                })
            }
            processing_request::Request::ResponseHeaders(_) => {
                self.observe_served(message.metadata_context.as_ref());
                // The engine answered: the request no longer waits in its queue.
                let decision = self.state.decision.take();
                self.state.inflight_deadline = None;
                let debug = decision.as_ref().filter(|_| self.state.expose_debug);
                self.send(ProcessingResponse {
                    response: Some(processing_response::Response::ResponseHeaders(
                        HeadersResponse {
                            response: debug.map(debug_response_headers),
                        },
                    )),
                    ..ProcessingResponse::default()
                })
            }
            processing_request::Request::ResponseBody(chunk) => {
                let response = if self.state.response_body_full_duplex {
                    CommonResponse {
                        body_mutation: Some(streamed(chunk.body, chunk.end_of_stream)),
                        ..CommonResponse::default()
                    }
                } else {
                    CommonResponse::default()
                };
                self.send(ProcessingResponse {
                    response: Some(processing_response::Response::ResponseBody(BodyResponse {
                        response: Some(response),
                    })),
                    ..ProcessingResponse::default()
                })
            }
            processing_request::Request::ResponseTrailers(_) => self.send(ProcessingResponse {
                response: Some(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                )),
                ..ProcessingResponse::default()
            }),
        }
    }

    /// No body will come (a GET, or an empty POST): route on load in the headers answer.
    async fn route_bodyless(&mut self) -> Flow {
        let request = request::ParsedRequest {
            model: std::borrow::Cow::Borrowed(""),
            prompt: request::Prompt::Absent,
            cache_salt: None,
            kv_transfer_params: false,
        };
        let strip = self.state.strip_header.take();
        let decided = self
            .picker
            .decide_explained(&request, self.state.subset.as_deref(), self.explain())
            .await;
        let decision = match decided {
            Ok(decision) => decision,
            Err(RequestError::MissingField { .. }) => {
                // Several pools and no default: which one is meant is unknown; Envoy balances it.
                tracing::debug!("bodyless request names no pool; passed on without a decision");
                return self.send(headers_response(CommonResponse {
                    header_mutation: strip.map(|name| HeaderMutation {
                        remove_headers: vec![name],
                        ..HeaderMutation::default()
                    }),
                    ..CommonResponse::default()
                }));
            }
            Err(error) => {
                self.send(immediate_error(&error));
                return Flow::Stop;
            }
        };
        let mut mutation = decision_headers(&decision);
        mutation.remove_headers.extend(strip);
        let applied = decision.mode == PoolMode::Route;
        self.trace_decision(&decision, &mut mutation);
        let mut response = headers_response(CommonResponse {
            header_mutation: Some(mutation),
            clear_route_cache: applied,
            ..CommonResponse::default()
        });
        response.dynamic_metadata = applied.then(|| destination_metadata(&decision.destination()));
        self.commit_decision(decision);
        self.send(response)
    }

    /// Holds the decision until its response (in-flight accounting, served-endpoint check).
    fn commit_decision(&mut self, decision: Decision) {
        self.state.inflight_deadline =
            Some(tokio::time::Instant::now() + self.picker.runtime().config.inflight_max_age);
        self.state.decision = Some(decision);
    }

    /// The body is complete: decide and answer in the mode's shape.
    async fn finish_request(&mut self, trailers_follow: bool) -> Flow {
        let endpoint = self.state.endpoint.unwrap_or(Endpoint::Other);
        let body = std::mem::take(&mut self.state.body);
        let parsed = kvroute_runtime::trace_span!("kvroute.parse")
            .in_scope(|| request::parse(&body, endpoint));
        let decided = match parsed {
            Ok(parsed) => {
                self.span
                    .record("gen_ai.request.model", parsed.model.as_ref());
                self.picker
                    .decide_explained(&parsed, self.state.subset.as_deref(), self.explain())
                    .await
            }
            Err(e) => {
                self.picker
                    .metrics()
                    .request_errors
                    .get_or_create(&crate::metrics::KindLabel { kind: e.as_label() })
                    .inc();
                Err(e)
            }
        };
        let decision = match decided {
            Ok(decision) => decision,
            Err(error) => {
                tracing::debug!(error = %error, "request refused");
                self.send(immediate_error(&error));
                return Flow::Stop;
            }
        };
        tracing::debug!(
            replica_id = %decision.replica_id,
            tier = decision.tier.as_label(),
            reason = decision.reason,
            "routed"
        );
        let mut decision = decision;
        let decode_leg = self.run_prefill_leg(&mut decision, endpoint, &body).await;
        let mut mutation = decision_headers(&decision);
        self.trace_decision(&decision, &mut mutation);
        if self.state.headers_answer_owed {
            // FULL_DUPLEX: this answers the request headers, so the token header goes here.
            mutation
                .remove_headers
                .extend(self.state.strip_header.take());
        }
        let (body, replaced) = match decode_leg {
            Some(decode) => {
                decode_leg_headers(&decode, self.state.headers_answer_owed, &mut mutation);
                (decode.body, true)
            }
            None => (body, false),
        };
        let applied = decision.mode == PoolMode::Route;
        let mut common = CommonResponse {
            header_mutation: Some(mutation),
            clear_route_cache: applied,
            ..CommonResponse::default()
        };
        let metadata = applied.then(|| destination_metadata(&decision.destination()));
        self.commit_decision(decision);
        if !self.state.headers_answer_owed {
            if replaced {
                // BUFFERED: the whole body is replaced (its new content-length is set above).
                common.body_mutation = Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::Body(body)),
                });
            }
            let mut response = body_response(common);
            response.dynamic_metadata = metadata;
            return self.send(response);
        }
        self.state.headers_answer_owed = false;
        let mut response = headers_response(common);
        response.dynamic_metadata = metadata;
        if let Flow::Stop = self.send(response) {
            return Flow::Stop;
        }
        // Echo the body back; Envoy forwards these chunks upstream.
        let chunks: Vec<&[u8]> = if body.is_empty() {
            vec![&[][..]]
        } else {
            body.chunks(MAX_STREAMED_CHUNK).collect()
        };
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let end = i == last && !trailers_follow;
            let response = body_response(CommonResponse {
                body_mutation: Some(streamed(chunk.to_vec(), end)),
                ..CommonResponse::default()
            });
            if let Flow::Stop = self.send(response) {
                return Flow::Stop;
            }
        }
        Flow::Continue
    }

    /// `disaggregation.mode: envoy`: a split request's prefill leg runs now, before Envoy hears
    /// of the decision; what the decode replica gets, or `None` (not split here, or the leg
    /// failed: served whole, counted). The prefill replica's in-flight slot ends with its leg.
    async fn run_prefill_leg(
        &self,
        decision: &mut Decision,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Option<DecodeLeg> {
        if decision.mode != PoolMode::Route {
            return None;
        }
        let leg = decision
            .prefill
            .as_mut()
            .filter(|leg| leg.disaggregation.mode == DisaggregationMode::Envoy)?;
        let decode = self
            .prefiller
            .run(leg, &self.state.path, endpoint, body)
            .await;
        leg.inflight.release();
        decode
    }

    /// Decides whether this request gets the debug response headers; in `token` mode marks the
    /// token header (right or wrong) for removal before the request goes upstream.
    fn check_debug_token(&mut self, headers: &HttpHeaders) {
        let runtime = self.picker.runtime();
        self.state.expose_debug = match &runtime.config.debug_headers {
            DebugHeaders::Never => false,
            DebugHeaders::Always => true,
            DebugHeaders::Token {
                header: name,
                token,
            } => {
                let presented = header(headers, name);
                let result = match &presented {
                    None => "no_token",
                    Some(value) if token.matches(value) => "exposed",
                    Some(_) => "wrong_token",
                };
                self.picker
                    .metrics()
                    .debug_header_requests
                    .get_or_create(&crate::metrics::KindLabel { kind: result })
                    .inc();
                if result == "wrong_token"
                    && let Some(suppressed) = self.logs.wrong_debug_token.allow()
                {
                    tracing::warn!(
                        header = %name,
                        suppressed,
                        "debug headers refused: wrong token (counted in kvroute_extproc_debug_header_requests)"
                    );
                }
                if presented.is_some() {
                    self.state.strip_header = Some(name.clone());
                }
                result == "exposed"
            }
        };
    }

    /// `limits.inflight_max_age` passed without response headers: the request stops counting on
    /// its replica (the stream itself goes on; its response is still answered).
    fn expire_inflight(&mut self) {
        self.state.inflight_deadline = None;
        let Some(decision) = self.state.decision.as_mut() else {
            return;
        };
        if !decision.inflight.is_held() {
            return;
        }
        decision.inflight.release();
        self.picker
            .metrics()
            .inflight_expired
            .get_or_create(&crate::metrics::ReplicaLabel {
                replica: decision.replica_id.clone(),
            })
            .inc();
        if let Some(suppressed) = self.logs.inflight_expired.allow() {
            tracing::warn!(
                replica_id = %decision.replica_id,
                max_age = ?self.picker.runtime().config.inflight_max_age,
                suppressed,
                "in-flight slot released: no response headers within limits.inflight_max_age"
            );
        }
    }

    /// Whether this request's decision is recorded on request (the debug token, or `always`).
    fn explain(&self) -> Explain {
        if self.state.expose_debug {
            Explain::Flagged
        } else {
            Explain::Unflagged
        }
    }

    /// The response began: the decision learns which endpoint Envoy served (override_host's
    /// `selected_host_key` in the forwarded `envoy.lb` metadata, when configured).
    fn observe_served(&mut self, metadata: Option<&Metadata>) {
        let served = metadata
            .and_then(|m| m.filter_metadata.get(LB_NAMESPACE))
            .and_then(|s| s.fields.get(SERVED_KEY))
            .and_then(|v| match &v.kind {
                Some(Kind::StringValue(s)) => s.parse::<SocketAddr>().ok(),
                _ => None,
            });
        let Some(decision) = self.state.decision.as_mut() else {
            return;
        };
        self.picker.responded(decision, served);
        let Some(served) = served else { return };
        let decided = decision.address;
        if served == decided || decision.mode == PoolMode::Shadow {
            return;
        }
        if decision.fallbacks.contains(&served) {
            // A retry walked the list (the chosen endpoint failed).
            self.picker.metrics().served_fallback.inc();
            tracing::debug!(%served, %decided, "Envoy served a fallback endpoint");
        } else {
            self.picker.metrics().served_mismatch.inc();
            tracing::debug!(%served, %decided, "Envoy served another endpoint than decided");
        }
    }
}

fn header(headers: &HttpHeaders, name: &str) -> Option<String> {
    let map = headers.headers.as_ref()?;
    let h = map
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))?;
    if h.raw_value.is_empty() {
        Some(h.value.clone())
    } else {
        String::from_utf8(h.raw_value.clone()).ok()
    }
}

/// Endpoints allowed by the GIE subset hint: a list of `ip:port` strings or one comma-separated
/// string. `None` when there is no hint; `Some(empty)` when the hint names nothing usable.
fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<SocketAddr>> {
    let value = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let parse = |s: &str| {
        s.split(',')
            .filter_map(|p| p.trim().parse::<SocketAddr>().ok())
            .collect::<Vec<_>>()
    };
    Some(match &value.kind {
        Some(Kind::StringValue(s)) => parse(s),
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(parse(s)),
                _ => None,
            })
            .flatten()
            .collect(),
        _ => Vec::new(),
    })
}

/// A header mutation entry setting `key` to `value`.
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

/// A header mutation entry replacing any `key` the request has with `value`.
fn overwrite_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..set_header(key, value)
    }
}

/// The decision's request headers: the destination (not in shadow mode, where Envoy's choice
/// stands and the request goes on unchanged), the cluster, and `x-kvroute-decision`.
fn decision_headers(decision: &Decision) -> HeaderMutation {
    if decision.mode == PoolMode::Shadow {
        return HeaderMutation::default();
    }
    let mut set_headers = vec![
        set_header(DESTINATION_HEADER, &decision.destination()),
        set_header(
            DECISION_HEADER,
            &format!("{}/{}", decision.tier.as_label(), decision.reason),
        ),
    ];
    if let Some(cluster) = &decision.envoy_cluster {
        set_headers.push(set_header(CLUSTER_HEADER, cluster));
    }
    if let Some(rank) = decision.dp_rank {
        // Replaces any rank the client named: the engine serves on the rank chosen here.
        set_headers.push(overwrite_header(
            kvroute_config::DATA_PARALLEL_RANK_HEADER,
            &rank.to_string(),
        ));
    }
    // Only kvroute names a prefill replica: in a disaggregated pool a client's own value is
    // replaced or removed, so no request can make a decode sidecar send its prompt elsewhere
    // (the shipped Envoy configs strip it before ext_proc too).
    let mut remove_headers = Vec::new();
    match &decision.prefill {
        Some(prefill) if prefill.disaggregation.mode == DisaggregationMode::Sidecar => {
            set_headers.push(overwrite_header(
                PREFILLER_HEADER,
                &prefill.address.to_string(),
            ));
        }
        _ if decision.disaggregated => remove_headers.push(PREFILLER_HEADER.to_owned()),
        _ => {}
    }
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// The decode leg's headers after a prefill leg ext-proc ran: the request id both legs share
/// and the new body's length. BUFFERED (`full_duplex` false) Envoy checks a replaced body
/// against `content-length`, which the processor must set; FULL_DUPLEX_STREAMED Envoy drops
/// `content-length` itself (the body is streamed on), and this removes it too.
fn decode_leg_headers(decode: &DecodeLeg, full_duplex: bool, mutation: &mut HeaderMutation) {
    mutation
        .set_headers
        .push(overwrite_header(REQUEST_ID_HEADER, &decode.request_id));
    if full_duplex {
        mutation.remove_headers.push(CONTENT_LENGTH.to_owned());
    } else {
        mutation.set_headers.push(overwrite_header(
            CONTENT_LENGTH,
            &decode.body.len().to_string(),
        ));
    }
}

/// The request header Envoy checks a replaced BUFFERED body against.
const CONTENT_LENGTH: &str = "content-length";

/// The decision echoed to the client (`x-kvroute-decision`, predicted cached tokens), only when
/// `debug_headers` allows it.
fn debug_response_headers(decision: &Decision) -> CommonResponse {
    let mut set_headers = vec![
        set_header(
            DECISION_HEADER,
            &format!("{}/{}", decision.tier.as_label(), decision.reason),
        ),
        set_header(
            PREDICTED_CACHED_HEADER,
            &decision.predicted_cached_tokens.to_string(),
        ),
    ];
    if let Some(record) = &decision.record {
        set_headers.push(set_header(EXPLAIN_HEADER, &record.compact()));
    }
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            ..HeaderMutation::default()
        }),
        ..CommonResponse::default()
    }
}

/// The `envoy.lb` dynamic metadata naming `endpoint` (GIE endpoint-picker protocol).
pub fn destination_metadata(endpoint: &str) -> Struct {
    let lb = Struct {
        fields: HashMap::from([(
            DESTINATION_HEADER.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoint.to_owned())),
            },
        )]),
    };
    Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        )]),
    }
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyMutation {
    BodyMutation {
        mutation: Some(body_mutation::Mutation::StreamedResponse(
            StreamedBodyResponse {
                body,
                end_of_stream,
                ..StreamedBodyResponse::default()
            },
        )),
    }
}

fn headers_response(common: CommonResponse) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(common),
            },
        )),
        ..ProcessingResponse::default()
    }
}

fn body_response(common: CommonResponse) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(common),
        })),
        ..ProcessingResponse::default()
    }
}

fn immediate_error(error: &RequestError) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(error.http_status()),
                }),
                headers: Some(HeaderMutation {
                    set_headers: vec![set_header("content-type", "application/json")],
                    ..HeaderMutation::default()
                }),
                body: error.to_openai_json(),
                details: error.as_label().to_owned(),
                ..ImmediateResponse::default()
            },
        )),
        ..ProcessingResponse::default()
    }
}
