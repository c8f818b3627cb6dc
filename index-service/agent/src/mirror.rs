//! One engine's block set as the agent mirrors it, with enough per block to re-emit it.
//!
//! vLLM semantics: `BlockStored` adds a block on a medium, `BlockRemoved` drops it from that
//! medium (the block is gone once no medium holds it), `AllBlocksCleared` empties everything.
//! Hybrid-attention models publish each KV-cache group's events apart (`group_idx`), with the
//! same hash in every group, so blocks are kept per (group, hash) and a removal touches its own
//! group only. Per block of a full-attention group the mirror keeps its parent, tokens and
//! keying extras, so [`ReplicaMirror::snapshot`] can re-emit the whole set as `BlockStored`
//! events in chain order (parents before children): what a token-chain pool needs to rebuild its
//! keys after a reset. Other groups' stores are not dense (a sliding window lists only the blocks
//! it keeps of the span its tokens cover) and the index keeps only their hashes, so only those
//! are kept and re-emitted.
//!
//! Bounded: at most `cap` (group, hash) blocks; further **new** blocks are refused (and
//! reported) rather than evicting, the same policy as the index core, so both stay identical.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvroute_block_keys::HashValue;

use kvroute_index_core::event::{BlockStored, CacheKind, EngineHash, KvEvent, Medium};

const MEDIA: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Other];

/// Most hashes of a non-full-attention group in one snapshot event: its blocks have no chain to
/// split runs, and one event per group could exceed what the index accepts per event.
const SIDE_RUN_BLOCKS: usize = 4096;

/// A block as the mirror keys it: (group, hash), the group `group_idx.unwrap_or(0)`.
type BlockKey = (u32, EngineHash);

fn medium_bit(medium: Medium) -> u8 {
    match medium {
        Medium::Gpu => 1,
        Medium::Cpu => 2,
        Medium::Storage => 4,
        Medium::Other => 8,
    }
}

/// Whether a store of this kind is dense (one block of tokens per hash, chained); `None` is a
/// dense model's (or a pre-0.22 engine's) full-attention group.
fn is_dense(kind: Option<CacheKind>) -> bool {
    kind.is_none_or(CacheKind::is_full_attention)
}

/// What the mirror keeps per block.
#[derive(Debug, Clone, PartialEq)]
struct MirrorBlock {
    /// Dense groups only (see [`is_dense`]); other groups' blocks have no parent or tokens.
    parent: Option<EngineHash>,
    tokens: Box<[u32]>,
    block_size: u32,
    /// Bit set of [`medium_bit`].
    media: u8,
    lora_id: Option<i64>,
    lora_name: Option<Arc<str>>,
    extra_key: Option<HashValue>,
    group_idx: Option<u32>,
    cache_kind: Option<CacheKind>,
    sliding_window: Option<u32>,
    digest: Option<Box<[u8]>>,
    parent_digest: Option<Box<[u8]>>,
}

impl MirrorBlock {
    fn dense(&self) -> bool {
        is_dense(self.cache_kind)
    }

    /// Whether `next` continues this block's run in one `BlockStored`.
    fn same_run_attributes(&self, next: &MirrorBlock) -> bool {
        self.block_size == next.block_size
            && self.tokens.is_empty() == next.tokens.is_empty()
            && self.lora_id == next.lora_id
            && self.lora_name == next.lora_name
            && self.group_idx == next.group_idx
            && self.cache_kind == next.cache_kind
            && self.sliding_window == next.sliding_window
            && self.digest.is_some() == next.digest.is_some()
    }
}

/// What applying one engine event did to the mirror.
#[derive(Debug, Default, PartialEq)]
pub struct MirrorOutcome {
    /// The event as the index must see it: identical to the input unless blocks were refused.
    pub forward: Vec<KvEvent>,
    /// New blocks refused because the mirror is at its cap.
    pub refused_blocks: usize,
}

