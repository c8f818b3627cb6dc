//! [`OtlpReceiver`]: an OpenTelemetry trace receiver on the official OTLP protos, over gRPC
//! (`opentelemetry.proto.collector.trace.v1.TraceService/Export`) and HTTP (`POST /v1/traces`,
//! protobuf), keeping every span it is sent with the `service.name` that sent it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use kvroute_test_support::deadline;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::HarnessError;

/// A span as received, with the service that sent it.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    /// The span.
    pub span: opentelemetry_proto::tonic::trace::v1::Span,
}

impl ReceivedSpan {
    /// The trace id, lowercase hex.
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    /// The span id, lowercase hex.
    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    /// The parent span id, lowercase hex (empty for a root span).
    pub fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    /// A string, integer or boolean attribute, as text.
    pub fn attribute(&self, key: &str) -> Option<String> {
        attribute(&self.span.attributes, key)
    }
}

/// Spans received so far, in arrival order.
#[derive(Debug, Clone, Default)]
struct Received(Arc<parking_lot::Mutex<Vec<ReceivedSpan>>>);

impl Received {
    fn add(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.0.lock();
        for resource_spans in request.resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| attribute(&resource.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                spans.extend(scope.spans.into_iter().map(|span| ReceivedSpan {
                    service: service.clone(),
                    span,
                }));
            }
        }
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.add(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// OTLP/HTTP's `POST /v1/traces` with a protobuf body.
async fn export_http(
    axum::extract::State(received): axum::extract::State<Received>,
    body: Bytes,
) -> axum::response::Response {
    match ExportTraceServiceRequest::decode(body) {
        Ok(request) => {
            received.add(request);
            (
                [(header::CONTENT_TYPE, "application/x-protobuf")],
                ExportTraceServiceResponse::default().encode_to_vec(),
            )
                .into_response()
        }
        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
    }
}

/// A trace receiver on 127.0.0.1: OTLP/gRPC on [`OtlpReceiver::grpc_endpoint`], OTLP/HTTP on
/// [`OtlpReceiver::http_endpoint`]. Stops when dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    grpc: SocketAddr,
    http: SocketAddr,
    received: Received,
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl OtlpReceiver {
    /// Binds both listeners and serves.
    pub async fn start() -> Result<Self, HarnessError> {
        let bind = || async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(listen_error)?;
            let addr = listener.local_addr().map_err(listen_error)?;
            Ok::<_, HarnessError>((listener, addr))
        };
        let (grpc_listener, grpc) = bind().await?;
        let (http_listener, http) = bind().await?;
        let received = Received::default();
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let grpc_server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(received.clone()))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(grpc_listener),
                stop.clone().cancelled_owned(),
            );
        tasks.spawn(async move {
            if let Err(error) = grpc_server.await {
                eprintln!("OTLP/gRPC receiver at {grpc} failed: {error}");
            }
        });
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(export_http))
            .with_state(received.clone());
        let http_server =
            axum::serve(http_listener, app).with_graceful_shutdown(stop.clone().cancelled_owned());
        tasks.spawn(async move {
            if let Err(error) = http_server.await {
                eprintln!("OTLP/HTTP receiver at {http} failed: {error}");
            }
        });
        tasks.close();
        Ok(Self {
            grpc,
            http,
            received,
            stop,
            tasks,
        })
    }

    /// Its OTLP/gRPC address (for Envoy's own tracer).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc
    }

    /// The `OTEL_EXPORTER_OTLP_ENDPOINT` of its gRPC side (with `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`).
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The `OTEL_EXPORTER_OTLP_ENDPOINT` of its HTTP side (`http/protobuf`; the exporter appends
    /// `/v1/traces`).
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.0.lock().clone()
    }

    /// The spans of trace `trace_id` (lowercase hex) received so far.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.received
            .0
            .lock()
            .iter()
            .filter(|span| span.trace_id() == trace_id)
            .cloned()
            .collect()
    }

    /// Stops both servers and waits for them.
    pub async fn stop(&self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(deadline(Duration::from_secs(10)), self.tasks.wait()).await;
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    match value.value.as_ref()? {
        AnyValue::StringValue(text) => Some(text.clone()),
        AnyValue::IntValue(n) => Some(n.to_string()),
        AnyValue::BoolValue(b) => Some(b.to_string()),
        AnyValue::DoubleValue(x) => Some(x.to_string()),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn listen_error(error: std::io::Error) -> HarnessError {
    HarnessError::Protocol {
        what: "an OTLP receiver's listener on 127.0.0.1:0".to_owned(),
        detail: error.to_string(),
    }
}
