//! A small bounded LRU map (O(log n) per operation), used by the token cache.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Least-recently-used map with a fixed capacity.
#[derive(Debug)]
pub(crate) struct Lru<K, V> {
    capacity: usize,
    tick: u64,
    entries: HashMap<K, (V, u64)>,
    by_age: BTreeMap<u64, K>,
}

impl<K: Hash + Eq + Clone, V> Lru<K, V> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            tick: 0,
            entries: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Looks up and marks as recently used.
    pub(crate) fn get(&mut self, key: &K) -> Option<&V> {
        self.tick += 1;
        let tick = self.tick;
        let (value, age) = self.entries.get_mut(key)?;
        self.by_age.remove(age);
        *age = tick;
        self.by_age.insert(tick, key.clone());
        Some(value)
    }

    /// Looks up without changing recency.
    #[cfg(test)]
    pub(crate) fn peek(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(v, _)| v)
    }

    /// Inserts or replaces, evicting the least recently used entry when full.
    pub(crate) fn insert(&mut self, key: K, value: V) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((old_value, age)) = self.entries.get_mut(&key) {
            self.by_age.remove(age);
            *old_value = value;
            *age = tick;
            self.by_age.insert(tick, key);
            return;
        }
        if self.entries.len() >= self.capacity
            && let Some((_, oldest)) = self.by_age.pop_first()
        {
            self.entries.remove(&oldest);
        }
        self.by_age.insert(tick, key.clone());
        self.entries.insert(key, (value, tick));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut lru = Lru::new(2);
        lru.insert(1, "a");
        lru.insert(2, "b");
        assert_eq!(lru.get(&1), Some(&"a"));
        lru.insert(3, "c");
        assert_eq!(lru.peek(&2), None, "2 was least recently used");
        assert_eq!(lru.peek(&1), Some(&"a"));
        assert_eq!(lru.len(), 2);
        lru.insert(1, "z");
        assert_eq!(lru.get(&1), Some(&"z"));
        assert_eq!(lru.len(), 2);
    }
}
