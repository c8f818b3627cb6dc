//! Plugin configuration: the JSON in `PluginConfig.configuration` (Envoy `StringValue`, Istio
//! `WasmPlugin.pluginConfig`), parsed into [`RawConfig`] and validated into [`Config`].
//!
//! The same module runs twice in the chain; `role` says which instance this is. Every other key has a
//! default so the two instances can share one JSON document apart from `role`. Anything malformed is
//! rejected with a [`ConfigError`] naming the field, so `on_configure` can refuse the plugin with one
//! clear log line instead of running with a guess.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Before ext_proc: route on headers alone (pin, learned session, model pool) and skip ext_proc.
    FastPath,
    /// After ext_proc: learn ext_proc's decision; if there is none, pick a replica by hashing.
    Fallback,
}

/// The configuration document as written by the operator.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// Required: `"fast_path"` or `"fallback"`.
    pub role: Option<Role>,
    /// Conversation id header (learned affinity, and the fallback's first hash key).
    pub session_header: Option<String>,
    /// Header carrying a replica decision (`x-gateway-destination-endpoint`, or `x-kvroute-cluster`
    /// when each replica is its own Envoy cluster).
    pub replica_header: Option<String>,
    /// Header carrying a pool (cluster) decision for model routes.
    pub pool_header: Option<String>,
    /// Marker set by the fast path; the chain skips ext_proc when it is present.
    pub marker_header: Option<String>,
    /// Known replicas: the fallback's hash ring, and the only values a pin may name.
    pub replicas: Vec<String>,
    /// Learned session affinity table.
    pub affinity: RawAffinity,
    /// Explicit pin header; absent = pins are never honoured.
    pub pin: Option<RawPin>,
    /// Header naming the model (e.g. set by the client or a body-to-header filter).
    pub model_header: Option<String>,
    /// Model name → pool cluster, routed without ext_proc.
    pub model_routes: BTreeMap<String, String>,
    /// Headers hashed by the fallback, first present wins (default: the session header).
    pub fallback_hash_headers: Vec<String>,
}

/// `affinity` section as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawAffinity {
    /// Entry lifetime in seconds.
    pub ttl_seconds: Option<u64>,
    /// Number of buckets.
    pub slots: Option<u32>,
    /// Entries per bucket.
    pub ways: Option<u8>,
    /// Shared-data key prefix.
    pub key_prefix: Option<String>,
}

/// `pin` section as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawPin {
    /// Header naming the replica to pin to.
    pub header: Option<String>,
    /// `true`: every source is trusted (only for gateways reachable solely by trusted callers).
    pub trust_all: bool,
    /// Header carrying the shared secret of trusted clients.
    pub token_header: Option<String>,
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

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No configuration bytes at all (`role` is mandatory).
    #[error("plugin configuration is empty; `role` (\"fast_path\" or \"fallback\") is required")]
    Empty,
    /// Not JSON, unknown key, or wrong type.
    #[error("plugin configuration is not valid: {source}")]
    Json {
        /// The parser's error (names the key and position).
        #[from]
        source: serde_json::Error,
    },
    /// A required field is absent.
    #[error("`{field}` is required")]
    Missing {
        /// Field path.
        field: &'static str,
    },
    /// A header name that Envoy would not accept as a lowercase HTTP header.
    #[error("`{field}` = {value:?} is not a lowercase HTTP header name")]
    BadHeaderName {
        /// Field path.
        field: &'static str,
        /// The rejected value.
        value: String,
    },
    /// A number outside its allowed range.
    #[error("`{field}` = {value} is outside {min}..={max}")]
    OutOfRange {
        /// Field path.
        field: &'static str,
        /// The rejected value.
        value: u64,
        /// Smallest accepted value.
        min: u64,
        /// Largest accepted value.
        max: u64,
    },
    /// A replica or cluster name that is empty, too long, or not a plain token.
    #[error("`{field}` entry {value:?} must be 1..=255 visible ASCII characters without commas")]
    BadTarget {
        /// Field path.
        field: &'static str,
        /// The rejected value.
        value: String,
    },
    /// The same replica listed twice (would skew the hash ring).
    #[error("`replicas` lists {value:?} twice")]
    DuplicateReplica {
        /// The duplicated replica.
        value: String,
    },
    /// The fallback role needs something to pick from.
    #[error("role \"fallback\" needs a non-empty `replicas` list")]
    NoReplicas,
    /// Two roles of header would be confused with each other.
    #[error("`{field}` must differ from `{other}` (both are {value:?})")]
    HeaderClash {
        /// Field path.
        field: &'static str,
        /// The other field path.
        other: &'static str,
        /// The shared value.
        value: String,
    },
    /// The pin section neither trusts everyone nor names a token.
    #[error("`pin` needs either `trust_all: true` or both `token_header` and `token`")]
    PinTrustUnset,
    /// The pin section both trusts everyone and names a token.
    #[error("`pin.trust_all` and `pin.token` are mutually exclusive")]
    PinTrustAmbiguous,
}

