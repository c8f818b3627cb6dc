//! One pool (served model): its sharded key → holders tables, its replica slots, and the match
//! walk.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};

use super::groups::Groups;
use super::holders::{KeyHasherBuilder, MediaSet, Removal, Slot, SlotSet};
use super::keys::PoolKeys;
use super::paths::{
    MAX_RUN, MIN_RUN, MIN_STORED_RUN, PathStats, Paths, PathsView, RunRef, interleave,
};
use super::table::{HolderTable, HolderWord, HomeEntry, Layout, LayoutView, Storage, read_fence};
use super::{FlagReason, IndexError, ReplicaId, ReplicaMatch, ReplicaState};
use crate::event::Medium;

/// Whether a replica's holdings are counted in its match: a precise replica's, and those of a
/// replica flagged only for a KV-cache group whose hit rule the index does not model (its
/// modelled groups' answer, reported approximate: `precise` stays false).
fn counted(found: &ReplicaMatch) -> bool {
    found.precise || found.state == ReplicaState::Flagged(FlagReason::UnmodelledCacheGroup)
}

/// Replica slots of a pool, and whether each is trusted for precise matching.
#[derive(Debug, Default)]
struct Members {
    slots: Vec<Option<Member>>,
    by_replica: HashMap<ReplicaId, Slot>,
    /// What a match of the whole pool starts from (every member, slot order), and the slots
    /// below 64 that are trusted: rebuilt on each change, so a match copies it instead of
    /// going through the slots.
    everyone: Vec<(Slot, ReplicaMatch)>,
    everyone_counted: u64,
}

