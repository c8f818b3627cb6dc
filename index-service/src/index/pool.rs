//! One pool (served model): its sharded key → holders map, its replica slots, and the match walk.

use std::collections::HashMap;

use parking_lot::RwLock;

use super::holders::{
    Holders, KeyHasherBuilder, KeyMap, Removal, Slot, SlotSet, shrink_if_sparse, table_bytes,
};
use super::keys::PoolKeys;
use super::{FlagReason, IndexError, ReplicaId, ReplicaMatch};
use crate::event::Medium;

/// Replica slots of a pool, and whether each is trusted for precise matching.
#[derive(Debug, Default)]
struct Members {
    slots: Vec<Option<Member>>,
    by_replica: HashMap<ReplicaId, Slot>,
}

#[derive(Debug, Clone, Copy)]
struct Member {
    replica: ReplicaId,
    flag: Option<FlagReason>,
}

/// Holdings of one pool. Replicas are addressed by their dense slot so the match walk can keep
/// the still-matching replicas in a bitset.
#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) model: String,
    pub(crate) block_size: u32,
    pub(crate) keys: PoolKeys,
    hasher: KeyHasherBuilder,
    shards: Box<[RwLock<KeyMap<Holders>>]>,
    shard_mask: usize,
    members: RwLock<Members>,
}

/// Keys looked up before the first early-exit check: most prompts stop matching early.
const FIRST_BATCH: usize = 16;
/// Largest batch of keys resolved per round of shard locks.
const MAX_BATCH: usize = 256;

/// Scratch space of one match walk: per batch position, the slots holding that key (any medium
/// and GPU), as word slices laid out like [`SlotSet`].
struct Batch {
    words: usize,
    present: Vec<u64>,
    gpu: Vec<u64>,
    shard_of: Vec<usize>,
    starts: Vec<usize>,
    order: Vec<usize>,
}

impl Batch {
    fn new(words: usize, shards: usize) -> Self {
        Batch {
            words,
            present: Vec::new(),
            gpu: Vec::new(),
            shard_of: Vec::new(),
            starts: vec![0; shards + 1],
            order: Vec::new(),
        }
    }

    fn reset(&mut self, keys: usize) {
        self.present.clear();
        self.present.resize(keys * self.words, 0);
        self.gpu.clear();
        self.gpu.resize(keys * self.words, 0);
    }

    fn present(&self, at: usize) -> &[u64] {
        &self.present[at * self.words..(at + 1) * self.words]
    }

    fn gpu(&self, at: usize) -> &[u64] {
        &self.gpu[at * self.words..(at + 1) * self.words]
    }
}

/// Shard lock hold is bounded: bulk removal releases the lock after this many keys.
const BULK_REMOVE_CHUNK: usize = 256;

impl Pool {
    pub(crate) fn new(
        model: String,
        block_size: u32,
        keys: PoolKeys,
        shards: usize,
        hasher: KeyHasherBuilder,
    ) -> Self {
        let shards = shards.clamp(1, 1 << 16).next_power_of_two();
        Pool {
            model,
            block_size,
            keys,
            hasher,
            shards: (0..shards)
                .map(|_| RwLock::new(KeyMap::with_hasher(hasher)))
                .collect(),
            shard_mask: shards - 1,
            members: RwLock::new(Members::default()),
        }
    }

    fn shard_of(&self, key: u64) -> usize {
        // Bits 40.. of the mix: the maps use the low bits for buckets and the top 7 as tags.
        ((self.hasher.mix(key) >> 40) as usize) & self.shard_mask
    }

