//! One replica's ingest state: how many engine blocks it holds (token-chain pools: which, and
//! their own keys, so removals and resets touch only its entries), its flag, and the event
//! application logic.

use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;
use std::time::Duration;

use super::groups::{GroupSpec, Groups, MAX_GROUPS, PoolLayout, Role, Unmodelled};
use super::holders::{KeyHasherBuilder, KeyMap, Slot, shrink_if_sparse, table_bytes};
use super::keys::{self, PoolKeys, Verification};
use super::metrics::{EventKind, IndexMetrics};
use super::pool::Pool;
use super::state::{Feed, FeedState, Feeds, ReplicaState};
use super::{ApplyOutcome, FlagReason, RejectReason, ReplicaId};
use crate::event::{BlockRemoved, BlockStored, CacheKind, EngineHash, KvEvent, Medium};
use crate::throttle::LogThrottle;

/// The engine blocks a replica holds, by engine hash.
#[derive(Debug)]
enum HeldBlocks {
    /// Exact pools (vLLM, SGLang): the engine hash is the block key, so the pool's table already says
    /// which keys the replica holds; only their number (the cap, the gauge) is kept here. A
    /// reset or listing scans the pool's tables instead (rare: restarts, `AllBlocksCleared`).
    Exact { count: usize },
    /// Token-chain pools: engine hash → kvroute's own key (parent lookup and removal).
    Chain(KeyMap<u64>),
}

impl HeldBlocks {
    fn new(keys: &PoolKeys, hasher: KeyHasherBuilder) -> Self {
        if keys.is_exact() {
            HeldBlocks::Exact { count: 0 }
        } else {
            HeldBlocks::Chain(KeyMap::with_hasher(hasher))
        }
    }

    fn len(&self) -> usize {
        match self {
            HeldBlocks::Exact { count } => *count,
            HeldBlocks::Chain(map) => map.len(),
        }
    }

    fn key_of(&self, engine: EngineHash, pool: &Pool, slot: Slot) -> Option<u64> {
        match self {
            HeldBlocks::Exact { .. } => pool.holds(slot, engine).then_some(engine),
            HeldBlocks::Chain(map) => map.get(&engine).copied(),
        }
    }

    /// A token-chain pool's key for `engine` (`None` for exact pools and unknown blocks).
    fn key_of_chain(&self, engine: EngineHash) -> Option<u64> {
        match self {
            HeldBlocks::Exact { .. } => None,
            HeldBlocks::Chain(map) => map.get(&engine).copied(),
        }
    }

    /// Records a block the replica did not hold.
    fn insert(&mut self, engine: EngineHash, key: u64) {
        match self {
            HeldBlocks::Exact { count } => *count += 1,
            HeldBlocks::Chain(map) => {
                map.insert(engine, key);
            }
        }
    }

    /// Forgets a block the replica no longer holds in any medium.
    fn remove(&mut self, engine: EngineHash) {
        match self {
            HeldBlocks::Exact { count } => *count = count.saturating_sub(1),
            HeldBlocks::Chain(map) => {
                map.remove(&engine);
                shrink_if_sparse(map);
            }
        }
    }

    /// The engine hashes held (debug listing; O(blocks), O(pool keys) for exact pools).
    fn engine_hashes(&self, pool: &Pool, slot: Slot) -> Vec<EngineHash> {
        match self {
            HeldBlocks::Exact { .. } => pool.keys_of(slot),
            HeldBlocks::Chain(map) => map.keys().copied().collect(),
        }
    }

    /// Empties the set (releasing its memory) and returns the block keys it held.
    fn take_keys(&mut self, pool: &Pool, slot: Slot) -> Vec<u64> {
        match self {
            HeldBlocks::Exact { count } => {
                *count = 0;
                pool.keys_of(slot)
            }
            HeldBlocks::Chain(map) => {
                let empty = KeyMap::with_hasher(*map.hasher());
                std::mem::replace(map, empty).into_values().collect()
            }
        }
    }

    fn memory_bytes(&self) -> usize {
        match self {
            HeldBlocks::Exact { .. } => 0,
            HeldBlocks::Chain(map) => table_bytes(map.capacity(), size_of::<(u64, u64)>()),
        }
    }
}

