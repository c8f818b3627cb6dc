//! Plugin configuration: the JSON in `PluginConfig.configuration` (Envoy `StringValue`, Istio
//! `WasmPlugin.pluginConfig`), parsed into [`RawConfig`] and validated into [`Config`].
//!
//! The same module runs twice in the chain; `role` says which instance this is. Every other key has a
//! default so the two instances can share one JSON document apart from `role`. Anything malformed is
//! rejected with a [`ConfigError`] naming the field path (`affinity.slots: ...`), so `on_configure`
//! can refuse the plugin with one clear log line instead of running with a guess. Every key:
//! `docs/configuration.md` (generated from [`RawConfig`]).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use kvroute_config::{ConfigError, HeaderName};
use schemars::JsonSchema;
use serde::Deserialize;

/// Header carrying the endpoint decision (Gateway API Inference Extension endpoint-picker protocol).
pub const DEFAULT_REPLICA_HEADER: &str = "x-gateway-destination-endpoint";
/// Header carrying a cluster decision for `cluster_header` routes.
pub const DEFAULT_POOL_HEADER: &str = "x-kvroute-cluster";
/// Header the fast path sets so the chain skips ext_proc (and the fallback knows who decided).
pub const DEFAULT_MARKER_HEADER: &str = "x-kvroute-fast-path";
/// Header naming the conversation; all its turns should reach the same replica.
pub const DEFAULT_SESSION_HEADER: &str = "x-session-id";
/// Header an operator-trusted client uses to pin a request to a replica.
pub const DEFAULT_PIN_HEADER: &str = "x-kvroute-pin";
/// How long a learned session → replica entry is used without being refreshed.
pub const DEFAULT_AFFINITY_TTL: Duration = Duration::from_secs(600);
/// Shared-data buckets of the learned table (one shared-data key each).
pub const DEFAULT_AFFINITY_SLOTS: u32 = 16_384;
/// Entries per bucket; `slots * ways` is the most sessions remembered at once.
pub const DEFAULT_AFFINITY_WAYS: u8 = 4;
/// Prefix of the shared-data keys, so two differently configured chains in one VM do not collide.
pub const DEFAULT_AFFINITY_KEY_PREFIX: &str = "kvroute.affinity";

/// Upper bound for `affinity.slots`: keeps shared data (and the bound on memory) modest.
pub const MAX_AFFINITY_SLOTS: u32 = 1 << 20;
/// Upper bound for `affinity.ways`: a bucket is decoded and scanned per request.
pub const MAX_AFFINITY_WAYS: u8 = 16;
/// Upper bound for the TTL: a stale learned replica should not outlive a day.
pub const MAX_AFFINITY_TTL: Duration = Duration::from_secs(86_400);
/// Longest replica/cluster name accepted anywhere (stored with a one-byte length).
pub const MAX_REPLICA_LEN: usize = 255;

/// Which of the two instances in the chain this plugin is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Before ext_proc: route on headers alone (pin, learned session, model pool) and skip ext_proc.
    FastPath,
    /// After ext_proc: learn ext_proc's decision; if there is none, pick a replica by hashing.
    Fallback,
}

