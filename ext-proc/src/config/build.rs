//! Raw → validated: each section's leaf values parsed and checked, then [`validate`] for the
//! rules across sections.

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_config::TokenSource;
use kvroute_config::parse_duration;
use kvroute_routing::ScoringConfig;
use kvroute_routing::load::DEFAULT_SCRAPE_INTERVAL;
use kvroute_routing::scoring::{
    DEFAULT_HOTSPOT_FACTOR, DEFAULT_HOTSPOT_MIN_MS, DEFAULT_KV_USAGE_MS,
    DEFAULT_PREFILL_MS_PER_TOKEN, DEFAULT_QUEUE_MS_PER_REQUEST, DEFAULT_RECOMPUTE_PENALTY,
    DEFAULT_RUNNING_MS_PER_REQUEST, DEFAULT_SPECULATIVE_TTL,
};
use kvroute_runtime::token::{AgentToken, TokenError};

use super::pools::{pool, replica};
use super::raw::*;
use super::validate::validate;
use super::{Config, DebugHeaders, DriftConfig, EmbeddedIndex, EppConfig, ScrapeConfig, Shedding};
use crate::error::ConfigError;

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, Self::Error> {
        let grpc_addr = socket_addr("listen.grpc", raw.listen.grpc.as_deref(), DEFAULT_GRPC_ADDR)?;
        let admin_addr = socket_addr(
            "listen.admin",
            raw.listen.admin.as_deref(),
            DEFAULT_ADMIN_ADDR,
        )?;
        let health_addr = raw
            .listen
            .health
            .as_deref()
            .map(|addr| socket_addr("listen.health", Some(addr), addr))
            .transpose()?;
        let epp = epp(&raw.epp)?;
        let grpc_tls = raw
            .listen
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ServerTls::load(tls, "listen.tls"))
            .transpose()?;
        let index_addresses = raw
            .index
            .addresses
            .iter()
            .enumerate()
            .map(|(i, a)| index_uri(&format!("index.addresses[{i}]"), a, raw.index.tls.is_some()))
            .collect::<Result<Vec<_>, _>>()?;
        let index_tls = raw
            .index
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ClientTls::load(tls, "index.tls"))
            .transpose()?;
        let index_token = match raw.index.token_file.as_deref() {
            None => None,
            Some(_) if index_addresses.is_empty() => {
                return Err(ConfigError::invalid(
                    "index.token_file",
                    "…",
                    "only used with index.addresses (the embedded index needs no token)",
                ));
            }
            Some(path) => {
                let token = AgentToken::load(&TokenSource::File(path.to_owned())).map_err(|e| {
                    ConfigError::invalid(
                        "index.token_file",
                        path,
                        match e {
                            TokenError::Empty { .. } => "the file holds no token",
                            _ => "cannot read the file",
                        },
                    )
                })?;
                if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(ConfigError::invalid(
                        "index.token_file",
                        path,
                        "the token must be printable ASCII without spaces",
                    ));
                }
                Some(token)
            }
        };
        let budgets = &raw.budgets;
        let decision_budget = duration(
            "budgets.decision",
            budgets.decision.as_deref(),
            DEFAULT_DECISION_BUDGET,
        )?;
        let tokenize_budget = duration(
            "budgets.tokenize",
            budgets.tokenize.as_deref(),
            DEFAULT_TOKENIZE_BUDGET,
        )?;
        let scoring = scoring(&raw.scoring)?;
        let pools = raw
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| pool(i, p))
            .collect::<Result<Vec<_>, _>>()?;
        let replicas = raw
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| replica(i, r, &pools))
            .collect::<Result<Vec<_>, _>>()?;
        let default_pool = match raw.default_pool.as_deref() {
            Some(name) => Some(pools.iter().position(|p| p.name == name).ok_or_else(|| {
                ConfigError::invalid("default_pool", name, "no pool of that name")
            })?),
            None => (pools.len() == 1).then_some(0),
        };
        let config = Config {
            grpc_addr,
            admin_addr,
            health_addr,
            secure_serving: raw.listen.secure_serving.unwrap_or(DEFAULT_SECURE_SERVING),
            epp,
            grpc_tls,
            index_addresses,
            embedded_index: raw
                .index
                .embedded
                .as_deref()
                .map(EmbeddedIndex::load)
                .transpose()?,
            index_tls,
            index_token,
            match_timeout: duration(
                "index.match_timeout",
                raw.index.match_timeout.as_deref(),
                DEFAULT_MATCH_TIMEOUT,
            )?,
            index_retry_after: duration(
                "index.retry_after",
                raw.index.retry_after.as_deref(),
                DEFAULT_INDEX_RETRY_AFTER,
            )?,
            decision_budget,
            tokenize_budget,
            drain_timeout: duration(
                "budgets.drain",
                budgets.drain.as_deref(),
                DEFAULT_DRAIN_TIMEOUT,
            )?,
            max_body_bytes: raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            scrape: ScrapeConfig {
                interval: duration(
                    "scrape.interval",
                    raw.scrape.interval.as_deref(),
                    DEFAULT_SCRAPE_INTERVAL,
                )?,
                timeout: duration(
                    "scrape.timeout",
                    raw.scrape.timeout.as_deref(),
                    DEFAULT_SCRAPE_TIMEOUT,
                )?,
                unready_after_failures: raw
                    .scrape
                    .unready_after_failures
                    .unwrap_or(DEFAULT_UNREADY_AFTER_FAILURES),
            },
            scoring,
            token_cache_entries: raw
                .token_cache_entries
                .unwrap_or(DEFAULT_TOKEN_CACHE_ENTRIES),
            token_cache_bytes: raw.token_cache_bytes.unwrap_or(DEFAULT_TOKEN_CACHE_BYTES),
            tokenize_concurrency: raw
                .limits
                .tokenize_concurrency
                .unwrap_or_else(default_tokenize_concurrency),
            tokenize_max_prompt_bytes: raw
                .limits
                .tokenize_max_prompt_bytes
                .unwrap_or(DEFAULT_TOKENIZE_MAX_PROMPT_BYTES),
            reload_interval: duration(
                "reload_interval",
                raw.reload_interval.as_deref(),
                DEFAULT_RELOAD_INTERVAL,
            )?,
            default_body_mode: raw.default_body_mode.unwrap_or(DEFAULT_BODY_MODE),
            debug_headers: debug_headers(&raw.debug_headers)?,
            inflight_max_age: duration(
                "limits.inflight_max_age",
                raw.limits.inflight_max_age.as_deref(),
                DEFAULT_INFLIGHT_MAX_AGE,
            )?,
            max_streams: raw.limits.max_streams.unwrap_or(DEFAULT_MAX_STREAMS),
            drift: drift(&raw.drift)?,
            default_pool,
            pools,
            replicas,
        };
        validate(&config)?;
        Ok(config)
    }
}

