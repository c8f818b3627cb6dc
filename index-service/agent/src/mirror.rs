//! One engine's block set as the agent mirrors it, with enough per block to re-emit it.
//!
//! vLLM semantics: `BlockStored` adds a block on a medium, `BlockRemoved` drops it from that
//! medium (the block is gone once no medium holds it), `AllBlocksCleared` empties everything.
//! Per block the mirror keeps its parent, tokens and keying extras, so [`ReplicaMirror::snapshot`]
//! can re-emit the whole set as `BlockStored` events in chain order (parents before children):
//! what a token-chain pool needs to rebuild its keys after a reset.
//!
//! Bounded: at most `cap` blocks; further **new** blocks are refused (and reported) rather than
//! evicting, the same policy as the index core, so both stay identical.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvroute_block_keys::HashValue;

use kvroute_index_core::event::{BlockStored, CacheKind, EngineHash, KvEvent, Medium};

const MEDIA: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Other];

fn medium_bit(medium: Medium) -> u8 {
    match medium {
        Medium::Gpu => 1,
        Medium::Cpu => 2,
        Medium::Storage => 4,
        Medium::Other => 8,
    }
}

/// What the mirror keeps per block.
#[derive(Debug, Clone, PartialEq)]
struct MirrorBlock {
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
    blocks: HashMap<EngineHash, MirrorBlock>,
    /// Copies of a block beyond the first, by (hash, medium): vLLM can hold several blocks with
    /// one hash and reports each store and eviction. Counted as the index counts them, so the
    /// mirror, its snapshots and the index agree.
    extra_copies: HashMap<(EngineHash, Medium), u32>,
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

    /// Blocks held (in any medium).
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
                for hash in &removed.block_hashes {
                    let copy = (*hash, removed.medium);
                    if let Some(copies) = self.extra_copies.get_mut(&copy) {
                        *copies -= 1;
                        if *copies == 0 {
                            self.extra_copies.remove(&copy);
                        }
                        continue;
                    }
                    if let Some(block) = self.blocks.get_mut(hash) {
                        block.media &= !bit;
                        if block.media == 0 {
                            self.blocks.remove(hash);
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
        let block_size = stored.block_size as usize;
        let lora_name: Option<Arc<str>> = stored.lora_name.as_deref().map(Arc::from);
        let mut accepted = Vec::with_capacity(stored.block_hashes.len());
        let mut refused = 0;
        for (i, &hash) in stored.block_hashes.iter().enumerate() {
            if let Some(block) = self.blocks.get_mut(&hash) {
                if block.media & bit != 0 {
                    *self.extra_copies.entry((hash, stored.medium)).or_insert(0) += 1;
                }
                block.media |= bit;
                accepted.push(i);
                continue;
            }
            if self.blocks.len() >= self.cap {
                refused += 1;
                continue;
            }
            let tokens = stored
                .token_ids
                .get(i * block_size..(i + 1) * block_size)
                .unwrap_or_default();
            let parent = if i == 0 {
                stored.parent_block_hash
            } else {
                stored.block_hashes.get(i - 1).copied()
            };
            let digests = stored.block_digests.as_deref();
            let parent_digest = if i == 0 {
                stored.parent_digest.as_deref()
            } else {
                digests.and_then(|d| d.get(i - 1)).map(Vec::as_slice)
            };
            self.blocks.insert(
                hash,
                MirrorBlock {
                    parent,
                    tokens: tokens.into(),
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
                    digest: digests.and_then(|d| d.get(i)).map(|d| d.as_slice().into()),
                    parent_digest: parent_digest.map(Into::into),
                },
            );
            accepted.push(i);
        }
        let forward = if refused == 0 {
            vec![KvEvent::BlockStored(stored.clone())]
        } else {
            // Forward exactly what the mirror holds, block by block, so index and mirror agree.
            accepted
                .iter()
                .filter_map(|&i| {
                    let hash = *stored.block_hashes.get(i)?;
                    Some(KvEvent::BlockStored(self.single(
                        hash,
                        self.blocks.get(&hash)?,
                        stored.medium,
                    )))
                })
                .collect()
        };
        MirrorOutcome {
            forward,
            refused_blocks: refused,
        }
    }

    /// A one-block `BlockStored` for `hash` on `medium`.
    fn single(&self, hash: EngineHash, block: &MirrorBlock, medium: Medium) -> BlockStored {
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
        }
    }

    /// Every held block as `BlockStored` events, parents before children, consecutive chain
    /// blocks merged into one event per run and medium.
    pub fn snapshot(&self) -> Vec<KvEvent> {
        let order = self.chain_order();
        let any_extra_keys = self.blocks.values().any(has_extra_keys);
        let mut events = Vec::new();
        for medium in MEDIA {
            let bit = medium_bit(medium);
            let mut run: Option<(BlockStored, EngineHash, &MirrorBlock)> = None;
            for &hash in &order {
                let Some(block) = self.blocks.get(&hash) else {
                    continue;
                };
                if block.media & bit == 0 {
                    continue;
                }
                match &mut run {
                    Some((stored, last, last_block))
                        if block.parent == Some(*last) && last_block.same_run_attributes(block) =>
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
                        let mut stored = self.single(hash, block, medium);
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
        // Duplicate copies after every first copy, so the receiver counts them as copies.
        let mut copies: Vec<_> = self.extra_copies.iter().collect();
        copies.sort_unstable_by_key(|((hash, medium), _)| (*hash, medium_bit(*medium)));
        for (&(hash, medium), &count) in copies {
            if let Some(block) = self.blocks.get(&hash) {
                for _ in 0..count {
                    events.push(KvEvent::BlockStored(self.single(hash, block, medium)));
                }
            }
        }
        events
    }

    /// Held hashes ordered so that every block comes after its parent (when the parent is held).
    fn chain_order(&self) -> Vec<EngineHash> {
        let mut order = Vec::with_capacity(self.blocks.len());
        let mut visited: HashSet<EngineHash> = HashSet::with_capacity(self.blocks.len());
        let mut chain = Vec::new();
        let mut roots: Vec<EngineHash> = self.blocks.keys().copied().collect();
        roots.sort_unstable(); // deterministic output
        for start in roots {
            let mut hash = start;
            // Walk up to the first ancestor already placed (or not held); `visited` also stops
            // a cycle that garbage hashes could form.
            while visited.insert(hash) {
                chain.push(hash);
                match self.blocks.get(&hash).and_then(|b| b.parent) {
                    Some(parent) if self.blocks.contains_key(&parent) => hash = parent,
                    _ => break,
                }
            }
            order.extend(chain.drain(..).rev());
        }
        order
    }

    /// Held hashes (sorted), for debugging and tests.
    pub fn hashes(&self) -> Vec<EngineHash> {
        let mut hashes: Vec<_> = self.blocks.keys().copied().collect();
        hashes.sort_unstable();
        hashes
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
                assert!(seen.contains(&parent) || !mirror.blocks.contains_key(&parent));
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
}
