//! The learned session → replica table, laid out for proxy-wasm shared data.
//!
//! Shared data is a flat string → bytes map shared by every worker's VM with the same `vm_id`,
//! with compare-and-swap writes and no way to enumerate or expire keys. So the table is a fixed set
//! of `slots` buckets, one shared-data key each (`<prefix>.<slot>`); a session hashes to one bucket
//! and the bucket holds at most `ways` entries. The number of keys and the bytes per key are both
//! bounded by configuration, whatever the number of distinct sessions:
//! at most `slots * ways` sessions are remembered and at most `slots * (2 + ways * 272)` bytes stored.
//!
//! Sessions are stored as a 64-bit fingerprint (never the raw id), with the replica and an absolute
//! expiry. Entries are kept most-recently-written first; a full bucket drops expired entries, then
//! the least recently written one (an eviction). Readers never write, so a hit costs one
//! `get_shared_data`; the fast path refreshes an entry only once less than half its TTL is left.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::{AffinityConfig, MAX_REPLICA_LEN};

/// Seed for session fingerprints; fixed so every VM (and every restart) agrees.
const FINGERPRINT_SEED: u64 = 0x6b76_726f_7574_6531; // "kvroute1"
/// First byte of an encoded bucket; bump when the layout changes.
const BUCKET_FORMAT_VERSION: u8 = 1;
/// fingerprint (8) + expiry (8) + replica length (1).
const ENTRY_FIXED_LEN: usize = 17;

/// Where a session lives in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionKey {
    /// 64-bit hash of the session id; compared in full, so slot collisions are harmless.
    pub fingerprint: u64,
    /// Bucket index in `0..slots`.
    pub slot: u32,
}

/// Table geometry and naming derived from [`AffinityConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffinityTable {
    slots: u32,
    ways: u8,
    ttl_ms: u64,
    key_prefix: String,
}

impl AffinityTable {
    /// Builds the table view for a validated configuration.
    pub fn new(config: &AffinityConfig) -> Self {
        AffinityTable {
            slots: config.slots,
            ways: config.ways,
            ttl_ms: u64::try_from(config.ttl.as_millis()).unwrap_or(u64::MAX),
            key_prefix: config.key_prefix.clone(),
        }
    }

    /// Hashes a session id to its fingerprint and bucket.
    pub fn key(&self, session: &str) -> SessionKey {
        let fingerprint = xxh3_64_with_seed(session.as_bytes(), FINGERPRINT_SEED);
        // `slots` is at least 1 (validated); the remainder is below `slots`, so it fits in u32.
        let slot = u32::try_from(fingerprint % u64::from(self.slots.max(1))).unwrap_or(0);
        SessionKey { fingerprint, slot }
    }

    /// The shared-data key of a bucket.
    pub fn shared_data_key(&self, key: SessionKey) -> String {
        format!("{}.{}", self.key_prefix, key.slot)
    }

    /// Entry lifetime in milliseconds.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Most sessions the table can remember at once.
    pub fn capacity(&self) -> u64 {
        u64::from(self.slots) * u64::from(self.ways)
    }

    /// Records `session → replica` in a bucket (see [`Bucket::learn`]).
    pub fn learn(
        &self,
        bucket: &mut Bucket,
        key: SessionKey,
        replica: &str,
        now_ms: u64,
    ) -> LearnOutcome {
        bucket.learn(
            key.fingerprint,
            replica,
            now_ms,
            self.ttl_ms,
            usize::from(self.ways),
        )
    }

    /// Whether a hit with this expiry should be rewritten to extend it (less than half the TTL left).
    pub fn needs_refresh(&self, entry: &Entry, now_ms: u64) -> bool {
        entry.expires_at_ms.saturating_sub(now_ms) < self.ttl_ms / 2
    }
}

/// One remembered session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Session fingerprint.
    pub fingerprint: u64,
    /// Milliseconds since the Unix epoch after which the entry is ignored.
    pub expires_at_ms: u64,
    /// The replica decision as ext_proc wrote it (`ip:port` or a fallback list, or a cluster name).
    pub replica: String,
}

