//! kvroute-runtime: what every kvroute binary (ext-proc, the index, the agent) runs on.
//!
//! - [`process`]: the process around a server — [`main`] runs a [`process::Component`] from the
//!   command line to the exit code (config refused: 64), with the `--ready-file`;
//! - [`admin`]: the admin HTTP server (`/metrics`, `/healthz`, `/readyz`, the component's routes);
//! - [`logging`]: the tracing subscriber (text or JSON lines, `log.format`), filtered by
//!   `RUST_LOG`;
//! - [`telemetry`]: OpenTelemetry traces exported over OTLP when `OTEL_EXPORTER_OTLP_*` says so
//!   (off, and free, otherwise), and the request-span helpers;
//! - [`trace_context`]: W3C `traceparent`/`tracestate`, parsed and printed;
//! - [`shutdown`]: the stop signal (SIGTERM, Ctrl-C);
//! - [`config_file`]: the one config-file watcher every component reloads through;
//! - [`tls`]: TLS settings of every kvroute gRPC endpoint, server and client side;
//! - [`token`]: shared secrets (agent and query tokens) and the `authorization` header.
//!
//! Config parsing (durations, TLS and token settings as written) is `kvroute_config`'s.

#![deny(missing_docs)]

pub mod admin;
pub mod config_file;
pub mod listener;
pub mod logging;
pub mod process;
pub mod shutdown;
pub mod telemetry;
pub mod tls;
pub mod token;
pub mod trace_context;

/// For [`trace_span!`]: the `tracing` its expansion names.
#[doc(hidden)]
pub use tracing as __tracing;

pub use process::main;
