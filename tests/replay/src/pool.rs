//! A vLLM-style KV block pool (vLLM v1's `BlockPool` and `FreeKVCacheBlockQueue`).
//!
//! - `capacity` blocks, each with a reference count; a running request pins its blocks.
//! - Blocks with no reference sit in a free queue ordered from least to most recently freed.
//!   A free block may still hold a cached key: a prefix hit on it takes it back out of the queue
//!   (revival).
//! - Allocation pops the queue's head; if that block held a key the key is evicted (and
//!   reported, as vLLM publishes `BlockRemoved`).
//! - A request frees its blocks last-first, so its tail is evicted before its prefix.

use std::collections::HashMap;

/// No block (end of the free queue).
const NIL: u32 = u32::MAX;

/// Index of a block in the pool.
pub type BlockId = u32;

#[derive(Debug, Clone)]
struct Block {
    key: Option<u64>,
    refs: u32,
    prev: u32,
    next: u32,
}

/// The pool.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    free: usize,
    cached: HashMap<u64, BlockId>,
}

impl BlockPool {
    /// A pool of `capacity` empty blocks, all free.
    pub fn new(capacity: u32) -> Self {
        let blocks = (0..capacity)
            .map(|i| Block {
                key: None,
                refs: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == capacity { NIL } else { i + 1 },
            })
            .collect();
        BlockPool {
            blocks,
            head: if capacity == 0 { NIL } else { 0 },
            tail: capacity.checked_sub(1).unwrap_or(NIL),
            free: capacity as usize,
            cached: HashMap::new(),
        }
    }

    /// Total blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with no reference (cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.free
    }

    /// Share of blocks in use (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free as f64 / self.blocks.len() as f64
    }

    /// The block holding `key`, if cached.
    pub fn lookup(&self, key: u64) -> Option<BlockId> {
        self.cached.get(&key).copied()
    }

    /// Whether `id` is in the free queue (so a hit on it consumes a free block).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.refs == 0)
    }

    /// Takes a reference on a cached block, reviving it from the free queue.
    pub fn touch(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return;
        };
        block.refs += 1;
        if block.refs == 1 {
            self.unlink(id);
        }
    }

    /// Allocates a block (reference count 1), evicting the least recently freed one. An evicted
    /// key is pushed to `evicted`. `None` when every block is in use.
    pub fn allocate(&mut self, evicted: &mut Vec<u64>) -> Option<BlockId> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let block = &mut self.blocks[id as usize];
        block.refs = 1;
        if let Some(key) = block.key.take() {
            self.cached.remove(&key);
            evicted.push(key);
        }
        Some(id)
    }

    /// Gives `key` to a full, computed block. False (block left uncached) when another block
    /// already holds the key, as vLLM keeps only the first copy.
    pub fn cache(&mut self, id: BlockId, key: u64) -> bool {
        if self.cached.contains_key(&key) || self.blocks.get(id as usize).is_none() {
            return false;
        }
        self.blocks[id as usize].key = Some(key);
        self.cached.insert(key, id);
        true
    }

    /// Drops a reference; at zero the block joins the free queue's tail.
    pub fn release(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return;
        };
        if block.refs == 0 {
            return;
        }
        block.refs -= 1;
        if block.refs == 0 {
            self.push_tail(id);
        }
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        self.free -= 1;
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_eviction_revival_and_pinning() {
        let mut pool = BlockPool::new(3);
        let mut evicted = Vec::new();
        let a = pool.allocate(&mut evicted).unwrap();
        let b = pool.allocate(&mut evicted).unwrap();
        assert!(pool.cache(a, 10) && pool.cache(b, 11));
        assert!(!pool.cache(b, 10), "duplicate key stays uncached");
        assert!((pool.usage() - 2.0 / 3.0).abs() < 1e-12);
        // Freed last-first: b is older than a in the free queue.
        pool.release(b);
        pool.release(a);
        // Revive a (hit), then allocate two: the empty block, then b is evicted.
        pool.touch(pool.lookup(10).unwrap());
        let c = pool.allocate(&mut evicted).unwrap();
        assert!(evicted.is_empty());
        let d = pool.allocate(&mut evicted).unwrap();
        assert_eq!((d, evicted.as_slice()), (b, &[11][..]));
        assert_ne!(c, a);
        // Everything pinned: nothing to allocate.
        assert!(pool.allocate(&mut evicted).is_none());
        assert_eq!(pool.free_blocks(), 0);
        assert_eq!(pool.lookup(10), Some(a));
    }
}