/// One replica's mirrored block set.
#[derive(Debug)]
pub struct ReplicaMirror {
    blocks: HashMap<BlockKey, MirrorBlock>,
    /// Copies of a block beyond the first, by (group, hash, medium): vLLM can hold several
    /// blocks with one hash and reports each store and eviction. Counted as the index counts
    /// them, so the mirror, its snapshots and the index agree.
    extra_copies: HashMap<(u32, EngineHash, Medium), u32>,
    cap: usize,
}

impl ReplicaMirror {
    /// An empty mirror holding at most `cap` blocks.
    pub fn new(cap: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            extra_copies: HashMap::new(),
            cap,
        }
    }

    /// Blocks held (in any medium), counted per group.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Forgets everything (engine restart, unrepairable gap).
    pub fn clear(&mut self) {
        self.blocks = HashMap::new();
        self.extra_copies = HashMap::new();
    }

    /// Applies one engine event and returns what to forward.
    pub fn apply(&mut self, event: &KvEvent) -> MirrorOutcome {
        match event {
            KvEvent::BlockStored(stored) => self.store(stored),
            KvEvent::BlockRemoved(removed) => {
                let bit = medium_bit(removed.medium);
                let group = removed.group_idx.unwrap_or(0);
                for &hash in &removed.block_hashes {
                    let copy = (group, hash, removed.medium);
                    if let Some(copies) = self.extra_copies.get_mut(&copy) {
                        *copies -= 1;
                        if *copies == 0 {
                            self.extra_copies.remove(&copy);
                        }
                        continue;
                    }
                    if let Some(block) = self.blocks.get_mut(&(group, hash)) {
                        block.media &= !bit;
                        if block.media == 0 {
                            self.blocks.remove(&(group, hash));
                        }
                    }
                }
                MirrorOutcome {
                    forward: vec![event.clone()],
                    refused_blocks: 0,
                }
            }
            KvEvent::AllBlocksCleared => {
                self.clear();
                MirrorOutcome {
                    forward: vec![event.clone()],
                    refused_blocks: 0,
                }
            }
        }
    }

    fn store(&mut self, stored: &BlockStored) -> MirrorOutcome {
        let bit = medium_bit(stored.medium);
        let group = stored.group_idx.unwrap_or(0);
        let lora_name: Option<Arc<str>> = stored.lora_name.as_deref().map(Arc::from);
        let mut accepted = Vec::with_capacity(stored.block_hashes.len());
        let mut refused = 0;
        for (i, &hash) in stored.block_hashes.iter().enumerate() {
            if let Some(block) = self.blocks.get_mut(&(group, hash)) {
                if block.media & bit != 0 {
                    *self
                        .extra_copies
                        .entry((group, hash, stored.medium))
                        .or_insert(0) += 1;
                }
                block.media |= bit;
                accepted.push(hash);
                continue;
            }
            if self.blocks.len() >= self.cap {
                refused += 1;
                continue;
            }
            let mut block = MirrorBlock {
                parent: None,
                tokens: Box::default(),
                block_size: stored.block_size,
                media: bit,
                lora_id: stored.lora_id,
                lora_name: lora_name.clone(),
                extra_key: stored
                    .extra_keys
                    .as_ref()
                    .and_then(|keys| keys.get(i).cloned().flatten()),
                group_idx: stored.group_idx,
                cache_kind: stored.cache_kind,
                sliding_window: stored.sliding_window,
                digest: None,
                parent_digest: None,
            };
            if is_dense(stored.cache_kind) {
                dense_fields(&mut block, stored, i);
            }
            self.blocks.insert((group, hash), block);
            accepted.push(hash);
        }
        let forward = if refused == 0 {
            vec![KvEvent::BlockStored(stored.clone())]
        } else {
            // Forward exactly what the mirror holds, block by block, so index and mirror agree.
            accepted
                .iter()
                .filter_map(|&hash| {
                    let block = self.blocks.get(&(group, hash))?;
                    Some(KvEvent::BlockStored(single(hash, block, stored.medium)))
                })
                .collect()
        };
        MirrorOutcome {
            forward,
            refused_blocks: refused,
        }
    }

    /// Every held block as `BlockStored` events, group by group, parents before children,
    /// consecutive chain blocks merged into one event per run and medium.
    pub fn snapshot(&self) -> Vec<KvEvent> {
        let mut order = self.chain_order();
        // The index makes the first full-attention group it is sent its primary group: full
        // groups first, lowest first (the stable sort keeps each group's chain order).
        order.sort_by_key(|key| (self.blocks.get(key).is_some_and(|b| !b.dense()), key.0));
        let any_extra_keys = self.blocks.values().any(has_extra_keys);
        let mut events = Vec::new();
        for group in order.chunk_by(|a, b| a.0 == b.0) {
            for medium in MEDIA {
                let bit = medium_bit(medium);
                let mut run: Option<(BlockStored, EngineHash, &MirrorBlock)> = None;
                for key @ &(_, hash) in group {
                    let Some(block) = self.blocks.get(key) else {
                        continue;
                    };
                    if block.media & bit == 0 {
                        continue;
                    }
                    match &mut run {
                        Some((stored, last, last_block))
                            if last_block.same_run_attributes(block)
                                && if block.dense() {
                                    block.parent == Some(*last)
                                } else {
                                    stored.block_hashes.len() < SIDE_RUN_BLOCKS
                                } =>
                        {
                            stored.block_hashes.push(hash);
                            stored.token_ids.extend_from_slice(&block.tokens);
                            if let Some(keys) = &mut stored.extra_keys {
                                keys.push(block.extra_key.clone());
                            }
                            if let (Some(digests), Some(digest)) =
                                (&mut stored.block_digests, &block.digest)
                            {
                                digests.push(digest.to_vec());
                            }
                            *last = hash;
                            *last_block = block;
                        }
                        _ => {
                            if let Some((stored, _, _)) = run.take() {
                                events.push(KvEvent::BlockStored(stored));
                            }
                            let mut stored = single(hash, block, medium);
                            // Merged runs need an extra-keys list as soon as any block has one.
                            if stored.extra_keys.is_none() && any_extra_keys {
                                stored.extra_keys = Some(vec![None]);
                            }
                            run = Some((stored, hash, block));
                        }
                    }
                }
                if let Some((stored, _, _)) = run {
                    events.push(KvEvent::BlockStored(stored));
                }
            }
        }
        // Duplicate copies after every first copy, so the receiver counts them as copies.
        let mut copies: Vec<_> = self.extra_copies.iter().collect();
        copies.sort_unstable_by_key(|((group, hash, medium), _)| {
            (*group, *hash, medium_bit(*medium))
        });
        for (&(group, hash, medium), &count) in copies {
            if let Some(block) = self.blocks.get(&(group, hash)) {
                for _ in 0..count {
                    events.push(KvEvent::BlockStored(single(hash, block, medium)));
                }
            }
        }
        events
    }

    /// Held blocks ordered so that every block comes after its parent (when the parent is held
    /// in its group).
    fn chain_order(&self) -> Vec<BlockKey> {
        let mut order = Vec::with_capacity(self.blocks.len());
        let mut visited: HashSet<BlockKey> = HashSet::with_capacity(self.blocks.len());
        let mut chain = Vec::new();
        let mut roots: Vec<BlockKey> = self.blocks.keys().copied().collect();
        roots.sort_unstable(); // deterministic output
        for start in roots {
            let mut key = start;
            // Walk up to the first ancestor already placed (or not held); `visited` also stops
            // a cycle that garbage hashes could form.
            while visited.insert(key) {
                chain.push(key);
                match self.blocks.get(&key).and_then(|b| b.parent) {
                    Some(parent) if self.blocks.contains_key(&(key.0, parent)) => {
                        key = (key.0, parent);
                    }
                    _ => break,
                }
            }
            order.extend(chain.drain(..).rev());
        }
        order
    }

    /// Held hashes in any group (sorted, each once), for debugging and tests.
    pub fn hashes(&self) -> Vec<EngineHash> {
        let mut hashes: Vec<_> = self.blocks.keys().map(|&(_, hash)| hash).collect();
        hashes.sort_unstable();
        hashes.dedup();
        hashes
    }
}