/// The configuration document as written by the operator (JSON).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// Required: `fast_path` (before ext_proc) or `fallback` (after it).
    pub role: Option<Role>,
    /// Conversation id header (learned affinity, and the fallback's first hash key).
    #[schemars(extend("default" = DEFAULT_SESSION_HEADER))]
    pub session_header: Option<HeaderName>,
    /// Header carrying a replica decision (the endpoint-picker protocol's header, or
    /// `x-kvroute-cluster` when each replica is its own Envoy cluster).
    #[schemars(extend("default" = DEFAULT_REPLICA_HEADER))]
    pub replica_header: Option<HeaderName>,
    /// Header carrying a pool (cluster) decision for model routes.
    #[schemars(extend("default" = DEFAULT_POOL_HEADER))]
    pub pool_header: Option<HeaderName>,
    /// Marker the fast path sets; the chain skips ext_proc when it is present.
    #[schemars(extend("default" = DEFAULT_MARKER_HEADER))]
    pub marker_header: Option<HeaderName>,
    /// Known replicas (`ip:port` or cluster names, no duplicates): the fallback's hash ring
    /// (required for `fallback`), and the only values a pin may name.
    pub replicas: Vec<String>,
    /// Learned session affinity table.
    pub affinity: RawAffinity,
    /// Explicit pin header; absent: pins are never honoured.
    pub pin: Option<RawPin>,
    /// Header naming the model (set by the client or a body-to-header filter); required with
    /// `model_routes`.
    pub model_header: Option<HeaderName>,
    /// Model name → pool cluster, routed without ext_proc.
    pub model_routes: BTreeMap<String, String>,
    /// Headers hashed by the fallback, first present wins (default: the session header).
    pub fallback_hash_headers: Vec<HeaderName>,
}

/// `affinity` section as written.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawAffinity {
    /// How long a learned session → replica entry is used without being refreshed, in seconds
    /// (at most a day).
    #[schemars(extend("default" = DEFAULT_AFFINITY_TTL.as_secs()))]
    pub ttl_seconds: Option<u64>,
    /// Shared-data buckets of the learned table (one shared-data key each).
    #[schemars(extend("default" = DEFAULT_AFFINITY_SLOTS))]
    pub slots: Option<u32>,
    /// Entries per bucket; `slots * ways` is the most sessions remembered at once.
    #[schemars(extend("default" = DEFAULT_AFFINITY_WAYS))]
    pub ways: Option<u8>,
    /// Prefix of the shared-data keys, so two differently configured chains in one VM do not
    /// collide.
    #[schemars(extend("default" = DEFAULT_AFFINITY_KEY_PREFIX))]
    pub key_prefix: Option<String>,
}

/// `pin` section as written.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawPin {
    /// Header naming the replica to pin to.
    #[schemars(extend("default" = DEFAULT_PIN_HEADER))]
    pub header: Option<HeaderName>,
    /// `true`: every caller is trusted to pin (only for gateways reachable solely by trusted
    /// callers). Exclusive with `token`.
    pub trust_all: bool,
    /// Header carrying the shared secret of trusted clients.
    pub token_header: Option<HeaderName>,
    /// The shared secret; a pin is honoured only when `token_header` carries exactly this value.
    pub token: Option<String>,
}

/// Validated configuration used by the decision functions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Which instance this is.
    pub role: Role,
    /// Conversation id header.
    pub session_header: String,
    /// Header carrying replica decisions.
    pub replica_header: String,
    /// Header carrying pool decisions.
    pub pool_header: String,
    /// Fast-path marker header.
    pub marker_header: String,
    /// Known replicas, in configuration order (no duplicates).
    pub replicas: Vec<String>,
    /// Learned table parameters.
    pub affinity: AffinityConfig,
    /// Pin policy; `None` = pins are never looked at.
    pub pin: Option<PinConfig>,
    /// Model header, set when `model_routes` is non-empty.
    pub model_header: Option<String>,
    /// Model name → pool cluster.
    pub model_routes: BTreeMap<String, String>,
    /// Headers hashed by the fallback, first present wins.
    pub fallback_hash_headers: Vec<String>,
}

/// Learned table parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffinityConfig {
    /// Entry lifetime.
    pub ttl: Duration,
    /// Number of buckets.
    pub slots: u32,
    /// Entries per bucket.
    pub ways: u8,
    /// Shared-data key prefix.
    pub key_prefix: String,
}

/// Pin policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinConfig {
    /// Header naming the replica.
    pub header: String,
    /// Who is trusted to pin.
    pub trust: PinTrust,
}

/// Who may pin a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinTrust {
    /// Every caller (the gateway is only reachable by trusted callers).
    All,
    /// Callers presenting `token` in `header`.
    Token {
        /// Header carrying the secret.
        header: String,
        /// The secret.
        token: String,
    },
}

