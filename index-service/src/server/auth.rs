//! Optional bearer token on the query API: gRPC `Match` / `ReplicaState` (metadata
//! `authorization: Bearer <token>`) and the admin `/v1/*` endpoints (the same HTTP header). They
//! reveal which replica holds which prompt prefix, so with `query_auth` configured nobody without
//! the token learns it. `/metrics`, `/healthz`, `/readyz`, gRPC health and the agent stream (which
//! has its own per-agent tokens) stay open. Every refusal is counted by API and reason and logged
//! (throttled); the token is compared in constant time and never logged.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use kvroute_index_core::throttle::LogThrottle;
use kvroute_runtime::token::AgentToken;

pub use kvroute_runtime::token::AUTHORIZATION;

/// Why a query was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No `authorization` header.
    Missing,
    /// A header that is not `Bearer <token>`.
    Malformed,
    /// A bearer token that is not the configured one.
    WrongToken,
}

impl Refusal {
    pub(crate) fn as_label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::WrongToken => "wrong_token",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusalLabel {
    api: &'static str,
    reason: &'static str,
}

/// The query API's token check.
#[derive(Debug)]
pub(crate) struct QueryAuth {
    token: Option<AgentToken>,
    refusals: Family<RefusalLabel, Counter>,
    log: LogThrottle,
}

impl QueryAuth {
    pub(crate) fn register(token: Option<AgentToken>, registry: &mut Registry) -> Self {
        let refusals = Family::default();
        registry.register(
            "query_auth_refusals",
            "Query API requests refused for want of the query_auth token, by API and reason",
            refusals.clone(),
        );
        Self {
            token,
            refusals,
            log: LogThrottle::default(),
        }
    }

    /// Whether a token is required.
    pub(crate) fn is_required(&self) -> bool {
        self.token.is_some()
    }

    /// Checks the `authorization` value a request to `api` (`grpc`, `http`) carried.
    pub(crate) fn check(
        &self,
        api: &'static str,
        authorization: Option<&[u8]>,
    ) -> Result<(), Refusal> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        let result = match authorization {
            None => Err(Refusal::Missing),
            Some(value) => match bearer(value) {
                None => Err(Refusal::Malformed),
                Some(presented) if token.matches(presented) => Ok(()),
                Some(_) => Err(Refusal::WrongToken),
            },
        };
        if let Err(refusal) = result {
            self.refusals
                .get_or_create(&RefusalLabel {
                    api,
                    reason: refusal.as_label(),
                })
                .inc();
            if let Some(suppressed) = self.log.allow() {
                tracing::warn!(
                    api,
                    reason = refusal.as_label(),
                    suppressed,
                    "query refused: query_auth token required"
                );
            }
        }
        result
    }
}

/// The token of `Bearer <token>` (scheme case-insensitive).
fn bearer(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_bearer_token_passes() {
        let mut registry = Registry::default();
        let auth = QueryAuth::register(Some(AgentToken::from_literal("t0k")), &mut registry);
        assert_eq!(auth.check("http", Some(b"Bearer t0k")), Ok(()));
        assert_eq!(auth.check("http", Some(b"bearer t0k")), Ok(()));
        assert_eq!(auth.check("http", None), Err(Refusal::Missing));
        assert_eq!(auth.check("http", Some(b"t0k")), Err(Refusal::Malformed));
        assert_eq!(
            auth.check("http", Some(b"Basic t0k")),
            Err(Refusal::Malformed)
        );
        assert_eq!(
            auth.check("grpc", Some(b"Bearer t0")),
            Err(Refusal::WrongToken)
        );
        let open = QueryAuth::register(None, &mut Registry::default());
        assert_eq!(open.check("grpc", None), Ok(()));
    }
}
