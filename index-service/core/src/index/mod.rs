//! The KV block index core: which replica holds which blocks of which pool, and how many
//! leading blocks of a prompt each replica holds.
//!
//! Synchronous and `&self` throughout: ingest tasks (one per replica) call
//! [`BlockIndex::apply_event`] while query handlers call [`BlockIndex::find_matches`]
//! concurrently. Async plumbing, sockets and config files live elsewhere.
//!
//! # Data structure
//!
//! - A **pool** is one served model. Its block keys live in `shards` (a power of two of
//!   `HolderTable`s): open-addressing tables of 16-byte entries (key, packed holder word),
//!   four to a cache line, at most 3/4 full. A key held by one replica
//!   stores (slot, media) inline; a key held by several stores an index into per-medium slot
//!   bitsets (pools of up to 64 replicas) or a sorted list (larger pools). A (block, replica)
//!   holding costs ~25–45 bytes all in. Replicas are addressed by a dense per-pool slot so a
//!   query keeps the still-matching replicas in a bitset: one word for up to 64 replicas.
//! - **Readers never wait for writers.** Each shard's writers serialise on its mutex; match
//!   walks take no lock: entries and bitsets are atomics under a per-shard version (a seqlock:
//!   odd while a write is under way, checked after each read, read again on a change), and a
//!   table that grows or shrinks is a new storage published through an `ArcSwap` layout, the
//!   old one left odd so a reader still on it moves over (see `table`).
//! - **Prompt paths** beside the tables (pools of up to 64 replicas): runs of consecutive prompt
//!   keys with the same holders, each one contiguous array of keys plus one holder set. A key's
//!   table entry names its run; a walk that looks a key up compares the prompt's next keys with
//!   the run's (by bisection: keys are chains, see `paths::common_prefix`; only walks of keys
//!   kvroute computed build runs) and skips every key that matches, so a 1,000-block prompt
//!   held in a few runs costs a few lookups instead of 1,000 (a run also names the run built
//!   after it, entered without a lookup, and a prompt's first key names the run built from it,
//!   so a prompt held in runs needs no lookup at all). Runs are built by walks from the keys
//!   they had to look up one by one (the second time they meet them), cut by writers before a
//!   key's holders change, and checked by readers under a generation (see `paths`); the tables
//!   stay the truth.
//! - A **replica** of a token-chain pool keeps its engine hash → own key map; one of a
//!   vLLM-exact pool keeps only its block count (the pool's tables already say which keys its
//!   slot holds). Both are behind the replica's own mutex, and the count enforces the
//!   per-replica block cap.
//!
//! # Complexity
//!
//! - `apply_event`: O(blocks in the event) shard-mutex acquisitions (one short write each).
//! - `find_matches`: no lock; pools of up to 64 replicas: a table lookup per run the prompt
//!   passes through that is not reached from the run before it (or, for the first, from the
//!   prompt's first key) plus a sequential compare of the keys each run covers, and the keys no run
//!   covers looked up as below (then built into runs, with `try_lock`s only). Otherwise
//!   O(longest match + 1) table lookups (usually one cache line each, issued 32 at a time so
//!   their misses overlap, each checked against its shard's version), each followed by
//!   O(pool replicas / 64) word operations (O(holders) in pools of more than 64 replicas,
//!   whose spilled lists sit behind a read lock). Stops as soon as no candidate still matches.
//!   Measured in BENCHMARKS.md (`## Index` and the Dynamo comparison after it).
//! - `reset_replica`: token-chain pools O(blocks of the replica); vLLM-exact pools scan the
//!   pool's tables for the replica's slot (O(pool keys), one shard lock at a time; resets are
//!   engine restarts). Removal locks each shard once per 256 keys.
//!
//! # Bounded memory
//!
//! Each replica holds at most [`IndexConfig::max_blocks_per_replica`] distinct blocks. Past the
//! cap further **new** blocks are refused (and counted as `replica_capacity`) rather than
//! evicting older ones: the cap is sized above the engine's real KV capacity, so reaching it
//! means removals were lost, and refusing only under-reports (never claims a block the replica
//! may not hold) until ingest detects the gap and resets the replica. Evicting "oldest" would
//! need a per-entry age structure, doubling the per-holding cost, to guess at the same fix.