impl Config {
    /// Parses and validates the plugin configuration bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ConfigError::at(
                "",
                "plugin configuration is empty; `role` (\"fast_path\" or \"fallback\") is required",
            ));
        }
        Self::validate(kvroute_config::from_json(bytes)?)
    }

    /// Validates a parsed document: the rules between fields.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let role = raw
            .role
            .ok_or_else(|| ConfigError::at("role", "required"))?;
        let header_or = |value: Option<HeaderName>, default: &str| {
            value.map_or_else(|| default.to_owned(), String::from)
        };
        let session_header = header_or(raw.session_header, DEFAULT_SESSION_HEADER);
        let replica_header = header_or(raw.replica_header, DEFAULT_REPLICA_HEADER);
        let pool_header = header_or(raw.pool_header, DEFAULT_POOL_HEADER);
        let marker_header = header_or(raw.marker_header, DEFAULT_MARKER_HEADER);
        for (field, value, other, other_value) in [
            (
                "session_header",
                &session_header,
                "marker_header",
                &marker_header,
            ),
            (
                "replica_header",
                &replica_header,
                "marker_header",
                &marker_header,
            ),
            ("pool_header", &pool_header, "marker_header", &marker_header),
            (
                "session_header",
                &session_header,
                "replica_header",
                &replica_header,
            ),
        ] {
            if value == other_value {
                return Err(clash(field, other, value));
            }
        }

        let mut seen = HashSet::new();
        for (i, replica) in raw.replicas.iter().enumerate() {
            check_target(&format!("replicas[{i}]"), replica)?;
            if !seen.insert(replica.as_str()) {
                return Err(ConfigError::at(
                    format!("replicas[{i}]"),
                    format_args!("{replica:?} is listed twice (it would skew the hash ring)"),
                ));
            }
        }
        if role == Role::Fallback && raw.replicas.is_empty() {
            return Err(ConfigError::at(
                "replicas",
                "role \"fallback\" needs a non-empty list",
            ));
        }

        let affinity = validate_affinity(raw.affinity).map_err(|e| e.within("affinity"))?;
        let pin = raw
            .pin
            .map(validate_pin)
            .transpose()
            .map_err(|e| e.within("pin"))?;

        for (model, pool) in &raw.model_routes {
            check_target(&format!("model_routes.{model}"), pool)?;
        }
        let model_header = match (raw.model_header, raw.model_routes.is_empty()) {
            (Some(header), _) => Some(String::from(header)),
            (None, true) => None,
            (None, false) => {
                return Err(ConfigError::at(
                    "model_header",
                    "required with model_routes",
                ));
            }
        };

        let fallback_hash_headers = if raw.fallback_hash_headers.is_empty() {
            vec![session_header.clone()]
        } else {
            raw.fallback_hash_headers
                .into_iter()
                .map(String::from)
                .collect()
        };

        Ok(Config {
            role,
            session_header,
            replica_header,
            pool_header,
            marker_header,
            replicas: raw.replicas,
            affinity,
            pin,
            model_header,
            model_routes: raw.model_routes,
            fallback_hash_headers,
        })
    }

    /// Whether `replica` may be named by a pin (any value when no replica list is configured).
    pub fn is_pinnable(&self, replica: &str) -> bool {
        if self.replicas.is_empty() {
            is_valid_target(replica)
        } else {
            self.replicas.iter().any(|r| r == replica)
        }
    }
}

/// Two header roles that would be confused with each other.
fn clash(field: &str, other: &str, value: &str) -> ConfigError {
    ConfigError::at(
        field,
        format_args!("must differ from `{other}` (both are {value:?})"),
    )
}

