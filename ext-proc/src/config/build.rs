//! Raw → validated: each section's values checked and defaulted, then [`validate`] for the rules
//! across sections. A section validated on its own reports paths relative to itself and is placed
//! with [`ConfigError::within`], so every error reads `path: reason` with the full path.

use std::fmt::Display;
use std::time::Duration;

use kvroute_config::{ConfigDuration, ListenAddr, TokenSource};
use kvroute_routing::ScoringConfig;
use kvroute_routing::load::DEFAULT_SCRAPE_INTERVAL;
use kvroute_routing::scoring::{
    DEFAULT_HOTSPOT_FACTOR, DEFAULT_HOTSPOT_MIN_MS, DEFAULT_IDLE_POOL_MS, DEFAULT_KV_USAGE_MS,
    DEFAULT_OVERLOAD_IMBALANCE, DEFAULT_OVERLOAD_QUEUE_MS, DEFAULT_PREFILL_MS_PER_TOKEN,
    DEFAULT_QUEUE_MS_PER_REQUEST, DEFAULT_RECOMPUTE_PENALTY, DEFAULT_RUNNING_MS_PER_REQUEST,
    DEFAULT_SPECULATIVE_TTL,
};
use kvroute_runtime::tls::{ClientTls, ServerTls, TlsError};
use kvroute_runtime::token::{AgentToken, TokenError};

