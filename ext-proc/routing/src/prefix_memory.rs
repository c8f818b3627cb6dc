//! What kvroute itself routed, per replica: the approximate tier and speculative inserts.
//!
//! Block keys are chained (each depends on all tokens before it), so a per-replica set of keys is
//! a prefix tree: "holds key *k*" implies "holds the whole prefix up to *k*". Each replica's set is
//! bounded by the pool's `approx_capacity_blocks` (≈ its KV cache) and keeps the most recently
//! routed keys (`RoutedKeys`), with the time each key was last routed. Two readings:
//! - **approximate**: leading keys present at all (replicas without usable engine events);
//! - **speculative**: leading keys routed within the TTL, merged with the index's answer while a
//!   request carrying them is in flight (`Router::score_and_commit`), so a burst of siblings
//!   co-locates before the engine's events land.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_block_keys::KeyHasherBuilder;
use parking_lot::{Mutex, RwLock};

/// Leading blocks a replica is believed to hold, from kvroute's own routing history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Remembered {
    /// Leading keys routed there at any time and still remembered.
    pub approximate: u32,
    /// Leading keys routed there within the speculative TTL.
    pub speculative: u32,
}

type ReplicaKeys = Arc<Mutex<RoutedKeys>>;

/// One replica's memory, resolved by name once ([`PrefixMemory::handles`]) and read without
/// the replica table ([`PrefixMemory::lookup_handles`]).
#[derive(Debug, Clone)]
pub struct MemoryHandle(ReplicaKeys);

/// One replica's routed keys and when each was last routed there: two generations of at most
/// half the capacity each. Keys go into the current generation; when it is full it becomes the
/// previous one, replacing (and reusing the table of) the generation before. So the most recent
/// `capacity / 2` to `capacity` distinct keys are kept, at one hash-table insert per key — an
/// exact LRU also kept an ordered index, and its cache misses were most of recording a 1k-token
/// prompt's 62 keys.
#[derive(Debug)]
struct RoutedKeys {
    generation_capacity: usize,
    current: HashMap<u64, Instant, KeyHasherBuilder>,
    previous: HashMap<u64, Instant, KeyHasherBuilder>,
}

impl RoutedKeys {
    fn new(capacity: usize) -> Self {
        let hasher = KeyHasherBuilder::random();
        Self {
            generation_capacity: (capacity / 2).max(1),
            current: HashMap::with_hasher(hasher),
            previous: HashMap::with_hasher(hasher),
        }
    }

    fn insert(&mut self, key: u64, routed_at: Instant) {
        if self.current.len() >= self.generation_capacity && !self.current.contains_key(&key) {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
        }
        self.current.insert(key, routed_at);
    }

    fn get(&self, key: u64) -> Option<Instant> {
        self.current
            .get(&key)
            .or_else(|| self.previous.get(&key))
            .copied()
    }
}

/// Per-replica routed-prefix memory.
#[derive(Debug)]
pub struct PrefixMemory {
    replicas: RwLock<crate::ByReplica<ReplicaKeys>>,
    /// Changes whenever memories may have been dropped ([`Self::retain`]).
    epoch: AtomicU64,
}

impl Default for PrefixMemory {
    fn default() -> Self {
        Self {
            replicas: RwLock::default(),
            epoch: AtomicU64::new(crate::next_epoch()),
        }
    }
}

impl PrefixMemory {
    /// Records that `keys` were routed to `replica` at `now`.
    pub fn record(&self, replica: &str, capacity: usize, keys: &[u64], now: Instant) {
        if keys.is_empty() {
            return;
        }
        let memory = self.replica(replica, capacity);
        let mut memory = memory.lock();
        for key in keys {
            memory.insert(*key, now);
        }
    }

    /// How many leading `keys` `replica` is believed to hold.
    pub fn lookup(&self, replica: &str, keys: &[u64], now: Instant, ttl: Duration) -> Remembered {
        let Some(memory) = self.replicas.read().get(replica).cloned() else {
            return Remembered::default();
        };
        Self::remembered(&memory, keys, now, ttl, 0)
    }

    /// [`lookup`](Self::lookup) for every one of `replicas`, in order, under one read of the
    /// replica table (a decision over a large pool reads every candidate's memory). `held[i]`
    /// (0 past its end): leading keys `replicas[i]`'s engine is known to hold (the index's
    /// answer), which count as remembered and are not looked up. Past them is where kvroute's
    /// memory adds anything, and a prompt routed there recently carried them too; a long
    /// conversation's next turn then looks up only its new keys.
    pub fn lookup_all(
        &self,
        replicas: &[&str],
        held: &[u32],
        keys: &[u64],
        now: Instant,
        ttl: Duration,
    ) -> Vec<Remembered> {
        let table = self.replicas.read();
        Self::remembered_each(
            replicas.iter().map(|replica| table.get(*replica)),
            held,
            keys,
            now,
            ttl,
        )
    }