/// `debug_headers`, validated.
fn debug_headers(raw: &RawDebugHeaders) -> Result<DebugHeaders, ConfigError> {
    let token_only = |field: &str| {
        ConfigError::invalid(
            format!("debug_headers.{field}"),
            "…",
            "only used with `expose: token`",
        )
    };
    match raw.expose.unwrap_or(DEFAULT_DEBUG_EXPOSE) {
        expose @ (DebugExpose::Never | DebugExpose::Always) => {
            if raw.token_file.is_some() {
                return Err(token_only("token_file"));
            }
            if raw.token_header.is_some() {
                return Err(token_only("token_header"));
            }
            Ok(if expose == DebugExpose::Never {
                DebugHeaders::Never
            } else {
                DebugHeaders::Always
            })
        }
        DebugExpose::Token => {
            let header = raw
                .token_header
                .as_deref()
                .unwrap_or(DEFAULT_DEBUG_TOKEN_HEADER)
                .to_ascii_lowercase();
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(ConfigError::invalid(
                    "debug_headers.token_header",
                    &header,
                    "expected an HTTP header name",
                ));
            }
            let path = raw
                .token_file
                .as_deref()
                .ok_or_else(|| ConfigError::missing("debug_headers.token_file"))?;
            let token = AgentToken::load(&TokenSource::File(path.to_owned())).map_err(|e| {
                ConfigError::invalid(
                    "debug_headers.token_file",
                    path,
                    match e {
                        TokenError::Empty { .. } => "the file holds no token",
                        _ => "cannot read the file",
                    },
                )
            })?;
            Ok(DebugHeaders::Token { header, token })
        }
    }
}

/// `drift`, validated.
fn drift(raw: &RawDrift) -> Result<DriftConfig, ConfigError> {
    let share = |field: &str, value: f64| {
        if value.is_finite() && (0.0..=1.0).contains(&value) {
            Ok(value)
        } else {
            Err(ConfigError::invalid(
                format!("drift.{field}"),
                value,
                "expected a number in 0..=1",
            ))
        }
    };
    let bound = share("bound", raw.bound.unwrap_or(DEFAULT_DRIFT_BOUND))?;
    let clear_below = share("clear_below", raw.clear_below.unwrap_or(bound / 2.0))?;
    if clear_below > bound {
        return Err(ConfigError::invalid(
            "drift.clear_below",
            clear_below,
            "must not exceed drift.bound",
        ));
    }
    let window = duration("drift.window", raw.window.as_deref(), DEFAULT_DRIFT_WINDOW)?;
    if window.is_zero() {
        return Err(ConfigError::invalid(
            "drift.window",
            "0",
            "must be positive",
        ));
    }
    Ok(DriftConfig {
        bound,
        clear_below,
        window,
        min_tokens: raw.min_tokens.unwrap_or(DEFAULT_DRIFT_MIN_TOKENS),
        action: raw.action.unwrap_or(DEFAULT_DRIFT_ACTION),
    })
}

