//! What each role decides for a request, as plain functions over headers and table lookups.
//!
//! The host glue (`filter.rs`) reads headers and shared data and applies the returned plan; all
//! the choices live here so they are tested natively.
//!
//! Fast path, in order: a pin from a trusted caller; the replica learned for the session; the pool
//! for the model. The first that applies routes the request and marks it so ext_proc is skipped.
//! Fallback: if the fast path routed, nothing to do; if ext_proc decided, remember that decision for
//! the session (this is how the table learns); if nobody decided (ext_proc failed open, timed out or
//! is down), pick a replica by rendezvous hashing of the session so a conversation still sticks.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::affinity_table::{AffinityTable, Entry, SessionKey};
use crate::config::{Config, MAX_REPLICA_LEN, PinTrust};

/// Value of the fast-path marker header.
pub const MARKER_VALUE: &str = "1";

/// Read access to the request headers (lowercase names). Non-UTF-8 values read as absent.
pub trait RequestHeaders {
    /// The header's value, if present.
    fn header(&self, name: &str) -> Option<String>;
}

/// A routing decision to write into the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route<'c> {
    /// Header to set (`replica_header` or `pool_header`).
    pub header: &'c str,
    /// Its value.
    pub value: String,
    /// Why the request was routed this way.
    pub reason: RouteReason,
}

/// Why a request was routed by the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteReason {
    /// Trusted caller's pin header.
    Pin,
    /// Learned session affinity.
    Session,
    /// Model header → pool.
    ModelPool,
    /// Fallback hashing (no ext_proc decision).
    Fallback,
}

/// What became of a pin header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinVerdict {
    /// Pins not configured, or no pin header.
    Absent,
    /// Trusted and names a known replica.
    Honoured,
    /// Present but not acted on.
    Ignored(PinIgnored),
}

/// Why a pin header was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinIgnored {
    /// The caller did not prove it is trusted.
    Untrusted,
    /// Trusted, but the value is not a replica we may route to.
    UnknownReplica,
}

impl PinIgnored {
    /// Stable label for logs.
    pub fn as_label(self) -> &'static str {
        match self {
            PinIgnored::Untrusted => "untrusted",
            PinIgnored::UnknownReplica => "unknown_replica",
        }
    }
}

/// The fast path's plan for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastPathPlan<'c> {
    /// Set the header, the marker, and clear the route cache; `None` = leave it to ext_proc.
    pub route: Option<Route<'c>>,
    /// What became of the pin header.
    pub pin: PinVerdict,
    /// A session hit whose entry should be extended (less than half its TTL left).
    pub refresh: Option<(SessionKey, String)>,
    /// Headers to remove before the request goes further (pin and its secret never leave Envoy).
    pub strip: Vec<&'c str>,
}

/// Plans the fast-path role. `learned` looks a session up in the shared table (live entries only).
pub fn plan_fast_path<'c>(
    config: &'c Config,
    table: &AffinityTable,
    headers: &impl RequestHeaders,
    now_ms: u64,
    learned: impl FnOnce(SessionKey) -> Option<Entry>,
) -> FastPathPlan<'c> {
    let mut plan = FastPathPlan {
        route: None,
        pin: PinVerdict::Absent,
        refresh: None,
        strip: Vec::new(),
    };

    if let Some(pin) = &config.pin {
        plan.strip.push(&pin.header);
        if let PinTrust::Token { header, .. } = &pin.trust {
            plan.strip.push(header);
        }
        if let Some(replica) = headers.header(&pin.header) {
            plan.pin = if !is_trusted(&pin.trust, headers) {
                PinVerdict::Ignored(PinIgnored::Untrusted)
            } else if !config.is_pinnable(&replica) {
                PinVerdict::Ignored(PinIgnored::UnknownReplica)
            } else {
                plan.route = Some(Route {
                    header: &config.replica_header,
                    value: replica,
                    reason: RouteReason::Pin,
                });
                PinVerdict::Honoured
            };
        }
    }
    if plan.route.is_some() {
        return plan;
    }

    if let Some(session) = headers
        .header(&config.session_header)
        .filter(|s| !s.is_empty())
    {
        let key = table.key(&session);
        if let Some(entry) =
            learned(key).filter(|e| e.fingerprint == key.fingerprint && e.expires_at_ms > now_ms)
        {
            if table.needs_refresh(&entry, now_ms) {
                plan.refresh = Some((key, entry.replica.clone()));
            }
            plan.route = Some(Route {
                header: &config.replica_header,
                value: entry.replica,
                reason: RouteReason::Session,
            });
            return plan;
        }
    }

    let pool = config
        .model_header
        .as_deref()
        .and_then(|h| headers.header(h))
        .and_then(|model| config.model_routes.get(&model));
    if let Some(pool) = pool {
        plan.route = Some(Route {
            header: &config.pool_header,
            value: pool.clone(),
            reason: RouteReason::ModelPool,
        });
    }
    plan
}

