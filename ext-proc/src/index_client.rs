//! Client of kvroute-index with fail-over across several addresses, under a deadline; or, with
//! `index.embedded`, the index running in this process, asked directly (no network round trip).
//!
//! Addresses are tried in configured order, skipping any that failed within `retry_after`; a call
//! fails over to the next address while the deadline allows. Channels connect lazily, so a dead
//! index never delays startup. With `index.token_file` every call carries
//! `authorization: Bearer <token>` (the index's `query_auth`).

use std::time::{Duration, Instant};

use kvroute_index_api::api::kv_index_client::KvIndexClient;
use kvroute_index_api::api::{MatchRequest, MatchResponse, PickerNews};
use kvroute_index_core::throttle::LogThrottle;
use kvroute_runtime::tls::ClientTls;
use kvroute_runtime::token::{AUTHORIZATION, AgentToken};
use kvroute_runtime::trace_context::{TRACEPARENT, TRACESTATE};
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};

use crate::embedded::LocalMatcher;
use crate::error::IndexError;

/// How long establishing a connection to one index address may take.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);

#[derive(Debug)]
struct IndexAddress {
    uri: http::Uri,
    client: KvIndexClient<Channel>,
    failed_at: Mutex<Option<Instant>>,
}

/// The index addresses of one config snapshot.
#[derive(Debug)]
pub struct IndexClient {
    /// The embedded index, asked instead of the addresses when present.
    local: Option<LocalMatcher>,
    addresses: Vec<IndexAddress>,
    retry_after: Duration,
    /// `authorization: Bearer <token>` for every call (`index.token_file`).
    authorization: Option<tonic::metadata::AsciiMetadataValue>,
    /// Throttles the warning for queries an index refuses (a config mismatch repeats per request).
    refusals: LogThrottle,
}

impl IndexClient {
    /// Lazily connecting clients for `uris`, over TLS when `tls` is given.
    pub fn new(uris: &[http::Uri], retry_after: Duration, tls: Option<&ClientTls>) -> Self {
        let addresses = uris
            .iter()
            .filter_map(|uri| {
                let endpoint = Endpoint::from(uri.clone())
                    .connect_timeout(CONNECT_TIMEOUT)
                    .tcp_nodelay(true);
                let endpoint = match tls.map(|tls| tls.apply(endpoint.clone())) {
                    None => endpoint,
                    Some(Ok(endpoint)) => endpoint,
                    Some(Err(error)) => {
                        // Validated with the config already; never fall back to plaintext.
                        tracing::error!(index = %uri, %error, "index address left out: TLS setup failed");
                        return None;
                    }
                };
                Some(IndexAddress {
                    uri: uri.clone(),
                    client: KvIndexClient::new(endpoint.connect_lazy()),
                    failed_at: Mutex::new(None),
                })
            })
            .collect();
        Self {
            local: None,
            addresses,
            retry_after,
            authorization: None,
            refusals: LogThrottle::default(),
        }
    }

    /// Sends `token` as `authorization: Bearer <token>` with every call (the index's `query_auth`).
    pub fn with_token(mut self, token: Option<&AgentToken>) -> Self {
        self.authorization = token.and_then(|token| {
            let value = format!("Bearer {}", token.expose()).parse().ok();
            if value.is_none() {
                // Unreachable in practice: the config checked the token is printable ASCII.
                tracing::error!("index.token_file: the token cannot be sent in a header");
            }
            value
        });
        self
    }

    /// Asks `local` (the embedded index) instead of the addresses.
    pub fn with_local(mut self, local: Option<LocalMatcher>) -> Self {
        self.local = local;
        self
    }

    /// The embedded index, if any.
    pub fn local(&self) -> Option<&LocalMatcher> {
        self.local.as_ref()
    }

    /// Whether an index is configured (embedded or at an address).
    pub fn is_configured(&self) -> bool {
        self.local.is_some() || !self.addresses.is_empty()
    }

