//! A real Prometheus (Debian's `prometheus`) on 127.0.0.1 for the test.

use std::path::Path;
use std::process::Command;

use kvroute_test_support::try_poll_until;
use kvroute_tests::harness::{ChildGuard, http, reserve_port};
use serde_json::Value;

use super::{ALERTS, repo_path, settle};

/// A real Prometheus scraping the given admin addresses every second, with the alert rules.
pub(super) struct Prometheus {
    pub(super) process: ChildGuard,
    pub(super) url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    pub(super) async fn start(binary: &Path, jobs: &[(&str, Vec<String>)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let scrape_configs: String = jobs
            .iter()
            .map(|(job, targets)| {
                let targets = targets
                    .iter()
                    .map(|t| format!("\"{t}\""))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("  - job_name: {job}\n    static_configs: [{{targets: [{targets}]}}]\n")
            })
            .collect();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [\"{rules}\"]\n\
                 scrape_configs:\n{scrape_configs}",
                rules = repo_path(ALERTS).display()
            ),
        )
        .unwrap();
        let port = reserve_port().unwrap();
        let mut command = Command::new(binary);
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let process =
            ChildGuard::spawn("prometheus", command, dir.path().join("prometheus.log")).unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let ready = format!("{url}/-/ready");
        try_poll_until("prometheus ready", settle(), || {
            let ready = ready.clone();
            async move {
                http::get(&ready)
                    .await
                    .ok()
                    .filter(|r| r.status == 200)
                    .map(|_| ())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", process.log()));
        Prometheus {
            process,
            url,
            _dir: dir,
        }
    }

    /// The result vector of an instant query (`None` when Prometheus refused it).
    pub(super) async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let url = format!("{}/api/v1/query?query={}", self.url, percent_encode(expr));
        let answer = http::get(&url).await.map_err(|e| e.to_string())?;
        let body = answer
            .json()
            .map_err(|e| format!("{e}: {}", answer.text()))?;
        if body["status"] != "success" {
            return Err(body.to_string());
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