/// Consecutive mismatching runs, among runs whose extra keys the event does not publish
/// (vLLM < 0.17: a hidden `cache_salt` is possible), before the replica is flagged. A
/// misconfigured seed or algorithm mismatches every run; a salted request only some.
const UNCERTAIN_MISMATCH_STREAK: u32 = 8;

/// At most one refusal warning per replica per this interval.
const REFUSAL_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Why a run is refused by a pool that requires verified hashes (`None`: verified).
fn unverified(verification: Verification) -> Option<RejectReason> {
    match verification {
        Verification::Verified => None,
        // A mismatch a hidden cache_salt may explain (vLLM < 0.17) is not proof either way.
        Verification::Unverifiable | Verification::Mismatch { certain: false, .. } => {
            Some(RejectReason::Unverifiable)
        }
        Verification::Mismatch { certain: true, .. } => Some(RejectReason::HashMismatch),
    }
}

/// A registered replica. Guarded by a mutex in the index; one ingest task writes it.
#[derive(Debug)]
pub(crate) struct Replica {
    pub(crate) id: ReplicaId,
    pub(crate) name: String,
    pub(crate) pool: Arc<Pool>,
    pub(crate) slot: Slot,
    blocks: HeldBlocks,
    pub(crate) flag: Option<FlagReason>,
    /// Its event feeds (ZMQ socket, agent) and how each stands.
    feeds: Feeds,
    pub(crate) events_applied: u64,
    pub(crate) blocks_rejected: u64,
    uncertain_mismatches: u32,
    /// Rate limit of the warnings about refused runs.
    refusal_warnings: LogThrottle,
    /// Copies of a block beyond the first, by (engine hash, medium). vLLM can hold several
    /// blocks with one hash (a repeated prompt recomputes its last full block; concurrent
    /// identical prefixes) and emits BlockStored/BlockRemoved per copy, so a hash stays held
    /// until its last copy is removed. Only duplicates cost memory here; they are rare.
    extra_copies: std::collections::HashMap<(EngineHash, Medium), u32>,
    /// Its KV-cache groups: which one the pool's tables hold, the others' holdings. Shared with
    /// the pool (for matches) once any group is not the primary one.
    pub(crate) groups: Arc<Groups>,
    /// Whether `groups` is registered with the pool.
    groups_in_pool: bool,
    /// Set by `remove_replica`: a task still holding this replica's `Arc` must not write into a
    /// slot that may be reused.
    pub(crate) removed: bool,
    blocks_gauge: Gauge,
}

impl Replica {
    pub(crate) fn new(
        id: ReplicaId,
        name: String,
        pool: Arc<Pool>,
        slot: Slot,
        hasher: KeyHasherBuilder,
        metrics: &IndexMetrics,
    ) -> Self {
        let blocks_gauge = metrics.replica_blocks_gauge(&name);
        blocks_gauge.set(0);
        Replica {
            id,
            blocks: HeldBlocks::new(&pool.keys, hasher),
            name,
            pool,
            slot,
            flag: None,
            feeds: Feeds::default(),
            events_applied: 0,
            blocks_rejected: 0,
            uncertain_mismatches: 0,
            refusal_warnings: LogThrottle::new(REFUSAL_WARN_INTERVAL),
            extra_copies: std::collections::HashMap::new(),
            groups: Arc::new(Groups::new(hasher)),
            groups_in_pool: false,
            removed: false,
            blocks_gauge,
        }
    }

    pub(crate) fn blocks(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.blocks.memory_bytes()
            + self.groups.memory_bytes()
            + table_bytes(
                self.extra_copies.capacity(),
                size_of::<((EngineHash, Medium), u32)>(),
            )
    }

    /// Engine hashes held, sorted (admin debug listing).
    pub(crate) fn engine_hashes(&self) -> Vec<EngineHash> {
        let mut hashes = self.blocks.engine_hashes(&self.pool, self.slot);
        hashes.sort_unstable();
        hashes
    }

