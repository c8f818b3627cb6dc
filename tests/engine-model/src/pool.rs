//! The KV block pool, with vLLM v1's prefix-caching semantics (`vllm/v1/core/block_pool.py`).
//!
//! - A fixed number of blocks. A block is in use (`ref_cnt > 0`, pinned by running requests) or
//!   in the free queue ([`LruQueue`]), least recently freed first.
//! - A full block gets its chained key when it is cached; a later request whose prompt starts
//!   with the same keys reuses it. As in vLLM, two blocks can carry the same key (identical
//!   prompts scheduled before either was cached); a lookup takes the first.
//! - A cached block in the free queue keeps its key and is revived (taken out of the queue) on a
//!   hit; it is evicted only when a new block is needed and it is at the head of the queue. Each
//!   eviction publishes one `BlockRemoved` with one hash, as vLLM does.
//! - A request frees its blocks tail first, so a prompt's last blocks are evicted before its
//!   first.
//!
//! Events accumulate in the pool until [`BlockPool::take_events`] (one engine step's batch).

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;

use kvroute_block_keys::{Digest, HashValue};
use kvroute_index_core::event::{BlockRemoved, BlockStored, KvEvent, Medium};

use crate::lru::LruQueue;

/// Index of a block in the pool.
pub type BlockId = usize;

/// A block's chained key: what the pool looks prefixes up by and what its events publish.
pub trait BlockKey: Copy + Eq + Hash + Debug {
    /// The hash as published in KV events (vLLM's u64 form).
    fn published(&self) -> u64;
}

/// Keys that are already the published hash (trace-derived keys).
impl BlockKey for u64 {
    fn published(&self) -> u64 {
        *self
    }
}

/// vLLM's chained digests, published as their u64 form.
impl BlockKey for Digest {
    fn published(&self) -> u64 {
        self.published_u64()
    }
}

#[derive(Debug, Clone)]
struct Block<K> {
    ref_cnt: u32,
    key: Option<K>,
}

/// A cached block as a debug view lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldBlock {
    /// The published hash.
    pub hash: u64,
    /// Requests pinning it (0: evictable).
    pub ref_cnt: u32,
}

/// The pool.
#[derive(Debug, Clone)]
pub struct BlockPool<K> {
    block_size: usize,
    blocks: Vec<Block<K>>,
    cached: HashMap<K, Vec<BlockId>>,
    free: LruQueue,
    events: Vec<KvEvent>,
}

impl<K: BlockKey> BlockPool<K> {
    /// `num_blocks` empty blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut free = LruQueue::new();
        for id in 0..num_blocks {
            free.push_back(id);
        }
        BlockPool {
            block_size,
            blocks: vec![
                Block {
                    ref_cnt: 0,
                    key: None
                };
                num_blocks
            ],
            cached: HashMap::new(),
            free,
            events: Vec::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with no reference (cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// `vllm:kv_cache_usage_perc`: the fraction of blocks in use (0..=1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    /// The block holding `key`, if cached (the first of duplicates).
    pub fn lookup(&self, key: &K) -> Option<BlockId> {
        self.cached.get(key).and_then(|ids| ids.first().copied())
    }

    /// Leading `keys` found cached, at most `max_blocks` (vLLM always recomputes the last prompt
    /// token, so a caller passes `(prompt_len - 1) / block_size`).
    pub fn prefix_hits(&self, keys: &[K], max_blocks: usize) -> Vec<BlockId> {
        keys.iter()
            .take(max_blocks)
            .map_while(|key| self.lookup(key))
            .collect()
    }

    /// Whether `id` is in the free queue (so pinning it consumes a free block).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.free.contains(id)
    }

    /// Pins a cached block, reviving it from the free queue.
    pub fn touch(&mut self, id: BlockId) {
        self.free.remove(id);
        if let Some(block) = self.blocks.get_mut(id) {
            block.ref_cnt += 1;
        }
    }

    /// A new block (reference count 1): the least recently freed, its key evicted (and
    /// published). `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = self.free.pop_front()?;
        self.evict(id);
        self.blocks[id].ref_cnt = 1;
        Some(id)
    }

