//! Compact per-key holder sets and the slot bitsets the match walk works on.
//!
//! Every indexed block key maps to the replicas (pool slots) holding it, each with the media it
//! is held in. Most keys are held by one replica (the unique tail of a conversation), a few by
//! many (shared system prompts), so the set is one inline [`Holder`] or a boxed slice: 16 bytes
//! in the map either way.

use std::hash::{BuildHasher, Hasher};

use crate::event::Medium;

/// Index of a replica inside its pool (dense, reused after removal).
pub(crate) type Slot = u16;

/// The media one replica holds one block in (bit per [`Medium`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MediaSet(u8);

impl MediaSet {
    fn bit(medium: Medium) -> u8 {
        match medium {
            Medium::Gpu => 1,
            Medium::Cpu => 2,
            Medium::Storage => 4,
            Medium::Other => 8,
        }
    }

    pub(crate) fn only(medium: Medium) -> Self {
        MediaSet(Self::bit(medium))
    }

    pub(crate) fn contains(self, medium: Medium) -> bool {
        self.0 & Self::bit(medium) != 0
    }

    pub(crate) fn has_gpu(self) -> bool {
        self.contains(Medium::Gpu)
    }

    fn with(self, medium: Medium) -> Self {
        MediaSet(self.0 | Self::bit(medium))
    }

    fn without(self, medium: Medium) -> Self {
        MediaSet(self.0 & !Self::bit(medium))
    }

    fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// One replica holding one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) slot: Slot,
    pub(crate) media: MediaSet,
}

/// The replicas holding one block key; never empty (the key is dropped with its last holder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Holders {
    One(Holder),
    /// Two or more holders, sorted by slot. Rebuilt on change: sets this large are the hot
    /// shared prefixes, which change rarely compared with how often they are read.
    Many(Box<[Holder]>),
}

/// What [`Holders::remove`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Removal {
    /// The slot held the block in the removed medium.
    pub(crate) was_held: bool,
    /// The slot no longer holds the block in any medium.
    pub(crate) slot_gone: bool,
    /// No slot holds the block any more: drop the key.
    pub(crate) set_empty: bool,
}

impl Holders {
    pub(crate) fn new(slot: Slot, medium: Medium) -> Self {
        Holders::One(Holder {
            slot,
            media: MediaSet::only(medium),
        })
    }

    pub(crate) fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(holder) => std::slice::from_ref(holder),
            Holders::Many(holders) => holders,
        }
    }

    /// Records that `slot` holds the block in `medium`; returns true when the slot did not hold
    /// the block in any medium before.
    pub(crate) fn add(&mut self, slot: Slot, medium: Medium) -> bool {
        match self {
            Holders::One(holder) if holder.slot == slot => {
                holder.media = holder.media.with(medium);
                false
            }
            Holders::One(holder) => {
                let added = Holder {
                    slot,
                    media: MediaSet::only(medium),
                };
                let pair = if holder.slot < slot {
                    [*holder, added]
                } else {
                    [added, *holder]
                };
                *self = Holders::Many(Box::new(pair));
                true
            }
            Holders::Many(holders) => match holders.binary_search_by_key(&slot, |h| h.slot) {
                Ok(at) => {
                    holders[at].media = holders[at].media.with(medium);
                    false
                }
                Err(at) => {
                    let mut grown = Vec::with_capacity(holders.len() + 1);
                    grown.extend_from_slice(&holders[..at]);
                    grown.push(Holder {
                        slot,
                        media: MediaSet::only(medium),
                    });
                    grown.extend_from_slice(&holders[at..]);
                    *holders = grown.into_boxed_slice();
                    true
                }
            },
        }
    }

    /// Removes `medium` (or every medium when `None`) from `slot`'s holding.
    pub(crate) fn remove(&mut self, slot: Slot, medium: Option<Medium>) -> Removal {
        let not_held = Removal {
            was_held: false,
            slot_gone: false,
            set_empty: false,
        };
        let strip = |media: MediaSet| match medium {
            Some(medium) => (media.contains(medium), media.without(medium)),
            None => (!media.is_empty(), MediaSet::default()),
        };
        match self {
            Holders::One(holder) if holder.slot == slot => {
                let (was_held, left) = strip(holder.media);
                holder.media = left;
                let gone = left.is_empty();
                Removal {
                    was_held,
                    slot_gone: gone,
                    set_empty: gone,
                }
            }
            Holders::One(_) => not_held,
            Holders::Many(holders) => {
                let Ok(at) = holders.binary_search_by_key(&slot, |h| h.slot) else {
                    return not_held;
                };
                let (was_held, left) = strip(holders[at].media);
                holders[at].media = left;
                if !left.is_empty() {
                    return Removal {
                        was_held,
                        slot_gone: false,
                        set_empty: false,
                    };
                }
                let rest: Vec<Holder> =
                    holders.iter().filter(|h| h.slot != slot).copied().collect();
                *self = match rest.as_slice() {
                    [single] => Holders::One(*single),
                    _ => Holders::Many(rest.into_boxed_slice()),
                };
                Removal {
                    was_held,
                    slot_gone: true,
                    set_empty: false,
                }
            }
        }
    }

    /// Heap bytes owned beyond the map entry itself.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::One(_) => 0,
            Holders::Many(holders) => std::mem::size_of_val::<[Holder]>(holders),
        }
    }
}

