//! Process harnesses for integration tests: a real Envoy ([`Envoy`]), our binaries such as the
//! engine simulator ([`SimProcess`]), a TCP link a test can cut ([`TcpProxy`]), a small HTTP
//! client ([`http`]), an ext_proc client playing Envoy and the one fake ext_proc ([`ext_proc`])
//! the one `/metrics` and `/proc` parser ([`metrics`]) and an OTLP trace receiver ([`otlp`]); deadline polling is
//! `kvroute_test_support`'s, which every kvroute crate shares.
//!
//! Every process listens on port 0 and reports its real ports (one that cannot, such as real
//! vLLM, gets a port from [`reserve_port`], outside the ephemeral range); readiness is a polled condition
//! with a deadline, never a fixed sleep. A [`ChildGuard`] owns each process: on drop it sends
//! SIGTERM, then kills after a grace period, and prints the process log if the test is panicking.

mod envoy;
pub mod ext_proc;
pub mod health;
pub mod http;
pub mod metrics;
pub mod otlp;
pub mod pd_sidecar;
pub mod ports;
mod process;
mod proxy;
mod sim_process;

use std::path::PathBuf;
use std::time::Duration;

use kvroute_test_support::{TimedOut, deadline, try_poll_until};

pub use envoy::{Envoy, envoy_bin, round_robin_config};
pub use ports::{reserve_port, reserve_port_run, reserve_ports};
pub use process::ChildGuard;
pub use proxy::TcpProxy;
pub use sim_process::SimProcess;

/// How long a process gets to become ready.
pub fn startup_timeout() -> Duration {
    deadline(Duration::from_secs(30))
}

/// Why a harness step failed.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A process could not be spawned.
    #[error("cannot spawn {program}")]
    Spawn {
        /// The program.
        program: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A condition did not hold in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The deadline.
        after: Duration,
    },
    /// A file operation failed.
    #[error("i/o on {}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The process answered something unexpected.
    #[error("unexpected answer from {what}: {detail}")]
    Protocol {
        /// Which endpoint.
        what: String,
        /// What was wrong.
        detail: String,
    },
}

impl HarnessError {
    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            HarnessError::Spawn { .. } => "spawn",
            HarnessError::Timeout { .. } => "timeout",
            HarnessError::Io { .. } => "io",
            HarnessError::Protocol { .. } => "protocol",
        }
    }
}

impl From<TimedOut> for HarnessError {
    fn from(TimedOut { what, after }: TimedOut) -> Self {
        HarnessError::Timeout { what, after }
    }
}

/// Waits until kvroute-ext-proc at `admin_url` (`http://host:port`) sees every replica idle: its
/// in-flight, running and waiting gauges all zero. A test that compares two sequential requests'
/// decisions waits for this between them, so that a scrape taken while the first was running
/// cannot make the second prefer another replica on load.
pub async fn until_ext_proc_sees_replicas_idle(
    admin_url: &str,
    timeout: Duration,
) -> Result<(), HarnessError> {
    let url = format!("{admin_url}/metrics");
    try_poll_until("ext-proc to see every replica idle", timeout, || async {
        let text = http::get(&url).await.ok()?.text();
        [
            "kvroute_extproc_replica_inflight_requests",
            "kvroute_extproc_replica_running_requests",
            "kvroute_extproc_replica_waiting_requests",
        ]
        .iter()
        .all(|family| metrics::sum(&text, family, &[]) == 0.0)
        .then_some(())
    })
    .await
    .map_err(HarnessError::from)
}

/// The workspace root (`tests/..`).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The shared tiny model folder (tokenizer + config) committed under `tests/fixtures/`.
pub fn tiny_model_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/tiny-model"))
}