/// The fallback role's plan for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackPlan<'c> {
    /// The fast path routed it (marker present): nothing to do.
    FastPathRouted,
    /// ext_proc decided. `learn` = remember session → replica (absent without a session header or
    /// when the decision is not a storable replica, e.g. only a pool was chosen).
    ExtProcDecided {
        /// Session to remember and the replica decision to remember for it.
        learn: Option<(SessionKey, String)>,
    },
    /// No decision was made: route here.
    Hashed(Route<'c>),
    /// No decision and none of the hash headers present: Envoy's own balancing serves it.
    Unkeyed,
}

/// Plans the fallback role.
pub fn plan_fallback<'c>(
    config: &'c Config,
    table: &AffinityTable,
    headers: &impl RequestHeaders,
) -> FallbackPlan<'c> {
    if headers.header(&config.marker_header).is_some() {
        return FallbackPlan::FastPathRouted;
    }
    if let Some(decision) = headers
        .header(&config.replica_header)
        .filter(|d| !d.is_empty())
    {
        let learn = headers
            .header(&config.session_header)
            .filter(|s| !s.is_empty() && is_learnable(&decision))
            .map(|session| (table.key(&session), decision));
        return FallbackPlan::ExtProcDecided { learn };
    }
    if headers
        .header(&config.pool_header)
        .is_some_and(|p| !p.is_empty())
    {
        return FallbackPlan::ExtProcDecided { learn: None };
    }
    let key = config
        .fallback_hash_headers
        .iter()
        .find_map(|h| headers.header(h).filter(|v| !v.is_empty()));
    match key
        .as_deref()
        .and_then(|k| rendezvous_pick(k, &config.replicas))
    {
        Some(replica) => FallbackPlan::Hashed(Route {
            header: &config.replica_header,
            value: replica.to_owned(),
            reason: RouteReason::Fallback,
        }),
        None => FallbackPlan::Unkeyed,
    }
}

/// Highest-random-weight (rendezvous) choice: each replica scores `hash(key, replica)` and the top
/// score wins. Removing a replica only moves the keys it owned; adding one takes ~1/n of the keys.
pub fn rendezvous_pick<'r>(key: &str, replicas: &'r [String]) -> Option<&'r str> {
    replicas
        .iter()
        .map(|replica| {
            (
                xxh3_64_with_seed(key.as_bytes(), xxh3_64(replica.as_bytes())),
                replica,
            )
        })
        .max_by_key(|(score, _)| *score)
        .map(|(_, replica)| replica.as_str())
}

/// A decision worth remembering: what ext_proc wrote, an `ip:port` or an override_host fallback
/// list (`ip:port,ip:port`) or a cluster name, short enough for the table's length byte.
pub fn is_learnable(decision: &str) -> bool {
    !decision.is_empty()
        && decision.len() <= MAX_REPLICA_LEN
        && decision.bytes().all(|b| b.is_ascii_graphic())
}

fn is_trusted(trust: &PinTrust, headers: &impl RequestHeaders) -> bool {
    match trust {
        PinTrust::All => true,
        PinTrust::Token { header, token } => headers
            .header(header)
            .is_some_and(|presented| constant_time_eq(presented.as_bytes(), token.as_bytes())),
    }
}