impl ConfigError {
    /// Stable label for logs and counters.
    pub fn as_label(&self) -> &'static str {
        match self {
            ConfigError::Empty => "empty",
            ConfigError::Json { .. } => "json",
            ConfigError::Missing { .. } => "missing",
            ConfigError::BadHeaderName { .. } => "bad_header_name",
            ConfigError::OutOfRange { .. } => "out_of_range",
            ConfigError::BadTarget { .. } => "bad_target",
            ConfigError::DuplicateReplica { .. } => "duplicate_replica",
            ConfigError::NoReplicas => "no_replicas",
            ConfigError::HeaderClash { .. } => "header_clash",
            ConfigError::PinTrustUnset => "pin_trust_unset",
            ConfigError::PinTrustAmbiguous => "pin_trust_ambiguous",
        }
    }
}

impl Config {
    /// Parses and validates the plugin configuration bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ConfigError::Empty);
        }
        let raw: RawConfig = serde_json::from_slice(bytes)?;
        Self::validate(raw)
    }

    /// Validates a parsed document.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let role = raw.role.ok_or(ConfigError::Missing { field: "role" })?;
        let session_header =
            header_or(raw.session_header, "session_header", DEFAULT_SESSION_HEADER)?;
        let replica_header =
            header_or(raw.replica_header, "replica_header", DEFAULT_REPLICA_HEADER)?;
        let pool_header = header_or(raw.pool_header, "pool_header", DEFAULT_POOL_HEADER)?;
        let marker_header = header_or(raw.marker_header, "marker_header", DEFAULT_MARKER_HEADER)?;
        for (field, value) in [
            ("session_header", &session_header),
            ("replica_header", &replica_header),
            ("pool_header", &pool_header),
        ] {
            if *value == marker_header {
                return Err(ConfigError::HeaderClash {
                    field,
                    other: "marker_header",
                    value: value.clone(),
                });
            }
        }
        if session_header == replica_header {
            return Err(ConfigError::HeaderClash {
                field: "session_header",
                other: "replica_header",
                value: session_header,
            });
        }

        let mut seen = HashSet::new();
        for replica in &raw.replicas {
            check_target("replicas", replica)?;
            if !seen.insert(replica.as_str()) {
                return Err(ConfigError::DuplicateReplica {
                    value: replica.clone(),
                });
            }
        }
        if role == Role::Fallback && raw.replicas.is_empty() {
            return Err(ConfigError::NoReplicas);
        }

        let affinity = validate_affinity(raw.affinity)?;
        let pin = raw.pin.map(validate_pin).transpose()?;

        for pool in raw.model_routes.values() {
            check_target("model_routes", pool)?;
        }
        let model_header = match (raw.model_header, raw.model_routes.is_empty()) {
            (Some(h), _) => Some(check_header("model_header", h)?),
            (None, true) => None,
            (None, false) => {
                return Err(ConfigError::Missing {
                    field: "model_header",
                });
            }
        };

        let fallback_hash_headers = if raw.fallback_hash_headers.is_empty() {
            vec![session_header.clone()]
        } else {
            raw.fallback_hash_headers
                .into_iter()
                .map(|h| check_header("fallback_hash_headers", h))
                .collect::<Result<_, _>>()?
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

fn validate_affinity(raw: RawAffinity) -> Result<AffinityConfig, ConfigError> {
    let ttl_seconds = raw.ttl_seconds.unwrap_or(DEFAULT_AFFINITY_TTL.as_secs());
    check_range(
        "affinity.ttl_seconds",
        ttl_seconds,
        1,
        MAX_AFFINITY_TTL.as_secs(),
    )?;
    let slots = raw.slots.unwrap_or(DEFAULT_AFFINITY_SLOTS);
    check_range(
        "affinity.slots",
        u64::from(slots),
        1,
        u64::from(MAX_AFFINITY_SLOTS),
    )?;
    let ways = raw.ways.unwrap_or(DEFAULT_AFFINITY_WAYS);
    check_range(
        "affinity.ways",
        u64::from(ways),
        1,
        u64::from(MAX_AFFINITY_WAYS),
    )?;
    let key_prefix = raw
        .key_prefix
        .unwrap_or_else(|| DEFAULT_AFFINITY_KEY_PREFIX.to_owned());
    if key_prefix.is_empty() || !key_prefix.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::BadTarget {
            field: "affinity.key_prefix",
            value: key_prefix,
        });
    }
    Ok(AffinityConfig {
        ttl: Duration::from_secs(ttl_seconds),
        slots,
        ways,
        key_prefix,
    })
}

