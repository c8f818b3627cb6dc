//! A deliberately naive index: per replica, a map engine hash → (key, copies per medium), scanned
//! linearly. A hash stays held in a medium until as many removals as stores (vLLM can hold
//! several blocks with one hash and reports each).
//! It states the index semantics in the plainest terms; [`BlockIndex`] must agree with it.

use std::collections::{BTreeMap, HashMap};

use kvroute_block_keys::TokenChain;
use parking_lot::Mutex;

use crate::event::{KvEvent, Medium};
use crate::index::{
    ApplyOutcome, FlagReason, IndexError, KvIndex, PoolConfig, PoolKeys, RejectReason, ReplicaId,
    ReplicaMatch, ReplicaState,
};

#[derive(Debug, Default)]
struct State {
    pools: HashMap<String, PoolConfig>,
    /// Registration order stands in for slot order.
    replicas: BTreeMap<ReplicaId, RefReplica>,
    next_order: u64,
}

#[derive(Debug)]
struct RefReplica {
    model: String,
    order: u64,
    blocks: HashMap<u64, (u64, BTreeMap<Medium, u32>)>,
    /// An event with another block size, or a group of unknown kind, makes the replica's
    /// matches untrusted until a reset (the first reason stays).
    flag: Option<FlagReason>,
    /// Groups (> 0) stored without a kind: unmodelled, forgotten with the holdings.
    unmodelled_groups: std::collections::BTreeSet<u32>,
}

/// The reference model.
#[derive(Debug)]
pub(crate) struct Reference {
    max_blocks: usize,
    state: Mutex<State>,
}

impl Reference {
    pub(crate) fn new(max_blocks: usize) -> Self {
        Reference {
            max_blocks,
            state: Mutex::new(State::default()),
        }
    }
}

impl KvIndex for Reference {
    fn add_pool(&self, pool: PoolConfig) -> Result<(), IndexError> {
        let mut state = self.state.lock();
        if pool.block_size == 0 {
            return Err(IndexError::ZeroBlockSize { pool: pool.model });
        }
        if state.pools.contains_key(&pool.model) {
            return Err(IndexError::DuplicatePool { pool: pool.model });
        }
        state.pools.insert(pool.model.clone(), pool);
        Ok(())
    }

    fn add_replica(&self, replica: ReplicaId, _name: &str, model: &str) -> Result<(), IndexError> {
        let mut state = self.state.lock();
        if !state.pools.contains_key(model) {
            return Err(IndexError::UnknownPool {
                pool: model.to_owned(),
            });
        }
        if state.replicas.contains_key(&replica) {
            return Err(IndexError::DuplicateReplica { replica });
        }
        state.next_order += 1;
        let order = state.next_order;
        state.replicas.insert(
            replica,
            RefReplica {
                model: model.to_owned(),
                order,
                blocks: HashMap::new(),
                flag: None,
                unmodelled_groups: Default::default(),
            },
        );
        Ok(())
    }