/// Compares secrets without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::affinity_table::Bucket;

    impl RequestHeaders for HashMap<&str, &str> {
        fn header(&self, name: &str) -> Option<String> {
            self.get(name).map(|v| (*v).to_owned())
        }
    }

    const NOW: u64 = 1_000_000;

    fn config(json: &str) -> Config {
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn fast_path_config() -> Config {
        config(
            r#"{"role":"fast_path","replicas":["10.0.0.1:8000","10.0.0.2:8000"],
                "affinity":{"ttl_seconds":60},
                "pin":{"token_header":"x-kvroute-pin-token","token":"s3cret"},
                "model_header":"x-model","model_routes":{"embed":"pool_embed"}}"#,
        )
    }

    fn fallback_config() -> Config {
        config(
            r#"{"role":"fallback","replicas":["10.0.0.1:8000","10.0.0.2:8000","10.0.0.3:8000"]}"#,
        )
    }

    /// A table holding `session → replica`, learned at `learned_at`.
    fn lookup_in(
        table: &AffinityTable,
        session: &str,
        replica: &str,
        learned_at: u64,
    ) -> impl FnOnce(SessionKey) -> Option<Entry> {
        let mut bucket = Bucket::default();
        table.learn(&mut bucket, table.key(session), replica, learned_at);
        move |key| bucket.lookup(key.fingerprint, NOW).cloned()
    }

    fn nothing_learned(_: SessionKey) -> Option<Entry> {
        None
    }

    #[test]
    fn learned_session_routes_without_ext_proc() {
        let config = fast_path_config();
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([("x-session-id", "conv-1")]);
        let plan = plan_fast_path(
            &config,
            &table,
            &headers,
            NOW,
            lookup_in(&table, "conv-1", "10.0.0.2:8000", NOW),
        );
        assert_eq!(
            plan.route,
            Some(Route {
                header: "x-gateway-destination-endpoint",
                value: "10.0.0.2:8000".into(),
                reason: RouteReason::Session
            })
        );
        assert_eq!(plan.refresh, None);
        assert_eq!(plan.pin, PinVerdict::Absent);
    }

    #[test]
    fn old_hit_is_refreshed() {
        let config = fast_path_config();
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([("x-session-id", "conv-1")]);
        let learned_at = NOW - 40_000; // 20 s of 60 s left
        let plan = plan_fast_path(
            &config,
            &table,
            &headers,
            NOW,
            lookup_in(&table, "conv-1", "10.0.0.2:8000", learned_at),
        );
        assert_eq!(
            plan.refresh,
            Some((table.key("conv-1"), "10.0.0.2:8000".into()))
        );
    }

    #[test]
    fn unknown_session_without_model_route_is_a_miss() {
        let config = fast_path_config();
        let table = AffinityTable::new(&config.affinity);
        let other_session = lookup_in(&table, "conv-2", "10.0.0.2:8000", NOW);
        let headers = HashMap::from([("x-session-id", "conv-1"), ("x-model", "chat")]);
        assert_eq!(
            plan_fast_path(&config, &table, &headers, NOW, other_session).route,
            None
        );
        assert_eq!(
            plan_fast_path(&config, &table, &HashMap::new(), NOW, nothing_learned).route,
            None
        );
    }

    #[test]
    fn model_header_routes_to_pool() {
        let config = fast_path_config();
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([("x-model", "embed")]);
        let plan = plan_fast_path(&config, &table, &headers, NOW, nothing_learned);
        assert_eq!(
            plan.route,
            Some(Route {
                header: "x-kvroute-cluster",
                value: "pool_embed".into(),
                reason: RouteReason::ModelPool
            })
        );
    }

    #[test]
    fn pin_needs_the_token() {
        let config = fast_path_config();
        let table = AffinityTable::new(&config.affinity);

        let spoofed = HashMap::from([("x-kvroute-pin", "10.0.0.1:8000")]);
        let plan = plan_fast_path(&config, &table, &spoofed, NOW, nothing_learned);
        assert_eq!(plan.pin, PinVerdict::Ignored(PinIgnored::Untrusted));
        assert_eq!(plan.route, None);
        assert_eq!(plan.strip, vec!["x-kvroute-pin", "x-kvroute-pin-token"]);

        let wrong = HashMap::from([
            ("x-kvroute-pin", "10.0.0.1:8000"),
            ("x-kvroute-pin-token", "s3creT"),
        ]);
        assert_eq!(
            plan_fast_path(&config, &table, &wrong, NOW, nothing_learned).pin,
            PinVerdict::Ignored(PinIgnored::Untrusted)
        );

        let trusted = HashMap::from([
            ("x-kvroute-pin", "10.0.0.1:8000"),
            ("x-kvroute-pin-token", "s3cret"),
        ]);
        let plan = plan_fast_path(&config, &table, &trusted, NOW, nothing_learned);
        assert_eq!(plan.pin, PinVerdict::Honoured);
        assert_eq!(
            plan.route.map(|r| (r.value, r.reason)),
            Some(("10.0.0.1:8000".into(), RouteReason::Pin))
        );
    }

    #[test]
    fn trusted_pin_to_unknown_replica_is_ignored_and_session_still_routes() {
        let config = fast_path_config();
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([
            ("x-kvroute-pin", "10.9.9.9:8000"),
            ("x-kvroute-pin-token", "s3cret"),
            ("x-session-id", "conv-1"),
        ]);
        let plan = plan_fast_path(
            &config,
            &table,
            &headers,
            NOW,
            lookup_in(&table, "conv-1", "10.0.0.2:8000", NOW),
        );
        assert_eq!(plan.pin, PinVerdict::Ignored(PinIgnored::UnknownReplica));
        assert_eq!(plan.route.map(|r| r.reason), Some(RouteReason::Session));
    }

    #[test]
    fn pin_without_pin_config_is_not_read() {
        let config = config(r#"{"role":"fast_path"}"#);
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([("x-kvroute-pin", "10.0.0.1:8000")]);
        let plan = plan_fast_path(&config, &table, &headers, NOW, nothing_learned);
        assert_eq!(
            (plan.pin, plan.route, plan.strip.len()),
            (PinVerdict::Absent, None, 0)
        );
    }

    #[test]
    fn fallback_learns_ext_proc_decisions() {
        let config = fallback_config();
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([
            ("x-session-id", "conv-1"),
            ("x-gateway-destination-endpoint", "10.0.0.3:8000"),
        ]);
        assert_eq!(
            plan_fallback(&config, &table, &headers),
            FallbackPlan::ExtProcDecided {
                learn: Some((table.key("conv-1"), "10.0.0.3:8000".into()))
            }
        );
        let no_session = HashMap::from([("x-gateway-destination-endpoint", "10.0.0.3:8000")]);
        assert_eq!(
            plan_fallback(&config, &table, &no_session),
            FallbackPlan::ExtProcDecided { learn: None }
        );
        let pool_only = HashMap::from([
            ("x-session-id", "conv-1"),
            ("x-kvroute-cluster", "pool_embed"),
        ]);
        assert_eq!(
            plan_fallback(&config, &table, &pool_only),
            FallbackPlan::ExtProcDecided { learn: None }
        );
    }

    #[test]
    fn fallback_leaves_fast_path_requests_alone() {
        let config = fallback_config();
        let table = AffinityTable::new(&config.affinity);
        let headers = HashMap::from([
            ("x-kvroute-fast-path", "1"),
            ("x-gateway-destination-endpoint", "10.0.0.3:8000"),
        ]);
        assert_eq!(
            plan_fallback(&config, &table, &headers),
            FallbackPlan::FastPathRouted
        );
    }

    #[test]
    fn fallback_hashes_undecided_sessions_consistently() {
        let config = fallback_config();
        let table = AffinityTable::new(&config.affinity);
        let mut seen = std::collections::HashSet::new();
        for i in 0..200 {
            let session = format!("conv-{i}");
            let headers = HashMap::from([("x-session-id", session.as_str())]);
            let FallbackPlan::Hashed(first) = plan_fallback(&config, &table, &headers) else {
                panic!("expected a hashed route");
            };
            assert_eq!(first.header, "x-gateway-destination-endpoint");
            assert_eq!(
                plan_fallback(&config, &table, &headers),
                FallbackPlan::Hashed(first.clone())
            );
            seen.insert(first.value);
        }
        assert_eq!(seen.len(), 3, "200 sessions spread over every replica");
        assert_eq!(
            plan_fallback(&config, &table, &HashMap::new()),
            FallbackPlan::Unkeyed
        );
    }

    #[test]
    fn fallback_uses_configured_hash_headers_in_order() {
        let config = config(
            r#"{"role":"fallback","replicas":["a:1","b:1"],"fallback_hash_headers":["x-user","x-org"]}"#,
        );
        let table = AffinityTable::new(&config.affinity);
        let by_org = HashMap::from([("x-org", "acme")]);
        let by_user = HashMap::from([("x-org", "acme"), ("x-user", "u1")]);
        let expect = |key: &str| rendezvous_pick(key, &config.replicas).map(str::to_owned);
        let value = |plan: FallbackPlan<'_>| match plan {
            FallbackPlan::Hashed(route) => Some(route.value),
            _ => None,
        };
        assert_eq!(
            value(plan_fallback(&config, &table, &by_org)),
            expect("acme")
        );
        assert_eq!(
            value(plan_fallback(&config, &table, &by_user)),
            expect("u1")
        );
        // The session header is not a hash key when others are configured.
        let session_only = HashMap::from([("x-session-id", "conv-1")]);
        assert_eq!(
            plan_fallback(&config, &table, &session_only),
            FallbackPlan::Unkeyed
        );
    }

    #[test]
    fn rendezvous_moves_only_the_removed_replicas_keys() {
        let all: Vec<String> = (1..=5).map(|i| format!("10.0.0.{i}:8000")).collect();
        let without_third: Vec<String> = all
            .iter()
            .filter(|r| !r.starts_with("10.0.0.3"))
            .cloned()
            .collect();
        for i in 0..500 {
            let key = format!("k{i}");
            let before = rendezvous_pick(&key, &all).unwrap();
            let after = rendezvous_pick(&key, &without_third).unwrap();
            if before != "10.0.0.3:8000" {
                assert_eq!(before, after, "key {key} moved although its replica stayed");
            }
        }
        assert_eq!(rendezvous_pick("k", &[]), None);
    }

    #[test]
    fn learnable_decisions() {
        assert!(is_learnable("10.0.0.1:8000"));
        assert!(is_learnable("10.0.0.1:8000,10.0.0.2:8000"));
        assert!(!is_learnable(""));
        assert!(!is_learnable("a b"));
        assert!(!is_learnable(&"x".repeat(MAX_REPLICA_LEN + 1)));
    }

    #[test]
    fn constant_time_eq_matches_eq() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
