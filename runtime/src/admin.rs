//! The admin HTTP server every kvroute component runs on its own port: `/metrics`, `/healthz`,
//! `/readyz` (when the component has a readiness), plus the component's own routes.
//!
//! - `/metrics`: the component's [`Registry`] as OpenMetrics text ([`METRICS_CONTENT_TYPE`]);
//! - `/healthz`: `200 ok` while the process serves HTTP at all (liveness);
//! - `/readyz`: what the component's [`ReadinessProbe`] says — `200` when ready, `503` when not,
//!   with the probe's body either way.
//!
//! ```no_run
//! # async fn demo(registry: std::sync::Arc<prometheus_client::registry::Registry>) -> std::io::Result<()> {
//! use kvroute_runtime::admin::{AdminListener, AdminServer, Readiness};
//!
//! let listener = AdminListener::bind(([127, 0, 0, 1], 0).into()).await?;
//! let bound = listener.local_addr();
//! AdminServer::new(registry)
//!     .readiness(|| Readiness::ready("ready\n"))
//!     .routes(axum::Router::new().route("/v1/hello", axum::routing::get(|| async { "hi\n" })))
//!     .serve(listener, async { let _ = tokio::signal::ctrl_c().await; })
//!     .await
//! # }
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// The one content type `/metrics` answers with (OpenMetrics text, what Prometheus negotiates).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What `/readyz` answers: `200` when [`Readiness::ready`], else `503`; the body as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    /// Whether the component takes traffic.
    pub ready: bool,
    /// Plain text for operators: the verdict and, when the component knows, why.
    pub body: String,
}

impl Readiness {
    /// Ready (`200`), saying `body`.
    pub fn ready(body: impl Into<String>) -> Self {
        Self {
            ready: true,
            body: body.into(),
        }
    }

    /// Not ready (`503`), saying `body`.
    pub fn not_ready(body: impl Into<String>) -> Self {
        Self {
            ready: false,
            body: body.into(),
        }
    }
}

/// A component's readiness, asked on every `/readyz` (so it must be cheap and must not block).
pub trait ReadinessProbe: Send + Sync + 'static {
    /// Whether the component is ready now, and the body that says so.
    fn readiness(&self) -> Readiness;
}

impl<F> ReadinessProbe for F
where
    F: Fn() -> Readiness + Send + Sync + 'static,
{
    fn readiness(&self) -> Readiness {
        self()
    }
}

/// Builds the admin server: the common routes, the component's readiness and its own routes.
#[derive(Debug)]
pub struct AdminServer {
    registry: Arc<Registry>,
    readiness: Option<Arc<dyn ReadinessProbe>>,
    routes: Router,
}

impl std::fmt::Debug for dyn ReadinessProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReadinessProbe")
    }
}

impl AdminServer {
    /// `/metrics` (from `registry`) and `/healthz`; no `/readyz` until [`AdminServer::readiness`].
    pub fn new(registry: Arc<Registry>) -> Self {
        Self {
            registry,
            readiness: None,
            routes: Router::new(),
        }
    }

    /// Serves `/readyz` from `probe`.
    pub fn readiness(mut self, probe: impl ReadinessProbe) -> Self {
        self.readiness = Some(Arc::new(probe));
        self
    }

    /// Adds the component's own routes (merged: a path the server already has is a bug, and
    /// axum panics at build time, in every test that starts the component).
    pub fn routes(mut self, routes: Router) -> Self {
        self.routes = self.routes.merge(routes);
        self
    }

    /// The whole router (for serving it some other way, and for tests).
    pub fn into_router(self) -> Router {
        let registry = self.registry;
        let mut router = Router::new()
            .route(
                "/metrics",
                get(move || {
                    let registry = Arc::clone(&registry);
                    async move { metrics(&registry) }
                }),
            )
            .route("/healthz", get(|| async { "ok\n" }));
        if let Some(probe) = self.readiness {
            router = router.route(
                "/readyz",
                get(move || {
                    let probe = Arc::clone(&probe);
                    async move { readyz(probe.readiness()) }
                }),
            );
        }
        router.merge(self.routes)
    }

