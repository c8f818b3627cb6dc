//! A KV block pool with vLLM's prefix-caching semantics (`vllm/v1/core/block_pool.py`).
//!
//! - A fixed number of blocks. A block is either in use (`ref_cnt > 0`, pinned by running
//!   requests) or in the free queue, ordered least recently freed first.
//! - A full block gets its chained hash when it is computed; `cached` maps hash → blocks so a
//!   later request whose prompt starts with the same blocks reuses them. Like vLLM, two blocks can
//!   carry the same hash when identical prompts ran concurrently.
//! - A cached block in the free queue keeps its hash and is revived (taken out of the queue) on a
//!   hit; it is evicted only when a new block is needed and it is at the head of the queue. Its
//!   eviction publishes `BlockRemoved` (one hash per event, as vLLM does).
//! - A request frees its blocks tail first, so a prompt's last blocks are evicted before its first.

use std::collections::{BTreeMap, HashMap};

use kvroute_block_keys::Digest;
use kvroute_index::event::{BlockRemoved, BlockStored, KvEvent, Medium};

/// Index of a block in the pool.
pub type BlockId = usize;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    hash: Option<Digest>,
    /// Position in the free queue while `ref_cnt == 0`.
    free_tick: Option<u64>,
}

/// Blocks granted to a request at admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The request's blocks in sequence order: the prefix hits first, then new blocks.
    pub blocks: Vec<BlockId>,
    /// How many leading blocks were prefix-cache hits.
    pub hit_blocks: usize,
}

/// A cached block as the debug endpoint lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeldBlock {
    /// The hash as published in events (vLLM's u64 form).
    pub hash: u64,
    /// `"GPU"`, as vLLM's block pool reports.
    pub medium: String,
    /// Requests pinning it (0: evictable).
    pub ref_cnt: u32,
}

/// The block pool.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    blocks: Vec<Block>,
    cached: HashMap<Digest, Vec<BlockId>>,
    /// Free queue: tick → block, smallest tick evicted first.
    free: BTreeMap<u64, BlockId>,
    next_tick: u64,
}