impl Members {
    fn refresh(&mut self) {
        self.everyone.clear();
        self.everyone_counted = 0;
        for (slot, member) in self.slots.iter().enumerate() {
            if let (Some(member), Ok(slot)) = (member, Slot::try_from(slot)) {
                let found = ReplicaMatch::empty(member.replica, member.state);
                if counted(&found) && slot < 64 {
                    self.everyone_counted |= 1 << slot;
                }
                self.everyone.push((slot, found));
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Member {
    replica: ReplicaId,
    /// Precise only when `Ready`.
    state: ReplicaState,
}

/// Holdings of one pool. Replicas are addressed by their dense slot so the match walk can keep
/// the still-matching replicas in a bitset.
#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) model: String,
    pub(crate) block_size: u32,
    pub(crate) keys: PoolKeys,
    /// The model's chunked local attention chunk, when configured.
    pub(crate) attention_chunk_size: Option<u32>,
    hasher: KeyHasherBuilder,
    /// Each shard's table, locked by its writers only.
    shards: Box<[Mutex<HolderTable>]>,
    /// Where match walks read the shards, without locks.
    layout: Arc<Layout>,
    shard_mask: usize,
    members: RwLock<Members>,
    /// Runs of prompt keys with the same holders, beside the tables (see [`super::paths`]).
    paths: Arc<Paths>,
    /// Whether a `BlockStored`'s keys are built into runs as they are stored (see
    /// [`IndexConfig::runs_from_events`](super::IndexConfig::runs_from_events)).
    runs_from_events: bool,
    /// The replicas (by slot) with KV-cache groups beside the tables' (hybrid attention), whose
    /// matches are vLLM's coordinator's answer over all groups. Empty for dense models: a
    /// match then only checks that it is.
    groups: ArcSwap<Vec<(Slot, Arc<Groups>)>>,
    /// Whether `groups` has ever held a replica: a dense pool's match reads this flag only
    /// (loading the `ArcSwap` costs a dense match's p99 measurably).
    has_groups: AtomicBool,
}

/// Who asked for runs: a walk (its stretches are built the second time a walk meets them) or
/// a writer that just stored an event's keys (built at once; chained after the run its parent
/// key ends).
#[derive(Debug, Clone, Copy)]
enum Origin {
    Walk,
    Stored { parent: Option<u64> },
}

impl Origin {
    /// Shortest stretch built into a run.
    fn shortest_run(self) -> usize {
        match self {
            Origin::Walk => MIN_RUN,
            Origin::Stored { .. } => MIN_STORED_RUN,
        }
    }
}

/// One key a walk looked up (its index in the prompt and its holders below slot 64, any medium
/// and GPU): what runs are built from.
type Looked = (usize, u64, u64);

/// Keys looked up back to back before their holders are intersected: enough independent loads
/// for the CPU to overlap their cache misses, few enough that an early mismatch wastes little.
const CHUNK: usize = 32;
const _: () = assert!(CHUNK <= 64, "look_up marks a chunk's stale keys in one u64");

/// Optimistic reads of one key before a walk reads it under its shard's writer lock instead
/// (only a shard rewritten through every try gets there).
const OPTIMISTIC_TRIES: usize = 64;

/// Shard lock hold is bounded: bulk removal releases the lock after this many keys.
const BULK_REMOVE_CHUNK: usize = 256;

impl Pool {
    pub(crate) fn new(
        model: String,
        block_size: u32,
        keys: PoolKeys,
        attention_chunk_size: Option<u32>,
        shards: usize,
        hasher: KeyHasherBuilder,
        runs_from_events: bool,
    ) -> Self {
        let shards = shards.clamp(1, 1 << 16).next_power_of_two();
        let paths = Arc::new(Paths::default());
        let (layout, tables) = Layout::with_tables(shards, hasher, &paths);
        Pool {
            model,
            block_size,
            keys,
            attention_chunk_size,
            hasher,
            shards: tables.into_iter().map(Mutex::new).collect(),
            layout,
            shard_mask: shards - 1,
            members: RwLock::new(Members::default()),
            paths,
            runs_from_events,
            groups: ArcSwap::default(),
            has_groups: AtomicBool::new(false),
        }
    }

    /// Registers `slot`'s groups: its matches are answered over them from now on.
    pub(crate) fn add_groups(&self, slot: Slot, groups: Arc<Groups>) {
        self.groups.rcu(|current| {
            let mut next: Vec<_> = current
                .iter()
                .filter(|(s, _)| *s != slot)
                .cloned()
                .collect();
            next.push((slot, Arc::clone(&groups)));
            next
        });
        self.has_groups.store(true, Ordering::Release);
    }

    /// Whether a match must look at replicas' groups.
    fn any_groups(&self) -> bool {
        self.has_groups.load(Ordering::Acquire) && !self.groups.load().is_empty()
    }

    /// Forgets `slot`'s groups (the replica left the pool).
    fn drop_groups(&self, slot: Slot) {
        if self.groups.load().iter().any(|(s, _)| *s == slot) {
            self.groups.rcu(|current| {
                current
                    .iter()
                    .filter(|(s, _)| *s != slot)
                    .cloned()
                    .collect::<Vec<_>>()
            });
        }
    }

    /// Replaces each hybrid replica's counts (its primary group's prefix, from the walk) with
    /// the hit vLLM would give over all its groups.
    fn answer_groups(&self, keys: &[u64], reported: &mut [(Slot, ReplicaMatch)]) {
        let groups = self.groups.load();
        for (slot, groups) in groups.iter() {
            let Some((_, found)) = reported
                .iter_mut()
                .find(|(s, found)| s == slot && counted(found))
            else {
                continue;
            };
            found.prefix_blocks = groups.prefix_blocks(keys, found.matched_blocks);
            (found.matched_blocks, found.gpu_blocks) = groups.hit_blocks_and_gpu(
                keys,
                self.block_size,
                (found.matched_blocks, found.gpu_blocks),
            );
        }
    }

    /// `key`'s mix: its high bits pick the shard, its low bits the entry in the shard's table.
    fn hash(&self, key: u64) -> u64 {
        self.hasher.mix(key)
    }

    fn shard_of(&self, hash: u64) -> usize {
        ((hash >> 40) as usize) & self.shard_mask
    }

    /// Gives `replica` a slot (reusing freed ones).
    pub(crate) fn add_member(&self, replica: ReplicaId) -> Result<Slot, IndexError> {
        let mut members = self.members.write();
        let member = Some(Member {
            replica,
            state: ReplicaState::Ready,
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
        members.refresh();
        Ok(slot)
    }

    /// Frees `slot`; the caller has already removed every holding of it.
    pub(crate) fn remove_member(&self, slot: Slot) {
        self.drop_groups(slot);
        let mut members = self.members.write();
        if let Some(entry) = members.slots.get_mut(usize::from(slot))
            && let Some(member) = entry.take()
        {
            members.by_replica.remove(&member.replica);
        }
        while members.slots.last().is_some_and(Option::is_none) {
            members.slots.pop();
        }
        members.refresh();
    }

    pub(crate) fn set_state(&self, slot: Slot, state: ReplicaState) {
        let mut members = self.members.write();
        if let Some(Some(member)) = members.slots.get_mut(usize::from(slot)) {
            member.state = state;
        }
        members.refresh();
    }

    /// Records that `slot` holds `key` in `medium`; returns the media it held `key` in before.
    pub(crate) fn store(&self, slot: Slot, key: u64, medium: Medium) -> MediaSet {
        let hash = self.hash(key);
        self.shards[self.shard_of(hash)]
            .lock()
            .add(key, hash, slot, medium)
    }

    /// Loads the home lines of `keys` (lock-free, like a walk) before a writer goes through
    /// them one by one: their cache misses overlap instead of costing one each in turn under
    /// the shard locks (at fleet scale nearly every write misses).
    pub(crate) fn prefetch(&self, keys: &[u64]) {
        let view = self.layout.view();
        let mut loaded = 0;
        for &key in keys {
            let hash = self.hash(key);
            loaded ^= view[self.shard_of(hash)].touch(hash);
        }
        std::hint::black_box(loaded);
    }

    /// Builds runs over `keys`, the chain of keys one `BlockStored` just stored (after
    /// `parent`, if any), so that a prompt's first walk follows them instead of looking each key
    /// up. Reads the keys' holders as a walk would (lock-free, just written so cached); a run
    /// covers each stretch of keys with equal holders that no live run covers already (a shared
    /// prefix stays in the run that has it; a walk goes from it to the new run in one lookup).
    /// Pools of more than 64 slots walk without runs, so they build none.
    pub(crate) fn build_stored(&self, parent: Option<u64>, keys: &[u64]) {
        if !self.runs_from_events
            || keys.len() < MIN_STORED_RUN
            || self.members.read().slots.len() > 64
        {
            return;
        }
        let mut view = self.layout.view();
        let paths = self.paths.view();
        let mut looked: Vec<Looked> = Vec::with_capacity(keys.len());
        for (chunk_at, chunk) in keys.chunks(CHUNK).enumerate() {
            let mut found = [(HolderWord::default(), (0, 0)); CHUNK];
            self.look_up(&mut view, chunk, |storage, word, offset| {
                found[offset] = (word, storage.first_words(word));
            });
            for (offset, (&key, &(word, (present, gpu)))) in chunk.iter().zip(&found).enumerate() {
                if !self.paths.vouches_in(&paths, word.run(), key) {
                    looked.push((chunk_at * CHUNK + offset, present, gpu));
                }
            }
        }
        self.build(keys, &looked, Origin::Stored { parent });
    }

    /// The keys `slot` holds (O(pool keys), one shard lock at a time: resets and listings).
    pub(crate) fn keys_of(&self, slot: Slot) -> Vec<u64> {
        self.shards
            .iter()
            .flat_map(|shard| shard.lock().keys_held_by(slot))
            .collect()
    }

    /// Whether `slot` holds `key` in any medium.
    pub(crate) fn holds(&self, slot: Slot, key: u64) -> bool {
        let hash = self.hash(key);
        let shard = self.shards[self.shard_of(hash)].lock();
        !shard.media_of(key, hash, slot).is_empty()
    }

    /// Whether `slot` holds `key` in `medium`.
    pub(crate) fn holds_in(&self, slot: Slot, key: u64, medium: Medium) -> bool {
        let hash = self.hash(key);
        let shard = self.shards[self.shard_of(hash)].lock();
        shard.media_of(key, hash, slot).contains(medium)
    }

    /// Removes `slot`'s holding of `key` in `medium` (every medium when `None`).
    pub(crate) fn remove(&self, slot: Slot, key: u64, medium: Option<Medium>) -> Removal {
        let hash = self.hash(key);
        self.shards[self.shard_of(hash)]
            .lock()
            .remove(key, hash, slot, medium)
    }

    /// Removes every holding of `slot` for `keys` (consumed; reordered by shard so each shard
    /// lock is taken once per chunk instead of once per key).
    pub(crate) fn remove_all(&self, slot: Slot, keys: Vec<u64>) {
        let mut hashed: Vec<(u64, u64)> =
            keys.into_iter().map(|key| (self.hash(key), key)).collect();
        hashed.sort_unstable_by_key(|&(hash, _)| self.shard_of(hash));
        for run in hashed.chunk_by(|a, b| self.shard_of(a.0) == self.shard_of(b.0)) {
            let Some(&(first, _)) = run.first() else {
                continue;
            };
            for chunk in run.chunks(BULK_REMOVE_CHUNK) {
                let mut shard = self.shards[self.shard_of(first)].lock();
                for &(hash, key) in chunk {
                    shard.remove(key, hash, slot, None);
                }
            }
        }
        self.release_if_empty();
    }

    /// Gives the runs' memory back if the pool is empty (every replica reset, gone or emptied
    /// by its removals): O(shards), so called only when a replica's last block went.
    pub(crate) fn release_if_empty(&self) {
        if self.shards.iter().all(|shard| shard.lock().is_empty()) {
            self.paths.release();
        }
    }

    /// What walks did with runs.
    pub(crate) fn path_stats(&self) -> PathStats {
        self.paths.stats()
    }

    /// Leading blocks of `keys` held per replica. See [`super::KvIndex::find_matches`].
    ///
    /// `builds`: whether this walk may build runs from what it looks up. Runs are compared
    /// trusting that prompts are chains of keys (see `paths::common_prefix`), so only walks of
    /// keys kvroute computed may build them; a walk of anyone else's keys only reads runs.
    pub(crate) fn find_matches(
        &self,
        keys: &[u64],
        candidates: Option<&[ReplicaId]>,
        builds: bool,
    ) -> Vec<ReplicaMatch> {
        // Snapshot who is asked about and who is trusted, then walk without the members lock.
        let (mut reported, slot_count, everyone_counted) = {
            let members = self.members.read();
            match candidates {
                None => (
                    members.everyone.clone(),
                    members.slots.len(),
                    Some(members.everyone_counted),
                ),
                Some(candidates) => {
                    let mut reported = Vec::with_capacity(candidates.len());
                    let mut seen = SlotSet::with_slots(members.slots.len());
                    for replica in candidates {
                        if let Some(&slot) = members.by_replica.get(replica)
                            && let Some(Some(member)) = members.slots.get(usize::from(slot))
                            && !seen.contains(slot)
                        {
                            seen.insert(slot);
                            reported
                                .push((slot, ReplicaMatch::empty(member.replica, member.state)));
                        }
                    }
                    (reported, members.slots.len(), None)
                }
            }
        };

        let total = keys.len() as u32;
        if slot_count <= 64 {
            self.count_small(keys, &mut reported, everyone_counted, builds);
            if self.any_groups() {
                self.answer_groups(keys, &mut reported);
            }
            return reported.into_iter().map(|(_, found)| found).collect();
        }
        let mut alive = SlotSet::with_slots(slot_count);
        for (slot, found) in &reported {
            if counted(found) {
                alive.insert(*slot);
            }
        }
        let mut gpu_alive = alive.clone();
        // Per slot: leading blocks held (any medium), then on the GPU.
        let mut counts = vec![0u32; 2 * slot_count];
        let (matched, gpu_matched) = counts.split_at_mut(slot_count);
        if !alive.is_empty() {
            self.walk(keys, &mut alive, &mut gpu_alive, matched, gpu_matched);
        }
        // Replicas still matching after the walk hold every key.
        for (slot, found) in &mut reported {
            if counted(found) {
                let at = usize::from(*slot);
                found.matched_blocks = if alive.contains(*slot) {
                    total
                } else {
                    matched[at]
                };
                found.prefix_blocks = found.matched_blocks;
                found.gpu_blocks = if gpu_alive.contains(*slot) {
                    total
                } else {
                    gpu_matched[at]
                };
            }
        }
        if self.any_groups() {
            self.answer_groups(keys, &mut reported);
        }
        reported.into_iter().map(|(_, found)| found).collect()
    }

    /// Walks `keys` in order (pools of more than 64 slots; smaller ones: [`Self::count_small`]),
    /// dropping from `alive` (`gpu_alive`) each slot at the first key it does not hold (on the
    /// GPU) and recording that key's index as its match length. Stops once no slot is alive.
    ///
    /// Takes no lock (either walk): each key's holders are read optimistically from its shard's
    /// storage and checked against the shard's version (see [`super::table`]), so a walk never
    /// waits for ingest. Each key's holders are one state of that key; a walk running beside
    /// writers may see keys at different moments, as requests and events interleave anyway.
    fn walk(
        &self,
        keys: &[u64],
        alive: &mut SlotSet,
        gpu_alive: &mut SlotSet,
        matched: &mut [u32],
        gpu_matched: &mut [u32],
    ) {
        let mut view = self.layout.view();
        self.walk_words(&mut view, keys, alive, gpu_alive, matched, gpu_matched);
    }

    /// [`Self::find_matches`]'s counts for pools of up to 64 slots: the live sets are single
    /// words and the walk follows runs ([`Self::walk_one_word`]), then builds runs over what
    /// it had to look up one by one.
    /// `counted`: the slots whose holdings are counted, when the caller knows them; `builds`: see
    /// [`Self::find_matches`].
    fn count_small(
        &self,
        keys: &[u64],
        reported: &mut [(Slot, ReplicaMatch)],
        counted_slots: Option<u64>,
        builds: bool,
    ) {
        let mut alive = counted_slots.unwrap_or_else(|| {
            reported
                .iter()
                .filter(|(_, found)| counted(found))
                .fold(0u64, |alive, &(slot, _)| alive | 1 << slot)
        });
        let mut gpu_alive = alive;
        let (mut matched, mut gpu_matched) = ([0u32; 64], [0u32; 64]);
        if alive != 0 {
            let mut view = self.layout.view();
            let paths = self.paths.view();
            let mut looked = Vec::new();
            let (by_run, looked_up) = self.walk_one_word(
                &mut view,
                &paths,
                keys,
                (&mut alive, &mut gpu_alive),
                (&mut matched, &mut gpu_matched),
                &mut looked,
            );
            self.paths.record_walk(by_run, looked_up);
            if builds && looked.len() >= MIN_RUN {
                self.build(keys, &looked, Origin::Walk);
            }
        }
        // Replicas still matching after the walk hold every key.
        let total = keys.len() as u32;
        for (slot, found) in reported.iter_mut().filter(|(_, found)| counted(found)) {
            let (bit, at) = (1u64 << *slot, usize::from(*slot) % 64);
            found.matched_blocks = if alive & bit != 0 { total } else { matched[at] };
            found.prefix_blocks = found.matched_blocks;
            found.gpu_blocks = if gpu_alive & bit != 0 {
                total
            } else {
                gpu_matched[at]
            };
        }
    }

    /// Calls `decode` with the holder word of each of `keys` (at most [`CHUNK`]) and its
    /// position, from a version-checked read of the key's shard; a key whose shard changed
    /// under the read is read again (and decoded again: `decode` must overwrite).
    ///
    /// Two passes: the first only loads each key's home entry, with no branch on what it
    /// loads, so the CPU issues all the cache misses at once; the second resolves the entries
    /// from cache. One pass would stall on every probe that does not hit the key first (the
    /// mispredicted branch discards the lookups issued after it).
    #[inline]
    fn look_up(
        &self,
        view: &mut LayoutView,
        keys: &[u64],
        mut decode: impl FnMut(&Storage, HolderWord, usize),
    ) {
        let mut homes = [(0, 0, 0, HomeEntry::default()); CHUNK];
        for (home, &key) in homes.iter_mut().zip(keys) {
            let hash = self.hash(key);
            let shard = self.shard_of(hash);
            let storage = &view[shard];
            let version = storage.read_begin();
            *home = (shard, hash, version, storage.home_entry(hash));
        }
        for (at, (&key, &(shard, hash, _, home))) in keys.iter().zip(&homes).enumerate() {
            let storage = &view[shard];
            decode(storage, storage.resolve(key, hash, home), at);
        }
        interleave::at(interleave::Point::ChunkRead);
        read_fence();
        // Every key is checked against the storage it was read from before any is read again:
        // `read_again` loads a new layout, whose successor storage may by chance carry the
        // version an older read began at.
        let mut stale = homes
            .iter()
            .take(keys.len())
            .enumerate()
            .filter(|&(_, &(shard, _, version, _))| !view[shard].read_valid(version))
            .fold(0u64, |stale, (at, _)| stale | 1 << at);
        while stale != 0 {
            let at = stale.trailing_zeros() as usize;
            stale &= stale - 1;
            let (shard, hash, _, _) = homes[at];
            self.read_again(view, keys[at], hash, shard, &mut |storage, word| {
                decode(storage, word, at)
            });
        }
    }

    /// A key whose optimistic read met a write: read until a try sees no write, then (the
    /// shard busy through every try) under the writer's lock.
    #[cold]
    fn read_again(
        &self,
        view: &mut LayoutView,
        key: u64,
        hash: u64,
        shard: usize,
        decode: &mut dyn FnMut(&Storage, HolderWord),
    ) {
        for _ in 0..OPTIMISTIC_TRIES {
            // A replaced storage stays odd: load the layout again to find its successor.
            *view = self.layout.view();
            let storage = &view[shard];
            let version = storage.read_begin();
            if version & 1 == 0 {
                decode(storage, storage.holder_word(key, hash));
                read_fence();
                if storage.read_valid(version) {
                    return;
                }
            }
            std::hint::spin_loop();
        }
        let table = self.shards[shard].lock();
        let storage = table.storage();
        decode(storage, storage.holder_word(key, hash));
    }

    /// One key's holder word and its holders below slot 64 (any medium, GPU), from a
    /// version-checked read of its shard (read again on a change, like [`Self::look_up`]).
    #[inline]
    fn look_up_one(&self, view: &mut LayoutView, key: u64) -> (HolderWord, (u64, u64)) {
        let hash = self.hash(key);
        let shard = self.shard_of(hash);
        let storage = &view[shard];
        let version = storage.read_begin();
        let word = storage.holder_word(key, hash);
        let holders = storage.first_words(word);
        interleave::at(interleave::Point::KeyRead);
        read_fence();
        if storage.read_valid(version) {
            return (word, holders);
        }
        let mut found = (HolderWord::default(), (0, 0));
        self.read_again(view, key, hash, shard, &mut |storage, word| {
            found = (word, storage.first_words(word));
        });
        found
    }

    /// [`Self::walk`] for pools of up to 64 slots: the live sets are single words. Follows
    /// runs: each key looked up whose run vouches for the prompt's next keys (same keys, same
    /// holders) lets the walk skip them at the cost of a compare; after a run one key is
    /// looked up (the next run usually starts there), otherwise a chunk. Keys no run covers
    /// are pushed to `looked` (runs are built from them). Returns the keys answered by runs
    /// and the keys looked up.
    fn walk_one_word(
        &self,
        view: &mut LayoutView,
        paths: &PathsView,
        keys: &[u64],
        (alive, gpu_alive): (&mut u64, &mut u64),
        (matched, gpu_matched): (&mut [u32], &mut [u32]),
        looked: &mut Vec<Looked>,
    ) -> (usize, usize) {
        let mut found = [(HolderWord::default(), (0, 0)); CHUNK];
        let (mut by_run, mut looked_up) = (0, 0);
        // A run built from the prompt's first key answers it (and what follows) without a
        // lookup: a lookup reads a shard ingest keeps writing.
        let Some(&first) = keys.first() else {
            return (by_run, looked_up);
        };
        let head = self.paths.head(paths, first);
        let Some(mut at) = self.follow_runs(
            paths,
            head,
            keys,
            0,
            (&mut *alive, &mut *gpu_alive),
            (&mut *matched, &mut *gpu_matched),
            &mut by_run,
        ) else {
            return (by_run, looked_up);
        };
        let mut one = true;
        while at < keys.len() {
            let chunk = &keys[at..keys.len().min(at + if one { 1 } else { CHUNK })];
            if let ([key], true) = (chunk, one) {
                found[0] = self.look_up_one(view, *key);
            } else {
                self.look_up(view, chunk, |storage, word, offset| {
                    found[offset] = (word, storage.first_words(word));
                });
            }
            looked_up += chunk.len();
            let mut next = at + chunk.len();
            one = false;
            for (offset, &(word, (present, gpu))) in found[..chunk.len()].iter().enumerate() {
                let at = at + offset;
                let index = at as u32;
                drop_absent(alive, present, |slot| matched[slot] = index);
                drop_absent(gpu_alive, gpu, |slot| gpu_matched[slot] = index);
                if *alive == 0 {
                    // The end of a stretch looked up (a stretch is consecutive keys).
                    if looked.last().is_some_and(|last| last.0 + 1 == at) {
                        looked.push((at, present, gpu));
                    }
                    return (by_run, looked_up);
                }
                // The keys a run vouches for have this key's holders: nothing to drop.
                let rest = &keys[at + 1..];
                let span = self
                    .paths
                    .covered(paths, word.run(), keys[at], rest, (present, gpu));
                if span.covered > 0 {
                    by_run += span.covered;
                    one = true;
                    // The runs built after it, while their first keys are the prompt's next.
                    match self.follow_runs(
                        paths,
                        span.next,
                        keys,
                        at + 1 + span.covered,
                        (&mut *alive, &mut *gpu_alive),
                        (&mut *matched, &mut *gpu_matched),
                        &mut by_run,
                    ) {
                        Some(end) => next = end,
                        None => return (by_run, looked_up),
                    }
                    break;
                }
                looked.push((at, present, gpu));
            }
            at = next;
        }
        (by_run, looked_up)
    }

    /// Enters `hint` and the runs chained after it while each starts with the prompt's key at
    /// `next`, dropping the slots that do not hold each; returns where the last one left the
    /// prompt, or `None` once no slot is alive.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn follow_runs(
        &self,
        paths: &PathsView,
        mut hint: RunRef,
        keys: &[u64],
        mut next: usize,
        (alive, gpu_alive): (&mut u64, &mut u64),
        (matched, gpu_matched): (&mut [u32], &mut [u32]),
        by_run: &mut usize,
    ) -> Option<usize> {
        while hint.is_some() {
            let Some((holders, span)) = self.paths.enter(paths, hint, &keys[next..]) else {
                break;
            };
            let index = next as u32;
            drop_absent(alive, holders.0, |slot| matched[slot] = index);
            drop_absent(gpu_alive, holders.1, |slot| gpu_matched[slot] = index);
            if *alive == 0 {
                return None;
            }
            *by_run += 1 + span.covered;
            next += 1 + span.covered;
            hint = span.next;
        }
        Some(next)
    }

    /// Builds runs over the stretches of `looked` (consecutive keys with the same holders, held
    /// by someone): for a walk, those a walk met before; for a stored event, all of them. Each
    /// key is linked under its shard lock, taken with `try_lock` so neither a walk nor a writer
    /// waits; a run ends at the first key that is busy, has other holders by now, or was cut
    /// meanwhile. Nothing is built while another builder works.
    #[cold]
    fn build(&self, keys: &[u64], looked: &[Looked], origin: Origin) {
        let stretches = looked.chunk_by(|a, b| b.0 == a.0 + 1 && (a.1, a.2) == (b.1, b.2));
        let mut builder = None;
        // The last run built and where its keys end in the prompt.
        let mut built = None;
        let shortest = origin.shortest_run();
        for stretch in stretches {
            let Some(&(first, present, gpu)) = stretch.first() else {
                continue;
            };
            if stretch.len() < shortest
                || present == 0
                || matches!(origin, Origin::Walk) && !self.paths.seen_before(keys[first])
            {
                continue;
            }
            if builder.is_none() {
                builder = match origin {
                    Origin::Walk => self.paths.try_build(),
                    Origin::Stored { .. } => self.paths.try_build_stored(),
                };
            }
            let Some(builder) = builder.as_mut() else {
                return;
            };
            for (piece_at, piece) in keys[first..first + stretch.len()]
                .chunks(MAX_RUN)
                .enumerate()
            {
                if piece.len() < MIN_RUN {
                    continue;
                }
                let Some(run) = builder.allocate(piece, (present, gpu)) else {
                    return;
                };
                let begins = first + piece_at * MAX_RUN;
                if begins == 0 {
                    if let Origin::Stored {
                        parent: Some(parent),
                    } = origin
                    {
                        let (word, _) = self.look_up_one(&mut self.layout.view(), parent);
                        builder.chain_after(word.run(), run);
                    } else {
                        builder.head(keys[0], run);
                    }
                }
                if let Some((previous, ended)) = built
                    && ended == begins
                {
                    builder.chain(previous, run);
                }
                built = Some((run, begins + piece.len()));
                for (offset, &key) in piece.iter().enumerate() {
                    let hash = self.hash(key);
                    let Some(mut table) = self.shards[self.shard_of(hash)].try_lock() else {
                        break;
                    };
                    if !table.link(key, hash, (present, gpu), run.at(offset))
                        || !builder.extend(run, offset)
                    {
                        break;
                    }
                }
            }
        }
    }

    /// [`Self::walk`] for pools of more than 64 slots.
    fn walk_words(
        &self,
        view: &mut LayoutView,
        keys: &[u64],
        alive: &mut SlotSet,
        gpu_alive: &mut SlotSet,
        matched: &mut [u32],
        gpu_matched: &mut [u32],
    ) {
        let words = alive.word_count();
        // Per chunk position: the slots holding its key (any medium, GPU) as `words` words each.
        let mut present = vec![0u64; CHUNK * words];
        let mut gpu = vec![0u64; CHUNK * words];
        for (chunk_at, chunk) in keys.chunks(CHUNK).enumerate() {
            self.look_up(view, chunk, |storage, word, at| {
                let range = at * words..(at + 1) * words;
                present[range.clone()].fill(0);
                gpu[range.clone()].fill(0);
                storage.mark(word, &mut present[range.clone()], &mut gpu[range]);
            });
            for at in 0..chunk.len() {
                let index = (chunk_at * CHUNK + at) as u32;
                let range = at * words..(at + 1) * words;
                alive.retain_words(&present[range.clone()], |slot| matched[slot] = index);
                gpu_alive.retain_words(&gpu[range], |slot| gpu_matched[slot] = index);
                if alive.is_empty() {
                    return;
                }
            }
        }
    }

    /// (block, replica) holdings in the pool.
    pub(crate) fn holdings(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.lock().holdings())
            .sum()
    }

    /// Bytes allocated by the shard tables and the runs.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.lock().memory_bytes())
            .sum::<usize>()
            + self.paths.memory_bytes()
    }
}

/// Clears the bits of `alive` absent from `present`, calling `on_dropped` with each.
#[inline]
fn drop_absent(alive: &mut u64, present: u64, mut on_dropped: impl FnMut(usize)) {
    let mut dropped = *alive & !present;
    *alive &= present;
    while dropped != 0 {
        on_dropped(dropped.trailing_zeros() as usize);
        dropped &= dropped - 1;
    }
}
