//! Logging set-up, the same for every kvroute binary: log lines to stderr as text or JSON
//! (`log.format`), filtered by `RUST_LOG`, and the OpenTelemetry layer when spans are exported
//! ([`crate::telemetry`]).
//!
//! A JSON line is one object: `timestamp` (RFC 3339, UTC), `level`, `target`, `message`,
//! `fields` (the event's other fields), `span` (the innermost span's name, when inside one), and
//! inside a traced request `trace_id` — with `span_id`, the kvroute span's, when spans are
//! exported. Without export a request span holds only its caller's trace id (there is no kvroute
//! span to name), so a line gets `trace_id` alone.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::OnceLock;

use kvroute_config::LogFormat;
use opentelemetry::trace::TraceContextExt as _;
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::telemetry::{self, ExporterError, OtlpSettings, RemoteTraceId, Telemetry};
use crate::trace_context::hex;

/// Logs text lines to stderr, filtered by `RUST_LOG`, or by `default_filter` (e.g. `warn`) when it
/// is unset or unparsable; no span export (a command-line tool's logging).
pub fn init(default_filter: &str) {
    // Without an exporter there is nothing that can fail.
    let _ = init_with(default_filter, LogFormat::Text, None);
}

/// Logs to stderr in `format`, filtered by `RUST_LOG`, or by `default_filter` (e.g. `info`) when
/// it is unset or unparsable; exports spans as `otlp` says (built on the current tokio runtime),
/// named `service_name` unless `OTEL_SERVICE_NAME` says otherwise. When the exporter cannot be
/// built, logging starts without it and the error is returned.
pub fn init_with(
    default_filter: &str,
    format: LogFormat,
    otlp: Option<&OtlpSettings>,
) -> Result<Telemetry, ExporterError> {
    let (provider, error) = match otlp.map(telemetry::provider).transpose() {
        Ok(provider) => (provider, None),
        Err(error) => (None, Some(error)),
    };
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter))
    };
    let otel = provider.as_ref().zip(otlp).map(|(provider, otlp)| {
        telemetry::layer(provider, &otlp.service_name).with_filter(
            tracing_subscriber::filter::filter_fn(|metadata| {
                metadata.target() == telemetry::TARGET
            }),
        )
    });
    let subscriber = tracing_subscriber::registry().with(otel);
    // Boxed, not optional: an `Option` layer does not pass on the dispatch JSON lines need to
    // read a span's OpenTelemetry context.
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter())
            .boxed(),
        LogFormat::Json => {
            // Request spans are seen whatever `RUST_LOG` says: their trace id goes on every line.
            let filter = match format!("{}=info", telemetry::TARGET).parse() {
                Ok(directive) => filter().add_directive(directive),
                Err(_) => filter(),
            };
            JsonLines::default().with_filter(filter).boxed()
        }
    };
    // Another subscriber already installed (a test calling twice): keep it.
    let _ = subscriber.with(logs).try_init();
    telemetry::set_modes(
        provider.is_some() || format == LogFormat::Json,
        provider.is_some(),
    );
    match error {
        None => Ok(Telemetry { provider }),
        Some(error) => Err(error),
    }
}

/// The JSON-lines layer.
#[derive(Default)]
struct JsonLines {
    /// The subscriber it is part of, to read a span's OpenTelemetry context.
    dispatch: OnceLock<tracing::dispatcher::WeakDispatch>,
}

impl<S> tracing_subscriber::Layer<S> for JsonLines
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        let _ = self.dispatch.set(subscriber.downgrade());
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let metadata = event.metadata();
        let mut line = String::with_capacity(256);
        line.push_str("{\"timestamp\":\"");
        let mut timestamp = String::new();
        if tracing_subscriber::fmt::time::FormatTime::format_time(
            &tracing_subscriber::fmt::time::SystemTime,
            &mut tracing_subscriber::fmt::format::Writer::new(&mut timestamp),
        )
        .is_ok()
        {
            line.push_str(&timestamp);
        }
        let _ = write!(
            line,
            "\",\"level\":\"{}\",\"target\":{},\"message\":{},\"fields\":{}",
            metadata.level(),
            json_string(metadata.target()),
            json_string(&fields.message),
            serde_json::Value::Object(fields.rest),
        );
        if let Some(span) = ctx.event_span(event) {
            let _ = write!(line, ",\"span\":{}", json_string(span.name()));
        }
        if let Some((trace_id, span_id)) = self.trace_ids(event, &ctx) {
            let _ = write!(line, ",\"trace_id\":\"{}\"", hex(&trace_id));
            if let Some(span_id) = span_id {
                let _ = write!(line, ",\"span_id\":\"{}\"", hex(&span_id));
            }
        }
        line.push_str("}\n");
        // One write per line, so lines of different threads do not interleave.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

impl JsonLines {
    /// The trace (and kvroute span) of the innermost span around `event` that is part of one.
    fn trace_ids<S>(
        &self,
        event: &tracing::Event<'_>,
        ctx: &Context<'_, S>,
    ) -> Option<([u8; 16], Option<[u8; 8]>)>
    where
        S: tracing::Subscriber + for<'span> LookupSpan<'span>,
    {
        let scope = ctx.event_scope(event)?;
        let dispatch = telemetry::exporting()
            .then(|| self.dispatch.get().and_then(|weak| weak.upgrade()))
            .flatten();
        for span in scope {
            // The guard is dropped before the OpenTelemetry layer locks the span's extensions.
            let remote = span.extensions().get::<RemoteTraceId>().copied();
            if let Some(RemoteTraceId(trace_id)) = remote {
                return Some((trace_id, None));
            }
            if let Some(dispatch) = &dispatch
                && let Some(context) = tracing_opentelemetry::get_otel_context(&span.id(), dispatch)
            {
                let span_ref = context.span();
                let span_context = span_ref.span_context();
                if span_context.is_valid() {
                    return Some((
                        span_context.trace_id().to_bytes(),
                        Some(span_context.span_id().to_bytes()),
                    ));
                }
            }
        }
        None
    }
}

fn json_string(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// An event's fields: its message, and the rest as JSON values.
#[derive(Default)]
struct Fields {
    message: String,
    rest: serde_json::Map<String, serde_json::Value>,
}

impl Fields {
    fn insert(&mut self, field: &Field, value: serde_json::Value) {
        if field.name() == "message" {
            self.message = match value {
                serde_json::Value::String(text) => text,
                other => other.to_string(),
            };
        } else {
            self.rest.insert(field.name().to_owned(), value);
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.insert(field, value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.insert(field, value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.insert(field, value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.insert(field, value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.insert(field, value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.insert(field, crate::process::ErrorChain(value).to_string().into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.insert(field, format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Checks the fields of every event it sees, counting them.
    struct Check(AtomicUsize);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for &'static Check {
        fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
            let mut fields = Fields::default();
            event.record(&mut fields);
            assert_eq!(fields.message, "hello world");
            assert_eq!(
                serde_json::Value::Object(fields.rest),
                serde_json::json!({"count": 3, "ok": true, "name": "a\"b", "shown": "[1]"})
            );
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn fields_keep_their_json_types_and_the_message_stands_apart() {
        static CHECK: Check = Check(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry().with(&CHECK);
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(count = 3_u64, ok = true, name = "a\"b", shown = ?[1], "hello {}", "world");
        });
        assert_eq!(CHECK.0.load(Ordering::Relaxed), 1);
    }
}