impl KvCache {
    /// `num_blocks` usable blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut cache = Self {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            cached: HashMap::new(),
            free: BTreeMap::new(),
            next_tick: 0,
        };
        for id in 0..num_blocks {
            cache.push_free(id);
        }
        cache
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// `vllm:kv_cache_usage_perc`: the fraction of blocks in use (0..=1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    /// Leading blocks of `digests` that are cached. As in vLLM, the last prompt token is always
    /// recomputed, so hits cover at most `prompt_len - 1` tokens.
    pub fn prefix_hits(&self, digests: &[Digest], prompt_len: usize) -> usize {
        let max_hit_blocks = prompt_len.saturating_sub(1) / self.block_size;
        digests
            .iter()
            .take(max_hit_blocks)
            .take_while(|digest| self.cached.contains_key(digest))
            .count()
    }

    /// Grants `total_blocks` blocks to a request whose prompt has `prompt_len` tokens and the
    /// given full-block digests, reusing cached prefix blocks; `None` if not enough are free.
    /// Evictions are appended to `events`.
    pub fn allocate(
        &mut self,
        digests: &[Digest],
        prompt_len: usize,
        total_blocks: usize,
        events: &mut Vec<KvEvent>,
    ) -> Option<Allocation> {
        let hit_blocks = self.prefix_hits(digests, prompt_len).min(total_blocks);
        let hits: Vec<BlockId> = digests[..hit_blocks]
            .iter()
            .filter_map(|digest| self.cached.get(digest).and_then(|ids| ids.first().copied()))
            .collect();
        let revived = hits
            .iter()
            .filter(|&&id| self.blocks[id].ref_cnt == 0)
            .count();
        let new_blocks = total_blocks - hit_blocks;
        if new_blocks > self.free.len() - revived {
            return None;
        }
        for &id in &hits {
            self.touch(id);
        }
        let mut blocks = hits;
        for _ in 0..new_blocks {
            let (_, id) = self.free.pop_first()?;
            self.evict(id, events);
            let block = &mut self.blocks[id];
            block.free_tick = None;
            block.ref_cnt = 1;
            blocks.push(id);
        }
        Some(Allocation { blocks, hit_blocks })
    }

    /// Marks `blocks[start..end]` computed: they get `digests[start..end]` and one `BlockStored`
    /// event (parent = the published hash of block `start - 1`, tokens = the blocks' tokens).
    pub fn cache_blocks(
        &mut self,
        blocks: &[BlockId],
        digests: &[Digest],
        start: usize,
        end: usize,
        tokens: &[u32],
        events: &mut Vec<KvEvent>,
    ) {
        if start >= end {
            return;
        }
        for i in start..end {
            let id = blocks[i];
            self.blocks[id].hash = Some(digests[i]);
            self.cached.entry(digests[i]).or_default().push(id);
        }
        let bs = self.block_size;
        events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: digests[start..end]
                .iter()
                .map(Digest::published_u64)
                .collect(),
            parent_block_hash: start.checked_sub(1).map(|p| digests[p].published_u64()),
            token_ids: tokens[start * bs..end * bs].to_vec(),
            block_size: bs as u32,
            medium: Medium::Gpu,
            extra_keys: Some(vec![None; end - start]),
            group_idx: Some(0),
            ..BlockStored::default()
        }));
    }

    /// Releases a finished request's blocks, tail first.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let block = &mut self.blocks[id];
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 {
                self.push_free(id);
            }
        }
    }

    /// `reset_prefix_cache`: drops every hash if no block is in use (else `false`, as vLLM).
    pub fn reset(&mut self, events: &mut Vec<KvEvent>) -> bool {
        if self.free.len() != self.blocks.len() {
            return false;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Every block that carries a hash, in block order.
    pub fn held_blocks(&self) -> Vec<HeldBlock> {
        self.blocks
            .iter()
            .filter_map(|block| {
                block.hash.map(|digest| HeldBlock {
                    hash: digest.published_u64(),
                    medium: "GPU".to_owned(),
                    ref_cnt: block.ref_cnt,
                })
            })
            .collect()
    }

    fn push_free(&mut self, id: BlockId) {
        let tick = self.next_tick;
        self.next_tick += 1;
        self.free.insert(tick, id);
        self.blocks[id].free_tick = Some(tick);
    }

    /// Pins a hit block, reviving it from the free queue.
    fn touch(&mut self, id: BlockId) {
        let block = &mut self.blocks[id];
        if let Some(tick) = block.free_tick.take() {
            self.free.remove(&tick);
        }
        block.ref_cnt += 1;
    }

    /// Drops the hash of a block taken from the free queue for reuse.
    fn evict(&mut self, id: BlockId, events: &mut Vec<KvEvent>) {
        let Some(digest) = self.blocks[id].hash.take() else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&digest) {
            ids.retain(|&other| other != id);
            if ids.is_empty() {
                self.cached.remove(&digest);
            }
        }
        events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![digest.published_u64()],
            medium: Medium::Gpu,
            group_idx: Some(0),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        Digest::from_slice(&[n; 32]).unwrap()
    }

    fn removed(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some(r.block_hashes[0]),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn hits_revive_and_lru_evicts_tail_first() {
        let mut cache = KvCache::new(4, 2);
        let mut events = Vec::new();
        let a = [digest(1), digest(2)];
        let tokens = [1, 2, 3, 4, 5];
        let first = cache.allocate(&a, 5, 3, &mut events).unwrap();
        assert_eq!(first.hit_blocks, 0);
        cache.cache_blocks(&first.blocks, &a, 0, 2, &tokens, &mut events);
        assert_eq!(cache.usage(), 0.75);
        cache.free(&first.blocks);
        assert_eq!(cache.usage(), 0.0);

        // Same prompt: both blocks hit (4 of 5 tokens) and leave the free queue.
        let second = cache.allocate(&a, 5, 3, &mut events).unwrap();
        assert_eq!(second.hit_blocks, 2);
        assert_eq!(second.blocks[..2], first.blocks[..2]);
        cache.free(&second.blocks);

        // A 4-token prompt equal to the cached blocks recomputes its last token: one hit.
        assert_eq!(cache.prefix_hits(&a, 4), 1);

        // Filling the cache evicts the least recently freed: tail blocks before head blocks.
        events.clear();
        let other = cache.allocate(&[], 8, 3, &mut events).unwrap();
        assert_eq!(other.hit_blocks, 0);
        assert_eq!(removed(&events), [digest(2).published_u64()]);
        assert!(
            cache.allocate(&[], 8, 2, &mut events).is_none(),
            "only one block is free"
        );
    }

    #[test]
    fn reset_only_when_idle() {
        let mut cache = KvCache::new(2, 2);
        let mut events = Vec::new();
        let alloc = cache.allocate(&[digest(1)], 3, 2, &mut events).unwrap();
        cache.cache_blocks(&alloc.blocks, &[digest(1)], 0, 1, &[7, 8, 9], &mut events);
        assert!(!cache.reset(&mut events));
        cache.free(&alloc.blocks);
        assert_eq!(cache.held_blocks().len(), 1);
        assert!(cache.reset(&mut events));
        assert_eq!(events.last(), Some(&KvEvent::AllBlocksCleared));
        assert!(cache.held_blocks().is_empty());
        assert_eq!(cache.prefix_hits(&[digest(1)], 3), 0);
    }
}
