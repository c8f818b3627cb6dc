//! gRPC health checks (`grpc.health.v1.Health/Check`) as a probe sends them: one client for
//! every test that asks kvroute-ext-proc or kvroute-index whether a service is serving.

use std::time::Duration;

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

/// Asks `url` (`http://host:port`, plaintext) for `service`'s status. `Err` says why there was
/// no answer: no connection (a TLS-only listener refuses plaintext), or an error status.
pub async fn check(url: &str, service: &str) -> Result<ServingStatus, String> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| format!("bad url {url}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .map_err(|status| format!("{url} answered {status}"))?
        .into_inner()
        .status;
    ServingStatus::try_from(status).map_err(|_| format!("{url} sent status {status}"))
}