    /// Each KV-cache group's held hashes, one entry per copy (any medium), sorted, by group.
    pub(crate) fn group_hashes(&self) -> Vec<(u32, Vec<EngineHash>)> {
        let mut groups = self.groups.side_hashes();
        if self.blocks.len() > 0 {
            let mut hashes = self.engine_hashes();
            for (&(hash, _), &copies) in &self.extra_copies {
                hashes.extend(std::iter::repeat_n(hash, copies as usize));
            }
            hashes.sort_unstable();
            groups.push((self.groups.primary().unwrap_or(0), hashes));
        }
        groups.sort_by_key(|(group, _)| *group);
        groups
    }

    pub(crate) fn set_flag(&mut self, flag: Option<FlagReason>, metrics: &IndexMetrics) {
        metrics.flag_changed(self.flag, flag);
        self.flag = flag;
        self.uncertain_mismatches = 0;
        self.pool.set_state(self.slot, self.state());
    }

    pub(crate) fn set_feed(&mut self, feed: Feed, state: FeedState) {
        self.feeds.set(feed, state);
        self.pool.set_state(self.slot, self.state());
    }

    /// Its feeds and flag folded into what the Match API reports.
    pub(crate) fn state(&self) -> ReplicaState {
        self.feeds.state(self.flag)
    }

    /// Drops every holding of this replica (restart, `AllBlocksCleared`, unrepairable gap).
    pub(crate) fn clear(&mut self) {
        self.groups.clear();
        self.extra_copies = std::collections::HashMap::new();
        let keys = self.blocks.take_keys(&self.pool, self.slot);
        self.pool.remove_all(self.slot, keys);
        self.blocks_gauge.set(0);
    }

    pub(crate) fn forget_gauge(&self, metrics: &IndexMetrics) {
        metrics.forget_replica(&self.name);
    }

    pub(crate) fn apply(
        &mut self,
        event: &KvEvent,
        max_blocks: usize,
        metrics: &IndexMetrics,
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        match event {
            KvEvent::BlockStored(stored) => {
                metrics.event(EventKind::BlockStored);
                self.apply_stored(stored, max_blocks, metrics, &mut outcome);
            }
            KvEvent::BlockRemoved(removed) => {
                metrics.event(EventKind::BlockRemoved);
                self.apply_removed(removed, metrics, &mut outcome);
            }
            KvEvent::AllBlocksCleared => {
                metrics.event(EventKind::AllBlocksCleared);
                outcome.blocks_removed = self.blocks.len() + self.groups.side_blocks();
                self.clear();
            }
        }
        self.events_applied += 1;
        self.blocks_rejected += outcome.blocks_rejected as u64;
        self.blocks_gauge
            .set(i64::try_from(self.blocks.len()).unwrap_or(i64::MAX));
        outcome
    }