/// Fills what a dense store says about its `i`-th block: tokens, parent and digests.
fn dense_fields(block: &mut MirrorBlock, stored: &BlockStored, i: usize) {
    let block_size = stored.block_size as usize;
    block.tokens = stored
        .token_ids
        .get(i * block_size..(i + 1) * block_size)
        .unwrap_or_default()
        .into();
    block.parent = match i.checked_sub(1) {
        None => stored.parent_block_hash,
        Some(before) => stored.block_hashes.get(before).copied(),
    };
    let digests = stored.block_digests.as_deref();
    block.digest = digests.and_then(|d| d.get(i)).map(|d| d.as_slice().into());
    block.parent_digest = match i.checked_sub(1) {
        None => stored.parent_digest.as_deref().map(Into::into),
        Some(before) => digests
            .and_then(|d| d.get(before))
            .map(|d| d.as_slice().into()),
    };
}

/// A one-block `BlockStored` for `hash` on `medium`.
fn single(hash: EngineHash, block: &MirrorBlock, medium: Medium) -> BlockStored {
    BlockStored {
        block_hashes: vec![hash],
        parent_block_hash: block.parent,
        token_ids: block.tokens.to_vec(),
        block_size: block.block_size,
        lora_id: block.lora_id,
        lora_name: block.lora_name.as_deref().map(str::to_owned),
        medium,
        extra_keys: has_extra_keys(block).then(|| vec![block.extra_key.clone()]),
        group_idx: block.group_idx,
        cache_kind: block.cache_kind,
        sliding_window: block.sliding_window,
        block_digests: block.digest.as_ref().map(|d| vec![d.to_vec()]),
        parent_digest: block.parent_digest.as_ref().map(|d| d.to_vec()),
        // The agent forwards vLLM engines only.
        sglang: None,
    }
}