mod error;
mod groups;
mod hit;
mod holders;
mod keys;
mod metrics;
mod paths;
mod pool;
mod replica;
mod state;
mod table;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};

pub use error::{FlagReason, IndexError, RejectReason};
pub use keys::{HashValidator, PoolKeys, VerifyHashes};
pub use metrics::IndexMetrics;
pub use paths::PathStats;
pub use state::{Feed, FeedState, ReplicaState};

use crate::event::KvEvent;
use holders::KeyHasherBuilder;
use pool::Pool;
use replica::Replica;

/// Default [`IndexConfig::max_blocks_per_replica`]: well above one GPU's KV cache in 16-token
/// blocks (an 80 GB GPU holds ~10^5–10^6) plus CPU offload.
pub const DEFAULT_MAX_BLOCKS_PER_REPLICA: usize = 4_000_000;
/// Default [`IndexConfig::shards_per_pool`]: enough that ingest writers rarely meet on a lock.
pub const DEFAULT_SHARDS_PER_POOL: usize = 16;

/// A replica's dense id, assigned from config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u32);

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Index-wide limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most distinct blocks indexed per replica; further new blocks are refused and counted.
    pub max_blocks_per_replica: usize,
    /// Lock shards per pool (rounded up to a power of two).
    pub shards_per_pool: usize,
    /// Whether the keys of each `BlockStored` are built into runs as they are stored, so that
    /// a prompt's first match walk follows them (see `index::paths`). Off, runs come only from
    /// walks (a stretch's second walk): tests of that path turn it off.
    pub runs_from_events: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            max_blocks_per_replica: DEFAULT_MAX_BLOCKS_PER_REPLICA,
            shards_per_pool: DEFAULT_SHARDS_PER_POOL,
            runs_from_events: true,
        }
    }
}

/// One pool: a served model and how its blocks are keyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Served model name (the `model` of requests and of the Match API).
    pub model: String,
    /// Tokens per block, as the engines are configured.
    pub block_size: u32,
    /// Key scheme.
    pub keys: PoolKeys,
    /// Tokens per attention chunk of the served model's chunked local attention layers (Llama
    /// 4's `attention_chunk_size`): vLLM does not publish it, and without it a replica with
    /// such a group answers approximately (flagged).
    pub attention_chunk_size: Option<u32>,
}

/// A pool's parameters, for validating queries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolInfo {
    /// Tokens per block.
    pub block_size: u32,
    /// Key scheme.
    pub keys: PoolKeys,
}

/// How many leading blocks of a query one replica holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaMatch {
    /// The replica.
    pub replica: ReplicaId,
    /// Leading blocks held in any medium (stops at the replica's first miss).
    pub matched_blocks: u32,
    /// Of those, the leading blocks held on the GPU.
    pub gpu_blocks: u32,
    /// How far a longer prompt with these leading keys could still hit: the leading blocks its
    /// full-attention group holds (`matched_blocks` itself for dense models; every key for a
    /// replica without full attention, whose hit needs only a window before the cut). A caller
    /// that asked about a prompt's leading part learns more from its whole only below this.
    pub prefix_blocks: u32,
    /// True only when the replica is [`ReplicaState::Ready`]; otherwise its counts are 0 and
    /// say nothing about what it holds, except for a replica flagged
    /// [`FlagReason::UnmodelledCacheGroup`]: its counts are its modelled groups' answer, an
    /// approximation (a group whose rule is not modelled may give less).
    pub precise: bool,
    /// Why it is (not) precise.
    pub state: ReplicaState,
}

impl ReplicaMatch {
    fn empty(replica: ReplicaId, state: ReplicaState) -> Self {
        ReplicaMatch {
            replica,
            matched_blocks: 0,
            gpu_blocks: 0,
            prefix_blocks: 0,
            precise: state.is_precise(),
            state,
        }
    }
}

/// What applying one event did (also counted in metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyOutcome {
    /// Blocks recorded as held (including a new medium for a block already held).
    pub blocks_stored: usize,
    /// Block holdings removed.
    pub blocks_removed: usize,
    /// Blocks not applied.
    pub blocks_rejected: usize,
    /// Why (the last reason when several apply).
    pub rejection: Option<RejectReason>,
}