    /// Gives `blocks[start..end]` the keys `keys[start..end]` and publishes one `BlockStored`
    /// (parent = the key of block `start - 1`). `tokens`, when known, are the sequence's token
    /// ids (at least `end × block_size`); unknown tokens are published as zeros. `extra_keys`,
    /// when given, are the sequence's per-block extra keys in their published form (images;
    /// blocks past its end have none), as vLLM 0.32 publishes them beside the hashes.
    pub fn cache_blocks(
        &mut self,
        blocks: &[BlockId],
        keys: &[K],
        start: usize,
        end: usize,
        tokens: Option<&[u32]>,
        extra_keys: Option<&[Option<HashValue>]>,
    ) {
        if start >= end {
            return;
        }
        for i in start..end {
            let id = blocks[i];
            self.blocks[id].key = Some(keys[i]);
            self.cached.entry(keys[i]).or_default().push(id);
        }
        let bs = self.block_size;
        let token_ids = match tokens {
            Some(tokens) => tokens[start * bs..end * bs].to_vec(),
            None => vec![0; (end - start) * bs],
        };
        self.events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: keys[start..end].iter().map(BlockKey::published).collect(),
            parent_block_hash: start.checked_sub(1).map(|p| keys[p].published()),
            token_ids,
            block_size: bs as u32,
            medium: Medium::Gpu,
            extra_keys: Some(
                (start..end)
                    .map(|i| extra_keys.and_then(|keys| keys.get(i)).cloned().flatten())
                    .collect(),
            ),
            group_idx: Some(0),
            ..BlockStored::default()
        }));
    }

    /// Releases a request's blocks, tail first.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let Some(block) = self.blocks.get_mut(id) else {
                continue;
            };
            if block.ref_cnt == 0 {
                continue;
            }
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.free.push_back(id);
            }
        }
    }

    /// `reset_prefix_cache`: drops every key if no block is in use (else `false`, as vLLM),
    /// publishing `AllBlocksCleared`.
    pub fn reset(&mut self) -> bool {
        if self.free.len() != self.blocks.len() {
            return false;
        }
        for block in &mut self.blocks {
            block.key = None;
        }
        self.cached.clear();
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Every block that carries a key, in block order.
    pub fn held_blocks(&self) -> Vec<HeldBlock> {
        self.blocks
            .iter()
            .filter_map(|block| {
                block.key.map(|key| HeldBlock {
                    hash: key.published(),
                    ref_cnt: block.ref_cnt,
                })
            })
            .collect()
    }

    /// The events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Drops the key of a block taken from the free queue for reuse.
    fn evict(&mut self, id: BlockId) {
        let Some(key) = self.blocks[id].key.take() else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&key) {
            ids.retain(|&other| other != id);
            if ids.is_empty() {
                self.cached.remove(&key);
            }
        }
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![key.published()],
            medium: Medium::Gpu,
            group_idx: Some(0),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn stores_publish_the_blocks_extra_keys() {
        let mut pool = BlockPool::<u64>::new(4, 2);
        let blocks: Vec<BlockId> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        let image = Some(HashValue::Tuple(vec![HashValue::Tuple(vec![
            HashValue::Str("h".into()),
            HashValue::Int(1),
        ])]));
        // Keys for blocks 0 and 1 only: block 2 has none.
        let extra = [None, image.clone()];
        pool.cache_blocks(&blocks, &[1, 2, 3], 1, 3, None, Some(&extra));
        let stored = pool.take_events();
        assert!(matches!(&stored[..], [KvEvent::BlockStored(s)]
            if s.extra_keys == Some(vec![image.clone(), None])));
    }

    #[test]
    fn hits_revive_and_lru_evicts_tail_first() {
        let mut pool = BlockPool::<u64>::new(4, 2);
        let keys = [10, 11];
        let tokens = [1, 2, 3, 4, 5];
        let first: Vec<BlockId> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        pool.cache_blocks(&first, &keys, 0, 2, Some(&tokens), None);
        let stored = pool.take_events();
        assert!(matches!(&stored[..], [KvEvent::BlockStored(s)]
            if s.block_hashes == keys && s.token_ids == tokens[..4] && s.parent_block_hash.is_none()));
        assert_eq!(pool.usage(), 0.75);
        pool.free(&first);
        assert_eq!(pool.usage(), 0.0);

        // Same prompt of 5 tokens: both blocks hit (4 of 5 tokens) and leave the free queue.
        let hits = pool.prefix_hits(&keys, (5 - 1) / 2);
        assert_eq!(hits, first[..2]);
        let revived = hits.iter().filter(|&&b| pool.is_free(b)).count();
        assert_eq!(revived, 2);
        for &b in &hits {
            pool.touch(b);
        }
        assert_eq!(pool.free_blocks(), 2);
        pool.free(&hits);

        // Filling the pool evicts the least recently freed: tail blocks before head blocks.
        let _empty_first = pool.allocate().unwrap();
        let _third_block = pool.allocate().unwrap();
        assert!(
            pool.take_events().is_empty(),
            "two uncached blocks went first"
        );
        let _ = pool.allocate().unwrap();
        assert_eq!(removed(&pool.take_events()), [11]);
        assert_eq!(pool.lookup(&10), Some(first[0]));
    }

    #[test]
    fn duplicates_are_cached_and_each_eviction_is_published() {
        let mut pool = BlockPool::<u64>::new(2, 1);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        pool.cache_blocks(&[a], &[7], 0, 1, None, None);
        pool.cache_blocks(&[b], &[7], 0, 1, None, None);
        assert_eq!(pool.lookup(&7), Some(a));
        assert_eq!(pool.held_blocks().len(), 2);
        pool.free(&[a]);
        pool.free(&[b]);
        let _ = pool.take_events();
        let _ = pool.allocate().unwrap();
        assert_eq!(removed(&pool.take_events()), [7]);
        assert_eq!(pool.lookup(&7), Some(b), "the other copy still answers");
        assert!(pool.allocate().is_some());
        assert!(pool.allocate().is_none());
    }

    #[test]
    fn reset_only_when_idle() {
        let mut pool = BlockPool::<u64>::new(2, 2);
        let id = pool.allocate().unwrap();
        pool.cache_blocks(&[id], &[1], 0, 1, None, None);
        assert!(!pool.reset());
        pool.free(&[id]);
        assert!(pool.reset());
        assert_eq!(pool.take_events().last(), Some(&KvEvent::AllBlocksCleared));
        assert!(pool.held_blocks().is_empty());
        assert!(pool.prefix_hits(&[1], 1).is_empty());
    }
}