    /// [`lookup_all`](Self::lookup_all) over memories already resolved ([`Self::handles`]).
    pub fn lookup_handles<'a>(
        memories: impl IntoIterator<Item = &'a MemoryHandle>,
        held: &[u32],
        keys: &[u64],
        now: Instant,
        ttl: Duration,
    ) -> Vec<Remembered> {
        Self::remembered_each(
            memories.into_iter().map(|memory| Some(&memory.0)),
            held,
            keys,
            now,
            ttl,
        )
    }

    /// What each of `memories` (`None`: a replica without one) remembers of `keys`, past the
    /// `held[i]` leading keys its engine is known to hold.
    fn remembered_each<'a>(
        memories: impl Iterator<Item = Option<&'a ReplicaKeys>>,
        held: &[u32],
        keys: &[u64],
        now: Instant,
        ttl: Duration,
    ) -> Vec<Remembered> {
        memories
            .enumerate()
            .map(|(i, memory)| {
                let held = held.get(i).copied().unwrap_or(0);
                memory.map_or_else(Remembered::default, |memory| {
                    Self::remembered(memory, keys, now, ttl, held)
                })
            })
            .collect()
    }

    /// The memories of `replicas` (id, capacity in blocks should it be created), in order,
    /// created empty where none is yet.
    pub fn handles(&self, replicas: &[(&str, usize)]) -> Vec<MemoryHandle> {
        replicas
            .iter()
            .map(|(replica, capacity)| MemoryHandle(self.replica(replica, *capacity)))
            .collect()
    }

    /// This memory's state: another memory, or this one after replicas' memories were dropped,
    /// has another number (see [`crate::load::LoadBoard::epoch`]).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn remembered(
        memory: &ReplicaKeys,
        keys: &[u64],
        now: Instant,
        ttl: Duration,
        held: u32,
    ) -> Remembered {
        let held = (held as usize).min(keys.len());
        let memory = memory.lock();
        let mut remembered = Remembered {
            approximate: held as u32,
            speculative: held as u32,
        };
        let mut speculative_run = true;
        for key in &keys[held..] {
            let Some(routed_at) = memory.get(*key) else {
                break;
            };
            remembered.approximate += 1;
            speculative_run &= now.saturating_duration_since(routed_at) < ttl;
            if speculative_run {
                remembered.speculative += 1;
            }
        }
        remembered
    }

    /// Drops replicas no longer configured.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut replicas = self.replicas.write();
        replicas.retain(|id, _| keep(id));
        self.epoch.store(crate::next_epoch(), Ordering::Release);
    }

    fn replica(&self, replica: &str, capacity: usize) -> ReplicaKeys {
        if let Some(memory) = self.replicas.read().get(replica) {
            return Arc::clone(memory);
        }
        Arc::clone(
            self.replicas
                .write()
                .entry(replica.to_owned())
                .or_insert_with(|| Arc::new(Mutex::new(RoutedKeys::new(capacity)))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_keys_and_ttl() {
        let memory = PrefixMemory::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(5);
        memory.record("r0", 100, &[1, 2, 3], t0);
        memory.record("r0", 100, &[1, 2], t0 + Duration::from_secs(10));
        let at = t0 + Duration::from_secs(11);
        assert_eq!(
            memory.lookup("r0", &[1, 2, 3, 4], at, ttl),
            Remembered {
                approximate: 3,
                speculative: 2
            }
        );
        assert_eq!(memory.lookup("r0", &[9, 1], at, ttl), Remembered::default());
        assert_eq!(memory.lookup("r1", &[1], at, ttl), Remembered::default());
    }

    #[test]
    fn keys_the_engine_holds_are_not_looked_up() {
        let memory = PrefixMemory::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        // Keys 3 and 4 routed just now; 1 and 2 no longer remembered (the engine holds them).
        memory.record("r0", 100, &[3, 4], now);
        let all = |held: &[u32]| memory.lookup_all(&["r0", "r1"], held, &[1, 2, 3, 4, 5], now, ttl);
        assert_eq!(
            all(&[])[0],
            Remembered::default(),
            "from the first key: none"
        );
        assert_eq!(
            all(&[2, 1]),
            vec![
                Remembered {
                    approximate: 4,
                    speculative: 4
                },
                // A replica kvroute never routed to: nothing remembered, whatever it holds.
                Remembered::default(),
            ]
        );
        assert_eq!(all(&[9])[0].approximate, 5, "at most every key");
    }

    #[test]
    fn capacity_bounds_each_replica() {
        let memory = PrefixMemory::default();
        let now = Instant::now();
        memory.record("r0", 2, &[1, 2, 3], now);
        assert_eq!(
            memory
                .lookup("r0", &[1], now, Duration::from_secs(1))
                .approximate,
            0
        );
        assert_eq!(
            memory
                .lookup("r0", &[2, 3], now, Duration::from_secs(1))
                .approximate,
            2
        );
    }

    #[test]
    fn routing_a_key_again_keeps_it_over_older_ones() {
        let memory = PrefixMemory::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(1);
        memory.record("r0", 4, &[1, 2, 3, 4], now);
        memory.record("r0", 4, &[1], now);
        let held = |keys: &[u64]| memory.lookup("r0", keys, now, ttl).approximate;
        assert_eq!(held(&[1]), 1, "routed again: kept");
        assert_eq!(held(&[2]), 0, "the oldest key not routed again: dropped");
        assert_eq!(held(&[3, 4]), 2);
        let replica = memory.replica("r0", 4);
        let keys = replica.lock();
        assert!(
            keys.current.len() + keys.previous.len() <= 4,
            "bounded by the capacity"
        );
    }
}