impl ApplyOutcome {
    fn reject(&mut self, reason: RejectReason, blocks: usize, metrics: &IndexMetrics) {
        self.blocks_rejected += blocks;
        self.rejection = Some(reason);
        metrics.rejected(reason, blocks as u64);
    }
}

/// One replica's state for the admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// The replica.
    pub replica: ReplicaId,
    /// Its id from config (metric label).
    pub name: String,
    /// Its pool's model.
    pub model: String,
    /// Distinct blocks indexed.
    pub blocks: usize,
    /// Why it is excluded from precise matching, if it is.
    pub flag: Option<FlagReason>,
    /// Its feeds and flag folded: only `Ready` is precise.
    pub state: ReplicaState,
    /// Events applied since registration.
    pub events_applied: u64,
    /// Blocks not applied since registration.
    pub blocks_rejected: u64,
}

/// The index core's contract, shared by [`BlockIndex`] and the reference model its
/// conformance suite checks it against.
pub trait KvIndex: Send + Sync {
    /// Registers a pool.
    fn add_pool(&self, pool: PoolConfig) -> Result<(), IndexError>;
    /// Registers a replica of `model`'s pool; `name` is its config id (metric label).
    fn add_replica(&self, replica: ReplicaId, name: &str, model: &str) -> Result<(), IndexError>;
    /// Applies one event published by `replica`.
    fn apply_event(&self, replica: ReplicaId, event: &KvEvent) -> Result<ApplyOutcome, IndexError>;
    /// Leading blocks of `keys` held by each replica of the pool (or each of `candidates`
    /// that belongs to it), in slot order or candidate order.
    fn find_matches(
        &self,
        model: &str,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
    ) -> Result<Vec<ReplicaMatch>, IndexError>;
    /// Drops everything indexed for `replica` and clears its flag (engine restart,
    /// unrepairable event gap).
    fn reset_replica(&self, replica: ReplicaId) -> Result<(), IndexError>;
    /// Unregisters `replica`, dropping its blocks.
    fn remove_replica(&self, replica: ReplicaId) -> Result<(), IndexError>;
}

/// The production index. See the module docs for the structure.
#[derive(Debug)]
pub struct BlockIndex {
    config: IndexConfig,
    metrics: IndexMetrics,
    hasher: KeyHasherBuilder,
    /// Published whole on each pool added, so a match looks its pool up without a lock or a
    /// reference count (both would be writes to lines ingest threads read too).
    pools: ArcSwap<HashMap<String, Arc<Pool>>>,
    /// Serialises pool additions.
    pools_writer: Mutex<()>,
    replicas: RwLock<HashMap<ReplicaId, Arc<Mutex<Replica>>>>,
}

impl BlockIndex {
    /// An empty index recording into `metrics`.
    pub fn new(config: IndexConfig, metrics: IndexMetrics) -> Self {
        BlockIndex {
            config,
            metrics,
            hasher: KeyHasherBuilder::random(),
            pools: ArcSwap::default(),
            pools_writer: Mutex::new(()),
            replicas: RwLock::new(HashMap::new()),
        }
    }

    fn pool(&self, model: &str) -> Result<Arc<Pool>, IndexError> {
        self.pools
            .load()
            .get(model)
            .cloned()
            .ok_or_else(|| unknown_pool(model))
    }

    fn replica(&self, replica: ReplicaId) -> Result<Arc<Mutex<Replica>>, IndexError> {
        self.replicas
            .read()
            .get(&replica)
            .cloned()
            .ok_or(IndexError::UnknownReplica { replica })
    }

    /// A pool's block size and key scheme.
    pub fn pool_info(&self, model: &str) -> Option<PoolInfo> {
        let pool = self.pool(model).ok()?;
        Some(PoolInfo {
            block_size: pool.block_size,
            keys: pool.keys.clone(),
        })
    }