impl Entry {
    fn is_live(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }
}

/// The decoded contents of one shared-data key, most recently written first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bucket {
    entries: Vec<Entry>,
}

/// What [`Bucket::learn`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LearnOutcome {
    /// What happened to the session's own entry.
    pub change: LearnChange,
    /// Live entries of other sessions dropped to make room.
    pub evicted: u32,
}

/// What happened to the learned session's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LearnChange {
    /// Already known with the same replica and plenty of TTL left: nothing to write.
    Unchanged,
    /// The session was not in the table (or had expired).
    Inserted,
    /// Same replica, expiry extended.
    Refreshed,
    /// The session moved to another replica.
    Replaced,
}

impl LearnOutcome {
    /// Whether the bucket must be written back.
    pub fn is_write(&self) -> bool {
        self.change != LearnChange::Unchanged
    }
}

/// Why stored bucket bytes could not be read (the bucket is then treated as empty and rewritten).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// Written by an incompatible module version.
    #[error("bucket format version {found} is not {BUCKET_FORMAT_VERSION}")]
    UnknownVersion {
        /// Version byte found.
        found: u8,
    },
    /// Ends in the middle of an entry.
    #[error("bucket is truncated at byte {at} of {len}")]
    Truncated {
        /// Offset where more bytes were needed.
        at: usize,
        /// Total length.
        len: usize,
    },
    /// A replica that is not UTF-8.
    #[error("bucket entry {index} has a non-UTF-8 replica")]
    BadReplica {
        /// Entry index.
        index: usize,
    },
    /// Bytes after the last entry.
    #[error("bucket has {extra} trailing bytes")]
    TrailingBytes {
        /// Number of unexpected bytes.
        extra: usize,
    },
}

impl TableError {
    /// Stable label for logs and counters.
    pub fn as_label(&self) -> &'static str {
        match self {
            TableError::UnknownVersion { .. } => "unknown_version",
            TableError::Truncated { .. } => "truncated",
            TableError::BadReplica { .. } => "bad_replica",
            TableError::TrailingBytes { .. } => "trailing_bytes",
        }
    }
}

impl Bucket {
    /// Decodes stored bytes; an empty value is an empty bucket.
    pub fn decode(bytes: &[u8]) -> Result<Bucket, TableError> {
        let Some((&version, rest)) = bytes.split_first() else {
            return Ok(Bucket::default());
        };
        if version != BUCKET_FORMAT_VERSION {
            return Err(TableError::UnknownVersion { found: version });
        }
        let len = bytes.len();
        let truncated = |at: usize| TableError::Truncated { at, len };
        let (&count, mut rest) = rest.split_first().ok_or(truncated(1))?;
        let mut entries = Vec::with_capacity(usize::from(count));
        for index in 0..usize::from(count) {
            let at = len - rest.len();
            let (fixed, tail) = rest
                .split_at_checked(ENTRY_FIXED_LEN)
                .ok_or(truncated(at))?;
            let (fingerprint, fixed) = read_u64(fixed).ok_or(truncated(at))?;
            let (expires_at_ms, fixed) = read_u64(fixed).ok_or(truncated(at))?;
            let replica_len = usize::from(fixed.first().copied().ok_or(truncated(at))?);
            let (replica, tail) = tail
                .split_at_checked(replica_len)
                .ok_or(truncated(len - tail.len()))?;
            let replica = String::from_utf8(replica.to_vec())
                .map_err(|_| TableError::BadReplica { index })?;
            entries.push(Entry {
                fingerprint,
                expires_at_ms,
                replica,
            });
            rest = tail;
        }
        if !rest.is_empty() {
            return Err(TableError::TrailingBytes { extra: rest.len() });
        }
        Ok(Bucket { entries })
    }

