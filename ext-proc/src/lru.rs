//! A small bounded LRU map (O(log n) per operation), used by the token cache: bounded by entry
//! count and by the bytes its entries account for (the caller says what an entry weighs).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Least-recently-used map bounded by entries and by bytes.
#[derive(Debug)]
pub(crate) struct Lru<K, V> {
    max_entries: usize,
    max_bytes: usize,
    bytes: usize,
    tick: u64,
    /// Value, last-use tick, weight in bytes.
    entries: HashMap<K, (V, u64, usize)>,
    by_age: BTreeMap<u64, K>,
}

impl<K: Hash + Eq + Clone, V> Lru<K, V> {
    pub(crate) fn new(max_entries: usize, max_bytes: usize) -> Self {
        Self {
            max_entries: max_entries.max(1),
            max_bytes,
            bytes: 0,
            tick: 0,
            entries: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes the entries account for (at most `max_bytes`).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Looks up and marks as recently used.
    pub(crate) fn get(&mut self, key: &K) -> Option<&V> {
        self.tick += 1;
        let tick = self.tick;
        let (value, age, _) = self.entries.get_mut(key)?;
        self.by_age.remove(age);
        *age = tick;
        self.by_age.insert(tick, key.clone());
        Some(value)
    }

    /// Whether `key` is held (recency unchanged).
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Looks up without changing recency.
    #[cfg(test)]
    pub(crate) fn peek(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(v, _, _)| v)
    }

    /// Inserts or replaces an entry weighing `bytes`, evicting least recently used entries until
    /// both bounds hold. An entry heavier than the whole byte bound is not kept (and whatever
    /// the key held before goes); returns whether it was.
    pub(crate) fn insert(&mut self, key: K, value: V, bytes: usize) -> bool {
        self.remove(&key);
        if bytes > self.max_bytes {
            return false;
        }
        while self.entries.len() >= self.max_entries || self.bytes + bytes > self.max_bytes {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            if let Some((_, _, weight)) = self.entries.remove(&oldest) {
                self.bytes -= weight;
            }
        }
        self.tick += 1;
        self.by_age.insert(self.tick, key.clone());
        self.entries.insert(key, (value, self.tick, bytes));
        self.bytes += bytes;
        true
    }

    fn remove(&mut self, key: &K) {
        if let Some((_, age, weight)) = self.entries.remove(key) {
            self.by_age.remove(&age);
            self.bytes -= weight;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut lru = Lru::new(2, usize::MAX);
        lru.insert(1, "a", 1);
        lru.insert(2, "b", 1);
        assert_eq!(lru.get(&1), Some(&"a"));
        lru.insert(3, "c", 1);
        assert_eq!(lru.peek(&2), None, "2 was least recently used");
        assert_eq!(lru.peek(&1), Some(&"a"));
        assert_eq!(lru.len(), 2);
        lru.insert(1, "z", 1);
        assert_eq!(lru.get(&1), Some(&"z"));
        assert_eq!(lru.len(), 2);
    }

    #[test]
    fn bytes_bound_evicts_by_weight_and_refuses_what_cannot_fit() {
        let mut lru = Lru::new(100, 10);
        assert!(lru.insert(1, "a", 4));
        assert!(lru.insert(2, "b", 4));
        assert_eq!(lru.get(&1), Some(&"a"));
        // 8 + 4 > 10: the least recently used (2) goes, 1 stays.
        assert!(lru.insert(3, "c", 4));
        assert_eq!((lru.peek(&2), lru.bytes()), (None, 8));
        // Replacing an entry re-weighs it.
        assert!(lru.insert(1, "A", 6));
        assert_eq!((lru.len(), lru.bytes()), (2, 10));
        // Heavier than the whole bound: not kept, and the key's old value is gone too.
        assert!(!lru.insert(3, "huge", 11));
        assert_eq!(
            (lru.peek(&3), lru.peek(&1), lru.bytes()),
            (None, Some(&"A"), 6)
        );
        // One entry filling the bound evicts everything else.
        assert!(lru.insert(4, "d", 10));
        assert_eq!((lru.len(), lru.bytes()), (1, 10));
    }
}