fn scoring(raw: &RawScoring) -> Result<ScoringConfig, ConfigError> {
    let non_negative = |field: &str, value: Option<f64>, default: f64| {
        let v = value.unwrap_or(default);
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(ConfigError::invalid(
                format!("scoring.{field}"),
                v,
                "must be a finite number >= 0",
            ))
        }
    };
    let hotspot_factor =
        non_negative("hotspot_factor", raw.hotspot_factor, DEFAULT_HOTSPOT_FACTOR)?;
    if hotspot_factor < 1.0 {
        return Err(ConfigError::invalid(
            "scoring.hotspot_factor",
            hotspot_factor,
            "must be >= 1",
        ));
    }
    Ok(ScoringConfig {
        prefill_ms_per_token: non_negative(
            "prefill_ms_per_token",
            raw.prefill_ms_per_token,
            DEFAULT_PREFILL_MS_PER_TOKEN,
        )?,
        queue_ms_per_request: non_negative(
            "queue_ms_per_request",
            raw.queue_ms_per_request,
            DEFAULT_QUEUE_MS_PER_REQUEST,
        )?,
        running_ms_per_request: non_negative(
            "running_ms_per_request",
            raw.running_ms_per_request,
            DEFAULT_RUNNING_MS_PER_REQUEST,
        )?,
        kv_usage_ms: non_negative("kv_usage_ms", raw.kv_usage_ms, DEFAULT_KV_USAGE_MS)?,
        hotspot_factor,
        hotspot_min_ms: non_negative("hotspot_min_ms", raw.hotspot_min_ms, DEFAULT_HOTSPOT_MIN_MS)?,
        recompute_penalty: non_negative(
            "recompute_penalty",
            raw.recompute_penalty,
            DEFAULT_RECOMPUTE_PENALTY,
        )?,
        speculative_ttl: duration(
            "scoring.speculative_ttl",
            raw.speculative_ttl.as_deref(),
            DEFAULT_SPECULATIVE_TTL,
        )?,
    })
}

fn epp(raw: &RawEpp) -> Result<EppConfig, ConfigError> {
    let shedding = raw
        .shedding
        .as_ref()
        .map(|shed| {
            let queue_depth = shed.queue_depth.unwrap_or(DEFAULT_SHED_QUEUE_DEPTH);
            if !(queue_depth.is_finite() && queue_depth >= 1.0) {
                return Err(ConfigError::invalid(
                    "epp.shedding.queue_depth",
                    queue_depth,
                    "must be at least 1",
                ));
            }
            let kv_cache_usage = shed.kv_cache_usage.unwrap_or(DEFAULT_SHED_KV_CACHE_USAGE);
            if !(kv_cache_usage > 0.0 && kv_cache_usage <= 1.0) {
                return Err(ConfigError::invalid(
                    "epp.shedding.kv_cache_usage",
                    kv_cache_usage,
                    "must be in (0, 1]",
                ));
            }
            Ok(Shedding {
                queue_depth,
                kv_cache_usage,
            })
        })
        .transpose()?;
    Ok(EppConfig {
        fallbacks: raw.fallbacks.unwrap_or(DEFAULT_EPP_FALLBACKS),
        shedding,
    })
}

fn socket_addr(field: &str, value: Option<&str>, default: &str) -> Result<SocketAddr, ConfigError> {
    let value = value.unwrap_or(default);
    value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected ip:port"))
}

pub(super) fn http_uri(field: &str, value: &str) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected an http:// URL"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(ConfigError::invalid(
            field,
            value,
            "expected an http:// URL",
        ));
    }
    Ok(uri)
}

/// An index address: `http://` plaintext, or `https://` when `index.tls` is set.
fn index_uri(field: &str, value: &str, tls: bool) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected an http(s):// URL"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(ConfigError::invalid(
            field,
            value,
            "expected an http(s):// URL",
        ));
    }
    kvroute_runtime::tls::check_scheme(value, tls)
        .map_err(|reason| ConfigError::invalid(field, value, reason))?;
    Ok(uri)
}

/// An optional duration key (`250ms`, `2s`, `1m`: [`kvroute_config::parse_duration`],
/// the one parser of every kvroute config), or `default` when absent.
pub(super) fn duration(
    field: &str,
    value: Option<&str>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    value.map_or(Ok(default), |text| {
        parse_duration(text).map_err(|e| ConfigError::invalid(field, text, e.to_string()))
    })
}
