//! A bounded set of block keys evicting the least recently used: router-side prefix memories
//! (SGLang's tree, llm-d's index) and the cache bounds.

use std::collections::{BTreeMap, HashMap};

/// The set.
#[derive(Debug, Clone)]
pub struct KeyLru {
    capacity: usize,
    clock: u64,
    stamps: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl KeyLru {
    /// Holds at most `capacity` keys (`usize::MAX`: unbounded).
    pub fn new(capacity: usize) -> Self {
        KeyLru {
            capacity,
            clock: 0,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Whether `key` is held (does not refresh it).
    pub fn contains(&self, key: u64) -> bool {
        self.stamps.contains_key(&key)
    }

    /// Inserts or refreshes `key` as most recent; returns the evicted key, if any.
    pub fn touch(&mut self, key: u64) -> Option<u64> {
        self.clock += 1;
        if let Some(old) = self.stamps.insert(key, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, key);
        if self.stamps.len() > self.capacity {
            let (_, oldest) = self.order.pop_first()?;
            self.stamps.remove(&oldest);
            return Some(oldest);
        }
        None
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: u64) {
        if let Some(stamp) = self.stamps.remove(&key) {
            self.order.remove(&stamp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent() {
        let mut lru = KeyLru::new(2);
        assert_eq!(lru.touch(1), None);
        assert_eq!(lru.touch(2), None);
        assert_eq!(lru.touch(1), None);
        assert_eq!(lru.touch(3), Some(2));
        assert!(lru.contains(1) && lru.contains(3) && !lru.contains(2));
        lru.remove(1);
        assert_eq!(lru.len(), 1);
    }
}
