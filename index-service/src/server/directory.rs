//! Names ↔ ids: the configured replicas and pools as the index and the ingest tasks know them.

use std::{collections::HashMap, sync::Arc};

use kvroute_block_keys::KeyScheme;

use super::ServeError;
use crate::{
    config::{Config, SocketMode},
    event::EventBatch,
    index::{BlockIndex, Feed, FeedState, FlagReason, KvIndex, PoolConfig, PoolKeys, ReplicaId},
    ingest::{self, EventSink, IngestConfig, ReplicaKey, ResetReason},
};

/// A configured pool, with what queries need to turn tokens into keys.
#[derive(Debug, Clone)]
pub struct PoolEntry {
    /// Pool name (the index's pool key).
    pub name: String,
    /// Served model names (what Match requests name).
    pub models: Vec<String>,
    /// Tokens per block.
    pub block_size: u32,
    /// How prompts become keys.
    pub scheme: KeyScheme,
}

/// A configured replica.
#[derive(Debug, Clone)]
pub struct ReplicaEntry {
    /// Config id.
    pub name: Arc<str>,
    /// Dense index id.
    pub id: ReplicaId,
    /// Its pool's name.
    pub pool: String,
}

/// Lookup tables built once from the config.
#[derive(Debug, Clone)]
pub struct Directory {
    pools: Vec<PoolEntry>,
    replicas: Vec<ReplicaEntry>,
    by_name: HashMap<Arc<str>, ReplicaId>,
}

impl Directory {
    /// Registers every pool and replica of `config` in `index`.
    pub fn register(config: &Config, index: &BlockIndex) -> Result<Self, ServeError> {
        let mut pools = Vec::with_capacity(config.pools.len());
        for pool in &config.pools {
            index
                .add_pool(PoolConfig {
                    model: pool.name.clone(),
                    block_size: pool.block_size,
                    keys: PoolKeys::from_scheme(&pool.key_scheme, pool.verify_hashes),
                })
                .map_err(|source| ServeError::Register {
                    what: format!("pool {}", pool.name),
                    source,
                })?;
            pools.push(PoolEntry {
                name: pool.name.clone(),
                models: pool.models.clone(),
                block_size: pool.block_size,
                scheme: pool.key_scheme.clone(),
            });
        }

        let mut replicas = Vec::with_capacity(config.replicas.len());
        let mut by_name = HashMap::with_capacity(config.replicas.len());
        for (i, replica) in config.replicas.iter().enumerate() {
            let id = ReplicaId(u32::try_from(i).unwrap_or(u32::MAX));
            let pool = config.pools[replica.pool].name.clone();
            index
                .add_replica(id, &replica.id, &pool)
                .map_err(|source| ServeError::Register {
                    what: format!("replica {}", replica.id),
                    source,
                })?;
            // Precise only once a feed has caught up: until then the index cannot vouch for it.
            let agent_fed = config
                .agents
                .iter()
                .any(|agent| agent.replicas.contains(&replica.id));
            let feeds = [
                (Feed::Socket, !replica.endpoint.is_empty()),
                (Feed::Agent, agent_fed),
            ];
            for (feed, _) in feeds.into_iter().filter(|(_, configured)| *configured) {
                index
                    .set_feed_state(id, feed, FeedState::NeverConnected)
                    .map_err(|source| ServeError::Register {
                        what: format!("replica {}", replica.id),
                        source,
                    })?;
            }
            let name: Arc<str> = Arc::from(replica.id.as_str());
            by_name.insert(Arc::clone(&name), id);
            replicas.push(ReplicaEntry { name, id, pool });
        }
        Ok(Directory {
            pools,
            replicas,
            by_name,
        })
    }