    fn apply_stored(
        &mut self,
        stored: &BlockStored,
        max_blocks: usize,
        metrics: &IndexMetrics,
        outcome: &mut ApplyOutcome,
    ) {
        let count = stored.block_hashes.len();
        let block_size = stored.block_size as usize;
        if stored.block_size > 0 {
            match self.group_role(stored, metrics) {
                Ok(Role::Primary) => {}
                Ok(Role::Side(side)) => {
                    return self.apply_side_stored(side, stored, max_blocks, metrics, outcome);
                }
                Ok(Role::Unmodelled(_)) => {
                    return outcome.reject(RejectReason::UnmodelledGroup, count, metrics);
                }
                Err(reason) => return outcome.reject(reason, count, metrics),
            }
        }
        let rejection = if stored.block_size == 0 || stored.token_ids.is_empty() {
            Some(RejectReason::Placeholder)
        } else if stored.block_size != self.pool.block_size {
            Some(RejectReason::BlockSizeMismatch)
        } else if stored.token_ids.len() != count * block_size
            || stored
                .extra_keys
                .as_ref()
                .is_some_and(|extra| extra.len() != count)
        {
            Some(RejectReason::Malformed)
        } else {
            None
        };
        if let Some(reason) = rejection {
            outcome.reject(reason, count, metrics);
            if reason == RejectReason::BlockSizeMismatch {
                self.block_size_mismatch(stored.block_size, metrics);
            }
            return;
        }

        // The key before the event's first (runs chain on from its run), and the event's keys.
        let (parent, keys) = match &self.pool.keys {
            PoolKeys::VllmExact { .. } | PoolKeys::SglangExact { .. } => {
                // A flagged replica is out of precise scoring already; only a pool that refuses
                // unverified runs still needs their verdict.
                if let Some(required) = self.pool.keys.verifies()
                    && (required || self.flag.is_none())
                {
                    let verification = self.pool.keys.verify(stored);
                    if self.flag.is_none() {
                        self.validate(verification, stored, metrics);
                    }
                    if required && let Some(reason) = unverified(verification) {
                        outcome.reject(reason, count, metrics);
                        self.refusal_warning(reason, count);
                        return;
                    }
                }
                (stored.parent_block_hash, stored.block_hashes.clone())
            }
            PoolKeys::TokenChain => {
                let parent = match stored.parent_block_hash {
                    None => None,
                    Some(engine) => match self.blocks.key_of(engine, &self.pool, self.slot) {
                        Some(key) => Some(key),
                        None => {
                            outcome.reject(RejectReason::ParentUnknown, count, metrics);
                            return;
                        }
                    },
                };
                let run = keys::chain_keys(parent, stored);
                if run.unsupported > 0 {
                    outcome.reject(RejectReason::UnsupportedExtraKeys, run.unsupported, metrics);
                }
                (parent, run.keys)
            }
        };

        self.pool.prefetch(&keys);
        let mut stored_blocks = 0;
        for (&engine, &key) in stored.block_hashes.iter().zip(&keys) {
            // Exact pools under the cap: one table write says whether the block is new, held
            // in another medium, or another copy (storing a held medium again changes nothing).
            if let HeldBlocks::Exact { count } = &mut self.blocks
                && *count < max_blocks
            {
                let before = self.pool.store(self.slot, key, stored.medium);
                if before.contains(stored.medium) {
                    *self
                        .extra_copies
                        .entry((engine, stored.medium))
                        .or_insert(0) += 1;
                } else if before.is_empty() {
                    *count += 1;
                }
                stored_blocks += 1;
                continue;
            }
            let key = match self.blocks.key_of(engine, &self.pool, self.slot) {
                // Another copy in a medium that already holds it: counted, not re-stored.
                Some(held) if self.pool.holds_in(self.slot, held, stored.medium) => {
                    *self
                        .extra_copies
                        .entry((engine, stored.medium))
                        .or_insert(0) += 1;
                    stored_blocks += 1;
                    continue;
                }
                // Another medium of a block already held: keep its recorded key.
                Some(held) => held,
                None if self.blocks.len() >= max_blocks => {
                    outcome.reject(RejectReason::ReplicaCapacity, 1, metrics);
                    continue;
                }
                None => {
                    self.blocks.insert(engine, key);
                    key
                }
            };
            self.pool.store(self.slot, key, stored.medium);
            stored_blocks += 1;
        }
        self.pool.build_stored(parent, &keys);
        outcome.blocks_stored += stored_blocks;
        metrics.stored(stored.medium, stored_blocks as u64);
    }

    /// The role of a store's group, learnt from its first store (an unmodelled group flags the
    /// replica, once). Events without a group are a dense model's (group 0); a group without a
    /// kind is full attention when it is group 0 (vLLM before 0.22 published no kinds, and
    /// dense models have only group 0), unknown otherwise.
    fn group_role(
        &mut self,
        stored: &BlockStored,
        metrics: &IndexMetrics,
    ) -> Result<Role, RejectReason> {
        let group = stored.group_idx.unwrap_or(0);
        let kind = stored.cache_kind.unwrap_or(if group == 0 {
            CacheKind::FullAttention
        } else {
            CacheKind::Unknown
        });
        if group >= MAX_GROUPS {
            self.unmodelled_group(group, kind, Unmodelled::Conflict, metrics);
            return Err(RejectReason::GroupConflict);
        }
        let spec = GroupSpec {
            kind,
            block_size: stored.block_size,
            window: stored.sliding_window,
        };
        let layout = PoolLayout {
            block_size: self.pool.block_size,
            exact_keys: self.pool.keys.is_exact(),
            attention_chunk_size: self.pool.attention_chunk_size,
            verified_only: self.pool.keys.verifies() == Some(true),
        };
        let Ok(role) = self.groups.role_for_store(group, spec, layout) else {
            // A stream whose stores contradict each other describes no layout to trust.
            self.unmodelled_group(group, kind, Unmodelled::Conflict, metrics);
            return Err(RejectReason::GroupConflict);
        };
        if role != Role::Primary && !self.groups_in_pool {
            self.pool.add_groups(self.slot, Arc::clone(&self.groups));
            self.groups_in_pool = true;
        }
        if let Role::Unmodelled(why) = role {
            self.unmodelled_group(group, kind, why, metrics);
        }
        Ok(role)
    }

