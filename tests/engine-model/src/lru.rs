//! The LRU queue: dense ids in least-recently-pushed order, O(1) push, pop and removal by id
//! (a doubly linked list over arrays, as vLLM's `FreeKVCacheBlockQueue`). The block pool's free
//! queue is one; [`KeyLru`] (a bounded set of keys, for router-side prefix memories and cache
//! bounds) is one over key slots.

use std::collections::HashMap;

/// No id (end of the list).
const NIL: u32 = u32::MAX;

/// Ids `0..` in the order they were pushed; grows as larger ids are pushed.
#[derive(Debug, Clone, Default)]
pub struct LruQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruQueue {
    /// An empty queue.
    pub fn new() -> Self {
        LruQueue {
            head: NIL,
            tail: NIL,
            ..LruQueue::default()
        }
    }

    /// Ids queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `id` is queued.
    pub fn contains(&self, id: usize) -> bool {
        self.linked.get(id).copied().unwrap_or(false)
    }

    /// Queues `id` as the most recent (moving it there if already queued).
    pub fn push_back(&mut self, id: usize) {
        if self.contains(id) {
            self.remove(id);
        }
        if id >= self.linked.len() {
            self.prev.resize(id + 1, NIL);
            self.next.resize(id + 1, NIL);
            self.linked.resize(id + 1, false);
        }
        let raw = id as u32;
        self.prev[id] = self.tail;
        self.next[id] = NIL;
        if self.tail == NIL {
            self.head = raw;
        } else {
            self.next[self.tail as usize] = raw;
        }
        self.tail = raw;
        self.linked[id] = true;
        self.len += 1;
    }

    /// Takes the least recent id out.
    pub fn pop_front(&mut self) -> Option<usize> {
        if self.head == NIL {
            return None;
        }
        let id = self.head as usize;
        self.remove(id);
        Some(id)
    }

    /// Takes `id` out; false if it was not queued.
    pub fn remove(&mut self, id: usize) -> bool {
        if !self.contains(id) {
            return false;
        }
        let (prev, next) = (self.prev[id], self.next[id]);
        if prev == NIL {
            self.head = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        self.prev[id] = NIL;
        self.next[id] = NIL;
        self.linked[id] = false;
        self.len -= 1;
        true
    }
}

/// A bounded set of `u64` keys evicting the least recently touched.
#[derive(Debug, Clone)]
pub struct KeyLru {
    capacity: usize,
    slots: HashMap<u64, usize>,
    keys: Vec<u64>,
    spare: Vec<usize>,
    order: LruQueue,
}

impl KeyLru {
    /// Holds at most `capacity` keys (`usize::MAX`: unbounded).
    pub fn new(capacity: usize) -> Self {
        KeyLru {
            capacity,
            slots: HashMap::new(),
            keys: Vec::new(),
            spare: Vec::new(),
            order: LruQueue::new(),
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether `key` is held (does not refresh it).
    pub fn contains(&self, key: u64) -> bool {
        self.slots.contains_key(&key)
    }

    /// Inserts or refreshes `key` as most recent; returns the evicted key, if any.
    pub fn touch(&mut self, key: u64) -> Option<u64> {
        if let Some(&slot) = self.slots.get(&key) {
            self.order.push_back(slot);
            return None;
        }
        let slot = match self.spare.pop() {
            Some(slot) => {
                self.keys[slot] = key;
                slot
            }
            None => {
                self.keys.push(key);
                self.keys.len() - 1
            }
        };
        self.slots.insert(key, slot);
        self.order.push_back(slot);
        if self.slots.len() > self.capacity {
            let oldest = self.order.pop_front()?;
            let evicted = self.keys[oldest];
            self.slots.remove(&evicted);
            self.spare.push(oldest);
            return Some(evicted);
        }
        None
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: u64) {
        if let Some(slot) = self.slots.remove(&key) {
            self.order.remove(slot);
            self.spare.push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_pops_in_push_order_and_removes_from_the_middle() {
        let mut queue = LruQueue::new();
        for id in [3, 0, 5, 1] {
            queue.push_back(id);
        }
        assert!(queue.remove(5) && !queue.remove(5));
        queue.push_back(3);
        assert_eq!(queue.len(), 3);
        let order: Vec<usize> = std::iter::from_fn(|| queue.pop_front()).collect();
        assert_eq!(order, [0, 1, 3]);
        assert!(queue.is_empty() && !queue.contains(0));
    }

    #[test]
    fn key_set_evicts_least_recent() {
        let mut lru = KeyLru::new(2);
        assert_eq!(lru.touch(1), None);
        assert_eq!(lru.touch(2), None);
        assert_eq!(lru.touch(1), None);
        assert_eq!(lru.touch(3), Some(2));
        assert!(lru.contains(1) && lru.contains(3) && !lru.contains(2));
        lru.remove(1);
        assert_eq!(lru.len(), 1);
        assert_eq!(lru.touch(4), None);
        assert_eq!(lru.touch(5), Some(3));
    }
}