use super::pools::{pool, replicas};
use super::raw::{
    DEFAULT_ADMIN_ADDR, DEFAULT_BODY_MODE, DEFAULT_DEBUG_EXPOSE, DEFAULT_DEBUG_TOKEN_HEADER,
    DEFAULT_DECISION_BUDGET, DEFAULT_DRAIN_TIMEOUT, DEFAULT_DRIFT_ACTION, DEFAULT_DRIFT_BOUND,
    DEFAULT_DRIFT_MIN_TOKENS, DEFAULT_DRIFT_WINDOW, DEFAULT_EPP_FALLBACKS, DEFAULT_GRPC_ADDR,
    DEFAULT_INDEX_RETRY_AFTER, DEFAULT_INFLIGHT_MAX_AGE, DEFAULT_MATCH_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_STREAMS, DEFAULT_PEERS_MAX_STALENESS, DEFAULT_PEERS_SHARE,
    DEFAULT_RECORD_SAMPLE, DEFAULT_RECORDS_KEPT, DEFAULT_RELOAD_INTERVAL, DEFAULT_SCRAPE_TIMEOUT,
    DEFAULT_SECURE_SERVING, DEFAULT_SHED_KV_CACHE_USAGE, DEFAULT_SHED_QUEUE_DEPTH,
    DEFAULT_TOKEN_CACHE_BYTES, DEFAULT_TOKEN_CACHE_ENTRIES, DEFAULT_TOKENIZE_BUDGET,
    DEFAULT_TOKENIZE_MAX_PROMPT_BYTES, DEFAULT_UNREADY_AFTER_FAILURES, DebugExpose,
    MAX_RECORDS_KEPT, RawConfig, RawDebugHeaders, RawDecisionRecords, RawDrift, RawEpp, RawIndex,
    RawScoring, default_tokenize_concurrency,
};
use super::validate::validate;
use super::{
    Config, DebugHeaders, DecisionRecordsConfig, DriftConfig, EmbeddedIndex, EppConfig,
    PeerSharing, ScrapeConfig, Shedding,
};
use kvroute_config::ConfigError;

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, Self::Error> {
        let listen = &raw.listen;
        let grpc_tls = listen
            .tls
            .as_ref()
            .map(|tls| ServerTls::load(tls, "listen.tls"))
            .transpose()
            .map_err(tls_error)?;
        let index = index(&raw.index)?;
        let pools = raw
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| pool(p).map_err(|e| e.within(&format!("pools[{i}]"))))
            .collect::<Result<Vec<_>, _>>()?;
        let replicas = raw
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| replicas(r, &pools).map_err(|e| e.within(&format!("replicas[{i}]"))))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .flatten()
            .collect();
        let default_pool = match raw.default_pool.as_deref() {
            Some(name) => Some(
                pools
                    .iter()
                    .position(|p| p.name == name)
                    .ok_or_else(|| invalid("default_pool", name, "no pool of that name"))?,
            ),
            None => (pools.len() == 1).then_some(0),
        };
        let config = Config {
            grpc_addr: listen.grpc.map_or(DEFAULT_GRPC_ADDR, ListenAddr::get),
            admin_addr: listen.admin.map_or(DEFAULT_ADMIN_ADDR, ListenAddr::get),
            health_addr: listen.health.map(ListenAddr::get),
            secure_serving: listen.secure_serving.unwrap_or(DEFAULT_SECURE_SERVING),
            epp: epp(&raw.epp).map_err(|e| e.within("epp"))?,
            grpc_tls,
            index_addresses: index.addresses,
            embedded_index: index.embedded,
            index_tls: index.tls,
            index_token: index.token,
            match_timeout: or_default(raw.index.match_timeout, DEFAULT_MATCH_TIMEOUT),
            index_retry_after: or_default(raw.index.retry_after, DEFAULT_INDEX_RETRY_AFTER),
            decision_budget: or_default(raw.budgets.decision, DEFAULT_DECISION_BUDGET),
            tokenize_budget: or_default(raw.budgets.tokenize, DEFAULT_TOKENIZE_BUDGET),
            drain_timeout: or_default(raw.budgets.drain, DEFAULT_DRAIN_TIMEOUT),
            max_body_bytes: raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            scrape: ScrapeConfig {
                interval: or_default(raw.scrape.interval, DEFAULT_SCRAPE_INTERVAL),
                timeout: or_default(raw.scrape.timeout, DEFAULT_SCRAPE_TIMEOUT),
                unready_after_failures: raw
                    .scrape
                    .unready_after_failures
                    .unwrap_or(DEFAULT_UNREADY_AFTER_FAILURES),
            },
            scoring: scoring(&raw.scoring).map_err(|e| e.within("scoring"))?,
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
            reload_interval: or_default(raw.reload_interval, DEFAULT_RELOAD_INTERVAL),
            log_format: raw.log.format(),
            default_body_mode: raw.default_body_mode.unwrap_or(DEFAULT_BODY_MODE),
            debug_headers: debug_headers(&raw.debug_headers)
                .map_err(|e| e.within("debug_headers"))?,
            inflight_max_age: or_default(raw.limits.inflight_max_age, DEFAULT_INFLIGHT_MAX_AGE),
            peers: PeerSharing {
                share: raw.peers.share.unwrap_or(DEFAULT_PEERS_SHARE),
                max_staleness: or_default(raw.peers.max_staleness, DEFAULT_PEERS_MAX_STALENESS),
            },
            max_streams: raw.limits.max_streams.unwrap_or(DEFAULT_MAX_STREAMS),
            drift: drift(&raw.drift).map_err(|e| e.within("drift"))?,
            decision_records: decision_records(&raw.decision_records)
                .map_err(|e| e.within("decision_records"))?,
            default_pool,
            pools,
            replicas,
        };
        validate(&config)?;
        Ok(config)
    }
}

/// A value the rules refuse, as every kvroute config writes it: `path: reason (got "value")`.
pub(super) fn invalid(
    path: impl Into<String>,
    value: impl Display,
    reason: impl Display,
) -> ConfigError {
    ConfigError::at(path, format_args!("{reason} (got {:?})", value.to_string()))
}

/// A required key that is absent: `path: required`.
pub(super) fn missing(path: impl Into<String>) -> ConfigError {
    ConfigError::at(path, "required")
}

/// A duration key's value, or `default` when absent.
pub(super) fn or_default(value: Option<ConfigDuration>, default: Duration) -> Duration {
    value.map_or(default, ConfigDuration::get)
}

/// Unusable TLS material, at the key naming the file (`listen.tls.cert`).
fn tls_error(error: TlsError) -> ConfigError {
    ConfigError::load(error.field(), error.reason())
}

/// The token in the file `path` names, for the key at `field` (`index.token_file`).
fn load_token(field: &str, path: &str) -> Result<AgentToken, ConfigError> {
    AgentToken::load(&TokenSource::File(path.to_owned())).map_err(|e| {
        let reason = match e {
            TokenError::Empty { .. } => "the file holds no token",
            _ => "cannot read the file",
        };
        ConfigError::load(field, format_args!("{reason} (got {path:?})"))
    })
}

