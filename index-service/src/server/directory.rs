//! Names ↔ ids: the configured replicas and pools as the index and the ingest tasks know them.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use parking_lot::RwLock;

use kvroute_block_keys::KeyScheme;

use super::ServeError;
use crate::config::{Config, ReplicaConfig};
use kvroute_index_core::event::EventBatch;
use kvroute_index_core::index::{
    BlockIndex, Feed, FeedState, FlagReason, IndexError, KvIndex, PoolConfig, PoolKeys, ReplicaId,
};
use kvroute_ingest::{EventSink, IngestConfig, ReplicaKey, ResetReason};

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

/// A replica the index knows (from `replicas:` or discovery).
#[derive(Debug, Clone)]
pub struct ReplicaEntry {
    /// Config id.
    pub name: Arc<str>,
    /// Index id (never reused while the process runs: a late batch of a removed replica cannot
    /// land on a newer one).
    pub id: ReplicaId,
    /// Its pool's name.
    pub pool: String,
    /// The node it runs on (discovered replicas; its node agent may feed it).
    pub node: Option<String>,
    /// Fed by an agent (a static `agents:` owner, or its node's agent).
    pub agent_fed: bool,
}

/// The replicas: they come and go (discovery, reloads), so every clone shares one table.
#[derive(Debug, Default)]
struct ReplicaTable {
    entries: BTreeMap<ReplicaId, ReplicaEntry>,
    by_name: HashMap<Arc<str>, ReplicaId>,
    next_id: u32,
}

/// Lookup tables: pools fixed at start, replicas shared and changing.
#[derive(Debug, Clone)]
pub struct Directory {
    pools: Arc<[PoolEntry]>,
    replicas: Arc<RwLock<ReplicaTable>>,
}

