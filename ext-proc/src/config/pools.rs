//! A pool's and a replica's entries, validated. Paths are relative to the entry (`block_size`);
//! the caller places them (`pools[2]`).

use kvroute_block_keys::{KeyScheme, PoolKeySettings};
use kvroute_config::ListenAddr;

use super::build::{http_uri, invalid, missing, or_default};
use super::raw::{
    DEFAULT_APPROX_CAPACITY_BLOCKS, DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS,
    DEFAULT_DISAGGREGATION_MIN_UNCACHED_TOKENS, DEFAULT_MAX_CONCURRENT_PREFILLS,
    DEFAULT_MAX_PREFILL_QUEUE, DEFAULT_POOL_EVENTS, DEFAULT_POOL_MODE, DEFAULT_PREFILL_RETRIES,
    DEFAULT_PREFILL_TIMEOUT, DEFAULT_REMOTE_TOKENIZE_TIMEOUT, RawAdapter, RawDisaggregation,
    RawPool, RawReplica, RawTokenizer,
};
use super::{
    Adapter, Disaggregation, DisaggregationMode, Pool, PrefillLegSettings, Replica, TokenizerSource,
};
use kvroute_config::ConfigError;

/// `pools[i]`.
pub(super) fn pool(raw: &RawPool) -> Result<Pool, ConfigError> {
    let name = raw
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| missing("name"))?;
    if raw.models.is_empty() && !raw.any_model {
        return Err(missing("models"));
    }
    if raw.models.iter().any(String::is_empty) {
        return Err(invalid("models", "", "empty model name"));
    }
    let adapters = raw
        .adapters
        .iter()
        .map(|a| match a {
            RawAdapter::Name(name) => Adapter {
                name: name.clone(),
                id: None,
                path: None,
            },
            RawAdapter::Full { name, id, path } => Adapter {
                name: name.clone(),
                id: *id,
                path: path.clone(),
            },
        })
        .collect::<Vec<_>>();
    if adapters.iter().any(|a| a.name.is_empty()) {
        return Err(invalid("adapters", "", "empty adapter name"));
    }
    let PoolKeySettings {
        block_size,
        scheme: key_scheme,
    } = PoolKeySettings::from_raw(raw.block_size, &raw.key_scheme)
        .map_err(|e| invalid(e.field, e.value, e.reason))?;
    let key_scheme_engine = key_scheme.engine();
    if let KeyScheme::VllmExact { era, .. } = &key_scheme {
        // Check the adapters carry what this era hashes, at startup rather than per request.
        for (j, adapter) in adapters.iter().enumerate() {
            era.block_extra_keys(Some(&adapter.as_lora_ref()), None, 0).map_err(|_| {
                invalid(
                    format!("adapters[{j}]"),
                    &adapter.name,
                    "this vLLM version hashes the adapter's id (<=0.11.0) or path (>=0.31): add it",
                )
            })?;
        }
    }
    if matches!(key_scheme, KeyScheme::SglangExact(_)) && !adapters.is_empty() {
        return Err(invalid(
            "adapters",
            &adapters[0].name,
            "SGLang keys a LoRA request's pages by its internal adapter id, which kvroute \
             cannot reproduce: use `key_scheme: {kind: token-chain}` for pools with adapters",
        ));
    }
    let tokenizer = match &raw.tokenizer {
        None => TokenizerSource::None,
        Some(RawTokenizer {
            model_dir: Some(dir),
            remote: None,
            render: None,
            timeout: None,
        }) => TokenizerSource::ModelDir(dir.clone()),
        Some(RawTokenizer {
            model_dir: None,
            remote: None,
            render: Some(url),
            timeout,
        }) => TokenizerSource::Render {
            url: http_uri("tokenizer.render", url)?,
            timeout: or_default(*timeout, DEFAULT_REMOTE_TOKENIZE_TIMEOUT),
        },
        Some(RawTokenizer {
            model_dir: None,
            remote: Some(url),
            render: None,
            timeout,
        }) => TokenizerSource::Remote {
            url: http_uri("tokenizer.remote", url)?,
            timeout: or_default(*timeout, DEFAULT_REMOTE_TOKENIZE_TIMEOUT),
        },
        Some(_) => {
            return Err(invalid(
                "tokenizer",
                "…",
                "expected exactly one of model_dir, remote or render (timeout only with remote or render)",
            ));
        }
    };
    let approx_capacity_blocks = raw
        .approx_capacity_blocks
        .unwrap_or(DEFAULT_APPROX_CAPACITY_BLOCKS);
    if approx_capacity_blocks == 0 {
        return Err(invalid("approx_capacity_blocks", 0, "must be positive"));
    }
    let discovery = match &raw.discovery {
        None => None,
        Some(kvroute_discovery::RawPoolDiscovery { kubernetes: None }) => {
            return Err(missing("discovery.kubernetes"));
        }
        Some(kvroute_discovery::RawPoolDiscovery {
            kubernetes: Some(kubernetes),
        }) => Some(
            kvroute_discovery::KubernetesSource::try_from(kubernetes.clone())
                .map_err(|e| e.within("discovery.kubernetes"))?,
        ),
    };
    let keys_fingerprint =
        xxhash_rust::xxh3::xxh3_64(format!("{key_scheme:?}/{block_size}").as_bytes());
    Ok(Pool {
        name,
        models: raw.models.clone(),
        adapters,
        block_size,
        key_scheme,
        keys_fingerprint,
        mode: raw.mode.unwrap_or(DEFAULT_POOL_MODE),
        events: raw.events.unwrap_or(DEFAULT_POOL_EVENTS),
        approx_capacity_blocks,
        tokenizer,
        discovery,
        disaggregation: raw
            .disaggregation
            .as_ref()
            .map(disaggregation)
            .transpose()
            .map_err(|e| e.within("disaggregation"))?,
        // Unsaid, the family whose hashes the pool keys on (vLLM for token-chain).
        engine: raw
            .engine
            .unwrap_or_else(|| key_scheme_engine.unwrap_or_default()),
    })
}