    /// `Match` on the first healthy address, failing over until `deadline`.
    pub async fn match_prefix(
        &self,
        request: MatchRequest,
        deadline: Instant,
    ) -> Result<MatchResponse, IndexError> {
        if let Some(local) = &self.local {
            // Microseconds in memory: no deadline to enforce, nothing to fail over to.
            return local.r#match(&request).map_err(IndexError::Refused);
        }
        if self.addresses.is_empty() {
            return Err(IndexError::NotConfigured);
        }
        let now = Instant::now();
        let healthy = |a: &&IndexAddress| {
            a.failed_at
                .lock()
                .is_none_or(|at| now.duration_since(at) >= self.retry_after)
        };
        // Healthy addresses first (in order), then the recently failed ones as a last resort.
        let order = self
            .addresses
            .iter()
            .filter(healthy)
            .chain(self.addresses.iter().filter(|a| !healthy(a)));
        // The index's `Match` span joins the decision's trace (the `kvroute.index_match` span).
        let trace = if kvroute_runtime::telemetry::exporting() {
            trace_metadata(&tracing::Span::current())
        } else {
            None
        };
        let mut last_status = None;
        for address in order {
            let Some(remaining) = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
            else {
                break;
            };
            let mut client = address.client.clone();
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(remaining);
            if let Some(authorization) = &self.authorization {
                call.metadata_mut()
                    .insert(AUTHORIZATION, authorization.clone());
            }
            if let Some((parent, state)) = &trace {
                call.metadata_mut().insert(TRACEPARENT, parent.clone());
                if let Some(state) = state {
                    call.metadata_mut().insert(TRACESTATE, state.clone());
                }
            }
            match tokio::time::timeout(remaining, client.r#match(call)).await {
                Ok(Ok(response)) => {
                    *address.failed_at.lock() = None;
                    return Ok(response.into_inner());
                }
                Ok(Err(status))
                    if matches!(
                        status.code(),
                        tonic::Code::InvalidArgument | tonic::Code::NotFound
                    ) =>
                {
                    // The index is up and says no: the query itself is wrong for it, so another
                    // address would say the same, and this one is not unhealthy.
                    if let Some(suppressed) = self.refusals.allow() {
                        tracing::warn!(
                            index = %address.uri,
                            code = ?status.code(),
                            reason = status.message(),
                            suppressed,
                            "the index refuses this pool's queries: check that its pool (model, \
                             block_size, key scheme) matches ext-proc's; decisions use the \
                             approximate tier"
                        );
                    }
                    return Err(IndexError::Rejected { status });
                }
                Ok(Err(status)) => {
                    tracing::debug!(index = %address.uri, code = ?status.code(), "index match failed");
                    *address.failed_at.lock() = Some(Instant::now());
                    last_status = Some(status);
                }
                Err(_) => {
                    *address.failed_at.lock() = Some(Instant::now());
                    break;
                }
            }
        }
        match last_status {
            Some(status) if Instant::now() < deadline => Err(IndexError::Unavailable { status }),
            _ => Err(IndexError::Timeout {
                after: deadline.saturating_duration_since(now),
            }),
        }
    }
}

impl IndexClient {
    /// Opens `ShareDecisions` on the first healthy index address (the configured order, so
    /// replicas with the same addresses meet on the same instance), sending `outgoing`. Returns
    /// the address and the other pickers' news. A failure marks the address failed, so the next
    /// attempt tries the next one.
    pub async fn share_decisions<S>(
        &self,
        outgoing: S,
    ) -> Result<(http::Uri, tonic::Streaming<PickerNews>), IndexError>
    where
        S: futures::Stream<Item = PickerNews> + Send + 'static,
    {
        let now = Instant::now();
        let address = self
            .addresses
            .iter()
            .find(|a| {
                a.failed_at
                    .lock()
                    .is_none_or(|at| now.duration_since(at) >= self.retry_after)
            })
            .or_else(|| self.addresses.first())
            .ok_or(IndexError::NotConfigured)?;
        let mut call = tonic::Request::new(outgoing);
        if let Some(authorization) = &self.authorization {
            call.metadata_mut()
                .insert(AUTHORIZATION, authorization.clone());
        }
        match address.client.clone().share_decisions(call).await {
            Ok(response) => {
                *address.failed_at.lock() = None;
                Ok((address.uri.clone(), response.into_inner()))
            }
            Err(status) => {
                *address.failed_at.lock() = Some(Instant::now());
                Err(IndexError::Unavailable { status })
            }
        }
    }
}

/// `span`'s `traceparent` and `tracestate` as gRPC metadata values.
fn trace_metadata(
    span: &tracing::Span,
) -> Option<(
    tonic::metadata::AsciiMetadataValue,
    Option<tonic::metadata::AsciiMetadataValue>,
)> {
    let (parent, state) = kvroute_runtime::telemetry::outgoing_context(span)?;
    let parent = parent.parse().ok()?;
    Some((parent, state.and_then(|state| state.parse().ok())))
}
