//! Readiness: a pool is ready when enough of its replicas are [`ReplicaState::Ready`]
//! (`readiness:` in the config); the service is ready when every pool is and it is not
//! shutting down. `/readyz` answers it with a reason per pool; gRPC health follows it.

use std::sync::{Arc, atomic::Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tonic::server::NamedService as _;
use tonic_health::ServingStatus;

use super::Shared;
use kvroute_index_api::api::kv_index_server::KvIndexServer;
use kvroute_index_core::index::ReplicaState;

/// How often gRPC health is brought in line with readiness.
const FOLLOW_INTERVAL: Duration = Duration::from_millis(100);

/// One pool's readiness.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolReadiness {
    /// Its name.
    pub pool: String,
    /// Enough replicas are ready.
    pub ready: bool,
    /// Replicas ready now.
    pub ready_replicas: usize,
    /// Ready replicas it needs.
    pub required: usize,
    /// Replicas configured.
    pub replicas: usize,
    /// Each replica that is not ready, with its state (`syncing`, `disconnected`, …).
    pub not_ready: Vec<(String, &'static str)>,
}

/// What `/readyz` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadinessReport {
    /// Every pool is ready and the service is not shutting down.
    pub ready: bool,
    /// Shutdown has started.
    pub shutting_down: bool,
    /// Per pool, in config order.
    pub pools: Vec<PoolReadiness>,
}

impl ReadinessReport {
    /// Plain text for `/readyz`: the verdict, then one line per pool.
    pub fn text(&self) -> String {
        let mut text = String::from(if self.ready { "ready\n" } else { "not ready\n" });
        if self.shutting_down {
            text.push_str("shutting down\n");
        }
        for pool in &self.pools {
            let verdict = if pool.ready { "ready" } else { "not ready" };
            text.push_str(&format!(
                "pool {}: {verdict}: {}/{} replicas ready, {} required",
                pool.pool, pool.ready_replicas, pool.replicas, pool.required
            ));
            if !pool.not_ready.is_empty() {
                let list: Vec<String> = pool
                    .not_ready
                    .iter()
                    .map(|(id, state)| format!("{id} {state}"))
                    .collect();
                text.push_str(&format!(" ({})", list.join(", ")));
            }
            text.push('\n');
        }
        text
    }
}

pub(crate) fn report(shared: &Shared) -> ReadinessReport {
    let statuses = shared.index.replica_statuses(None);
    let shutting_down = shared.draining.load(Ordering::Relaxed);
    let pools: Vec<PoolReadiness> = shared
        .directory
        .pools()
        .iter()
        .map(|pool| {
            let members: Vec<_> = statuses.iter().filter(|s| s.model == pool.name).collect();
            let ready_replicas = members
                .iter()
                .filter(|s| s.state == ReplicaState::Ready)
                .count();
            let required = shared.readiness.required(members.len());
            PoolReadiness {
                pool: pool.name.clone(),
                ready: ready_replicas >= required,
                ready_replicas,
                required,
                replicas: members.len(),
                not_ready: members
                    .iter()
                    .filter(|s| s.state != ReplicaState::Ready)
                    .map(|s| (s.name.clone(), s.state.as_label()))
                    .collect(),
            }
        })
        .collect();
    ReadinessReport {
        ready: !shutting_down && pools.iter().all(|pool| pool.ready),
        shutting_down,
        pools,
    }
}

/// Sets gRPC health for the whole server (`""`) and the `KvIndex` service.
pub(crate) async fn set_health(health: &tonic_health::server::HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    health.set_service_status("", status).await;
    health
        .set_service_status(KvIndexServer::<super::grpc::MatchService>::NAME, status)
        .await;
}

/// Keeps gRPC health equal to readiness until `cancel`.
pub(crate) async fn follow(
    shared: Arc<Shared>,
    health: tonic_health::server::HealthReporter,
    cancel: CancellationToken,
) {
    let mut reported = false;
    let mut ticker = tokio::time::interval(FOLLOW_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ready = report(&shared).ready;
        if ready != reported {
            tracing::info!(ready, "readiness changed");
            set_health(&health, ready).await;
            reported = ready;
        }
    }
}