impl Directory {
    /// Registers every pool and static replica of `config` in `index`.
    pub fn register(config: &Config, index: &BlockIndex) -> Result<Self, ServeError> {
        let mut pools = Vec::with_capacity(config.pools.len());
        for pool in &config.pools {
            index
                .add_pool(PoolConfig {
                    model: pool.name.clone(),
                    block_size: pool.block_size,
                    keys: PoolKeys::from_scheme(&pool.key_scheme, pool.verify_hashes),
                    attention_chunk_size: pool.attention_chunk_size,
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
        let directory = Directory {
            pools: pools.into(),
            replicas: Arc::default(),
        };
        for replica in &config.replicas {
            directory.add(config, index, replica)?;
        }
        Ok(directory)
    }

    /// Adds one replica to the table and the index, its feeds `never_connected` until they catch
    /// up (the index cannot vouch for it before).
    pub fn add(
        &self,
        config: &Config,
        index: &BlockIndex,
        replica: &ReplicaConfig,
    ) -> Result<ReplicaId, ServeError> {
        let register_error = |source| ServeError::Register {
            what: format!("replica {}", replica.id),
            source,
        };
        let pool = config.pools[replica.pool].name.clone();
        let mut table = self.replicas.write();
        if table.by_name.contains_key(replica.id.as_str()) {
            return Err(register_error(IndexError::DuplicateReplica {
                replica: table.by_name[replica.id.as_str()],
            }));
        }
        let id = ReplicaId(table.next_id);
        index
            .add_replica(id, &replica.id, &pool)
            .map_err(register_error)?;
        table.next_id = table.next_id.saturating_add(1);
        let agent_fed = config
            .agents
            .iter()
            .any(|agent| agent.replicas.contains(&replica.id))
            || (config.node_agents.is_some()
                && replica.endpoint.is_empty()
                && replica.node.is_some());
        let feeds = [
            (Feed::Socket, !replica.endpoint.is_empty()),
            (Feed::Agent, agent_fed),
        ];
        for (feed, _) in feeds.into_iter().filter(|(_, configured)| *configured) {
            index
                .set_feed_state(id, feed, FeedState::NeverConnected)
                .map_err(register_error)?;
        }
        let name: Arc<str> = Arc::from(replica.id.as_str());
        table.by_name.insert(Arc::clone(&name), id);
        table.entries.insert(
            id,
            ReplicaEntry {
                name,
                id,
                pool,
                node: replica.node.clone(),
                agent_fed,
            },
        );
        Ok(id)
    }

    /// Removes a replica from the table and the index (its blocks are dropped). Stop its ingest
    /// first, so no batch of it arrives afterwards.
    pub fn remove(&self, index: &BlockIndex, name: &str) -> Option<ReplicaId> {
        let mut table = self.replicas.write();
        let id = table.by_name.remove(name)?;
        table.entries.remove(&id);
        if let Err(error) = index.remove_replica(id) {
            tracing::warn!(replica_id = name, %error, "replica was not in the index");
        }
        Some(id)
    }

    /// The ingest socket of a replica (`None`: agent-fed only, no ZMQ socket here).
    pub fn ingest_config(config: &Config, replica: &ReplicaConfig) -> Option<IngestConfig> {
        if replica.endpoint.is_empty() {
            return None;
        }
        let socket = IngestConfig::new(
            Arc::from(replica.id.as_str()),
            &replica.endpoint,
            replica.mode,
        );
        let mut socket = if replica.dp_rank_checked {
            socket.with_checked_dp_rank(replica.dp_rank)
        } else {
            socket.with_dp_rank(replica.dp_rank)
        }
        .with_topic_filter(replica.topic.clone())
        .with_allowed_peers(replica.allowed_peers.clone())
        .with_engine(replica.engine);
        socket.replay_timeout = config.replay_timeout;
        socket.max_message_bytes = replica.max_message_bytes;
        socket.reconnect_backoff_max = replica.reconnect_backoff_max;
        if let Some(replay) = &replica.replay_endpoint {
            socket = socket.with_replay_endpoint(replay.clone());
        }
        Some(socket)
    }

    /// The sink the ingest tasks feed.
    pub fn sink(&self, index: Arc<BlockIndex>) -> IndexSink {
        IndexSink {
            index,
            directory: self.clone(),
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

    /// Every replica now, in the order they were added.
    pub fn replicas(&self) -> Vec<ReplicaEntry> {
        self.replicas.read().entries.values().cloned().collect()
    }

    /// A replica's index id by config id.
    pub fn replica_id(&self, name: &str) -> Option<ReplicaId> {
        self.replicas.read().by_name.get(name).copied()
    }

    /// The node a replica runs on, by config id (`None`: unknown replica or not discovered).
    pub fn replica_node(&self, name: &str) -> Option<String> {
        let table = self.replicas.read();
        let id = table.by_name.get(name)?;
        table.entries.get(id)?.node.clone()
    }

    /// A replica by config id.
    pub fn replica(&self, name: &str) -> Option<ReplicaEntry> {
        let table = self.replicas.read();
        let id = table.by_name.get(name)?;
        table.entries.get(id).cloned()
    }

    /// A replica's config id by index id.
    pub fn replica_name(&self, id: ReplicaId) -> Option<Arc<str>> {
        self.replicas
            .read()
            .entries
            .get(&id)
            .map(|entry| Arc::clone(&entry.name))
    }
}

/// Applies ingested batches to the index.
#[derive(Debug)]
pub struct IndexSink {
    index: Arc<BlockIndex>,
    directory: Directory,
}

impl EventSink for IndexSink {
    fn apply(&self, replica: &ReplicaKey, seq: u64, batch: EventBatch) {
        let Some(id) = self.directory.replica_id(&replica.replica_id) else {
            return;
        };
        if let Err(error) = self.index.apply_events(id, &batch.events) {
            tracing::warn!(replica_id = %replica.replica_id, seq, %error, "batch not applied");
        }
    }

    fn reset(&self, replica: &ReplicaKey, reason: ResetReason) {
        let Some(id) = self.directory.replica_id(&replica.replica_id) else {
            return;
        };
        tracing::info!(replica_id = %replica.replica_id, reason = reason.as_label(), "replica reset");
        if let Err(error) = self.index.reset_replica(id) {
            tracing::warn!(replica_id = %replica.replica_id, %error, "reset failed");
        }
    }

    fn feed_state(&self, replica: &ReplicaKey, state: FeedState) {
        if let Some(id) = self.directory.replica_id(&replica.replica_id) {
            let _ = self.index.set_feed_state(id, Feed::Socket, state);
        }
    }

    fn stream_unusable(&self, replica: &ReplicaKey, reason: FlagReason, unusable: bool) {
        let Some(id) = self.directory.replica_id(&replica.replica_id) else {
            return;
        };
        let _ = if unusable {
            self.index.flag_replica(id, reason)
        } else {
            self.index.clear_flag_if(id, reason)
        };
    }
}
