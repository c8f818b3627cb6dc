//! What kvroute itself routed, per replica: the approximate tier and speculative inserts.
//!
//! Block keys are chained (each depends on all tokens before it), so a per-replica set of keys is
//! a prefix tree: "holds key *k*" implies "holds the whole prefix up to *k*". Each replica's set is
//! an LRU bounded by the pool's `approx_capacity_blocks` (≈ its KV cache), with the time each key
//! was last routed. Two readings:
//! - **approximate**: leading keys present at all (replicas without usable engine events);
//! - **speculative**: leading keys routed within the TTL, merged with the index's answer as
//!   `max(index, speculative)` so a burst of siblings co-locates before the engine's events land.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::lru::Lru;

/// Leading blocks a replica is believed to hold, from kvroute's own routing history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Remembered {
    /// Leading keys routed there at any time still in the LRU.
    pub approximate: u32,
    /// Leading keys routed there within the speculative TTL.
    pub speculative: u32,
}

/// One replica's routed keys and when each was last routed there.
type ReplicaKeys = Arc<Mutex<Lru<u64, Instant>>>;

/// Per-replica routed-prefix memory.
#[derive(Debug, Default)]
pub struct PrefixMemory {
    replicas: RwLock<HashMap<String, ReplicaKeys>>,
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
        let memory = memory.lock();
        let mut remembered = Remembered::default();
        let mut speculative_run = true;
        for key in keys {
            let Some(routed_at) = memory.peek(key) else {
                break;
            };
            remembered.approximate += 1;
            speculative_run &= now.saturating_duration_since(*routed_at) < ttl;
            if speculative_run {
                remembered.speculative += 1;
            }
        }
        remembered
    }

    /// Drops replicas no longer configured.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.replicas.write().retain(|id, _| keep(id));
    }

    fn replica(&self, replica: &str, capacity: usize) -> ReplicaKeys {
        if let Some(memory) = self.replicas.read().get(replica) {
            return Arc::clone(memory);
        }
        Arc::clone(
            self.replicas
                .write()
                .entry(replica.to_owned())
                .or_insert_with(|| Arc::new(Mutex::new(Lru::new(capacity)))),
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
}