/// The `affinity` section; paths relative to it.
fn validate_affinity(raw: RawAffinity) -> Result<AffinityConfig, ConfigError> {
    let ttl_seconds = raw.ttl_seconds.unwrap_or(DEFAULT_AFFINITY_TTL.as_secs());
    check_range("ttl_seconds", ttl_seconds, 1, MAX_AFFINITY_TTL.as_secs())?;
    let slots = raw.slots.unwrap_or(DEFAULT_AFFINITY_SLOTS);
    check_range("slots", u64::from(slots), 1, u64::from(MAX_AFFINITY_SLOTS))?;
    let ways = raw.ways.unwrap_or(DEFAULT_AFFINITY_WAYS);
    check_range("ways", u64::from(ways), 1, u64::from(MAX_AFFINITY_WAYS))?;
    let key_prefix = raw
        .key_prefix
        .unwrap_or_else(|| DEFAULT_AFFINITY_KEY_PREFIX.to_owned());
    if key_prefix.is_empty() || !key_prefix.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::at(
            "key_prefix",
            format_args!("must be visible ASCII characters (got {key_prefix:?})"),
        ));
    }
    Ok(AffinityConfig {
        ttl: Duration::from_secs(ttl_seconds),
        slots,
        ways,
        key_prefix,
    })
}

/// The `pin` section; paths relative to it.
fn validate_pin(raw: RawPin) -> Result<PinConfig, ConfigError> {
    let header = raw
        .header
        .map_or_else(|| DEFAULT_PIN_HEADER.to_owned(), String::from);
    let trust = match (raw.trust_all, raw.token_header, raw.token) {
        (true, None, None) => PinTrust::All,
        (true, _, _) => {
            return Err(ConfigError::at(
                "trust_all",
                "`trust_all` and `token` are mutually exclusive",
            ));
        }
        (false, Some(token_header), Some(token)) if !token.is_empty() => {
            let token_header = String::from(token_header);
            if token_header == header {
                return Err(clash("token_header", "pin.header", &token_header));
            }
            PinTrust::Token {
                header: token_header,
                token,
            }
        }
        (false, _, _) => {
            return Err(ConfigError::at(
                "",
                "needs either `trust_all: true` or both `token_header` and `token`",
            ));
        }
    };
    Ok(PinConfig { header, trust })
}

fn check_range(field: &str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::at(
            field,
            format_args!("must be within {min}..={max} (got {value})"),
        ))
    }
}

fn check_target(field: &str, value: &str) -> Result<(), ConfigError> {
    if is_valid_target(value) {
        Ok(())
    } else {
        Err(ConfigError::at(
            field,
            format_args!(
                "must be 1..={MAX_REPLICA_LEN} visible ASCII characters without commas (got {value:?})"
            ),
        ))
    }
}