fn validate_pin(raw: RawPin) -> Result<PinConfig, ConfigError> {
    let header = header_or(raw.header, "pin.header", DEFAULT_PIN_HEADER)?;
    let trust = match (raw.trust_all, raw.token_header, raw.token) {
        (true, None, None) => PinTrust::All,
        (true, _, _) => return Err(ConfigError::PinTrustAmbiguous),
        (false, Some(token_header), Some(token)) if !token.is_empty() => {
            let token_header = check_header("pin.token_header", token_header)?;
            if token_header == header {
                return Err(ConfigError::HeaderClash {
                    field: "pin.token_header",
                    other: "pin.header",
                    value: token_header,
                });
            }
            PinTrust::Token {
                header: token_header,
                token,
            }
        }
        (false, _, _) => return Err(ConfigError::PinTrustUnset),
    };
    Ok(PinConfig { header, trust })
}

fn header_or(
    value: Option<String>,
    field: &'static str,
    default: &str,
) -> Result<String, ConfigError> {
    check_header(field, value.unwrap_or_else(|| default.to_owned()))
}

/// Envoy stores header names lowercase; an uppercase name in config would never match.
fn check_header(field: &'static str, value: String) -> Result<String, ConfigError> {
    let valid = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    if valid {
        Ok(value)
    } else {
        Err(ConfigError::BadHeaderName { field, value })
    }
}

fn check_range(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value,
            min,
            max,
        })
    }
}

fn check_target(field: &'static str, value: &str) -> Result<(), ConfigError> {
    if is_valid_target(value) {
        Ok(())
    } else {
        Err(ConfigError::BadTarget {
            field,
            value: value.to_owned(),
        })
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
    fn rejections_name_the_problem() {
        let cases = [
            ("", "empty"),
            ("  ", "empty"),
            ("{", "json"),
            (r#"{"role":"fast_path","bogus":1}"#, "json"),
            (r#"{"role":"sideways"}"#, "json"),
            ("{}", "missing"),
            (
                r#"{"role":"fast_path","session_header":"X-Session"}"#,
                "bad_header_name",
            ),
            (
                r#"{"role":"fast_path","affinity":{"slots":0}}"#,
                "out_of_range",
            ),
            (
                r#"{"role":"fast_path","affinity":{"ways":17}}"#,
                "out_of_range",
            ),
            (
                r#"{"role":"fast_path","affinity":{"ttl_seconds":0}}"#,
                "out_of_range",
            ),
            (r#"{"role":"fast_path","replicas":["a,b"]}"#, "bad_target"),
            (
                r#"{"role":"fast_path","replicas":["a","a"]}"#,
                "duplicate_replica",
            ),
            (r#"{"role":"fallback"}"#, "no_replicas"),
            (
                r#"{"role":"fast_path","marker_header":"x-session-id"}"#,
                "header_clash",
            ),
            (r#"{"role":"fast_path","pin":{}}"#, "pin_trust_unset"),
            (
                r#"{"role":"fast_path","pin":{"token_header":"x-t","token":""}}"#,
                "pin_trust_unset",
            ),
            (
                r#"{"role":"fast_path","pin":{"trust_all":true,"token":"x"}}"#,
                "pin_trust_ambiguous",
            ),
            (
                r#"{"role":"fast_path","model_routes":{"m":"c"}}"#,
                "missing",
            ),
        ];
        for (json, label) in cases {
            let err = parse(json).unwrap_err();
            assert_eq!(err.as_label(), label, "{json} -> {err}");
        }
    }

    #[test]
    fn error_message_names_field_and_value() {
        let err = parse(r#"{"role":"fast_path","affinity":{"slots":0}}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`affinity.slots` = 0 is outside 1..=1048576"
        );
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