/// `pools[i].disaggregation`: the prefill leg's keys only where ext-proc runs it.
fn disaggregation(raw: &RawDisaggregation) -> Result<Disaggregation, ConfigError> {
    let mode = raw.mode.unwrap_or_default();
    if mode != DisaggregationMode::Envoy {
        let leg_keys = [
            ("prefill_timeout", raw.prefill_timeout.is_some()),
            ("prefill_retries", raw.prefill_retries.is_some()),
            (
                "max_concurrent_prefills",
                raw.max_concurrent_prefills.is_some(),
            ),
        ];
        if let Some((key, _)) = leg_keys.iter().find(|(_, set)| *set) {
            return Err(invalid(
                *key,
                "…",
                "only with mode: envoy (in sidecar mode the decode replica's sidecar runs the prefill leg)",
            ));
        }
    }
    let timeout = or_default(raw.prefill_timeout, DEFAULT_PREFILL_TIMEOUT);
    if timeout.is_zero() {
        return Err(invalid("prefill_timeout", "0s", "must be positive"));
    }
    let max_concurrent = raw
        .max_concurrent_prefills
        .unwrap_or(DEFAULT_MAX_CONCURRENT_PREFILLS);
    if max_concurrent == 0 {
        return Err(invalid("max_concurrent_prefills", 0, "must be at least 1"));
    }
    let max_prefill_queue = or_default(raw.max_prefill_queue, DEFAULT_MAX_PREFILL_QUEUE);
    if max_prefill_queue.is_zero() {
        return Err(invalid("max_prefill_queue", "0s", "must be positive"));
    }
    Ok(Disaggregation {
        mode,
        max_prefill_queue: Some(max_prefill_queue),
        min_prompt_tokens: raw
            .min_prompt_tokens
            .unwrap_or(DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS),
        min_uncached_tokens: raw
            .min_uncached_tokens
            .unwrap_or(DEFAULT_DISAGGREGATION_MIN_UNCACHED_TOKENS),
        prefill: PrefillLegSettings {
            timeout,
            retries: raw.prefill_retries.unwrap_or(DEFAULT_PREFILL_RETRIES),
            max_concurrent,
        },
    })
}

/// `replicas[i]`, whose pool is one of `pools`: the replica, or each of its data-parallel ranks.
pub(super) fn replicas(raw: &RawReplica, pools: &[Pool]) -> Result<Vec<Replica>, ConfigError> {
    let id = raw
        .id
        .clone()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| missing("id"))?;
    let pool_name = raw.pool.as_deref().ok_or_else(|| missing("pool"))?;
    let pool = pools
        .iter()
        .position(|p| p.name == pool_name)
        .ok_or_else(|| invalid("pool", pool_name, "no pool with this name"))?;
    let address = raw
        .address
        .map(ListenAddr::get)
        .ok_or_else(|| missing("address"))?;
    let metrics_url = raw
        .metrics_url
        .as_deref()
        .map(|u| http_uri("metrics_url", u))
        .transpose()?;
    if let Some(cluster) = raw
        .envoy_cluster
        .as_deref()
        .filter(|c| c.is_empty() || c.contains(char::is_whitespace))
    {
        return Err(invalid("envoy_cluster", cluster, "expected a cluster name"));
    }
    let ranks = raw.data_parallel_size.unwrap_or(1);
    kvroute_config::check_data_parallel_size(ranks)
        .map_err(|reason| ConfigError::at("data_parallel_size", reason))?;
    let role = raw.role.unwrap_or_default();
    let engine = raw.engine.unwrap_or(pools[pool].engine);
    let replica = |id: String, dp_rank: Option<u32>| Replica {
        id,
        pool,
        address,
        dp_rank,
        role,
        engine,
        metrics_url: metrics_url.clone(),
        envoy_cluster: raw.envoy_cluster.clone(),
    };
    if ranks == 1 {
        return Ok(vec![replica(id, None)]);
    }
    Ok((0..ranks)
        .map(|rank| replica(kvroute_config::rank_replica_id(&id, rank), Some(rank)))
        .collect())
}
