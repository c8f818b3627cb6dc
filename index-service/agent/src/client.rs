//! One stream to one kvroute-index: connect, `Hello`, snapshot, then deltas until the stream
//! breaks; reconnect with capped exponential backoff (reset once the index welcomes us). A
//! stream the hub ended because its replica set changed reopens at once, claiming the new set.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;

use super::hub::Hub;
use super::metrics::AgentMetrics;
use kvroute_index_api::agent_protocol::MAX_MESSAGE_BYTES;
use kvroute_index_api::api::{self, agent_ingest_client::AgentIngestClient};
use kvroute_index_core::throttle::LogThrottle;
use kvroute_runtime::token::AgentToken;
use kvroute_runtime::trace_context::{TRACEPARENT, TRACESTATE};
use tracing::Instrument as _;

/// Bound on one connect attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 pings detect a silently dead index (a cut network) within about twice this.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// What the connection loop needs.
#[derive(Debug, Clone)]
pub(crate) struct StreamSettings {
    pub(crate) index: String,
    pub(crate) agent_id: String,
    pub(crate) token: AgentToken,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) tls: Option<kvroute_runtime::tls::ClientTls>,
}

/// Keeps one index stream up until `cancel`.
pub(crate) async fn run(
    settings: StreamSettings,
    hub: Arc<Hub>,
    metrics: AgentMetrics,
    cancel: CancellationToken,
) {
    let mut delay = settings.backoff_min;
    loop {
        let ended = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            ended = stream_once(&settings, &hub, &metrics) => ended,
        };
        metrics.set_connected(&settings.index, false);
        if ended.generation.is_some_and(|g| g != hub.generation()) {
            // Not a failure: the index must hear the new claims (a new Hello) now.
            metrics.stream_ended("replicas_changed");
            tracing::info!(index = %settings.index, "replica set changed; reopening the index stream");
            delay = settings.backoff_min;
            continue;
        }
        metrics.stream_ended(ended.as_label());
        if ended.welcomed {
            delay = settings.backoff_min;
        }
        tracing::warn!(index = %settings.index, reason = ended.as_label(), detail = %ended.detail,
            retry_ms = delay.as_millis() as u64, "index stream ended; reconnecting");
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(settings.backoff_max);
    }
    metrics.set_connected(&settings.index, false);
}

#[derive(Debug)]
struct StreamEnd {
    reason: &'static str,
    detail: String,
    welcomed: bool,
    /// The hub generation the stream subscribed at (`None`: it never subscribed).
    generation: Option<u64>,
}

impl StreamEnd {
    fn as_label(&self) -> &'static str {
        self.reason
    }
}

async fn stream_once(settings: &StreamSettings, hub: &Hub, metrics: &AgentMetrics) -> StreamEnd {
    let end = |reason, detail: String, welcomed| StreamEnd {
        reason,
        detail,
        welcomed,
        generation: None,
    };
    let endpoint = match Endpoint::from_shared(settings.index.clone()) {
        Ok(endpoint) => endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE)
            .keep_alive_while_idle(true),
        Err(error) => return end("bad_uri", error.to_string(), false),
    };
    let endpoint = match &settings.tls {
        Some(tls) => match tls.apply(endpoint) {
            Ok(endpoint) => endpoint,
            Err(error) => return end("tls", error.to_string(), false),
        },
        None => endpoint,
    };
    let channel = match endpoint.connect().await {
        Ok(channel) => channel,
        Err(error) => return end("connect", error.to_string(), false),
    };
    let mut client = AgentIngestClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);

    // Subscribe only once connected: deltas queue for a live stream, not a dead address.
    let subscription = hub.subscribe();
    let generation = Some(subscription.generation);
    let end = |reason, detail: String, welcomed| StreamEnd {
        generation,
        ..end(reason, detail, welcomed)
    };
    let hello = api::AgentMessage {
        body: Some(api::agent_message::Body::Hello(api::Hello {
            agent_id: settings.agent_id.clone(),
            token: settings.token.expose().to_owned(),
            replicas: subscription.replicas,
        })),
    };
    let outbound = futures::stream::iter(std::iter::once(hello).chain(subscription.snapshot))
        .chain(ReceiverStream::new(subscription.deltas));
    // Opening the stream is a span (the stream itself lasts as long as the agent); the index's
    // side of the opening joins it through the call's metadata.
    let span = kvroute_runtime::trace_span!(
        "kvroute.index.v1.AgentIngest/AgentStream",
        otel.kind = "client",
        rpc.system = "grpc",
        kvroute.index = %settings.index,
    );
    let mut call = tonic::Request::new(outbound);
    if let Some((parent, state)) = kvroute_runtime::telemetry::outgoing_context(&span) {
        let metadata = call.metadata_mut();
        if let Ok(parent) = parent.parse() {
            metadata.insert(TRACEPARENT, parent);
        }
        if let Some(Ok(state)) = state.map(|state| state.parse()) {
            metadata.insert(TRACESTATE, state);
        }
    }
    let mut inbound = match client.agent_stream(call).instrument(span).await {
        Ok(response) => response.into_inner(),
        Err(status) => return end(status_label(&status), status.message().to_owned(), false),
    };
    let mut welcomed = false;
    let refusal_warnings = LogThrottle::new(REFUSAL_WARN_INTERVAL);
    loop {
        match inbound.message().await {
            Ok(Some(api::IndexMessage {
                body: Some(api::index_message::Body::Welcome(welcome)),
            })) => {
                welcomed = true;
                metrics.set_connected(&settings.index, true);
                tracing::info!(index = %settings.index, replicas = ?welcome.accepted, "index stream up");
            }
            Ok(Some(api::IndexMessage {
                body: Some(api::index_message::Body::Refused(refused)),
            })) => {
                metrics.refused_by_index();
                if let Some(suppressed) = refusal_warnings.allow() {
                    tracing::warn!(index = %settings.index, replica_id = %refused.replica_id,
                        reason = %refused.reason, suppressed, "index refused a write");
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => return end("closed", String::new(), welcomed),
            Err(status) => {
                return end(status_label(&status), status.message().to_owned(), welcomed);
            }
        }
    }
}

/// At most one "index refused a write" warning per stream per this interval (all are counted).
const REFUSAL_WARN_INTERVAL: Duration = Duration::from_secs(10);

fn status_label(status: &tonic::Status) -> &'static str {
    match status.code() {
        tonic::Code::Unauthenticated => "unauthenticated",
        tonic::Code::PermissionDenied => "permission_denied",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::Cancelled => "cancelled",
        tonic::Code::InvalidArgument => "invalid_argument",
        tonic::Code::ResourceExhausted => "resource_exhausted",
        _ => "error",
    }
}