    /// Flags the replica for a group the index cannot model (its matches would count only the
    /// other groups: approximate), with a warning when the flag is new.
    fn unmodelled_group(
        &mut self,
        group: u32,
        kind: CacheKind,
        why: Unmodelled,
        metrics: &IndexMetrics,
    ) {
        if self.flag.is_some() {
            return;
        }
        self.set_flag(Some(FlagReason::UnmodelledCacheGroup), metrics);
        tracing::warn!(
            replica = %self.name,
            model = %self.pool.model,
            group,
            kind = kind.as_label(),
            reason = %why.describe(),
            "KV-cache group the index cannot model; replica flagged, its matches are \
             approximate until the engine restarts"
        );
    }

    /// A side group's store: each hash held once more in its group (its position in the span
    /// of `token_ids` does not matter: prompt keys are the engine's hashes).
    fn apply_side_stored(
        &mut self,
        side: usize,
        stored: &BlockStored,
        max_blocks: usize,
        metrics: &IndexMetrics,
        outcome: &mut ApplyOutcome,
    ) {
        let count = stored.block_hashes.len();
        let block_size = stored.block_size as usize;
        // A window group lists only the blocks it keeps of the span its tokens cover: a whole
        // number of blocks, at least one per hash (or none, from an agent's snapshot).
        let tokens = stored.token_ids.len();
        let spans_hashes =
            tokens == 0 || (tokens.is_multiple_of(block_size) && tokens / block_size >= count);
        let malformed = !spans_hashes
            || stored
                .extra_keys
                .as_ref()
                .is_some_and(|extra| extra.len() != count);
        if malformed {
            return outcome.reject(RejectReason::Malformed, count, metrics);
        }
        let side = self
            .groups
            .store(side, &stored.block_hashes, stored.medium, max_blocks);
        if side.refused > 0 {
            outcome.reject(RejectReason::ReplicaCapacity, side.refused, metrics);
        }
        outcome.blocks_stored += side.applied;
        metrics.stored(stored.medium, side.applied as u64);
    }

    /// Every block of a replica whose engine uses another block size is refused: its stream is
    /// unusable, so it is flagged (out of precise matching), with a warning per
    /// [`REFUSAL_WARN_INTERVAL`]. The flag goes with the next reset (engine restart).
    fn block_size_mismatch(&mut self, published: u32, metrics: &IndexMetrics) {
        if self.flag.is_none() {
            self.set_flag(Some(FlagReason::BlockSizeMismatch), metrics);
        }
        if let Some(suppressed) = self.refusal_warnings.allow() {
            tracing::warn!(
                replica = %self.name,
                model = %self.pool.model,
                published_block_size = published,
                pool_block_size = self.pool.block_size,
                suppressed,
                "stored blocks refused: the engine's block_size differs from the pool's; replica \
                 flagged (check the pool's block_size and the engine's --block-size)"
            );
        }
    }

    /// Logs a refused run, at most once per [`REFUSAL_WARN_INTERVAL`] per replica (the rest are
    /// counted in `index_blocks_rejected_total` and summed into the next line).
    fn refusal_warning(&mut self, reason: RejectReason, blocks: usize) {
        if let Some(suppressed) = self.refusal_warnings.allow() {
            tracing::warn!(
                replica = %self.name,
                model = %self.pool.model,
                reason = reason.as_label(),
                blocks,
                suppressed,
                "stored blocks refused: the pool requires verified block hashes"
            );
        }
    }

