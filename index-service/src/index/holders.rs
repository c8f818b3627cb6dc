//! Compact per-key holder sets and the slot bitsets the match walk works on.
//!
//! Every indexed block key maps to the replicas (pool slots) holding it, each with the media it
//! is held in. Most keys are held by one replica (the unique tail of a conversation), a few by
//! many (shared system prompts). So a set is one inline [`Holder`], or, for two or more holders
//! in slots below 64 (pools of up to 64 replicas), one bitset word per medium: the match walk
//! then reads a key's holders with two word operations instead of expanding a list. Larger
//! pools spill to a sorted list. 16 bytes in the map in every case.

use std::hash::{BuildHasher, Hasher};

use crate::event::Medium;

/// Index of a replica inside its pool (dense, reused after removal).
pub(crate) type Slot = u16;

/// Media tracked per holding; [`MediaWords`] has a word per medium in this order.
const MEDIA: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Other];

/// The media one replica holds one block in (bit per [`Medium`], in [`MEDIA`] order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MediaSet(u8);

impl MediaSet {
    fn index(medium: Medium) -> usize {
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

/// Slots below this fit [`MediaWords`].
const NARROW_SLOTS: usize = 64;

/// Per medium (in [`MEDIA`] order), the slots holding the block: bit `s` of word `m` is set when
/// slot `s` holds it in medium `m`.
type MediaWords = [u64; MEDIA.len()];

/// Holders in slots of 64 and up, sorted by slot (a thin box keeps [`Holders`] at 16 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WideHolders(Vec<Holder>);

/// The replicas holding one block key; never empty (the key is dropped with its last holder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Holders {
    One(Holder),
    /// Two or more holders, every slot below 64.
    Narrow(Box<MediaWords>),
    /// Two or more holders, some slot 64 or above. Rebuilt on change: sets this large are the
    /// hot shared prefixes, which change rarely compared with how often they are read.
    Wide(Box<WideHolders>),
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

const NOT_HELD: Removal = Removal {
    was_held: false,
    slot_gone: false,
    set_empty: false,
};

fn any_medium(words: &MediaWords) -> u64 {
    words.iter().fold(0, |any, word| any | word)
}

impl Holders {
    pub(crate) fn new(slot: Slot, medium: Medium) -> Self {
        Holders::One(Holder {
            slot,
            media: MediaSet::only(medium),
        })
    }

    /// The compact form of a non-empty holder list sorted by slot.
    fn from_sorted(holders: Vec<Holder>) -> Self {
        match holders.as_slice() {
            [single] => Holders::One(*single),
            _ if holders.iter().all(|h| usize::from(h.slot) < NARROW_SLOTS) => {
                let mut words = MediaWords::default();
                for holder in &holders {
                    for (at, &medium) in MEDIA.iter().enumerate() {
                        if holder.media.contains(medium) {
                            words[at] |= 1 << holder.slot;
                        }
                    }
                }
                Holders::Narrow(Box::new(words))
            }
            _ => Holders::Wide(Box::new(WideHolders(holders))),
        }
    }

    /// The holders, sorted by slot (ingest paths that change the representation; O(holders)).
    fn to_sorted(&self) -> Vec<Holder> {
        match self {
            Holders::One(holder) => vec![*holder],
            Holders::Narrow(words) => {
                let mut holders = Vec::with_capacity(any_medium(words).count_ones() as usize);
                let mut slots = any_medium(words);
                while slots != 0 {
                    let slot = slots.trailing_zeros();
                    slots &= slots - 1;
                    let media = MediaSet(
                        (0..MEDIA.len())
                            .filter(|&at| words[at] & (1 << slot) != 0)
                            .fold(0, |bits, at| bits | 1 << at),
                    );
                    // `slot` < 64, so it fits.
                    holders.push(Holder {
                        slot: slot as Slot,
                        media,
                    });
                }
                holders
            }
            Holders::Wide(wide) => wide.0.clone(),
        }
    }

    /// Holders in the set.
    pub(crate) fn len(&self) -> usize {
        match self {
            Holders::One(_) => 1,
            Holders::Narrow(words) => any_medium(words).count_ones() as usize,
            Holders::Wide(wide) => wide.0.len(),
        }
    }

    /// The media `slot` holds the block in (empty when it does not hold it).
    pub(crate) fn media_of(&self, slot: Slot) -> MediaSet {
        match self {
            Holders::One(holder) if holder.slot == slot => holder.media,
            Holders::One(_) => MediaSet::default(),
            Holders::Narrow(words) if usize::from(slot) < NARROW_SLOTS => MediaSet(
                (0..MEDIA.len())
                    .filter(|&at| words[at] & (1 << slot) != 0)
                    .fold(0, |bits, at| bits | 1 << at),
            ),
            Holders::Narrow(_) => MediaSet::default(),
            Holders::Wide(wide) => match wide.0.binary_search_by_key(&slot, |h| h.slot) {
                Ok(at) => wide.0[at].media,
                Err(_) => MediaSet::default(),
            },
        }
    }

    /// Sets the bit of every holder in `present` and of every GPU holder in `gpu` (word slices
    /// laid out like [`SlotSet`]; slots beyond them are ignored).
    #[inline]
    pub(crate) fn mark(&self, present: &mut [u64], gpu: &mut [u64]) {
        match self {
            Holders::One(holder) => {
                SlotSet::set_in(present, holder.slot);
                if holder.media.has_gpu() {
                    SlotSet::set_in(gpu, holder.slot);
                }
            }
            Holders::Narrow(words) => {
                if let (Some(present), Some(gpu)) = (present.first_mut(), gpu.first_mut()) {
                    *present |= any_medium(words);
                    *gpu |= words[0];
                }
            }
            Holders::Wide(wide) => {
                for holder in &wide.0 {
                    SlotSet::set_in(present, holder.slot);
                    if holder.media.has_gpu() {
                        SlotSet::set_in(gpu, holder.slot);
                    }
                }
            }
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
            Holders::Narrow(words) if usize::from(slot) < NARROW_SLOTS => {
                let bit = 1 << slot;
                let added = any_medium(words) & bit == 0;
                words[MediaSet::index(medium)] |= bit;
                added
            }
            Holders::Wide(wide) => match wide.0.binary_search_by_key(&slot, |h| h.slot) {
                Ok(at) => {
                    wide.0[at].media = wide.0[at].media.with(medium);
                    false
                }
                Err(at) => {
                    let holder = Holder {
                        slot,
                        media: MediaSet::only(medium),
                    };
                    wide.0.insert(at, holder);
                    wide.0.shrink_to_fit();
                    true
                }
            },
            // A second holder, or a slot of 64 and up joining a narrow set.
            Holders::One(_) | Holders::Narrow(_) => {
                let mut holders = self.to_sorted();
                let at = holders.partition_point(|h| h.slot < slot);
                let holder = Holder {
                    slot,
                    media: MediaSet::only(medium),
                };
                holders.insert(at, holder);
                *self = Self::from_sorted(holders);
                true
            }
        }
    }

    /// Removes `medium` (or every medium when `None`) from `slot`'s holding.
    pub(crate) fn remove(&mut self, slot: Slot, medium: Option<Medium>) -> Removal {
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
            Holders::One(_) => NOT_HELD,
            Holders::Narrow(_) if usize::from(slot) >= NARROW_SLOTS => NOT_HELD,
            Holders::Narrow(words) => {
                let bit = 1 << slot;
                if any_medium(words) & bit == 0 {
                    return NOT_HELD;
                }
                let was_held = match medium {
                    Some(medium) => {
                        let word = &mut words[MediaSet::index(medium)];
                        let held = *word & bit != 0;
                        *word &= !bit;
                        held
                    }
                    None => {
                        words.iter_mut().for_each(|word| *word &= !bit);
                        true
                    }
                };
                let slot_gone = any_medium(words) & bit == 0;
                if any_medium(words).count_ones() == 1 {
                    *self = Self::from_sorted(self.to_sorted());
                }
                Removal {
                    was_held,
                    slot_gone,
                    set_empty: false,
                }
            }
            Holders::Wide(wide) => {
                let Ok(at) = wide.0.binary_search_by_key(&slot, |h| h.slot) else {
                    return NOT_HELD;
                };
                let (was_held, left) = strip(wide.0[at].media);
                wide.0[at].media = left;
                if !left.is_empty() {
                    return Removal {
                        was_held,
                        slot_gone: false,
                        set_empty: false,
                    };
                }
                let mut rest = std::mem::take(&mut wide.0);
                rest.remove(at);
                *self = Self::from_sorted(rest);
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
            Holders::Narrow(_) => size_of::<MediaWords>(),
            Holders::Wide(wide) => {
                size_of::<WideHolders>() + wide.0.capacity() * size_of::<Holder>()
            }
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

    /// Words in this set.
    pub(crate) fn word_count(&self) -> usize {
        self.words.len()
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

    /// The same add/remove sequence in every representation: slots `low < mid < high` all
    /// below 64 (bitset words) or not (sorted list), shrinking to a single inline holder.
    fn add_and_remove_media(low: Slot, mid: Slot, high: Slot) {
        let mut holders = Holders::new(mid, Medium::Gpu);
        assert!(!holders.add(mid, Medium::Cpu));
        assert!(holders.add(low, Medium::Gpu));
        assert!(holders.add(high, Medium::Storage));
        let slots: Vec<Slot> = holders.to_sorted().iter().map(|h| h.slot).collect();
        assert_eq!(slots, [low, mid, high]);
        assert_eq!(holders.len(), 3);
        assert_eq!(
            holders.media_of(mid),
            MediaSet::only(Medium::Gpu).with(Medium::Cpu)
        );
        let words = SlotSet::words_for(usize::from(high) + 1);
        let (mut present, mut gpu) = (vec![0; words], vec![0; words]);
        holders.mark(&mut present, &mut gpu);
        let mut expected = (vec![0; words], vec![0; words]);
        for slot in [low, mid, high] {
            SlotSet::set_in(&mut expected.0, slot);
        }
        SlotSet::set_in(&mut expected.1, low);
        SlotSet::set_in(&mut expected.1, mid);
        assert_eq!((present, gpu), expected);

        let removal = holders.remove(mid, Some(Medium::Gpu));
        assert_eq!(
            removal,
            Removal {
                was_held: true,
                slot_gone: false,
                set_empty: false
            }
        );
        let removal = holders.remove(mid, Some(Medium::Gpu));
        assert!(!removal.was_held);
        let removal = holders.remove(mid, Some(Medium::Cpu));
        assert_eq!(
            removal,
            Removal {
                was_held: true,
                slot_gone: true,
                set_empty: false
            }
        );
        assert!(!holders.remove(high - 1, None).was_held);
        holders.remove(low, None);
        assert_eq!(
            holders.to_sorted(),
            [Holder {
                slot: high,
                media: MediaSet::only(Medium::Storage)
            }]
        );
        assert!(matches!(holders, Holders::One(_)));
        let removal = holders.remove(high, None);
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
    fn add_and_remove_media_per_slot() {
        add_and_remove_media(1, 3, 7);
        add_and_remove_media(0, 3, 63);
        add_and_remove_media(1, 3, 70);
        add_and_remove_media(1, 64, 300);
    }

    #[test]
    fn representation_follows_the_slots() {
        let mut holders = Holders::new(5, Medium::Gpu);
        holders.add(9, Medium::Cpu);
        assert!(matches!(holders, Holders::Narrow(_)));
        holders.add(100, Medium::Gpu);
        assert!(matches!(holders, Holders::Wide(_)));
        assert_eq!(holders.len(), 3);
        assert!(holders.remove(100, None).slot_gone);
        assert!(matches!(holders, Holders::Narrow(_)));
        assert_eq!(holders.heap_bytes(), 32);
        assert!(holders.remove(5, Some(Medium::Gpu)).slot_gone);
        assert_eq!(holders, Holders::new(9, Medium::Cpu));
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