/// `index`, validated.
struct Index {
    addresses: Vec<http::Uri>,
    embedded: Option<EmbeddedIndex>,
    tls: Option<ClientTls>,
    token: Option<AgentToken>,
}

fn index(raw: &RawIndex) -> Result<Index, ConfigError> {
    let addresses = raw
        .addresses
        .iter()
        .enumerate()
        .map(|(i, a)| index_uri(&format!("index.addresses[{i}]"), a, raw.tls.is_some()))
        .collect::<Result<Vec<_>, _>>()?;
    let tls = raw
        .tls
        .as_ref()
        .map(|tls| ClientTls::load(tls, "index.tls"))
        .transpose()
        .map_err(tls_error)?;
    let token = match raw.token_file.as_deref() {
        None => None,
        Some(_) if addresses.is_empty() => {
            return Err(ConfigError::at(
                "index.token_file",
                "only used with index.addresses (the embedded index needs no token)",
            ));
        }
        Some(path) => {
            let token = load_token("index.token_file", path)?;
            if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid(
                    "index.token_file",
                    path,
                    "the token must be printable ASCII without spaces",
                ));
            }
            Some(token)
        }
    };
    let embedded = raw
        .embedded
        .as_deref()
        .map(EmbeddedIndex::load)
        .transpose()?;
    Ok(Index {
        addresses,
        embedded,
        tls,
        token,
    })
}

/// `decision_records`, validated; paths relative to the section.
fn decision_records(raw: &RawDecisionRecords) -> Result<DecisionRecordsConfig, ConfigError> {
    let sample = raw.sample.unwrap_or(DEFAULT_RECORD_SAMPLE);
    if !(0.0..=1.0).contains(&sample) {
        return Err(invalid("sample", sample, "expected a share from 0 to 1"));
    }
    let keep = raw.keep.unwrap_or(DEFAULT_RECORDS_KEPT);
    if keep > MAX_RECORDS_KEPT {
        return Err(invalid(
            "keep",
            keep,
            format_args!("at most {MAX_RECORDS_KEPT} records are kept"),
        ));
    }
    Ok(DecisionRecordsConfig { sample, keep })
}

/// `debug_headers`, validated; paths relative to the section.
fn debug_headers(raw: &RawDebugHeaders) -> Result<DebugHeaders, ConfigError> {
    let expose = raw.expose.unwrap_or(DEFAULT_DEBUG_EXPOSE);
    if expose != DebugExpose::Token {
        let token_only = |field: &str| ConfigError::at(field, "only used with `expose: token`");
        if raw.token_file.is_some() {
            return Err(token_only("token_file"));
        }
        if raw.token_header.is_some() {
            return Err(token_only("token_header"));
        }
    }
    match expose {
        DebugExpose::Never => Ok(DebugHeaders::Never),
        DebugExpose::Always => Ok(DebugHeaders::Always),
        DebugExpose::Token => {
            // Envoy hands ext_proc lowercase header names.
            let header = raw
                .token_header
                .as_deref()
                .unwrap_or(DEFAULT_DEBUG_TOKEN_HEADER)
                .to_ascii_lowercase();
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(invalid(
                    "token_header",
                    &header,
                    "expected an HTTP header name",
                ));
            }
            let path = raw
                .token_file
                .as_deref()
                .ok_or_else(|| missing("token_file"))?;
            let token = load_token("token_file", path)?;
            Ok(DebugHeaders::Token { header, token })
        }
    }
}

/// `drift`, validated; paths relative to the section.
fn drift(raw: &RawDrift) -> Result<DriftConfig, ConfigError> {
    let share = |field: &str, value: f64| {
        if value.is_finite() && (0.0..=1.0).contains(&value) {
            Ok(value)
        } else {
            Err(invalid(field, value, "expected a number in 0..=1"))
        }
    };
    let bound = share("bound", raw.bound.unwrap_or(DEFAULT_DRIFT_BOUND))?;
    let clear_below = share("clear_below", raw.clear_below.unwrap_or(bound / 2.0))?;
    if clear_below > bound {
        return Err(invalid(
            "clear_below",
            clear_below,
            "must not exceed drift.bound",
        ));
    }
    let window = or_default(raw.window, DEFAULT_DRIFT_WINDOW);
    if window.is_zero() {
        return Err(invalid("window", "0s", "must be positive"));
    }
    Ok(DriftConfig {
        bound,
        clear_below,
        window,
        min_tokens: raw.min_tokens.unwrap_or(DEFAULT_DRIFT_MIN_TOKENS),
        action: raw.action.unwrap_or(DEFAULT_DRIFT_ACTION),
    })
}