    /// Serves the routes on `listener` until `shutdown` resolves; open requests then finish
    /// before it returns. An error means the server is gone (the component decides whether the
    /// process goes on without it).
    pub async fn serve(
        self,
        listener: AdminListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        axum::serve(listener.listener, self.into_router())
            .with_graceful_shutdown(shutdown)
            .await?;
        tracing::debug!(exit_reason = "shutdown", "admin server stopped");
        Ok(())
    }
}

/// The admin server's bound listener. Components bind it with their other listeners, before they
/// build what the routes serve, so a port in use fails the start before anything runs.
#[derive(Debug)]
pub struct AdminListener {
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl AdminListener {
    /// Binds `addr` (port 0 picks a free port; [`AdminListener::local_addr`] says which).
    pub async fn bind(addr: SocketAddr) -> Result<Self, crate::listener::BindError> {
        let (listener, local_addr) = crate::listener::bind("admin", addr).await?;
        Ok(Self {
            listener,
            local_addr,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

fn metrics(registry: &Registry) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, registry) {
        Ok(()) => ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {error}\n"),
        )
            .into_response(),
    }
}

fn readyz(readiness: Readiness) -> Response {
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, readiness.body).into_response()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use prometheus_client::metrics::counter::Counter;
    use tokio::sync::oneshot;

    use super::*;

    /// `GET path`: the status line's code, the headers and the body.
    async fn fetch(addr: SocketAddr, path: &str) -> (u16, String, String) {
        let text = kvroute_test_support::http_get(addr, path).await;
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_ascii_lowercase(), body.to_owned())
    }

    fn registry() -> Arc<Registry> {
        let mut registry = Registry::with_prefix("demo");
        let counter = Counter::<u64>::default();
        counter.inc();
        registry.register("things", "Things seen", counter);
        Arc::new(registry)
    }

    #[tokio::test]
    async fn serves_metrics_probes_and_the_components_routes_until_shutdown() {
        let ready = Arc::new(AtomicBool::new(true));
        let probe_ready = Arc::clone(&ready);
        let listener = AdminListener::bind(([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        let addr = listener.local_addr();
        assert_ne!(addr.port(), 0);
        let admin = AdminServer::new(registry())
            .readiness(move || {
                if probe_ready.load(Ordering::Relaxed) {
                    Readiness::ready("ready\n")
                } else {
                    Readiness::not_ready("draining\n")
                }
            })
            .routes(Router::new().route("/v1/own", get(|| async { "own\n" })));
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = admin.serve(listener, async {
            let _ = stopped.await;
        });
        let checks = async {
            let (status, head, body) = fetch(addr, "/metrics").await;
            assert_eq!(status, 200);
            assert!(
                head.contains(&format!("content-type: {METRICS_CONTENT_TYPE}")),
                "{head}"
            );
            assert!(body.contains("demo_things_total 1"), "{body}");
            assert!(body.ends_with("# EOF\n"), "{body}");
            let (status, _, body) = fetch(addr, "/healthz").await;
            assert_eq!((status, body.as_str()), (200, "ok\n"));
            let (status, _, body) = fetch(addr, "/readyz").await;
            assert_eq!((status, body.as_str()), (200, "ready\n"));
            assert_eq!(fetch(addr, "/v1/own").await.2, "own\n");
            assert_eq!(fetch(addr, "/nothing").await.0, 404);

            ready.store(false, Ordering::Relaxed);
            let (status, _, body) = fetch(addr, "/readyz").await;
            assert_eq!((status, body.as_str()), (503, "draining\n"));
            let _ = stop.send(());
        };
        let (served, ()) = tokio::join!(serving, checks);
        served.unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test]
    async fn without_a_readiness_there_is_no_readyz() {
        let listener = AdminListener::bind(([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        let addr = listener.local_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = AdminServer::new(registry()).serve(listener, async {
            let _ = stopped.await;
        });
        let checks = async {
            assert_eq!(fetch(addr, "/readyz").await.0, 404);
            assert_eq!(fetch(addr, "/healthz").await.0, 200);
            let _ = stop.send(());
        };
        let (served, ()) = tokio::join!(serving, checks);
        served.unwrap();
    }
}