/// A set of pool slots as a bitset; the match walk intersects these once per prompt block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlotSet {
    words: Vec<u64>,
}

impl SlotSet {
    pub(crate) fn with_slots(slots: usize) -> Self {
        SlotSet {
            words: vec![0; slots.div_ceil(64)],
        }
    }

    pub(crate) fn insert(&mut self, slot: Slot) {
        let slot = usize::from(slot);
        if let Some(word) = self.words.get_mut(slot / 64) {
            *word |= 1 << (slot % 64);
        }
    }

    pub(crate) fn contains(&self, slot: Slot) -> bool {
        let slot = usize::from(slot);
        self.words
            .get(slot / 64)
            .is_some_and(|word| word & (1 << (slot % 64)) != 0)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.words.iter().all(|&word| word == 0)
    }

    /// Words per set for `slots` slots.
    pub(crate) fn words_for(slots: usize) -> usize {
        slots.div_ceil(64)
    }

    /// Sets `slot` in a bare word slice laid out like a `SlotSet`.
    pub(crate) fn set_in(words: &mut [u64], slot: Slot) {
        let slot = usize::from(slot);
        if let Some(word) = words.get_mut(slot / 64) {
            *word |= 1 << (slot % 64);
        }
    }

    /// Removes every member not in `present`, calling `on_removed` for each.
    #[cfg(test)]
    pub(crate) fn retain_present(&mut self, present: &SlotSet, on_removed: impl FnMut(usize)) {
        self.retain_words(&present.words, on_removed);
    }

    /// Removes every member whose bit is clear in `present` (a word slice of the same
    /// layout; missing words count as empty), calling `on_removed` for each.
    pub(crate) fn retain_words(&mut self, present: &[u64], mut on_removed: impl FnMut(usize)) {
        let kept_words = present.iter().copied().chain(std::iter::repeat(0));
        for (at, (word, kept)) in self.words.iter_mut().zip(kept_words).enumerate() {
            let mut dropped = *word & !kept;
            *word &= kept;
            while dropped != 0 {
                let bit = dropped.trailing_zeros() as usize;
                on_removed(at * 64 + bit);
                dropped &= dropped - 1;
            }
        }
    }
}

/// Hashes block keys for the shard maps.
///
/// Block keys are already outputs of a cryptographic or xxh3 hash, so a keyed multiply-fold
/// mix is enough: it spreads engine-chosen values over buckets and shards and costs a few
/// cycles instead of SipHash's dozens. The per-index seed keeps bucket placement unpredictable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyHasherBuilder {
    seed: u64,
}

impl KeyHasherBuilder {
    pub(crate) fn random() -> Self {
        KeyHasherBuilder {
            seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
        }
    }

    /// The well-mixed 64-bit hash of `key` (shard choice uses its high bits, maps the low).
    pub(crate) fn mix(&self, key: u64) -> u64 {
        // 64×64→128-bit multiply, folded: every output bit depends on every input bit.
        let product = u128::from(key ^ self.seed) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
        (product as u64) ^ ((product >> 64) as u64)
    }
}

impl BuildHasher for KeyHasherBuilder {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            builder: *self,
            state: 0,
        }
    }
}

/// The [`Hasher`] of [`KeyHasherBuilder`]; only `u64` keys are hashed with it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyHasher {
    builder: KeyHasherBuilder,
    state: u64,
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used for u64 keys; fold bytes in so the hasher stays correct for any key type.
        for &byte in bytes {
            self.state = self.builder.mix(self.state ^ u64::from(byte));
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.state = self.builder.mix(self.state ^ key);
    }
}