/// A replica (`ip:port`) or cluster name: visible ASCII, no comma (a comma would turn one pinned
/// value into an override_host fallback list), at most [`MAX_REPLICA_LEN`] bytes.
pub fn is_valid_target(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= MAX_REPLICA_LEN
        && value.bytes().all(|b| b.is_ascii_graphic() && b != b',')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::from_json(json.as_bytes())
    }

    #[test]
    fn minimal_fast_path_gets_defaults() {
        let config = parse(r#"{"role":"fast_path"}"#).unwrap();
        assert_eq!(config.role, Role::FastPath);
        assert_eq!(config.session_header, DEFAULT_SESSION_HEADER);
        assert_eq!(config.replica_header, DEFAULT_REPLICA_HEADER);
        assert_eq!(config.marker_header, DEFAULT_MARKER_HEADER);
        assert_eq!(config.affinity.ttl, DEFAULT_AFFINITY_TTL);
        assert_eq!(config.affinity.slots, DEFAULT_AFFINITY_SLOTS);
        assert_eq!(
            config.fallback_hash_headers,
            vec![DEFAULT_SESSION_HEADER.to_owned()]
        );
        assert!(config.pin.is_none());
    }

    #[test]
    fn full_document_parses() {
        let config = parse(
            r#"{"role":"fallback","session_header":"x-conv","replicas":["10.0.0.1:8000","10.0.0.2:8000"],
                "affinity":{"ttl_seconds":30,"slots":8,"ways":2,"key_prefix":"t"},
                "pin":{"header":"x-pin","token_header":"x-pin-token","token":"s3cret"},
                "model_header":"x-model","model_routes":{"embed":"pool_embed"},
                "fallback_hash_headers":["x-conv","x-user"]}"#,
        )
        .unwrap();
        assert_eq!(
            config.affinity,
            AffinityConfig {
                ttl: Duration::from_secs(30),
                slots: 8,
                ways: 2,
                key_prefix: "t".into()
            }
        );
        assert_eq!(
            config.pin.unwrap().trust,
            PinTrust::Token {
                header: "x-pin-token".into(),
                token: "s3cret".into()
            }
        );
        assert_eq!(
            config.model_routes.get("embed").map(String::as_str),
            Some("pool_embed")
        );
    }

    #[test]
    fn rejections_name_the_field_path() {
        let cases = [
            ("", ""),
            ("  ", ""),
            ("{", ""),
            (r#"{"role":"fast_path","bogus":1}"#, "bogus"),
            (r#"{"role":"sideways"}"#, "role"),
            ("{}", "role"),
            (
                r#"{"role":"fast_path","session_header":"X-Session"}"#,
                "session_header",
            ),
            (
                r#"{"role":"fast_path","affinity":{"slots":0}}"#,
                "affinity.slots",
            ),
            (
                r#"{"role":"fast_path","affinity":{"ways":17}}"#,
                "affinity.ways",
            ),
            (
                r#"{"role":"fast_path","affinity":{"ttl_seconds":0}}"#,
                "affinity.ttl_seconds",
            ),
            (r#"{"role":"fast_path","replicas":["a,b"]}"#, "replicas[0]"),
            (
                r#"{"role":"fast_path","replicas":["a","a"]}"#,
                "replicas[1]",
            ),
            (r#"{"role":"fallback"}"#, "replicas"),
            (
                r#"{"role":"fast_path","marker_header":"x-session-id"}"#,
                "session_header",
            ),
            (r#"{"role":"fast_path","pin":{}}"#, "pin"),
            (
                r#"{"role":"fast_path","pin":{"token_header":"x-t","token":""}}"#,
                "pin",
            ),
            (
                r#"{"role":"fast_path","pin":{"trust_all":true,"token":"x"}}"#,
                "pin.trust_all",
            ),
            (
                r#"{"role":"fast_path","model_routes":{"m":"c"}}"#,
                "model_header",
            ),
            (
                r#"{"role":"fast_path","fallback_hash_headers":["x-a","X-B"]}"#,
                "fallback_hash_headers[1]",
            ),
            (
                r#"{"role":"fast_path","pin":{"trust_all":true,"nope":1}}"#,
                "pin.nope",
            ),
        ];
        for (json, path) in cases {
            let err = parse(json).unwrap_err();
            assert_eq!(err.path(), path, "{json} -> {err}");
        }
    }

    #[test]
    fn error_message_names_field_and_value() {
        let err = parse(r#"{"role":"fast_path","affinity":{"slots":0}}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "affinity.slots: must be within 1..=1048576 (got 0)"
        );
        assert_eq!(err.as_label(), "invalid_value");
        let err = parse(r#"{"role":"fast_path","bogus":1}"#).unwrap_err();
        assert_eq!(err.as_label(), "parse");
    }

    #[test]
    fn pinnable_respects_replica_list() {
        let open = parse(r#"{"role":"fast_path"}"#).unwrap();
        assert!(open.is_pinnable("10.0.0.9:8000"));
        assert!(!open.is_pinnable("a,b"));
        let listed = parse(r#"{"role":"fast_path","replicas":["10.0.0.1:8000"]}"#).unwrap();
        assert!(listed.is_pinnable("10.0.0.1:8000"));
        assert!(!listed.is_pinnable("10.0.0.9:8000"));
    }
}