    /// The ingest socket of every replica.
    pub fn ingest_configs(&self, config: &Config) -> Vec<IngestConfig> {
        config
            .replicas
            .iter()
            .zip(&self.replicas)
            // Agent-fed replicas without an endpoint have no ZMQ socket here.
            .filter(|(replica, _)| !replica.endpoint.is_empty())
            .map(|(replica, entry)| {
                let mode = match replica.mode {
                    SocketMode::Connect => ingest::SocketMode::Connect,
                    SocketMode::Bind => ingest::SocketMode::Bind,
                };
                let mut socket =
                    IngestConfig::new(Arc::clone(&entry.name), &replica.endpoint, mode)
                        .with_dp_rank(replica.dp_rank)
                        .with_topic_filter(replica.topic.clone())
                        .with_allowed_peers(replica.allowed_peers.clone());
                socket.replay_timeout = config.replay_timeout;
                socket.max_message_bytes = replica.max_message_bytes;
                if let Some(replay) = &replica.replay_endpoint {
                    socket = socket.with_replay_endpoint(replay.clone());
                }
                socket
            })
            .collect()
    }

    /// The sink the ingest tasks feed.
    pub fn sink(&self, index: Arc<BlockIndex>) -> IndexSink {
        IndexSink {
            index,
            by_name: self.by_name.clone(),
        }
    }

    /// Every pool, in config order.
    pub fn pools(&self) -> &[PoolEntry] {
        &self.pools
    }

    /// The pool serving `model` (one of its `models`).
    pub fn pool(&self, model: &str) -> Option<&PoolEntry> {
        self.pools
            .iter()
            .find(|pool| pool.models.iter().any(|m| m == model))
    }

    /// The index's pool key for a ReplicaState filter: the pool serving `name` as a model, else
    /// `name` itself (a pool name).
    pub fn pool_key<'a>(&'a self, name: &'a str) -> &'a str {
        self.pool(name).map_or(name, |pool| pool.name.as_str())
    }

    /// Every replica, in config order.
    pub fn replicas(&self) -> &[ReplicaEntry] {
        &self.replicas
    }

    /// A replica's index id by config id.
    pub fn replica_id(&self, name: &str) -> Option<ReplicaId> {
        self.by_name.get(name).copied()
    }

    /// A replica's config id by index id.
    pub fn replica_name(&self, id: ReplicaId) -> Option<&Arc<str>> {
        self.replicas.get(id.0 as usize).map(|entry| &entry.name)
    }
}

/// Applies ingested batches to the index.
#[derive(Debug)]
pub struct IndexSink {
    index: Arc<BlockIndex>,
    by_name: HashMap<Arc<str>, ReplicaId>,
}

impl EventSink for IndexSink {
    fn apply(&self, replica: &ReplicaKey, seq: u64, batch: EventBatch) {
        let Some(&id) = self.by_name.get(&replica.replica_id) else {
            return;
        };
        if let Err(error) = self.index.apply_events(id, &batch.events) {
            tracing::warn!(replica_id = %replica.replica_id, seq, %error, "batch not applied");
        }
    }

    fn reset(&self, replica: &ReplicaKey, reason: ResetReason) {
        let Some(&id) = self.by_name.get(&replica.replica_id) else {
            return;
        };
        tracing::info!(replica_id = %replica.replica_id, reason = reason.as_label(), "replica reset");
        if let Err(error) = self.index.reset_replica(id) {
            tracing::warn!(replica_id = %replica.replica_id, %error, "reset failed");
        }
    }

    fn feed_state(&self, replica: &ReplicaKey, state: FeedState) {
        if let Some(&id) = self.by_name.get(&replica.replica_id) {
            let _ = self.index.set_feed_state(id, Feed::Socket, state);
        }
    }

    fn stream_unusable(&self, replica: &ReplicaKey, reason: FlagReason, unusable: bool) {
        let Some(&id) = self.by_name.get(&replica.replica_id) else {
            return;
        };
        let _ = if unusable {
            self.index.flag_replica(id, reason)
        } else {
            self.index.clear_flag_if(id, reason)
        };
    }
}