    /// Encodes for `set_shared_data`. Entries longer than [`MAX_REPLICA_LEN`] never get in
    /// ([`Bucket::learn`] refuses them), so every length fits its byte.
    pub fn encode(&self) -> Vec<u8> {
        let entries = &self.entries[..self.entries.len().min(usize::from(u8::MAX))];
        let size = 2 + entries
            .iter()
            .map(|e| ENTRY_FIXED_LEN + e.replica.len())
            .sum::<usize>();
        let mut out = Vec::with_capacity(size);
        out.push(BUCKET_FORMAT_VERSION);
        out.push(u8::try_from(entries.len()).unwrap_or(u8::MAX));
        for entry in entries {
            let replica = &entry.replica.as_bytes()[..entry.replica.len().min(MAX_REPLICA_LEN)];
            out.extend_from_slice(&entry.fingerprint.to_le_bytes());
            out.extend_from_slice(&entry.expires_at_ms.to_le_bytes());
            out.push(u8::try_from(replica.len()).unwrap_or(u8::MAX));
            out.extend_from_slice(replica);
        }
        out
    }

    /// The live entry for a session, if any.
    pub fn lookup(&self, fingerprint: u64, now_ms: u64) -> Option<&Entry> {
        self.entries
            .iter()
            .find(|e| e.fingerprint == fingerprint && e.is_live(now_ms))
    }

    /// Number of entries stored, live or not.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records `fingerprint → replica` valid for `ttl_ms` from `now_ms`, keeping at most `ways`
    /// entries. A replica that cannot be stored (empty or longer than [`MAX_REPLICA_LEN`]) leaves
    /// the bucket unchanged; callers validate first, this is the last guard for the byte layout.
    pub fn learn(
        &mut self,
        fingerprint: u64,
        replica: &str,
        now_ms: u64,
        ttl_ms: u64,
        ways: usize,
    ) -> LearnOutcome {
        let unchanged = LearnOutcome {
            change: LearnChange::Unchanged,
            evicted: 0,
        };
        if replica.is_empty() || replica.len() > MAX_REPLICA_LEN {
            return unchanged;
        }
        let expires_at_ms = now_ms.saturating_add(ttl_ms);
        let previous = self
            .entries
            .iter()
            .position(|e| e.fingerprint == fingerprint)
            .map(|i| self.entries.remove(i))
            .filter(|e| e.is_live(now_ms));
        let change = match &previous {
            Some(e)
                if e.replica == replica && e.expires_at_ms.saturating_sub(now_ms) >= ttl_ms / 2 =>
            {
                // Put it back untouched: nothing worth a shared-data write.
                self.entries.insert(0, e.clone());
                return unchanged;
            }
            Some(e) if e.replica == replica => LearnChange::Refreshed,
            Some(_) => LearnChange::Replaced,
            None => LearnChange::Inserted,
        };
        self.entries.retain(|e| e.is_live(now_ms));
        self.entries.insert(
            0,
            Entry {
                fingerprint,
                expires_at_ms,
                replica: replica.to_owned(),
            },
        );
        let ways = ways.max(1);
        let evicted = self.entries.len().saturating_sub(ways);
        self.entries.truncate(ways);
        LearnOutcome {
            change,
            evicted: u32::try_from(evicted).unwrap_or(u32::MAX),
        }
    }
}

