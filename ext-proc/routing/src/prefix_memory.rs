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
//!
//! A key is also marked **computed** once a request carrying it got its first token there (its
//! in-flight guard released, [`MemoryHandle::mark_computed`]; also when the request stopped
//! waiting for it, a guess like the rest of this memory): the replica then holds it, where
//! before it was only queued or being computed. That is the approximate tier's counterpart of what
//! the index confirms, which an idle pool counts (`policy` module docs).

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
    /// Leading keys a request carrying them got its first token for: computed there.
    pub computed: u32,
}

type ReplicaKeys = Arc<Mutex<RoutedKeys>>;

/// One replica's memory, resolved by name once ([`PrefixMemory::handles`]) and read without
/// the replica table ([`PrefixMemory::lookup_handles`]).
#[derive(Debug, Clone)]
pub struct MemoryHandle(ReplicaKeys);

impl MemoryHandle {
    /// Records that `keys` were routed to this replica at `now`.
    pub fn record(&self, keys: &[u64], now: Instant) {
        if keys.is_empty() {
            return;
        }
        let mut memory = self.0.lock();
        for key in keys {
            memory.insert(*key, now);
        }
    }

    /// A request carrying `keys` got its first token on this replica: it holds them now. Keys
    /// are chained, so a key computed there means its whole prefix was: the keys are marked from
    /// the last back to the first one already marked (a next turn or a sibling marks only its
    /// new blocks), and a lookup counts the leading keys up to the last marked one. A key no
    /// longer remembered stays forgotten.
    pub fn mark_computed(&self, keys: &[u64]) {
        let mut memory = self.0.lock();
        for key in keys.iter().rev() {
            if memory.mark_computed(*key) {
                break;
            }
        }
    }
}

/// When a key was last routed to a replica (nanoseconds after the memory's first record), and
/// whether a request carrying it got its first token there since it was first remembered (the
/// top bit): 8 bytes, so a table entry is 16 (with an `Instant` and a flag it was 32, and every
/// decision over a large pool probes one table per candidate).
#[derive(Debug, Clone, Copy)]
struct RoutedKey(u64);

impl RoutedKey {
    const COMPUTED: u64 = 1 << 63;

    fn new(since_base: Duration, computed: bool) -> Self {
        let nanos = u64::try_from(since_base.as_nanos()).unwrap_or(u64::MAX) & !Self::COMPUTED;
        Self(if computed {
            nanos | Self::COMPUTED
        } else {
            nanos
        })
    }

    fn routed_at(self, base: Instant) -> Instant {
        let since = Duration::from_nanos(self.0 & !Self::COMPUTED);
        base.checked_add(since).unwrap_or(base)
    }

    fn computed(self) -> bool {
        self.0 & Self::COMPUTED != 0
    }

    /// Marks it computed; whether it already was.
    fn mark_computed(&mut self) -> bool {
        let was = self.computed();
        self.0 |= Self::COMPUTED;
        was
    }
}

/// One replica's routed keys and when each was last routed there: two generations of at most
/// the capacity each. Keys go into the current generation; when it is full it becomes the
/// previous one, replacing (and reusing the table of) the generation before. So the most recent
/// `capacity` to `2 × capacity` distinct keys are kept, at one hash-table insert per key — an
/// exact LRU also kept an ordered index, and its cache misses were most of recording a 1k-token
/// prompt's 62 keys. At least `capacity`, as the exact LRU did: the capacity is the replica's KV
/// cache, which holds about that many blocks, and a memory of only half of it forgets a
/// conversation its replica still holds (in kvroute-replay, fleets without KV events on the
/// synthetic trace: hit rate 0.48 with half to all kept, 0.55 with all to twice).
#[derive(Debug)]
struct RoutedKeys {
    generation_capacity: usize,
    /// The first record's time: what every key's time counts from (an earlier one counts as it).
    base: Option<Instant>,
    current: HashMap<u64, RoutedKey, KeyHasherBuilder>,
    previous: HashMap<u64, RoutedKey, KeyHasherBuilder>,
}

impl RoutedKeys {
    fn new(capacity: usize) -> Self {
        let hasher = KeyHasherBuilder::random();
        Self {
            generation_capacity: capacity.max(1),
            base: None,
            current: HashMap::with_hasher(hasher),
            previous: HashMap::with_hasher(hasher),
        }
    }

    fn insert(&mut self, key: u64, routed_at: Instant) {
        let base = *self.base.get_or_insert(routed_at);
        let since_base = routed_at.saturating_duration_since(base);
        // A key routed again is usually in the current generation: one probe.
        if let Some(known) = self.current.get_mut(&key) {
            *known = RoutedKey::new(since_base, known.computed());
            return;
        }
        let computed = self
            .previous
            .get(&key)
            .is_some_and(|known| known.computed());
        if self.current.len() >= self.generation_capacity {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
        }
        self.current
            .insert(key, RoutedKey::new(since_base, computed));
    }

    /// Marks `key` computed; whether it already was (`false` when it is not remembered).
    fn mark_computed(&mut self, key: u64) -> bool {
        let known = match self.current.get_mut(&key) {
            Some(known) => Some(known),
            None => self.previous.get_mut(&key),
        };
        known.is_some_and(RoutedKey::mark_computed)
    }