/// `scoring`, validated; paths relative to the section.
fn scoring(raw: &RawScoring) -> Result<ScoringConfig, ConfigError> {
    let non_negative = |field: &str, value: Option<f64>, default: f64| {
        let v = value.unwrap_or(default);
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(invalid(field, v, "must be a finite number >= 0"))
        }
    };
    let factor = |field: &str, value: Option<f64>, default: f64| {
        let v = non_negative(field, value, default)?;
        if v < 1.0 {
            return Err(invalid(field, v, "must be >= 1"));
        }
        Ok(v)
    };
    let hotspot_factor = factor("hotspot_factor", raw.hotspot_factor, DEFAULT_HOTSPOT_FACTOR)?;
    let overload_imbalance = non_negative(
        "overload_imbalance",
        raw.overload_imbalance,
        DEFAULT_OVERLOAD_IMBALANCE,
    )?;
    if overload_imbalance < 1.0 {
        return Err(invalid(
            "overload_imbalance",
            overload_imbalance,
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
        idle_pool_ms: non_negative("idle_pool_ms", raw.idle_pool_ms, DEFAULT_IDLE_POOL_MS)?,
        recompute_penalty: non_negative(
            "recompute_penalty",
            raw.recompute_penalty,
            DEFAULT_RECOMPUTE_PENALTY,
        )?,
        speculative_ttl: or_default(raw.speculative_ttl, DEFAULT_SPECULATIVE_TTL),
        overload_queue_ms: non_negative(
            "overload_queue_ms",
            raw.overload_queue_ms,
            DEFAULT_OVERLOAD_QUEUE_MS,
        )?,
        overload_imbalance,
    })
}

/// `epp`, validated; paths relative to the section.
fn epp(raw: &RawEpp) -> Result<EppConfig, ConfigError> {
    let shedding = raw
        .shedding
        .as_ref()
        .map(|shed| {
            let queue_depth = shed.queue_depth.unwrap_or(DEFAULT_SHED_QUEUE_DEPTH);
            if !(queue_depth.is_finite() && queue_depth >= 1.0) {
                return Err(invalid(
                    "shedding.queue_depth",
                    queue_depth,
                    "must be at least 1",
                ));
            }
            let kv_cache_usage = shed.kv_cache_usage.unwrap_or(DEFAULT_SHED_KV_CACHE_USAGE);
            if !(kv_cache_usage > 0.0 && kv_cache_usage <= 1.0) {
                return Err(invalid(
                    "shedding.kv_cache_usage",
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
    let fallbacks = raw.fallbacks.unwrap_or(DEFAULT_EPP_FALLBACKS);
    let most = kvroute_routing::policy::FALLBACKS_KEPT;
    if fallbacks > most {
        return Err(invalid(
            "fallbacks",
            fallbacks,
            format_args!("at most {most} (the endpoints each decision ranks)"),
        ));
    }
    Ok(EppConfig {
        fallbacks,
        shedding,
    })
}

/// An `http://` URL with a host (`metrics_url`, `tokenizer.remote`, `tokenizer.render`).
pub(super) fn http_uri(field: &str, value: &str) -> Result<http::Uri, ConfigError> {
    let expected = || invalid(field, value, "expected an http:// URL");
    let uri: http::Uri = value.parse().map_err(|_| expected())?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(expected());
    }
    Ok(uri)
}

/// An index address: `http://` plaintext, or `https://` when `index.tls` is set.
fn index_uri(field: &str, value: &str, tls: bool) -> Result<http::Uri, ConfigError> {
    let expected = || invalid(field, value, "expected an http(s):// URL");
    let uri: http::Uri = value.parse().map_err(|_| expected())?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(expected());
    }
    kvroute_runtime::tls::check_scheme(value, tls)
        .map_err(|reason| invalid(field, value, reason))?;
    Ok(uri)
}
