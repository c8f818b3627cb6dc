//! Holder vocabulary (slots, media, removals), the slot bitsets the match walk works on, and
//! the block key maps. The per-key holder sets themselves live in [`super::table`].

use std::hash::BuildHasher;

pub(crate) use kvroute_block_keys::KeyHasherBuilder;

use crate::event::Medium;

/// Index of a replica inside its pool (dense, reused after removal).
pub(crate) type Slot = u16;

/// Media tracked per holding; [`MediaWords`] has a word per medium in this order.
pub(crate) const MEDIA: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Other];

/// The media one replica holds one block in (bit per [`Medium`], in [`MEDIA`] order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MediaSet(u8);

impl MediaSet {
    pub(crate) fn index(medium: Medium) -> usize {
        match medium {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
            Medium::Storage => 2,
            Medium::Other => 3,
        }
    }

    fn bit(medium: Medium) -> u8 {
        1 << Self::index(medium)
    }

    pub(crate) fn from_bits(bits: u8) -> Self {
        MediaSet(bits)
    }

    pub(crate) fn bits(self) -> u8 {
        self.0
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

    pub(crate) fn with(self, medium: Medium) -> Self {
        MediaSet(self.0 | Self::bit(medium))
    }

    pub(crate) fn without(self, medium: Medium) -> Self {
        MediaSet(self.0 & !Self::bit(medium))
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// One replica holding one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) slot: Slot,
    pub(crate) media: MediaSet,
}

/// Per medium (in [`MEDIA`] order), the slots below 64 holding a block: bit `s` of word `m` is
/// set when slot `s` holds it in medium `m`.
pub(crate) type MediaWords = [u64; MEDIA.len()];

/// What removing a holding left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Removal {
    /// The slot held the block in the removed medium.
    pub(crate) was_held: bool,
    /// The slot no longer holds the block in any medium.
    pub(crate) slot_gone: bool,
    /// No slot holds the block any more: drop the key.
    pub(crate) set_empty: bool,
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

    /// Words in this set.
    pub(crate) fn word_count(&self) -> usize {
        self.words.len()
    }

    /// Words per set for `slots` slots.
    #[cfg(test)]
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

/// A `u64`-keyed map using [`KeyHasherBuilder`].
pub(crate) type KeyMap<V> = std::collections::HashMap<u64, V, KeyHasherBuilder>;

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

#[cfg(test)]
mod tests {
    use super::*;

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