    /// Applies a batch of events of one replica in order (one replica lock for the batch).
    pub fn apply_events(
        &self,
        replica: ReplicaId,
        events: &[KvEvent],
    ) -> Result<ApplyOutcome, IndexError> {
        let entry = self.replica(replica)?;
        let mut state = entry.lock();
        if state.removed {
            return Err(IndexError::UnknownReplica { replica });
        }
        let mut total = ApplyOutcome::default();
        for event in events {
            let outcome = state.apply(event, self.config.max_blocks_per_replica, &self.metrics);
            total.blocks_stored += outcome.blocks_stored;
            total.blocks_removed += outcome.blocks_removed;
            total.blocks_rejected += outcome.blocks_rejected;
            total.rejection = outcome.rejection.or(total.rejection);
        }
        Ok(total)
    }

    /// Excludes `replica` from precise matching (ingest: gap, staleness) until cleared.
    pub fn flag_replica(&self, replica: ReplicaId, reason: FlagReason) -> Result<(), IndexError> {
        self.replica(replica)?
            .lock()
            .set_flag(Some(reason), &self.metrics);
        Ok(())
    }

    /// Trusts `replica` again without dropping its blocks (operator override).
    pub fn clear_flag(&self, replica: ReplicaId) -> Result<(), IndexError> {
        self.replica(replica)?.lock().set_flag(None, &self.metrics);
        Ok(())
    }

    /// Clears `replica`'s flag only if it is `reason` (a fault that went away, e.g. the stream
    /// decodes again); any other flag stays.
    pub fn clear_flag_if(&self, replica: ReplicaId, reason: FlagReason) -> Result<(), IndexError> {
        let entry = self.replica(replica)?;
        let mut state = entry.lock();
        if state.flag == Some(reason) {
            state.set_flag(None, &self.metrics);
        }
        Ok(())
    }

    /// Declares that `replica`'s events come (also) from `feed`, and how it stands. From the
    /// first call on, the replica is precise only while one of its feeds is
    /// [`FeedState::Ready`]; a replica without feeds is judged by its flag alone.
    pub fn set_feed_state(
        &self,
        replica: ReplicaId,
        feed: Feed,
        state: FeedState,
    ) -> Result<(), IndexError> {
        self.replica(replica)?.lock().set_feed(feed, state);
        Ok(())
    }

    /// One replica's state.
    pub fn replica_status(&self, replica: ReplicaId) -> Result<ReplicaStatus, IndexError> {
        Ok(status_of(&self.replica(replica)?.lock()))
    }

    /// Every replica's state, by id; `model` filters to one pool.
    pub fn replica_statuses(&self, model: Option<&str>) -> Vec<ReplicaStatus> {
        let entries: Vec<_> = self.replicas.read().values().cloned().collect();
        let mut statuses: Vec<ReplicaStatus> = entries
            .iter()
            .map(|entry| status_of(&entry.lock()))
            .filter(|status| model.is_none_or(|model| status.model == model))
            .collect();
        statuses.sort_by_key(|status| status.replica);
        statuses
    }

    /// The engine hashes `replica` holds, sorted (admin debug listing; O(its blocks)).
    pub fn replica_block_hashes(
        &self,
        replica: ReplicaId,
    ) -> Result<Vec<crate::event::EngineHash>, IndexError> {
        Ok(self.replica(replica)?.lock().engine_hashes())
    }

    /// [`KvIndex::find_matches`] for keys kvroute did not compute itself (a query API caller
    /// without the query token): the same answer, but the walk builds no runs of prompt keys.
    /// Runs trust that prompts are chains of keys (each commits to the one before it, as block
    /// hashes do); keys chosen by a client need not be, and a run built from them could then
    /// vouch for another prompt's keys it only shares at both ends of a stretch.
    pub fn find_matches_without_building(
        &self,
        model: &str,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
    ) -> Result<Vec<ReplicaMatch>, IndexError> {
        self.match_in_pool(model, keys, candidates, false)
    }

    /// Both match entry points: the pool looked up without a lock, `builds` as
    /// [`pool::Pool::find_matches`] takes it.
    fn match_in_pool(
        &self,
        model: &str,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
        builds: bool,
    ) -> Result<Vec<ReplicaMatch>, IndexError> {
        let pools = self.pools.load();
        let pool = pools.get(model).ok_or_else(|| unknown_pool(model))?;
        Ok(pool.find_matches(keys, candidates, builds))
    }

    /// What `model`'s match walks did with runs of prompt keys (benches, tests).
    pub fn path_stats(&self, model: &str) -> Option<PathStats> {
        Some(self.pool(model).ok()?.path_stats())
    }