/// A `u64`-keyed map using [`KeyHasherBuilder`].
pub(crate) type KeyMap<V> = std::collections::HashMap<u64, V, KeyHasherBuilder>;

/// A `u64` set using [`KeyHasherBuilder`].
pub(crate) type KeySet = std::collections::HashSet<u64, KeyHasherBuilder>;

/// Bytes a std/hashbrown table with this capacity has allocated for `(K, V)` entries:
/// buckets of entries plus one control byte per bucket and a 16-byte control tail.
pub(crate) fn table_bytes(capacity: usize, entry_size: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    // Inverse of hashbrown's bucket_mask_to_capacity: small tables keep one bucket free,
    // larger ones fill to 7/8.
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        capacity / 7 * 8
    };
    buckets * entry_size + buckets + 16
}

/// Shrinks a table that has emptied to under a quarter of its capacity, so removals give
/// memory back (a replica restart must not leave its high-water mark allocated).
pub(crate) fn shrink_if_sparse<K, V, S>(map: &mut std::collections::HashMap<K, V, S>)
where
    K: Eq + std::hash::Hash,
    S: BuildHasher,
{
    if map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

/// [`shrink_if_sparse`] for sets.
pub(crate) fn shrink_set_if_sparse<K, S>(set: &mut std::collections::HashSet<K, S>)
where
    K: Eq + std::hash::Hash,
    S: BuildHasher,
{
    if set.len() * 4 < set.capacity() {
        set.shrink_to(set.len() * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_stay_compact() {
        assert_eq!(std::mem::size_of::<Holders>(), 16);
        assert_eq!(std::mem::size_of::<(u64, Holders)>(), 24);
    }

    #[test]
    fn add_and_remove_media_per_slot() {
        let mut holders = Holders::new(3, Medium::Gpu);
        assert!(!holders.add(3, Medium::Cpu));
        assert!(holders.add(1, Medium::Gpu));
        assert!(holders.add(7, Medium::Storage));
        let slots: Vec<Slot> = holders.as_slice().iter().map(|h| h.slot).collect();
        assert_eq!(slots, [1, 3, 7]);

        let removal = holders.remove(3, Some(Medium::Gpu));
        assert_eq!(
            removal,
            Removal {
                was_held: true,
                slot_gone: false,
                set_empty: false
            }
        );
        let removal = holders.remove(3, Some(Medium::Gpu));
        assert!(!removal.was_held);
        let removal = holders.remove(3, Some(Medium::Cpu));
        assert_eq!(
            removal,
            Removal {
                was_held: true,
                slot_gone: true,
                set_empty: false
            }
        );
        assert!(!holders.remove(5, None).was_held);
        holders.remove(1, None);
        assert!(matches!(holders, Holders::One(Holder { slot: 7, .. })));
        let removal = holders.remove(7, None);
        assert_eq!(
            removal,
            Removal {
                was_held: true,
                slot_gone: true,
                set_empty: true
            }
        );
    }

    #[test]
    fn slot_set_reports_dropped_members() {
        let mut alive = SlotSet::with_slots(130);
        let mut present = SlotSet::with_slots(130);
        for slot in [0, 64, 129] {
            alive.insert(slot);
        }
        present.insert(64);
        let mut dropped = Vec::new();
        alive.retain_present(&present, |slot| dropped.push(slot));
        assert_eq!(dropped, [0, 129]);
        assert!(alive.contains(64) && !alive.contains(0));
        let mut words = vec![0; SlotSet::words_for(130)];
        SlotSet::set_in(&mut words, 64);
        alive.retain_words(&words, |_| panic!("64 is present"));
        alive.retain_words(&[], |slot| assert_eq!(slot, 64));
        assert!(alive.is_empty());
    }

    #[test]
    fn table_bytes_inverts_capacity() {
        let mut map: KeyMap<u64> = KeyMap::with_hasher(KeyHasherBuilder::random());
        assert_eq!(table_bytes(map.capacity(), 16), 0);
        for key in 0..1000 {
            map.insert(key, key);
            let capacity = map.capacity();
            let buckets = (table_bytes(capacity, 16) - 16) / 17;
            assert!(
                buckets.is_power_of_two(),
                "capacity {capacity} -> {buckets} buckets"
            );
        }
    }
}