    fn apply_event(&self, replica: ReplicaId, event: &KvEvent) -> Result<ApplyOutcome, IndexError> {
        let mut state = self.state.lock();
        let state = &mut *state;
        let entry = state
            .replicas
            .get_mut(&replica)
            .ok_or(IndexError::UnknownReplica { replica })?;
        let pool = &state.pools[&entry.model];
        let mut outcome = ApplyOutcome::default();
        let reject = |outcome: &mut ApplyOutcome, reason, blocks| {
            outcome.blocks_rejected += blocks;
            outcome.rejection = Some(reason);
        };
        match event {
            KvEvent::AllBlocksCleared => {
                outcome.blocks_removed = entry.blocks.len();
                entry.blocks.clear();
                entry.unmodelled_groups.clear();
            }
            KvEvent::BlockRemoved(removed) => {
                let count = removed.block_hashes.len();
                if let Some(group) = removed.group_idx.filter(|&g| g > 0) {
                    let reason = if entry.unmodelled_groups.contains(&group) {
                        RejectReason::UnmodelledGroup
                    } else {
                        RejectReason::UnknownBlock
                    };
                    reject(&mut outcome, reason, count);
                    return Ok(outcome);
                }
                for engine in &removed.block_hashes {
                    let was_held = match entry.blocks.get_mut(engine) {
                        Some((_, media)) => match media.get_mut(&removed.medium) {
                            Some(copies) if *copies > 1 => {
                                *copies -= 1;
                                true
                            }
                            Some(_) => media.remove(&removed.medium).is_some(),
                            None => false,
                        },
                        None => false,
                    };
                    if !was_held {
                        reject(&mut outcome, RejectReason::UnknownBlock, 1);
                        continue;
                    }
                    outcome.blocks_removed += 1;
                    if entry
                        .blocks
                        .get(engine)
                        .is_some_and(|(_, media)| media.is_empty())
                    {
                        entry.blocks.remove(engine);
                    }
                }
            }
            KvEvent::BlockStored(stored) => {
                let count = stored.block_hashes.len();
                let bs = stored.block_size as usize;
                if let Some(group) = stored.group_idx.filter(|&g| g > 0)
                    && bs > 0
                {
                    // Without a kind, a group other than 0 is of unknown kind: unmodelled.
                    entry.unmodelled_groups.insert(group);
                    entry.flag.get_or_insert(FlagReason::UnmodelledCacheGroup);
                    reject(&mut outcome, RejectReason::UnmodelledGroup, count);
                    return Ok(outcome);
                }
                if bs == 0 || stored.token_ids.is_empty() {
                    reject(&mut outcome, RejectReason::Placeholder, count);
                    return Ok(outcome);
                }
                if stored.block_size != pool.block_size {
                    entry.flag.get_or_insert(FlagReason::BlockSizeMismatch);
                    reject(&mut outcome, RejectReason::BlockSizeMismatch, count);
                    return Ok(outcome);
                }
                if stored.token_ids.len() != count * bs {
                    reject(&mut outcome, RejectReason::Malformed, count);
                    return Ok(outcome);
                }
                let keys = match pool.keys {
                    PoolKeys::VllmExact { .. } | PoolKeys::SglangExact { .. } => {
                        stored.block_hashes.clone()
                    }
                    PoolKeys::TokenChain => {
                        let parent = match stored.parent_block_hash {
                            None => TokenChain::root(stored.lora_name.as_deref(), None),
                            Some(parent) => match entry.blocks.get(&parent) {
                                Some((key, _)) => *key,
                                None => {
                                    reject(&mut outcome, RejectReason::ParentUnknown, count);
                                    return Ok(outcome);
                                }
                            },
                        };
                        let mut keys = Vec::new();
                        let chained =
                            TokenChain::keys_from_into(parent, &stored.token_ids, bs, &mut keys);
                        assert!(chained.is_ok());
                        keys
                    }
                };
                for (engine, key) in stored.block_hashes.iter().zip(keys) {
                    if !entry.blocks.contains_key(engine) {
                        if entry.blocks.len() >= self.max_blocks {
                            reject(&mut outcome, RejectReason::ReplicaCapacity, 1);
                            continue;
                        }
                        entry.blocks.insert(*engine, (key, BTreeMap::new()));
                    }
                    if let Some((_, media)) = entry.blocks.get_mut(engine) {
                        *media.entry(stored.medium).or_insert(0) += 1;
                    }
                    outcome.blocks_stored += 1;
                }
            }
        }
        Ok(outcome)
    }

    fn find_matches(
        &self,
        model: &str,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
    ) -> Result<Vec<ReplicaMatch>, IndexError> {
        let state = self.state.lock();
        if !state.pools.contains_key(model) {
            return Err(IndexError::UnknownPool {
                pool: model.to_owned(),
            });
        }
        let mut members: Vec<(&ReplicaId, &RefReplica)> = state
            .replicas
            .iter()
            .filter(|(_, r)| r.model == model)
            .collect();
        members.sort_by_key(|(_, r)| r.order);
        let mut chosen: Vec<ReplicaId> = Vec::new();
        match candidates {
            None => chosen.extend(members.iter().map(|(id, _)| **id)),
            Some(candidates) => {
                for id in candidates {
                    if members.iter().any(|(m, _)| *m == id) && !chosen.contains(id) {
                        chosen.push(*id);
                    }
                }
            }
        }
        let holds = |replica: &RefReplica, key: u64, gpu_only: bool| {
            replica
                .blocks
                .values()
                .any(|(k, media)| *k == key && (!gpu_only || media.contains_key(&Medium::Gpu)))
        };
        let leading = |replica: &RefReplica, gpu_only: bool| {
            keys.iter()
                .take_while(|&&key| holds(replica, key, gpu_only))
                .count() as u32
        };
        Ok(chosen
            .into_iter()
            .map(|id| {
                let replica = &state.replicas[&id];
                if let Some(flag) = replica.flag {
                    return ReplicaMatch {
                        replica: id,
                        matched_blocks: 0,
                        gpu_blocks: 0,
                        prefix_blocks: 0,
                        precise: false,
                        state: ReplicaState::Flagged(flag),
                    };
                }
                ReplicaMatch {
                    replica: id,
                    matched_blocks: leading(replica, false),
                    gpu_blocks: leading(replica, true),
                    prefix_blocks: leading(replica, false),
                    precise: true,
                    state: ReplicaState::Ready,
                }
            })
            .collect())
    }

    fn reset_replica(&self, replica: ReplicaId) -> Result<(), IndexError> {
        let mut state = self.state.lock();
        let entry = state
            .replicas
            .get_mut(&replica)
            .ok_or(IndexError::UnknownReplica { replica })?;
        entry.blocks.clear();
        entry.flag = None;
        entry.unmodelled_groups.clear();
        Ok(())
    }

    fn remove_replica(&self, replica: ReplicaId) -> Result<(), IndexError> {
        let mut state = self.state.lock();
        state
            .replicas
            .remove(&replica)
            .ok_or(IndexError::UnknownReplica { replica })?;
        Ok(())
    }
}
