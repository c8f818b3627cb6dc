//! OpenTelemetry traces: OTLP export configured the standard way, off unless configured, and the
//! span helpers the servers call on their request paths.
//!
//! Export is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set
//! (and neither `OTEL_TRACES_EXPORTER=none` nor `OTEL_SDK_DISABLED=true`), with
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (or `…_TRACES_PROTOCOL`) `http/protobuf` (the default, the
//! generic endpoint gets `/v1/traces` appended) or `grpc`, `OTEL_TRACES_SAMPLER` /
//! `OTEL_TRACES_SAMPLER_ARG` (default `parentbased_traceidratio` at 1.0) and `OTEL_SERVICE_NAME`
//! (default: the binary's name). Headers, timeout and compression are read by the exporter
//! (`OTEL_EXPORTER_OTLP_HEADERS`, …).
//!
//! **No cost when off**: request spans exist only when [`request_spans`] is true — when spans are
//! exported or logs are JSON (whose lines carry the request's trace id). Otherwise
//! [`trace_span!`](crate::trace_span) is `Span::none()` after one relaxed load, and no
//! OpenTelemetry layer is installed.
//!
//! A server continues its caller's trace with [`continue_trace`] and passes its own on with
//! [`outgoing_context`]; spans are flushed when the process ends ([`Telemetry::shutdown`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::trace_context::{RemoteContext, TraceParent};

/// The `tracing` target of every request span: the OpenTelemetry layer sees only these.
pub const TARGET: &str = "kvroute::trace";

/// How long the last spans may take to leave at shutdown.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

static REQUEST_SPANS: AtomicBool = AtomicBool::new(false);
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether request spans are made: spans are exported, or logs are JSON. One relaxed load.
#[inline]
pub fn request_spans() -> bool {
    REQUEST_SPANS.load(Ordering::Relaxed)
}

/// Whether spans are exported (an OpenTelemetry layer is installed).
#[inline]
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

pub(crate) fn set_modes(request_spans: bool, exporting: bool) {
    REQUEST_SPANS.store(request_spans, Ordering::Relaxed);
    EXPORTING.store(exporting, Ordering::Relaxed);
}

/// An `info` span with target [`TARGET`] when [`request_spans`] is on, else `Span::none()`:
/// takes what `tracing::info_span!` takes after its target.
#[macro_export]
macro_rules! trace_span {
    ($($args:tt)*) => {
        if $crate::telemetry::request_spans() {
            $crate::__tracing::info_span!(target: $crate::telemetry::TARGET, $($args)*)
        } else {
            $crate::__tracing::Span::none()
        }
    };
}

/// The OTLP protocol of the exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `grpc`: OTLP/gRPC (collector port 4317).
    Grpc,
    /// `http/protobuf`: OTLP/HTTP with protobuf bodies (collector port 4318).
    HttpProtobuf,
}

/// Which spans are recorded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerSetting {
    /// `always_on`.
    AlwaysOn,
    /// `always_off`.
    AlwaysOff,
    /// `traceidratio`: this share of traces, by trace id.
    Ratio(f64),
    /// `parentbased_always_on`.
    ParentBasedAlwaysOn,
    /// `parentbased_always_off`.
    ParentBasedAlwaysOff,
    /// `parentbased_traceidratio` (the default, at 1.0): the caller's decision when there is
    /// one, else this share of traces.
    ParentBasedRatio(f64),
}

/// The trace export, from the `OTEL_*` environment.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpSettings {
    /// Where spans go (for HTTP, the whole URL of the traces resource).
    pub endpoint: String,
    /// How.
    pub protocol: Protocol,
    /// Which spans.
    pub sampler: SamplerSetting,
    /// `service.name`.
    pub service_name: String,
}

/// An `OTEL_*` variable kvroute cannot use: the process refuses to start (exit 64).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value:?}: {reason}")]
pub struct OtelEnvError {
    /// The variable.
    pub variable: &'static str,
    /// Its value.
    pub value: String,
    /// What is accepted.
    pub reason: &'static str,
}

impl OtlpSettings {
    /// The settings `lookup` (an environment) asks for; `None` when no endpoint is set or export
    /// is disabled. `service_name` is the default `service.name`.
    pub fn from_env(
        lookup: impl Fn(&str) -> Option<String>,
        service_name: &str,
    ) -> Result<Option<Self>, OtelEnvError> {
        let get = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        if get("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match get("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => {
                return Err(OtelEnvError {
                    variable: "OTEL_TRACES_EXPORTER",
                    value: other.to_owned(),
                    reason: "expected otlp or none",
                });
            }
        }
        let (protocol_variable, protocol) = match get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") {
            Some(value) => ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", Some(value)),
            None => (
                "OTEL_EXPORTER_OTLP_PROTOCOL",
                get("OTEL_EXPORTER_OTLP_PROTOCOL"),
            ),
        };
        let protocol = match protocol.as_deref().map(str::trim) {
            None | Some("http/protobuf") => Protocol::HttpProtobuf,
            Some("grpc") => Protocol::Grpc,
            Some(other) => {
                return Err(OtelEnvError {
                    variable: protocol_variable,
                    value: other.to_owned(),
                    reason: "expected grpc or http/protobuf",
                });
            }
        };
        let endpoint = if let Some(traces) = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            traces.trim().to_owned()
        } else if let Some(base) = get("OTEL_EXPORTER_OTLP_ENDPOINT") {
            let base = base.trim();
            match protocol {
                Protocol::Grpc => base.to_owned(),
                Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
            }
        } else {
            return Ok(None);
        };
        Ok(Some(Self {
            endpoint,
            protocol,
            sampler: sampler(get("OTEL_TRACES_SAMPLER"), get("OTEL_TRACES_SAMPLER_ARG"))?,
            service_name: get("OTEL_SERVICE_NAME")
                .map_or_else(|| service_name.to_owned(), |name| name.trim().to_owned()),
        }))
    }
}

