//! [`SimProcess`]: `kvroute-engine-sim` as a child process, ready once it wrote its addresses.

use std::path::PathBuf;
use std::process::Command;

use kvroute_test_support::try_poll_until;

use super::{ChildGuard, HarnessError, http, startup_timeout};
use crate::sim::ReadyInfo;

/// A running simulator process (stopped on drop).
#[derive(Debug)]
pub struct SimProcess {
    /// The bound addresses it reported.
    pub ready: ReadyInfo,
    guard: ChildGuard,
    _dir: tempfile::TempDir,
}

impl SimProcess {
    /// Starts `binary` (the `kvroute-engine-sim` executable) with `args` plus `--ready-file`, and
    /// waits until the file exists and `/health` answers 200.
    pub async fn spawn(binary: &str, args: &[String]) -> Result<Self, HarnessError> {
        let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
            path: PathBuf::from("tempdir"),
            source,
        })?;
        let ready_file = dir.path().join("ready.json");
        let mut command = Command::new(binary);
        command.args(args).arg("--ready-file").arg(&ready_file);
        let mut guard =
            ChildGuard::spawn("kvroute-engine-sim", command, dir.path().join("sim.log"))?;
        let ready: ReadyInfo = try_poll_until("engine sim ready file", startup_timeout(), || {
            let exited = guard.exited();
            let ready_file = ready_file.clone();
            async move {
                if let Some(status) = exited {
                    // Fail fast: a dead process never becomes ready.
                    return Some(Err(status));
                }
                let text = std::fs::read_to_string(ready_file).ok()?;
                serde_json::from_str(&text).ok().map(Ok)
            }
        })
        .await?
        .map_err(|status| HarnessError::Protocol {
            what: "kvroute-engine-sim".to_owned(),
            detail: format!("exited with {status} before ready: {}", guard.log()),
        })?;
        let health = format!("http://{}/health", ready.http);
        try_poll_until("engine sim /health", startup_timeout(), || {
            let health = health.clone();
            async move {
                http::get(&health)
                    .await
                    .ok()
                    .filter(|r| r.status.is_success())
            }
        })
        .await?;
        Ok(Self {
            ready,
            guard,
            _dir: dir,
        })
    }

    /// Base URL of its HTTP API.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.ready.http)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }

    /// SIGKILL, as an engine crash: requests in flight are cut, nothing is flushed.
    pub fn kill(&mut self) {
        self.guard.kill();
    }
}
