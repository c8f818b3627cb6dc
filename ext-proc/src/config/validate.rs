//! Cross-field rules of the validated config, all in one function.

use std::collections::{HashMap, HashSet};

use kvroute_config::format_duration;

use super::Config;
use super::build::{invalid, missing};
use kvroute_config::ConfigError;

/// Cross-field rules, all in one place.
pub(super) fn validate(config: &Config) -> Result<(), ConfigError> {
    if config.pools.is_empty() {
        return Err(missing("pools"));
    }
    let discovered = |pool: usize| config.pools[pool].discovery.is_some();
    if config.replicas.is_empty() && !(0..config.pools.len()).any(discovered) {
        return Err(missing("replicas"));
    }
    if let Some((i, replica)) = config
        .replicas
        .iter()
        .enumerate()
        .find(|(_, r)| discovered(r.pool))
    {
        return Err(invalid(
            format!("replicas[{i}].pool"),
            &config.pools[replica.pool].name,
            "this pool discovers its replicas (pools[].discovery); a static replica cannot join it",
        ));
    }
    if config.tokenize_budget > config.decision_budget {
        return Err(invalid(
            "budgets.tokenize",
            format_duration(config.tokenize_budget),
            "must not exceed budgets.decision",
        ));
    }
    if config.decision_budget.is_zero() {
        return Err(invalid("budgets.decision", "0s", "must be positive"));
    }
    if config.max_body_bytes == 0 {
        return Err(invalid("max_body_bytes", 0, "must be positive"));
    }
    if config.inflight_max_age.is_zero() {
        return Err(invalid("limits.inflight_max_age", "0s", "must be positive"));
    }
    if config.peers.max_staleness.is_zero() {
        return Err(invalid("peers.max_staleness", "0s", "must be positive"));
    }
    if config.tokenize_concurrency == 0 {
        return Err(invalid(
            "limits.tokenize_concurrency",
            0,
            "must be positive",
        ));
    }
    if config.max_streams == 0 {
        return Err(invalid("limits.max_streams", 0, "must be positive"));
    }
    if config.scrape.interval.is_zero() {
        return Err(invalid("scrape.interval", "0s", "must be positive"));
    }
    if config.grpc_addr == config.admin_addr && config.grpc_addr.port() != 0 {
        return Err(invalid(
            "listen.admin",
            config.admin_addr,
            "must differ from listen.grpc",
        ));
    }
    if let Some(health) = config.health_addr
        && health.port() != 0
        && (health == config.grpc_addr || health == config.admin_addr)
    {
        return Err(invalid(
            "listen.health",
            health,
            "must differ from listen.grpc and listen.admin",
        ));
    }
    let mut names = HashMap::new();
    for (i, pool) in config.pools.iter().enumerate() {
        if names.insert(pool.name.as_str(), i).is_some() {
            return Err(invalid(format!("pools[{i}].name"), &pool.name, "duplicate"));
        }
    }
    let mut served = HashSet::new();
    for (i, pool) in config.pools.iter().enumerate() {
        for name in pool
            .models
            .iter()
            .chain(pool.adapters.iter().map(|a| &a.name))
        {
            if !served.insert(name.as_str()) {
                return Err(invalid(
                    format!("pools[{i}].models"),
                    name,
                    "model or adapter name served by two pools",
                ));
            }
        }
    }
    for (i, pool) in config.pools.iter().enumerate() {
        if !pool.keys_serve(pool.engine) {
            return Err(engine_keys_error(format!("pools[{i}].engine"), pool.engine));
        }
    }
    for (i, replica) in config.replicas.iter().enumerate() {
        let pool = &config.pools[replica.pool];
        if !pool.keys_serve(replica.engine) {
            return Err(engine_keys_error(
                format!("replicas[{i}].engine"),
                replica.engine,
            ));
        }
        if replica.role == crate::config::Role::Prefill && pool.disaggregation.is_none() {
            return Err(invalid(
                format!("replicas[{i}].role"),
                replica.role.as_label(),
                format_args!(
                    "pool {:?} splits no requests (no `disaggregation:`), so a prefill-only \
                     replica would never be used",
                    pool.name
                ),
            ));
        }
    }
    let mut ids = HashSet::new();
    let mut addresses = HashSet::new();
    for (i, replica) in config.replicas.iter().enumerate() {
        if !ids.insert(replica.id.as_str()) {
            return Err(invalid(
                format!("replicas[{i}].id"),
                &replica.id,
                "duplicate",
            ));
        }
        if !addresses.insert(replica.target()) {
            return Err(invalid(
                format!("replicas[{i}].address"),
                replica.address,
                "duplicate",
            ));
        }
    }
    Ok(())
}

/// An engine family whose published block hashes the pool's key scheme does not compute.
fn engine_keys_error(field: String, engine: crate::config::Engine) -> ConfigError {
    invalid(
        field,
        engine.as_label(),
        "the pool's key_scheme computes another engine family's published hashes (key_scheme \
         kind sglang-exact for SGLang, vllm-exact for vLLM, token-chain for either)",
    )
}