fn sampler(name: Option<String>, arg: Option<String>) -> Result<SamplerSetting, OtelEnvError> {
    let ratio = || match arg.as_deref().map(str::trim) {
        None => Ok(1.0),
        Some(text) => text
            .parse::<f64>()
            .ok()
            .filter(|ratio| (0.0..=1.0).contains(ratio))
            .ok_or_else(|| OtelEnvError {
                variable: "OTEL_TRACES_SAMPLER_ARG",
                value: text.to_owned(),
                reason: "expected a ratio in 0..=1",
            }),
    };
    Ok(match name.as_deref().map(str::trim) {
        None | Some("parentbased_traceidratio") => SamplerSetting::ParentBasedRatio(ratio()?),
        Some("traceidratio") => SamplerSetting::Ratio(ratio()?),
        Some("always_on") => SamplerSetting::AlwaysOn,
        Some("always_off") => SamplerSetting::AlwaysOff,
        Some("parentbased_always_on") => SamplerSetting::ParentBasedAlwaysOn,
        Some("parentbased_always_off") => SamplerSetting::ParentBasedAlwaysOff,
        Some(other) => {
            return Err(OtelEnvError {
                variable: "OTEL_TRACES_SAMPLER",
                value: other.to_owned(),
                reason: "expected always_on, always_off, traceidratio, parentbased_always_on, \
                         parentbased_always_off or parentbased_traceidratio",
            });
        }
    })
}

impl SamplerSetting {
    fn sampler(self) -> Sampler {
        match self {
            Self::AlwaysOn => Sampler::AlwaysOn,
            Self::AlwaysOff => Sampler::AlwaysOff,
            Self::Ratio(ratio) => Sampler::TraceIdRatioBased(ratio),
            Self::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
            Self::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
            Self::ParentBasedRatio(ratio) => {
                Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
            }
        }
    }
}

/// The exporter could not be built (an endpoint that is no URL).
#[derive(Debug, thiserror::Error)]
#[error("cannot export traces to {endpoint}")]
pub struct ExporterError {
    endpoint: String,
    #[source]
    source: opentelemetry_otlp::ExporterBuildError,
}

/// The tracer provider spans go to, built inside the tokio runtime the exporter's connections
/// run on.
pub(crate) fn provider(settings: &OtlpSettings) -> Result<SdkTracerProvider, ExporterError> {
    let error = |source| ExporterError {
        endpoint: settings.endpoint.clone(),
        source,
    };
    let exporter = match settings.protocol {
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(settings.endpoint.clone())
            .build(),
        Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(settings.endpoint.clone())
            .build(),
    }
    .map_err(error)?;
    let runtime = tokio::runtime::Handle::current();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(InRuntime {
            inner: exporter,
            runtime,
        })
        .with_sampler(settings.sampler.sampler())
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(settings.service_name.clone())
                .build(),
        )
        .build())
}

/// The OpenTelemetry layer over `provider`'s tracer.
pub(crate) fn layer<S>(
    provider: &SdkTracerProvider,
    service_name: &str,
) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service_name.to_owned()))
        .with_location(false)
        .with_threads(false)
}

/// A span exporter whose exports run with `runtime` entered: the SDK's batch processor calls it
/// on a thread of its own, and the HTTP client's timers need a tokio runtime.
#[derive(Debug)]
struct InRuntime<E> {
    inner: E,
    runtime: tokio::runtime::Handle,
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for InRuntime<E>
{
    fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> impl Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        EnterOnPoll {
            runtime: &self.runtime,
            inner: Box::pin(self.inner.export(batch)),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// Polls `inner` with `runtime` entered.
struct EnterOnPoll<'a, F> {
    runtime: &'a tokio::runtime::Handle,
    inner: std::pin::Pin<Box<F>>,
}

impl<F: Future> Future for EnterOnPoll<'_, F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let _entered = self.runtime.enter();
        self.inner.as_mut().poll(cx)
    }
}

/// The exporting part of the process's telemetry: flushed and stopped by [`Self::shutdown`].
#[derive(Debug, Default)]
pub struct Telemetry {
    pub(crate) provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still buffered (waiting up to 5 s) and stops the exporter. Call it with
    /// the tokio runtime still alive, outside its worker threads.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(error) = provider.shutdown_with_timeout(SHUTDOWN_FLUSH)
        {
            tracing::warn!(%error, "spans not all exported at shutdown");
        }
    }
}