fn read_u64(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let (head, tail) = bytes.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*head), tail))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;

    const TTL_MS: u64 = 60_000;

    fn table(slots: u32, ways: u8) -> AffinityTable {
        AffinityTable::new(&AffinityConfig {
            ttl: Duration::from_millis(TTL_MS),
            slots,
            ways,
            key_prefix: "test".into(),
        })
    }

    /// Stand-in for proxy-wasm shared data: key → bytes, as the host stores it.
    #[derive(Default)]
    struct SharedData(HashMap<String, Vec<u8>>);

    impl SharedData {
        fn learn(
            &mut self,
            table: &AffinityTable,
            session: &str,
            replica: &str,
            now_ms: u64,
        ) -> LearnOutcome {
            let key = table.key(session);
            let stored = self.0.entry(table.shared_data_key(key)).or_default();
            let mut bucket = Bucket::decode(stored).unwrap();
            let outcome = table.learn(&mut bucket, key, replica, now_ms);
            if outcome.is_write() {
                *stored = bucket.encode();
            }
            outcome
        }

        fn lookup(&self, table: &AffinityTable, session: &str, now_ms: u64) -> Option<String> {
            let key = table.key(session);
            let stored = self.0.get(&table.shared_data_key(key))?;
            Bucket::decode(stored)
                .unwrap()
                .lookup(key.fingerprint, now_ms)
                .map(|e| e.replica.clone())
        }

        fn entries(&self) -> usize {
            self.0
                .values()
                .map(|b| Bucket::decode(b).unwrap().len())
                .sum()
        }

        fn bytes(&self) -> usize {
            self.0.values().map(Vec::len).sum()
        }
    }

    #[test]
    fn encode_decode_round_trip() {
        let mut bucket = Bucket::default();
        bucket.learn(1, "10.0.0.1:8000", 5, TTL_MS, 4);
        bucket.learn(2, "10.0.0.2:8000,10.0.0.3:8000", 5, TTL_MS, 4);
        let decoded = Bucket::decode(&bucket.encode()).unwrap();
        assert_eq!(decoded, bucket);
        assert_eq!(Bucket::decode(&[]).unwrap(), Bucket::default());
    }

    #[test]
    fn malformed_bytes_are_errors_not_panics() {
        let mut bucket = Bucket::default();
        bucket.learn(7, "10.0.0.1:8000", 0, TTL_MS, 4);
        let good = bucket.encode();
        assert_eq!(
            Bucket::decode(&[9]).unwrap_err().as_label(),
            "unknown_version"
        );
        assert_eq!(Bucket::decode(&[1]).unwrap_err().as_label(), "truncated");
        for cut in 2..good.len() {
            assert_eq!(
                Bucket::decode(&good[..cut]).unwrap_err().as_label(),
                "truncated",
                "cut at {cut}"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            Bucket::decode(&long).unwrap_err().as_label(),
            "trailing_bytes"
        );
        let mut bad_utf8 = good;
        let last = bad_utf8.len() - 1;
        bad_utf8[last] = 0xff;
        assert_eq!(
            Bucket::decode(&bad_utf8).unwrap_err().as_label(),
            "bad_replica"
        );
    }

    #[test]
    fn lookup_ignores_expired_entries() {
        let mut bucket = Bucket::default();
        bucket.learn(1, "a:1", 1_000, TTL_MS, 4);
        assert_eq!(
            bucket
                .lookup(1, 1_000 + TTL_MS - 1)
                .map(|e| e.replica.as_str()),
            Some("a:1")
        );
        assert_eq!(bucket.lookup(1, 1_000 + TTL_MS), None);
        assert_eq!(bucket.lookup(2, 1_000), None);
    }

    #[test]
    fn learn_reports_what_changed() {
        let mut bucket = Bucket::default();
        assert_eq!(
            bucket.learn(1, "a:1", 0, TTL_MS, 4).change,
            LearnChange::Inserted
        );
        // Fresh and identical: no write needed.
        assert_eq!(
            bucket.learn(1, "a:1", TTL_MS / 4, TTL_MS, 4).change,
            LearnChange::Unchanged
        );
        // Less than half the TTL left: extend.
        let outcome = bucket.learn(1, "a:1", TTL_MS * 3 / 4, TTL_MS, 4);
        assert_eq!(outcome.change, LearnChange::Refreshed);
        assert_eq!(
            bucket.lookup(1, TTL_MS * 3 / 4).unwrap().expires_at_ms,
            TTL_MS * 7 / 4
        );
        assert_eq!(
            bucket.learn(1, "b:2", TTL_MS, TTL_MS, 4).change,
            LearnChange::Replaced
        );
        assert_eq!(bucket.lookup(1, TTL_MS).unwrap().replica, "b:2");
        // Expired entries count as new.
        assert_eq!(
            bucket.learn(1, "b:2", TTL_MS * 3, TTL_MS, 4).change,
            LearnChange::Inserted
        );
        assert_eq!(bucket.len(), 1);
    }

    #[test]
    fn full_bucket_drops_expired_first_then_least_recently_written() {
        let mut bucket = Bucket::default();
        bucket.learn(1, "a:1", 0, TTL_MS, 2);
        bucket.learn(2, "a:1", TTL_MS / 2, TTL_MS, 2);
        // Entry 1 has expired by now: dropping it is not an eviction.
        let outcome = bucket.learn(3, "a:1", TTL_MS + 1, TTL_MS, 2);
        assert_eq!(
            outcome,
            LearnOutcome {
                change: LearnChange::Inserted,
                evicted: 0
            }
        );
        // Both live: the least recently written (2) goes.
        let outcome = bucket.learn(4, "a:1", TTL_MS + 2, TTL_MS, 2);
        assert_eq!(
            outcome,
            LearnOutcome {
                change: LearnChange::Inserted,
                evicted: 1
            }
        );
        assert!(bucket.lookup(2, TTL_MS + 2).is_none());
        assert!(bucket.lookup(3, TTL_MS + 2).is_some());
        assert!(bucket.lookup(4, TTL_MS + 2).is_some());
    }

    #[test]
    fn unstorable_replicas_are_refused() {
        let mut bucket = Bucket::default();
        assert!(!bucket.learn(1, "", 0, TTL_MS, 4).is_write());
        assert!(
            !bucket
                .learn(1, &"x".repeat(MAX_REPLICA_LEN + 1), 0, TTL_MS, 4)
                .is_write()
        );
        assert!(
            bucket
                .learn(1, &"x".repeat(MAX_REPLICA_LEN), 0, TTL_MS, 4)
                .is_write()
        );
        assert!(!bucket.is_empty());
        assert_eq!(Bucket::decode(&bucket.encode()).unwrap(), bucket);
    }

    #[test]
    fn key_is_stable_and_in_range() {
        let table = table(7, 2);
        let a = table.key("conversation-1");
        assert_eq!(a, table.key("conversation-1"));
        assert_ne!(a.fingerprint, table.key("conversation-2").fingerprint);
        for i in 0..1_000 {
            assert!(table.key(&format!("s{i}")).slot < 7);
        }
        assert_eq!(
            table.shared_data_key(SessionKey {
                fingerprint: 0,
                slot: 3
            }),
            "test.3"
        );
    }

    #[test]
    fn table_stays_bounded_under_100k_distinct_sessions() {
        let defaults = crate::config::Config::from_json(br#"{"role":"fast_path"}"#).unwrap();
        for table in [table(1_024, 4), AffinityTable::new(&defaults.affinity)] {
            let mut shared = SharedData::default();
            let mut evicted = 0u64;
            let sessions = 100_000u64;
            for i in 0..sessions {
                let outcome = shared.learn(&table, &format!("session-{i}"), "10.0.0.1:8000", i);
                assert_eq!(outcome.change, LearnChange::Inserted);
                evicted += u64::from(outcome.evicted);
            }
            let entries = u64::try_from(shared.entries()).unwrap();
            assert!(
                entries <= table.capacity(),
                "{entries} entries > capacity {}",
                table.capacity()
            );
            assert!(u64::try_from(shared.0.len()).unwrap() <= u64::from(table.slots));
            assert_eq!(
                entries + evicted,
                sessions,
                "every insert is either stored or evicted one"
            );
            let max_bytes =
                usize::try_from(table.slots).unwrap() * (2 + usize::from(table.ways) * 272);
            assert!(shared.bytes() <= max_bytes);
            // The most recent sessions are the ones kept.
            let last = sessions - 1;
            assert_eq!(
                shared
                    .lookup(&table, &format!("session-{last}"), last)
                    .as_deref(),
                Some("10.0.0.1:8000")
            );
        }
    }
}