    /// When `key` was last routed here and whether it is computed.
    fn get(&self, key: u64) -> Option<(Instant, bool)> {
        let known = self.current.get(&key).or_else(|| self.previous.get(&key))?;
        let base = self.base?;
        Some((known.routed_at(base), known.computed()))
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

    /// The memory of `replica` (created empty with `capacity` blocks if none is yet).
    pub fn handle(&self, replica: &str, capacity: usize) -> MemoryHandle {
        MemoryHandle(self.replica(replica, capacity))
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
            computed: held as u32,
        };
        let mut speculative_run = true;
        for key in &keys[held..] {
            let Some((routed_at, computed)) = memory.get(*key) else {
                break;
            };
            remembered.approximate += 1;
            speculative_run &= now.saturating_duration_since(routed_at) < ttl;
            if speculative_run {
                remembered.speculative += 1;
            }
            // Chained keys: a key computed there means the whole prefix up to it was.
            if computed {
                remembered.computed = remembered.approximate;
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
        memory.handle("r0", 100).record(&[1, 2, 3], t0);
        memory
            .handle("r0", 100)
            .record(&[1, 2], t0 + Duration::from_secs(10));
        let at = t0 + Duration::from_secs(11);
        assert_eq!(
            memory.lookup("r0", &[1, 2, 3, 4], at, ttl),
            Remembered {
                approximate: 3,
                speculative: 2,
                computed: 0,
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
        memory.handle("r0", 100).record(&[3, 4], now);
        let all = |held: &[u32]| memory.lookup_all(&["r0", "r1"], held, &[1, 2, 3, 4, 5], now, ttl);
        assert_eq!(
            all(&[])[0],
            Remembered::default(),
            "from the first key: none"
        );
        assert_eq!(
            all(&[2, 1]),
            vec![
                // What the engine holds counts as computed.
                Remembered {
                    approximate: 4,
                    speculative: 4,
                    computed: 2,
                },
                // A replica kvroute never routed to: nothing remembered, whatever it holds.
                Remembered::default(),
            ]
        );
        assert_eq!(all(&[9])[0].approximate, 5, "at most every key");
    }

    #[test]
    fn keys_are_computed_once_a_request_carrying_them_got_its_first_token() {
        let memory = PrefixMemory::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(5);
        let computed = |keys: &[u64]| memory.lookup("r0", keys, now, ttl).computed;
        memory.handle("r0", 4).record(&[1, 2, 3], now);
        assert_eq!(computed(&[1, 2, 3]), 0, "routed, not answered yet");
        memory.handle("r0", 4).mark_computed(&[1, 2]);
        assert_eq!(computed(&[1, 2, 3]), 2);
        memory.handle("r0", 4).record(&[1, 2, 3, 4], now);
        assert_eq!(computed(&[1, 2, 3, 4]), 2, "routed again: still computed");
        assert_eq!(memory.lookup("r0", &[1, 2, 3, 4], now, ttl).approximate, 4);
        // A sibling answered: its own block is computed, and so is the prefix it shares.
        memory.handle("r0", 4).record(&[1, 2, 10], now);
        memory.handle("r0", 4).mark_computed(&[1, 2, 10]);
        assert_eq!(computed(&[1, 2, 10]), 3);
        memory.handle("r0", 4).record(&[1, 2, 11], now);
        assert_eq!(
            computed(&[1, 2, 11]),
            2,
            "the next sibling, not answered yet"
        );
        // Past the capacity the oldest generation goes, computed or not, and a mark does not
        // bring a forgotten key back.
        memory.handle("r0", 4).record(&[5, 6, 7, 8, 9], now);
        memory.handle("r0", 4).mark_computed(&[1, 9]);
        assert_eq!(computed(&[1]), 0);
        assert_eq!(memory.lookup("r0", &[1], now, ttl).approximate, 0);
        assert_eq!(computed(&[9]), 1);
    }

    #[test]
    fn capacity_bounds_each_replica() {
        let memory = PrefixMemory::default();
        let now = Instant::now();
        let held = |keys: &[u64]| {
            memory
                .lookup("r0", keys, now, Duration::from_secs(1))
                .approximate
        };
        memory.handle("r0", 2).record(&[1, 2, 3, 4, 5], now);
        assert_eq!(held(&[4, 5]), 2, "the last `capacity` keys are always kept");
        assert_eq!(held(&[3, 4, 5]), 3, "and up to twice as many");
        assert_eq!(held(&[1]), 0, "older ones are dropped");
        let replica = memory.replica("r0", 2);
        let keys = replica.lock();
        assert!(keys.current.len() + keys.previous.len() <= 4);
    }

    #[test]
    fn routing_a_key_again_keeps_it_over_older_ones() {
        let memory = PrefixMemory::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(1);
        memory.handle("r0", 2).record(&[1, 2], now);
        memory.handle("r0", 2).record(&[3], now);
        memory.handle("r0", 2).record(&[1], now);
        memory.handle("r0", 2).record(&[4], now);
        let held = |keys: &[u64]| memory.lookup("r0", keys, now, ttl).approximate;
        assert_eq!(held(&[1]), 1, "routed again: kept");
        assert_eq!(held(&[2]), 0, "an older key not routed again: dropped");
        assert_eq!((held(&[3]), held(&[4])), (1, 1));
        let replica = memory.replica("r0", 2);
        let keys = replica.lock();
        assert!(
            keys.current.len() + keys.previous.len() <= 4,
            "bounded by twice the capacity"
        );
    }
}