/// The caller's trace id, kept on a request span when no spans are exported, so JSON log lines
/// inside it still name the trace.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteTraceId(pub(crate) [u8; 16]);

/// Makes `span` (a request's server span, just created) continue `remote`, the caller's trace:
/// its OpenTelemetry parent when spans are exported (a new trace when `remote` is `None`), else
/// only the trace id JSON log lines print. Nothing when `span` is disabled.
pub fn continue_trace(span: &tracing::Span, remote: Option<&RemoteContext>) {
    if span.is_none() {
        return;
    }
    if exporting() {
        if let Some(remote) = remote {
            let parent = span_context(&remote.parent, remote.state.as_deref(), true);
            // Fails only when the span was started already: it was just created.
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
        }
        return;
    }
    let Some(remote) = remote else { return };
    let trace_id = RemoteTraceId(remote.parent.trace_id);
    span.with_subscriber(|(id, dispatch)| {
        if let Some(registry) = dispatch.downcast_ref::<tracing_subscriber::Registry>()
            && let Some(span) = tracing_subscriber::registry::LookupSpan::span(registry, id)
        {
            span.extensions_mut().insert(trace_id);
        }
    });
}

/// [`continue_trace`] for a gRPC call's server span, from the call's metadata (read only when
/// `span` is enabled).
pub fn continue_grpc_trace(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    if !span.is_none() {
        continue_trace(span, RemoteContext::from_metadata(metadata).as_ref());
    }
}

/// The `traceparent` (and `tracestate`) naming `span` as the parent, for a request kvroute sends
/// on (the upstream request, a `Match` call); `None` unless spans are exported and `span` is
/// part of a trace.
pub fn outgoing_context(span: &tracing::Span) -> Option<(String, Option<String>)> {
    if !exporting() || span.is_none() {
        return None;
    }
    let context = span.context();
    let span_ref = context.span();
    let span_context = span_ref.span_context();
    if !span_context.is_valid() {
        return None;
    }
    let parent = TraceParent {
        trace_id: span_context.trace_id().to_bytes(),
        span_id: span_context.span_id().to_bytes(),
        flags: span_context.trace_flags().to_u8(),
    };
    let state = span_context.trace_state().header();
    Some((parent.to_string(), (!state.is_empty()).then_some(state)))
}

/// An OpenTelemetry span context for `parent` and its `tracestate`.
fn span_context(parent: &TraceParent, state: Option<&str>, remote: bool) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        SpanId::from_bytes(parent.span_id),
        TraceFlags::new(parent.flags & 1),
        remote,
        state
            .and_then(|state| state.parse::<TraceState>().ok())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<Option<OtlpSettings>, OtelEnvError> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        OtlpSettings::from_env(|name| env.get(name).cloned(), "kvroute-test")
    }

    #[test]
    fn nothing_is_exported_without_an_endpoint() {
        assert_eq!(settings(&[]), Ok(None));
        assert_eq!(settings(&[("OTEL_TRACES_SAMPLER", "always_on")]), Ok(None));
        assert_eq!(
            settings(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_TRACES_EXPORTER", "none")
            ]),
            Ok(None)
        );
        assert_eq!(
            settings(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SDK_DISABLED", "true")
            ]),
            Ok(None)
        );
    }

    #[test]
    fn the_defaults_are_http_protobuf_and_parent_based_ratio_one() {
        let s = settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")])
            .unwrap()
            .unwrap();
        assert_eq!(s.endpoint, "http://c:4318/v1/traces");
        assert_eq!(s.protocol, Protocol::HttpProtobuf);
        assert_eq!(s.sampler, SamplerSetting::ParentBasedRatio(1.0));
        assert_eq!(s.service_name, "kvroute-test");
    }

    #[test]
    fn the_traces_endpoint_is_used_as_given_and_grpc_takes_the_base() {
        let s = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_SERVICE_NAME", "picker"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(s.endpoint, "http://c:4317");
        assert_eq!(s.protocol, Protocol::Grpc);
        assert_eq!(s.sampler, SamplerSetting::Ratio(0.25));
        assert_eq!(s.service_name, "picker");
        let s = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:9/x"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(s.endpoint, "http://t:9/x");
    }

    #[test]
    fn unusable_values_are_refused_naming_the_variable() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        for (variable, value) in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "smoke"),
            ("OTEL_TRACES_SAMPLER", "sometimes"),
            ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
            ("OTEL_TRACES_SAMPLER_ARG", "half"),
            ("OTEL_TRACES_EXPORTER", "zipkin"),
        ] {
            let error = settings(&[endpoint, (variable, value)]).unwrap_err();
            assert_eq!(error.variable, variable);
            assert_eq!(error.value, value);
        }
    }

    #[test]
    fn without_request_spans_the_span_helpers_do_nothing() {
        let span = crate::trace_span!("gateway.request");
        assert!(span.is_none());
        continue_trace(&span, None);
        assert_eq!(outgoing_context(&span), None);
    }
}