    /// Each KV-cache group's held hashes of `replica` (one entry per copy, sorted), by group
    /// index: what the engine's groups hold, as far as its events said (admin, tests).
    pub fn replica_group_hashes(
        &self,
        replica: ReplicaId,
    ) -> Result<Vec<(u32, Vec<crate::event::EngineHash>)>, IndexError> {
        Ok(self.replica(replica)?.lock().group_hashes())
    }

    /// (block, replica) holdings across all pools.
    pub fn holdings(&self) -> usize {
        self.pools.load().values().map(|pool| pool.holdings()).sum()
    }

    /// Bytes allocated for indexed blocks (hash tables at their capacity, spilled holder sets,
    /// per-replica block sets), computed from capacities. Excludes allocator overhead and the
    /// fixed per-pool/per-replica structs.
    pub fn memory_bytes(&self) -> usize {
        let pools: usize = self
            .pools
            .load()
            .values()
            .map(|pool| pool.memory_bytes())
            .sum();
        let entries: Vec<_> = self.replicas.read().values().cloned().collect();
        pools
            + entries
                .iter()
                .map(|entry| entry.lock().memory_bytes())
                .sum::<usize>()
    }
}

fn unknown_pool(model: &str) -> IndexError {
    IndexError::UnknownPool {
        pool: model.to_owned(),
    }
}

fn status_of(replica: &Replica) -> ReplicaStatus {
    ReplicaStatus {
        replica: replica.id,
        name: replica.name.clone(),
        model: replica.pool.model.clone(),
        blocks: replica.blocks(),
        flag: replica.flag,
        state: replica.state(),
        events_applied: replica.events_applied,
        blocks_rejected: replica.blocks_rejected,
    }
}

impl KvIndex for BlockIndex {
    fn add_pool(&self, config: PoolConfig) -> Result<(), IndexError> {
        if config.block_size == 0 {
            return Err(IndexError::ZeroBlockSize { pool: config.model });
        }
        let _writer = self.pools_writer.lock();
        if self.pools.load().contains_key(&config.model) {
            return Err(IndexError::DuplicatePool { pool: config.model });
        }
        let pool = Pool::new(
            config.model.clone(),
            config.block_size,
            config.keys,
            config.attention_chunk_size,
            self.config.shards_per_pool,
            self.hasher,
            self.config.runs_from_events,
        );
        let mut pools = HashMap::clone(&self.pools.load());
        pools.insert(config.model, Arc::new(pool));
        self.pools.store(Arc::new(pools));
        Ok(())
    }

    fn add_replica(&self, replica: ReplicaId, name: &str, model: &str) -> Result<(), IndexError> {
        let pool = self.pool(model)?;
        let mut replicas = self.replicas.write();
        if replicas.contains_key(&replica) {
            return Err(IndexError::DuplicateReplica { replica });
        }
        let slot = pool.add_member(replica)?;
        let state = Replica::new(
            replica,
            name.to_owned(),
            pool,
            slot,
            self.hasher,
            &self.metrics,
        );
        replicas.insert(replica, Arc::new(Mutex::new(state)));
        Ok(())
    }

    fn apply_event(&self, replica: ReplicaId, event: &KvEvent) -> Result<ApplyOutcome, IndexError> {
        self.apply_events(replica, std::slice::from_ref(event))
    }

    fn find_matches(
        &self,
        model: &str,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
    ) -> Result<Vec<ReplicaMatch>, IndexError> {
        self.match_in_pool(model, keys, candidates, true)
    }

    fn reset_replica(&self, replica: ReplicaId) -> Result<(), IndexError> {
        let entry = self.replica(replica)?;
        let mut state = entry.lock();
        state.clear();
        state.set_flag(None, &self.metrics);
        Ok(())
    }

    fn remove_replica(&self, replica: ReplicaId) -> Result<(), IndexError> {
        let entry = self
            .replicas
            .write()
            .remove(&replica)
            .ok_or(IndexError::UnknownReplica { replica })?;
        let mut state = entry.lock();
        state.clear();
        state.set_flag(None, &self.metrics);
        state.removed = true;
        state.forget_gauge(&self.metrics);
        state.pool.remove_member(state.slot);
        Ok(())
    }
}