    fn validate(
        &mut self,
        verification: Verification,
        stored: &BlockStored,
        metrics: &IndexMetrics,
    ) {
        let mismatch = match verification {
            Verification::Unverifiable => return,
            Verification::Verified => {
                self.uncertain_mismatches = 0;
                return;
            }
            Verification::Mismatch {
                block,
                computed,
                certain,
            } => {
                if !certain {
                    self.uncertain_mismatches += 1;
                    if self.uncertain_mismatches < UNCERTAIN_MISMATCH_STREAK {
                        return;
                    }
                }
                (block, computed)
            }
        };
        let (block, computed) = mismatch;
        tracing::warn!(
            replica = %self.name,
            model = %self.pool.model,
            block,
            published = stored.block_hashes.get(block).copied().unwrap_or_default(),
            computed,
            "published block hash disagrees with the hash of its token_ids; replica flagged \
             (check the pool's hash algorithm and PYTHONHASHSEED)"
        );
        self.set_flag(Some(FlagReason::HashMismatch), metrics);
    }

    fn apply_removed(
        &mut self,
        removed: &BlockRemoved,
        metrics: &IndexMetrics,
        outcome: &mut ApplyOutcome,
    ) {
        let count = removed.block_hashes.len();
        let group = removed.group_idx.unwrap_or(0);
        match self.groups.role_for_removal(group) {
            // The primary group, or (no store described it yet) a dense stream's only group.
            Some(Role::Primary) => {}
            None if group == 0 && self.groups.primary().is_none() => {}
            Some(Role::Side(side)) => {
                let side = self
                    .groups
                    .remove(side, &removed.block_hashes, removed.medium);
                if side.refused > 0 {
                    outcome.reject(RejectReason::UnknownBlock, side.refused, metrics);
                }
                outcome.blocks_removed += side.applied;
                metrics.removed(removed.medium, side.applied as u64);
                return;
            }
            Some(Role::Unmodelled(_)) => {
                return outcome.reject(RejectReason::UnmodelledGroup, count, metrics);
            }
            // No store described this group: none of its blocks is held.
            None => return outcome.reject(RejectReason::UnknownBlock, count, metrics),
        }
        let mut removed_blocks = 0;
        let mut unknown = 0;
        let exact = matches!(self.blocks, HeldBlocks::Exact { .. });
        if exact {
            self.pool.prefetch(&removed.block_hashes);
        }
        for &engine in &removed.block_hashes {
            let key = match self.blocks.key_of_chain(engine) {
                // Exact pools: the removal below finds out whether the block is held (copies
                // are counted only for held blocks).
                _ if exact => engine,
                Some(key) => key,
                None => {
                    unknown += 1;
                    continue;
                }
            };
            if let Some(copies) = self.extra_copies.get_mut(&(engine, removed.medium)) {
                // Another copy still holds this hash in this medium.
                *copies -= 1;
                if *copies == 0 {
                    self.extra_copies.remove(&(engine, removed.medium));
                    if self.extra_copies.is_empty() {
                        // Give the memory back: duplicates are transient.
                        self.extra_copies = std::collections::HashMap::new();
                    }
                }
                removed_blocks += 1;
                continue;
            }
            let removal = self.pool.remove(self.slot, key, Some(removed.medium));
            if removal.was_held {
                removed_blocks += 1;
            } else {
                unknown += 1;
            }
            if removal.slot_gone || !exact && !removal.was_held && !self.pool.holds(self.slot, key)
            {
                self.blocks.remove(engine);
            }
        }
        if unknown > 0 {
            outcome.reject(RejectReason::UnknownBlock, unknown, metrics);
        }
        outcome.blocks_removed += removed_blocks;
        metrics.removed(removed.medium, removed_blocks as u64);
        if removed_blocks > 0 && self.blocks.len() == 0 {
            self.pool.release_if_empty();
        }
    }
}