    /// Gives `replica` a slot (reusing freed ones).
    pub(crate) fn add_member(&self, replica: ReplicaId) -> Result<Slot, IndexError> {
        let mut members = self.members.write();
        let member = Some(Member {
            replica,
            flag: None,
        });
        let slot = match members.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => members.slots.len(),
        };
        let slot = Slot::try_from(slot).map_err(|_| IndexError::PoolFull {
            pool: self.model.clone(),
            max: usize::from(Slot::MAX) + 1,
        })?;
        match members.slots.get_mut(usize::from(slot)) {
            Some(entry) => *entry = member,
            None => members.slots.push(member),
        }
        members.by_replica.insert(replica, slot);
        Ok(slot)
    }

    /// Frees `slot`; the caller has already removed every holding of it.
    pub(crate) fn remove_member(&self, slot: Slot) {
        let mut members = self.members.write();
        if let Some(entry) = members.slots.get_mut(usize::from(slot))
            && let Some(member) = entry.take()
        {
            members.by_replica.remove(&member.replica);
        }
        while members.slots.last().is_some_and(Option::is_none) {
            members.slots.pop();
        }
    }

    pub(crate) fn set_flag(&self, slot: Slot, flag: Option<FlagReason>) {
        let mut members = self.members.write();
        if let Some(Some(member)) = members.slots.get_mut(usize::from(slot)) {
            member.flag = flag;
        }
    }

    /// Records that `slot` holds `key` in `medium`.
    pub(crate) fn store(&self, slot: Slot, key: u64, medium: Medium) {
        let mut shard = self.shards[self.shard_of(key)].write();
        shard
            .entry(key)
            .and_modify(|holders| {
                holders.add(slot, medium);
            })
            .or_insert_with(|| Holders::new(slot, medium));
    }

    /// Whether `slot` holds `key` in any medium.
    pub(crate) fn holds(&self, slot: Slot, key: u64) -> bool {
        let shard = self.shards[self.shard_of(key)].read();
        shard
            .get(&key)
            .is_some_and(|holders| holders.as_slice().iter().any(|h| h.slot == slot))
    }

    /// Removes `slot`'s holding of `key` in `medium` (every medium when `None`).
    pub(crate) fn remove(&self, slot: Slot, key: u64, medium: Option<Medium>) -> Removal {
        let mut shard = self.shards[self.shard_of(key)].write();
        let Some(holders) = shard.get_mut(&key) else {
            return Removal {
                was_held: false,
                slot_gone: false,
                set_empty: false,
            };
        };
        let removal = holders.remove(slot, medium);
        if removal.set_empty {
            shard.remove(&key);
            shrink_if_sparse(&mut shard);
        }
        removal
    }

    /// Removes every holding of `slot` for `keys` (consumed; reordered by shard so each shard
    /// lock is taken once per chunk instead of once per key).
    pub(crate) fn remove_all(&self, slot: Slot, mut keys: Vec<u64>) {
        keys.sort_unstable_by_key(|&key| self.shard_of(key));
        for run in keys.chunk_by(|&a, &b| self.shard_of(a) == self.shard_of(b)) {
            let Some(&first) = run.first() else { continue };
            for chunk in run.chunks(BULK_REMOVE_CHUNK) {
                let mut shard = self.shards[self.shard_of(first)].write();
                for key in chunk {
                    if let Some(holders) = shard.get_mut(key)
                        && holders.remove(slot, None).set_empty
                    {
                        shard.remove(key);
                    }
                }
                shrink_if_sparse(&mut shard);
            }
        }
    }

    /// Leading blocks of `keys` held per replica. See [`super::BlockIndex::find_matches`].
    pub(crate) fn find_matches(
        &self,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
    ) -> Vec<ReplicaMatch> {
        // Snapshot who is asked about and who is trusted, then walk without the members lock.
        let (mut reported, slot_count) = {
            let members = self.members.read();
            let mut reported: Vec<(Slot, ReplicaMatch)> = Vec::new();
            let mut seen = SlotSet::with_slots(members.slots.len());
            let mut report = |slot: Slot, member: &Member| {
                if !seen.contains(slot) {
                    seen.insert(slot);
                    let precise = member.flag.is_none();
                    reported.push((slot, ReplicaMatch::empty(member.replica, precise)));
                }
            };
            match candidates {
                Some(candidates) => {
                    for replica in candidates {
                        if let Some(&slot) = members.by_replica.get(replica)
                            && let Some(Some(member)) = members.slots.get(usize::from(slot))
                        {
                            report(slot, member);
                        }
                    }
                }
                None => {
                    for (slot, member) in members.slots.iter().enumerate() {
                        if let (Some(member), Ok(slot)) = (member, Slot::try_from(slot)) {
                            report(slot, member);
                        }
                    }
                }
            }
            (reported, members.slots.len())
        };

        let mut alive = SlotSet::with_slots(slot_count);
        for (slot, found) in &reported {
            if found.precise {
                alive.insert(*slot);
            }
        }
        let mut gpu_alive = alive.clone();
        let mut matched = vec![0u32; slot_count];
        let mut gpu_matched = vec![0u32; slot_count];
        let mut batch = Batch::new(SlotSet::words_for(slot_count), self.shards.len());
        let mut walked = 0;
        let mut batch_len = FIRST_BATCH;
        while walked < keys.len() && !alive.is_empty() {
            let end = keys.len().min(walked + batch_len);
            self.look_up(&keys[walked..end], &mut batch);
            for at in 0..end - walked {
                if alive.is_empty() {
                    break;
                }
                let index = (walked + at) as u32;
                alive.retain_words(batch.present(at), |slot| matched[slot] = index);
                gpu_alive.retain_words(batch.gpu(at), |slot| gpu_matched[slot] = index);
            }
            walked = end;
            batch_len = (batch_len * 4).min(MAX_BATCH);
        }
        // Replicas still matching after the walk hold every key.
        let total = keys.len() as u32;
        alive.retain_words(&[], |slot| matched[slot] = total);
        gpu_alive.retain_words(&[], |slot| gpu_matched[slot] = total);

        for (slot, found) in &mut reported {
            if found.precise {
                found.matched_blocks = matched[usize::from(*slot)];
                found.gpu_blocks = gpu_matched[usize::from(*slot)];
            }
        }
        reported.into_iter().map(|(_, found)| found).collect()
    }

    /// Resolves the holders of `keys` into `batch`, visiting shards in order so each shard's
    /// read lock is taken once per batch. Back-to-back lookups under one lock let the CPU
    /// overlap their cache misses; a lock per key would serialize them (each lock is a fence).
    fn look_up(&self, keys: &[u64], batch: &mut Batch) {
        batch.reset(keys.len());
        // Counting sort of the batch's key positions by shard.
        batch.shard_of.clear();
        batch
            .shard_of
            .extend(keys.iter().map(|&key| self.shard_of(key)));
        batch.starts.fill(0);
        for &shard in &batch.shard_of {
            batch.starts[shard + 1] += 1;
        }
        for shard in 0..self.shards.len() {
            batch.starts[shard + 1] += batch.starts[shard];
        }
        batch.order.resize(keys.len(), 0);
        let mut next = batch.starts.clone();
        for (at, &shard) in batch.shard_of.iter().enumerate() {
            batch.order[next[shard]] = at;
            next[shard] += 1;
        }
        let words = batch.words;
        for (shard, lock) in self.shards.iter().enumerate() {
            let (from, to) = (batch.starts[shard], batch.starts[shard + 1]);
            if from == to {
                continue;
            }
            let map = lock.read();
            // Lookups first, in a tight loop of independent loads; expanding the (possibly
            // 64-long) holder lists in between would fill the CPU's window and stop the overlap.
            let found: Vec<(usize, &Holders)> = batch.order[from..to]
                .iter()
                .filter_map(|&at| map.get(&keys[at]).map(|holders| (at, holders)))
                .collect();
            for (at, holders) in found {
                let present = &mut batch.present[at * words..(at + 1) * words];
                for holder in holders.as_slice() {
                    SlotSet::set_in(present, holder.slot);
                }
                let gpu = &mut batch.gpu[at * words..(at + 1) * words];
                for holder in holders.as_slice().iter().filter(|h| h.media.has_gpu()) {
                    SlotSet::set_in(gpu, holder.slot);
                }
            }
        }
    }

    /// (block, replica) holdings in the pool.
    pub(crate) fn holdings(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                shard
                    .read()
                    .values()
                    .map(|h| h.as_slice().len())
                    .sum::<usize>()
            })
            .sum()
    }

    /// Bytes allocated by the shard maps and their spilled holder sets.
    pub(crate) fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(u64, Holders)>();
        self.shards
            .iter()
            .map(|shard| {
                let shard = shard.read();
                table_bytes(shard.capacity(), entry)
                    + shard.values().map(Holders::heap_bytes).sum::<usize>()
            })
            .sum()
    }
}