fn has_extra_keys(block: &MirrorBlock) -> bool {
    block.extra_key.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_index_core::event::BlockRemoved;

    fn stored(hashes: &[u64], parent: Option<u64>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: hashes
                .iter()
                .flat_map(|&h| [h as u32, h as u32 + 1])
                .collect(),
            block_size: 2,
            medium,
            ..Default::default()
        })
    }

    fn removed(hashes: &[u64], medium: Medium) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium,
            group_idx: None,
        })
    }

    /// Replays a snapshot into a fresh mirror: the round trip must give the same blocks.
    fn rebuilt(mirror: &ReplicaMirror) -> ReplicaMirror {
        let mut copy = ReplicaMirror::new(usize::MAX);
        for event in mirror.snapshot() {
            copy.apply(&event);
        }
        copy
    }

    #[test]
    fn follows_vllm_semantics_per_medium() {
        let mut mirror = ReplicaMirror::new(100);
        mirror.apply(&stored(&[1, 2, 3], None, Medium::Gpu));
        mirror.apply(&stored(&[2], Some(1), Medium::Cpu));
        mirror.apply(&removed(&[2, 3], Medium::Gpu));
        assert_eq!(mirror.hashes(), vec![1, 2], "2 is still on the CPU");
        mirror.apply(&removed(&[2], Medium::Cpu));
        assert_eq!(mirror.hashes(), vec![1]);
        mirror.apply(&KvEvent::AllBlocksCleared);
        assert!(mirror.is_empty());
    }

    #[test]
    fn duplicate_copies_stay_until_each_is_removed_and_survive_a_snapshot() {
        let mut mirror = ReplicaMirror::new(100);
        mirror.apply(&stored(&[1, 2], None, Medium::Gpu));
        mirror.apply(&stored(&[1, 2], None, Medium::Gpu));
        mirror.apply(&removed(&[2], Medium::Gpu));
        assert_eq!(mirror.hashes(), [1, 2], "one copy of 2 is still held");
        let copy = rebuilt(&mirror);
        assert_eq!(copy.hashes(), [1, 2]);
        let mut copy = copy;
        copy.apply(&removed(&[1], Medium::Gpu));
        assert_eq!(
            copy.hashes(),
            [1, 2],
            "the snapshot carried both copies of 1"
        );
        copy.apply(&removed(&[1, 2], Medium::Gpu));
        assert!(copy.is_empty());
    }

    #[test]
    fn snapshot_puts_parents_first_and_round_trips() {
        let mut mirror = ReplicaMirror::new(100);
        mirror.apply(&stored(&[10, 11], None, Medium::Gpu));
        mirror.apply(&stored(&[12, 13], Some(11), Medium::Gpu));
        mirror.apply(&stored(&[20], Some(11), Medium::Gpu)); // a branch
        mirror.apply(&removed(&[10], Medium::Gpu)); // evicted parent: 11 becomes a root
        mirror.apply(&stored(&[10], None, Medium::Gpu)); // re-stored after its children
        mirror.apply(&stored(&[11], Some(10), Medium::Cpu));

        let snapshot = mirror.snapshot();
        let mut seen: HashSet<u64> = HashSet::new();
        for event in &snapshot {
            let KvEvent::BlockStored(s) = event else {
                panic!("only stores")
            };
            assert_eq!(s.token_ids.len(), s.block_hashes.len() * 2);
            if let Some(parent) = s.parent_block_hash {
                assert!(seen.contains(&parent) || !mirror.blocks.contains_key(&(0, parent)));
            }
            seen.extend(&s.block_hashes);
        }
        let copy = rebuilt(&mirror);
        assert_eq!(copy.blocks, mirror.blocks);
        assert!(
            snapshot.len() < mirror.len() + 2,
            "runs are merged: {snapshot:?}"
        );
    }

    #[test]
    fn cap_refuses_new_blocks_and_forwards_only_what_is_held() {
        let mut mirror = ReplicaMirror::new(2);
        let outcome = mirror.apply(&stored(&[1, 2, 3], None, Medium::Gpu));
        assert_eq!(outcome.refused_blocks, 1);
        assert_eq!(mirror.hashes(), vec![1, 2]);
        let mut index_view = ReplicaMirror::new(usize::MAX);
        for event in &outcome.forward {
            index_view.apply(event);
        }
        assert_eq!(index_view.blocks, mirror.blocks);
        // A known block on another medium is not new: accepted at the cap.
        assert_eq!(
            mirror
                .apply(&stored(&[1], None, Medium::Cpu))
                .refused_blocks,
            0
        );
    }

    #[test]
    fn parent_cycles_from_garbage_do_not_hang() {
        let mut mirror = ReplicaMirror::new(10);
        mirror.apply(&stored(&[1], Some(2), Medium::Gpu));
        mirror.apply(&stored(&[2], Some(1), Medium::Gpu));
        assert_eq!(rebuilt(&mirror).hashes(), vec![1, 2]);
    }

    const BS: u32 = 32;
    const H: [u64; 4] = [101, 102, 103, 104];

    /// Gemma 3's layout, group 0: a 64-token sliding window whose store spans `span` blocks of
    /// tokens and lists only the `kept` ones.
    fn window_stored(kept: &[usize], span: u32) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: kept.iter().map(|&b| H[b]).collect(),
            token_ids: (0..span * BS).collect(),
            block_size: BS,
            group_idx: Some(0),
            cache_kind: Some(CacheKind::SlidingWindow),
            sliding_window: Some(64),
            ..Default::default()
        })
    }

    /// Gemma 3's layout, group 1: full attention, dense, the same hashes as the window's.
    fn full_stored(blocks: std::ops::Range<usize>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: H[blocks.clone()].to_vec(),
            parent_block_hash: blocks.start.checked_sub(1).map(|p| H[p]),
            token_ids: (blocks.start as u32 * BS..blocks.end as u32 * BS).collect(),
            block_size: BS,
            medium,
            group_idx: Some(1),
            cache_kind: Some(CacheKind::FullAttention),
            ..Default::default()
        })
    }

    fn group_removed(blocks: &[usize], group_idx: Option<u32>) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: blocks.iter().map(|&b| H[b]).collect(),
            medium: Medium::Gpu,
            group_idx,
        })
    }

    /// What a fresh vLLM-exact index holds per group once fed `events`.
    fn index_groups(events: &[KvEvent]) -> Vec<(u32, Vec<u64>)> {
        use kvroute_index_core::index::{
            BlockIndex, IndexConfig, IndexMetrics, KvIndex, PoolConfig, PoolKeys, ReplicaId,
        };
        let index = BlockIndex::new(IndexConfig::default(), IndexMetrics::unregistered());
        index
            .add_pool(PoolConfig {
                model: "gemma".to_owned(),
                block_size: BS,
                keys: PoolKeys::VllmExact { validator: None },
                attention_chunk_size: None,
            })
            .unwrap();
        index.add_replica(ReplicaId(0), "r", "gemma").unwrap();
        for event in events {
            index.apply_event(ReplicaId(0), event).unwrap();
        }
        index.replica_group_hashes(ReplicaId(0)).unwrap()
    }

    #[test]
    fn hybrid_groups_are_kept_apart() {
        let mut mirror = ReplicaMirror::new(100);
        mirror.apply(&window_stored(&[2, 3], 4));
        mirror.apply(&full_stored(0..4, Medium::Gpu));
        assert_eq!(mirror.len(), 6, "2 window blocks and 4 full ones");
        assert_eq!(mirror.hashes(), H);
        // The window's blocks carry no tokens (their positions are not published); the full
        // group's are sliced per block.
        assert!(mirror.blocks[&(0, H[2])].tokens.is_empty());
        assert_eq!(
            *mirror.blocks[&(1, H[2])].tokens,
            *(64..96).collect::<Vec<u32>>()
        );
        // Another request's window keeps the same blocks: copies in group 0 only.
        mirror.apply(&window_stored(&[2, 3], 4));
        assert_eq!(mirror.extra_copies.len(), 2);
        assert!(mirror.extra_copies.keys().all(|&(group, _, _)| group == 0));
        // The window drops both copies of block 3: the full group still holds it.
        mirror.apply(&group_removed(&[3], Some(0)));
        mirror.apply(&group_removed(&[3], Some(0)));
        assert!(!mirror.blocks.contains_key(&(0, H[3])));
        assert!(mirror.blocks.contains_key(&(1, H[3])));
        assert_eq!(mirror.len(), 5);
    }

    #[test]
    fn hybrid_snapshot_feeds_the_index_as_the_events_do() {
        let events = [
            window_stored(&[2, 3], 4),
            full_stored(0..4, Medium::Gpu),
            window_stored(&[2, 3], 4),
            group_removed(&[3], Some(0)),
            full_stored(0..1, Medium::Cpu),
            group_removed(&[2], None), // None is group 0
        ];
        let mut mirror = ReplicaMirror::new(100);
        for event in &events {
            assert_eq!(mirror.apply(event).forward, std::slice::from_ref(event));
        }
        let direct = index_groups(&events);
        assert_eq!(direct, [(0, vec![H[2], H[3]]), (1, H.to_vec())]);
        let snapshot = mirror.snapshot();
        assert_eq!(index_groups(&snapshot), direct);
        for event in &snapshot {
            let KvEvent::BlockStored(s) = event else {
                panic!("only stores")
            };
            if s.group_idx == Some(0) {
                assert!(s.token_ids.is_empty() && s.parent_block_hash.is_none());
            }
        }
    }

    #[test]
    fn cap_refusals_stay_exact_per_group() {
        let mut mirror = ReplicaMirror::new(4);
        let mut forward = Vec::new();
        let mut refused = Vec::new();
        for event in [
            window_stored(&[2, 3], 4),
            full_stored(0..4, Medium::Gpu),
            // Block 1 is held in group 1, not group 0: new there, refused; block 2 a copy.
            window_stored(&[1, 2], 4),
        ] {
            let outcome = mirror.apply(&event);
            refused.push(outcome.refused_blocks);
            forward.extend(outcome.forward);
        }
        assert_eq!(refused, [0, 2, 1]);
        let held = [(0, vec![H[2], H[2], H[3]]), (1, vec![H[0], H[1]])];
        assert_eq!(index_groups(&forward), held);
        assert_eq!(index_groups(&mirror.snapshot()), held);
    }
}
