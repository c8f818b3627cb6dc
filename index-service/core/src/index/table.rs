//! One pool shard's block key → holders table, laid out for the match walk and read without
//! locks.
//!
//! Open addressing with linear probing over 16-byte entries (key, packed holder word), four to
//! a 64-byte line, so a lookup is usually one cache line and the walk can issue many lookups
//! back to back. (A std map needs a control-byte line and an entry line per lookup, and a boxed
//! holder list a third, one after the other.) The word holds a single holder inline; sets of two
//! or more live in side arenas: per-medium slot bitsets when every slot is below 64, so the walk
//! ORs a key's holders in with two word operations, and sorted lists (spill) otherwise.
//!
//! Deletion shifts the rest of the probe run back instead of leaving tombstones, so probe runs
//! stay short under churn.
//!
//! # Readers never wait for the writer
//!
//! The entries and the bitset arena are atomics, written only by the shard's one writer (the
//! caller holds the shard's mutex) and read by match walks without any lock: a seqlock. The
//! writer makes the shard's [`Storage`] version odd before it changes anything and even again
//! after; a reader notes the version before its loads and accepts what it loaded only if the
//! version is still the same even number after them (else it loads again). Growing, shrinking
//! or compacting builds a new `Storage`, publishes it in the pool's [`Layout`] and leaves the old
//! one's version odd for good, so a reader still looking at the old one retries on the new one.
//! Only spilled lists (pools of more than 64 replicas) sit behind a lock readers share.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};

use super::holders::{
    Holder, KeyHasherBuilder, MEDIA, MediaSet, MediaWords, Removal, Slot, SlotSet,
};
use super::paths::{Paths, RunRef};
use crate::event::Medium;

/// Entries per 64-byte line.
const LINE: usize = 4;
/// Smallest non-empty table, in entries.
const MIN_CAPACITY: usize = 2 * LINE;
/// Slots below this fit [`MediaWords`].
const NARROW_SLOTS: usize = 64;
/// Smallest non-empty bitset arena, in items.
const MIN_NARROW: usize = 4;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Entry {
    key: u64,
    /// [`Holding::encode`] in the low half (0 marks a vacant entry), the key's [`RunRef`] in
    /// the high half.
    word: u64,
}

/// The holding half of an entry's word.
const HOLDING_MASK: u64 = 0xFFFF_FFFF;
/// Arena indexes fit the holding half beside the tag.
const MAX_ARENA_INDEX: usize = 1 << (32 - TAG_BITS);

fn run_of(word: u64) -> RunRef {
    RunRef((word >> 32) as u32)
}

/// `holding`'s word keeping the run named by `word`.
fn keeping_run(word: u64, holding: Holding) -> u64 {
    holding.encode() | (word & !HOLDING_MASK)
}

/// Four entries as (key, word) atomics.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct Line([AtomicU64; 2 * LINE]);

/// One bitset arena item: [`MediaWords`] as atomics.
type AtomicMediaWords = [AtomicU64; MEDIA.len()];

const TAG_BITS: u32 = 2;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
const TAG_ONE: u64 = 1;
const TAG_NARROW: u64 = 2;
const TAG_WIDE: u64 = 3;

/// A decoded holder word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holding {
    Vacant,
    One(Holder),
    /// Index into the narrow arena.
    Narrow(usize),
    /// Index into the wide arena.
    Wide(usize),
}

impl Holding {
    fn decode(word: u64) -> Self {
        let word = word & HOLDING_MASK;
        match word & TAG_MASK {
            TAG_ONE => Holding::One(Holder {
                slot: (word >> 16) as Slot,
                media: MediaSet::from_bits((word >> 8) as u8),
            }),
            TAG_NARROW => Holding::Narrow((word >> TAG_BITS) as usize),
            TAG_WIDE => Holding::Wide((word >> TAG_BITS) as usize),
            _ => Holding::Vacant,
        }
    }

    fn encode(self) -> u64 {
        // A shard would need 2^30 multi-holder keys (32 GiB of bitsets) to pass this.
        debug_assert!(match self {
            Holding::Narrow(at) | Holding::Wide(at) => at < MAX_ARENA_INDEX,
            _ => true,
        });
        match self {
            Holding::Vacant => 0,
            Holding::One(holder) => {
                TAG_ONE | u64::from(holder.media.bits()) << 8 | u64::from(holder.slot) << 16
            }
            Holding::Narrow(at) => TAG_NARROW | (at as u64) << TAG_BITS,
            Holding::Wide(at) => TAG_WIDE | (at as u64) << TAG_BITS,
        }
    }
}

/// A key's holder word (0 when the key is absent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HolderWord(u64);

impl HolderWord {
    /// The run the key's entry names (checked by the run itself before it is trusted).
    #[inline]
    pub(crate) fn run(self) -> RunRef {
        run_of(self.0)
    }
}

/// The first entry of a key's probe run, loaded ahead by [`Storage::home_entry`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HomeEntry(Entry);

/// Items addressed by index, with freed indexes reused.
#[derive(Debug, Default)]
struct Arena<T> {
    items: Vec<T>,
    free: Vec<usize>,
}

impl<T: Default> Arena<T> {
    fn alloc(&mut self, item: T) -> usize {
        match self.free.pop() {
            Some(at) => {
                self.items[at] = item;
                at
            }
            None => {
                self.items.push(item);
                self.items.len() - 1
            }
        }
    }

    /// Frees `at`, returning its item.
    fn release(&mut self, at: usize) -> T {
        self.free.push(at);
        std::mem::take(&mut self.items[at])
    }
}

fn any_medium(words: &MediaWords) -> u64 {
    words.iter().fold(0, |any, word| any | word)
}

fn media_in_words(words: &MediaWords, slot: Slot) -> MediaSet {
    if usize::from(slot) >= NARROW_SLOTS {
        return MediaSet::default();
    }
    MEDIA
        .iter()
        .enumerate()
        .filter(|&(at, _)| words[at] & (1 << slot) != 0)
        .fold(MediaSet::default(), |media, (_, &medium)| {
            media.with(medium)
        })
}

const NOT_HELD: Removal = Removal {
    was_held: false,
    slot_gone: false,
    set_empty: false,
};

/// The version word on a line of its own: the writer bumps it on every change, and readers
/// load it twice per lookup, so it must not share a line with what either only reads.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Version(AtomicU64);

/// What the match walk reads of one shard: the entry lines and the bitset arena (atomics,
/// changed in place by the writer under the version), and the spilled lists.
#[derive(Debug)]
pub(crate) struct Storage {
    version: Version,
    /// Entry lines (any number: see [`home_of`]), or none.
    lines: Arc<[Line]>,
    narrow: Arc<[AtomicMediaWords]>,
    wide: Arc<RwLock<Arena<Vec<Holder>>>>,
}

fn new_lines(count: usize) -> Arc<[Line]> {
    (0..count).map(|_| Line::default()).collect()
}

fn new_narrow(count: usize) -> Arc<[AtomicMediaWords]> {
    (0..count).map(|_| AtomicMediaWords::default()).collect()
}

impl Storage {
    /// A new storage, its version odd: published mid-write, readable once the write ends.
    fn new(
        lines: Arc<[Line]>,
        narrow: Arc<[AtomicMediaWords]>,
        wide: Arc<RwLock<Arena<Vec<Holder>>>>,
    ) -> Self {
        Storage {
            version: Version(AtomicU64::new(1)),
            lines,
            narrow,
            wide,
        }
    }

    fn capacity(&self) -> usize {
        self.lines.len() * LINE
    }

    #[inline]
    fn load(&self, at: usize) -> Entry {
        let line = &self.lines[at / LINE].0;
        let field = at % LINE * 2;
        Entry {
            key: line[field].load(Ordering::Relaxed),
            word: line[field + 1].load(Ordering::Relaxed),
        }
    }

    fn store(&self, at: usize, entry: Entry) {
        let line = &self.lines[at / LINE].0;
        let field = at % LINE * 2;
        line[field].store(entry.key, Ordering::Relaxed);
        line[field + 1].store(entry.word, Ordering::Relaxed);
    }

    fn store_word(&self, at: usize, word: u64) {
        self.lines[at / LINE].0[at % LINE * 2 + 1].store(word, Ordering::Relaxed);
    }

    fn narrow_item(&self, at: usize) -> MediaWords {
        match self.narrow.get(at) {
            Some(item) => std::array::from_fn(|m| item[m].load(Ordering::Relaxed)),
            None => MediaWords::default(),
        }
    }

    fn set_narrow_item(&self, at: usize, words: MediaWords) {
        if let Some(item) = self.narrow.get(at) {
            for (atomic, word) in item.iter().zip(words) {
                atomic.store(word, Ordering::Relaxed);
            }
        }
    }

    /// The version to check a read against: even when no write is under way. Acquire: the
    /// loads after it see at least what the write that made it wrote.
    #[inline]
    pub(crate) fn read_begin(&self) -> u64 {
        self.version.0.load(Ordering::Acquire)
    }

    /// Whether what was loaded since [`Self::read_begin`] returned `begun` is one state of the
    /// table; the caller has issued [`read_fence`] after its loads.
    #[inline]
    pub(crate) fn read_valid(&self, begun: u64) -> bool {
        begun & 1 == 0 && self.version.0.load(Ordering::Relaxed) == begun
    }

    fn write_begin(&self) {
        let version = self.version.0.load(Ordering::Relaxed);
        self.version.0.store(version | 1, Ordering::Relaxed);
        // The odd version is visible before any change it covers.
        fence(Ordering::Release);
    }

    fn write_end(&self) {
        let version = self.version.0.load(Ordering::Relaxed);
        self.version.0.store((version | 1) + 1, Ordering::Release);
    }

    /// The entry where `hash`'s probe run starts (vacant when the table is empty). Branch-free
    /// on the loaded data, so a loop of these overlaps its cache misses.
    #[inline]
    pub(crate) fn home_entry(&self, hash: u64) -> HomeEntry {
        let capacity = self.capacity();
        if capacity == 0 {
            return HomeEntry::default();
        }
        HomeEntry(self.load(home_of(hash, capacity)))
    }

    /// Loads `hash`'s home line and returns a word of it (a writer's prefetch: see
    /// [`super::pool::Pool::prefetch`]).
    #[inline]
    pub(crate) fn touch(&self, hash: u64) -> u64 {
        self.home_entry(hash).0.word
    }

    /// The holder word of `key` (whose mix is `hash`). Bounded: a torn read of a table being
    /// changed may show no vacancy, and is rejected by the version check anyway.
    #[inline]
    pub(crate) fn holder_word(&self, key: u64, hash: u64) -> HolderWord {
        let capacity = self.capacity();
        if capacity == 0 {
            return HolderWord(0);
        }
        let mut at = home_of(hash, capacity);
        for _ in 0..capacity {
            let entry = self.load(at);
            if entry.word == 0 {
                return HolderWord(0);
            }
            if entry.key == key {
                return HolderWord(entry.word);
            }
            at = next_of(at, capacity);
        }
        HolderWord(0)
    }

    /// [`Self::holder_word`], given `key`'s [`Self::home_entry`] (usually `key`'s own entry).
    #[inline]
    pub(crate) fn resolve(&self, key: u64, hash: u64, home: HomeEntry) -> HolderWord {
        if home.0.key == key && home.0.word != 0 {
            HolderWord(home.0.word)
        } else {
            self.holder_word(key, hash)
        }
    }

    /// Sets the bit of every holder of `word` in `present` and of every GPU holder in `gpu`
    /// (word slices laid out like [`SlotSet`]; slots beyond them are ignored).
    #[inline]
    pub(crate) fn mark(&self, word: HolderWord, present: &mut [u64], gpu: &mut [u64]) {
        match Holding::decode(word.0) {
            Holding::Vacant => {}
            Holding::One(holder) => {
                SlotSet::set_in(present, holder.slot);
                if holder.media.has_gpu() {
                    SlotSet::set_in(gpu, holder.slot);
                }
            }
            Holding::Narrow(at) => {
                let words = self.narrow_item(at);
                if let (Some(present), Some(gpu)) = (present.first_mut(), gpu.first_mut()) {
                    *present |= any_medium(&words);
                    *gpu |= words[0];
                }
            }
            Holding::Wide(at) => {
                let wide = self.wide.read();
                for holder in wide.items.get(at).into_iter().flatten() {
                    SlotSet::set_in(present, holder.slot);
                    if holder.media.has_gpu() {
                        SlotSet::set_in(gpu, holder.slot);
                    }
                }
            }
        }
    }

    /// The holders of `word` in slots below 64, as (any medium, GPU) bitsets.
    #[inline]
    pub(crate) fn first_words(&self, word: HolderWord) -> (u64, u64) {
        match Holding::decode(word.0) {
            Holding::Vacant => (0, 0),
            Holding::One(holder) if usize::from(holder.slot) < NARROW_SLOTS => {
                let bit = 1 << holder.slot;
                (bit, if holder.media.has_gpu() { bit } else { 0 })
            }
            Holding::One(_) => (0, 0),
            Holding::Narrow(at) => {
                let words = self.narrow_item(at);
                (any_medium(&words), words[0])
            }
            Holding::Wide(_) => {
                let (mut present, mut gpu) = ([0], [0]);
                self.mark(word, &mut present, &mut gpu);
                (present[0], gpu[0])
            }
        }
    }
}

/// Where a probe run for `hash` starts in a table of `capacity` entries: the low 32 bits of the
/// mix scaled to the capacity (the high bits pick the shard), so any whole number of lines
/// works (a shrunk table is sized to its keys). Growth still doubles: growing by half (tables
/// 1/2–3/4 full) saved memory but doubled the match walk's time at fleet scale, more keys
/// sitting off their home entry (docs/benchmarks-history-2026-12.md, "Index against NVIDIA Dynamo's KV router index").
#[inline]
fn home_of(hash: u64, capacity: usize) -> usize {
    ((u64::from(hash as u32) * capacity as u64) >> 32) as usize
}

#[inline]
fn next_of(at: usize, capacity: usize) -> usize {
    if at + 1 == capacity { 0 } else { at + 1 }
}

/// Lines for at least `entries` entries, and at least [`MIN_CAPACITY`].
fn lines_for(entries: usize) -> usize {
    entries.max(MIN_CAPACITY).div_ceil(LINE)
}

/// Orders a reader's loads before its version check ([`Storage::read_valid`]).
#[inline]
pub(crate) fn read_fence() {
    fence(Ordering::Acquire);
}

/// Where match walks find each shard's current [`Storage`]; replaced (rarely: growth,
/// shrinking, compaction) by the shard's writer.
#[derive(Debug)]
pub(crate) struct Layout {
    storages: ArcSwap<Vec<Arc<Storage>>>,
    /// Serialises writers of different shards replacing their entries.
    replacing: Mutex<()>,
}

/// The storages of every shard as one walk sees them.
pub(crate) type LayoutView = arc_swap::Guard<Arc<Vec<Arc<Storage>>>>;

impl Layout {
    /// A layout of `shards` empty shards and their tables.
    pub(crate) fn with_tables(
        shards: usize,
        hasher: KeyHasherBuilder,
        paths: &Arc<Paths>,
    ) -> (Arc<Layout>, Vec<HolderTable>) {
        let storages: Vec<Arc<Storage>> = (0..shards)
            .map(|_| {
                let storage = Storage::new(new_lines(0), new_narrow(0), Arc::default());
                storage.write_end();
                Arc::new(storage)
            })
            .collect();
        let layout = Arc::new(Layout {
            storages: ArcSwap::from_pointee(storages.clone()),
            replacing: Mutex::new(()),
        });
        let tables = storages
            .into_iter()
            .enumerate()
            .map(|(shard, storage)| HolderTable {
                storage,
                len: 0,
                hasher,
                narrow_used: 0,
                narrow_free: Vec::new(),
                layout: Arc::clone(&layout),
                shard,
                paths: Arc::clone(paths),
            })
            .collect();
        (layout, tables)
    }

    #[inline]
    pub(crate) fn view(&self) -> LayoutView {
        self.storages.load()
    }

    fn replace(&self, shard: usize, storage: &Arc<Storage>) {
        let _replacing = self.replacing.lock();
        let mut next = Vec::clone(&self.storages.load());
        if let Some(entry) = next.get_mut(shard) {
            *entry = Arc::clone(storage);
        }
        self.storages.store(Arc::new(next));
    }
}

/// Block key → holders of one shard: the writer's side (see the module docs). The caller
/// serialises writers (the pool's shard mutex).
#[derive(Debug)]
pub(crate) struct HolderTable {
    storage: Arc<Storage>,
    /// Keys present; at most 3/4 of the entries.
    len: usize,
    hasher: KeyHasherBuilder,
    /// Narrow arena items ever handed out (the rest of `storage.narrow` is unused).
    narrow_used: usize,
    narrow_free: Vec<usize>,
    layout: Arc<Layout>,
    shard: usize,
    /// The pool's runs: a key's run is cut before its holders change.
    paths: Arc<Paths>,
}

impl HolderTable {
    /// A table of its own one-shard layout (tests).
    #[cfg(test)]
    pub(crate) fn new(hasher: KeyHasherBuilder) -> Self {
        let (_, mut tables) = Layout::with_tables(1, hasher, &Arc::default());
        tables.remove(0)
    }

    /// Its storage, consistent while the caller holds the writer's lock.
    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    fn capacity(&self) -> usize {
        self.storage.capacity()
    }

    fn entry(&self, at: usize) -> Entry {
        self.storage.load(at)
    }

    fn set_entry(&self, at: usize, entry: Entry) {
        self.storage.store(at, entry);
    }

    /// Sets entry `at`'s holding, keeping its run (a change of holders unlinks it first).
    fn set_word(&self, at: usize, holding: Holding) {
        let word = self.entry(at).word;
        self.storage.store_word(at, keeping_run(word, holding));
    }

    /// Ends the run of entry `at` before it and forgets it: called before a change of which
    /// slots hold the key (in any medium, or on the GPU) becomes visible.
    fn unlink(&self, at: usize) {
        let Entry { key, word } = self.entry(at);
        let run = run_of(word);
        if run.is_some() {
            self.paths.cut(run, key);
            self.storage.store_word(at, word & HOLDING_MASK);
        }
    }

    /// Names `run` in `key`'s entry if the key's holders (slots below 64, any medium and GPU)
    /// are `holders` and no live run covers it already (a new run does not take keys from
    /// another one: both would be cut shorter in turn). Not a change of holders, so no version
    /// bump: a reader sees the word before or after, the holding the same. The caller holds the
    /// shard lock, and grows the run over the key before releasing it.
    pub(crate) fn link(&mut self, key: u64, hash: u64, holders: (u64, u64), run: RunRef) -> bool {
        let Some(at) = self.find(key, hash) else {
            return false;
        };
        let word = self.entry(at).word;
        let old = run_of(word);
        if self.storage.first_words(HolderWord(word)) != holders || self.paths.vouches(old, key) {
            return false;
        }
        // The old run (if any) does not cover the key and never will again (a run only
        // grows while it is built): forgetting it loses nothing.
        self.storage
            .store_word(at, (word & HOLDING_MASK) | u64::from(run.0) << 32);
        true
    }

    /// Where `key`'s probe run starts; the table must not be empty.
    fn home(&self, hash: u64) -> usize {
        home_of(hash, self.capacity())
    }

    /// The entry holding `key` (whose mix is `hash`).
    #[inline]
    fn find(&self, key: u64, hash: u64) -> Option<usize> {
        if self.capacity() == 0 {
            return None;
        }
        let capacity = self.capacity();
        let mut at = self.home(hash);
        loop {
            let entry = self.entry(at);
            if entry.word == 0 {
                return None;
            }
            if entry.key == key {
                return Some(at);
            }
            at = next_of(at, capacity);
        }
    }

    /// The first vacant entry of `hash`'s probe run; the table must have one.
    fn vacancy(storage: &Storage, hash: u64) -> usize {
        let capacity = storage.capacity();
        let mut at = home_of(hash, capacity);
        while storage.load(at).word != 0 {
            at = next_of(at, capacity);
        }
        at
    }

    /// The holder word of `key`.
    #[cfg(test)]
    fn holder_word(&self, key: u64, hash: u64) -> HolderWord {
        self.storage.holder_word(key, hash)
    }

    fn narrow_alloc(&mut self, words: MediaWords) -> usize {
        let at = match self.narrow_free.pop() {
            Some(at) => at,
            None => {
                if self.narrow_used == self.storage.narrow.len() {
                    self.grow_narrow();
                }
                self.narrow_used += 1;
                self.narrow_used - 1
            }
        };
        self.storage.set_narrow_item(at, words);
        at
    }

    fn narrow_release(&mut self, at: usize) -> MediaWords {
        self.narrow_free.push(at);
        self.storage.narrow_item(at)
    }

    /// Doubles the bitset arena: a new storage sharing the entry lines.
    fn grow_narrow(&mut self) {
        let narrow = new_narrow((self.storage.narrow.len() * 2).max(MIN_NARROW));
        for (new, old) in narrow.iter().zip(self.storage.narrow.iter()) {
            for (new, old) in new.iter().zip(old) {
                new.store(old.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
        let storage = Storage::new(
            Arc::clone(&self.storage.lines),
            narrow,
            Arc::clone(&self.storage.wide),
        );
        self.install(storage);
    }

    /// Publishes `storage` (mid-write, odd) in place of the current one, which stays odd: any
    /// reader of it retries on the new one.
    fn install(&mut self, storage: Storage) {
        let storage = Arc::new(storage);
        self.layout.replace(self.shard, &storage);
        self.storage = storage;
    }

    /// Runs one change of the table under an odd version.
    fn write<R>(&mut self, change: impl FnOnce(&mut Self) -> R) -> R {
        self.storage.write_begin();
        let result = change(self);
        self.storage.write_end();
        result
    }

    fn media_in(&self, holding: Holding, slot: Slot) -> MediaSet {
        match holding {
            Holding::Vacant => MediaSet::default(),
            Holding::One(holder) if holder.slot == slot => holder.media,
            Holding::One(_) => MediaSet::default(),
            Holding::Narrow(at) => media_in_words(&self.storage.narrow_item(at), slot),
            Holding::Wide(at) => {
                let wide = self.storage.wide.read();
                let list = wide.items.get(at).map_or(&[][..], Vec::as_slice);
                match list.binary_search_by_key(&slot, |h| h.slot) {
                    Ok(found) => list[found].media,
                    Err(_) => MediaSet::default(),
                }
            }
        }
    }

    /// The media `slot` holds `key` in (empty when it does not hold it).
    pub(crate) fn media_of(&self, key: u64, hash: u64, slot: Slot) -> MediaSet {
        match self.find(key, hash) {
            Some(at) => self.media_in(Holding::decode(self.entry(at).word), slot),
            None => MediaSet::default(),
        }
    }

    /// The holders of `holding` sorted by slot, releasing its arena item.
    fn take_sorted(&mut self, holding: Holding) -> Vec<Holder> {
        match holding {
            Holding::Vacant => Vec::new(),
            Holding::One(holder) => vec![holder],
            Holding::Narrow(at) => {
                let words = self.narrow_release(at);
                let mut slots = any_medium(&words);
                let mut holders = Vec::with_capacity(slots.count_ones() as usize);
                while slots != 0 {
                    // Below 64, so it fits a slot.
                    let slot = slots.trailing_zeros() as Slot;
                    slots &= slots - 1;
                    let media = media_in_words(&words, slot);
                    holders.push(Holder { slot, media });
                }
                holders
            }
            Holding::Wide(at) => self.storage.wide.write().release(at),
        }
    }

    /// The compact form of a holder list sorted by slot.
    fn place(&mut self, holders: Vec<Holder>) -> Holding {
        match holders.as_slice() {
            [] => Holding::Vacant,
            [single] => Holding::One(*single),
            _ if holders.iter().all(|h| usize::from(h.slot) < NARROW_SLOTS) => {
                let mut words = MediaWords::default();
                for holder in &holders {
                    for (at, &medium) in MEDIA.iter().enumerate() {
                        if holder.media.contains(medium) {
                            words[at] |= 1 << holder.slot;
                        }
                    }
                }
                Holding::Narrow(self.narrow_alloc(words))
            }
            _ => {
                let mut holders = holders;
                holders.shrink_to_fit();
                Holding::Wide(self.storage.wide.write().alloc(holders))
            }
        }
    }

    /// Records that `slot` holds `key` in `medium`; returns the media it held `key` in before.
    pub(crate) fn add(&mut self, key: u64, hash: u64, slot: Slot, medium: Medium) -> MediaSet {
        self.write(|table| table.add_inner(key, hash, slot, medium))
    }

    fn add_inner(&mut self, key: u64, hash: u64, slot: Slot, medium: Medium) -> MediaSet {
        let Some(at) = self.find(key, hash) else {
            self.reserve_one();
            let at = Self::vacancy(&self.storage, hash);
            let holder = Holder {
                slot,
                media: MediaSet::only(medium),
            };
            self.set_entry(
                at,
                Entry {
                    key,
                    word: Holding::One(holder).encode(),
                },
            );
            self.len += 1;
            return MediaSet::default();
        };
        let bit = MediaSet::index(medium);
        let holding = Holding::decode(self.entry(at).word);
        let before = self.media_in(holding, slot);
        if before.is_empty() || medium == Medium::Gpu && !before.has_gpu() {
            self.unlink(at);
        }
        match holding {
            Holding::One(holder) if holder.slot == slot => {
                let media = holder.media.with(medium);
                self.set_word(at, Holding::One(Holder { slot, media }));
            }
            Holding::Narrow(item) if usize::from(slot) < NARROW_SLOTS => {
                if let Some(words) = self.storage.narrow.get(item) {
                    words[bit].fetch_or(1 << slot, Ordering::Relaxed);
                }
            }
            Holding::Wide(item) => {
                let mut wide = self.storage.wide.write();
                if let Some(list) = wide.items.get_mut(item) {
                    match list.binary_search_by_key(&slot, |h| h.slot) {
                        Ok(found) => list[found].media = list[found].media.with(medium),
                        Err(insert_at) => {
                            let media = MediaSet::only(medium);
                            list.insert(insert_at, Holder { slot, media });
                            list.shrink_to_fit();
                        }
                    }
                }
            }
            // A second holder, or a slot of 64 and up joining a bitset.
            holding => {
                let mut holders = self.take_sorted(holding);
                let insert_at = holders.partition_point(|h| h.slot < slot);
                let media = MediaSet::only(medium);
                holders.insert(insert_at, Holder { slot, media });
                let placed = self.place(holders);
                self.set_word(at, placed);
            }
        }
        before
    }

    /// The keys `slot` holds in any medium (O(entries): resets and debug listings only).
    pub(crate) fn keys_held_by(&self, slot: Slot) -> Vec<u64> {
        (0..self.capacity())
            .map(|at| self.entry(at))
            .filter(|entry| !self.media_in(Holding::decode(entry.word), slot).is_empty())
            .map(|entry| entry.key)
            .collect()
    }

    /// Removes `medium` (or every medium when `None`) from `slot`'s holding of `key`.
    pub(crate) fn remove(
        &mut self,
        key: u64,
        hash: u64,
        slot: Slot,
        medium: Option<Medium>,
    ) -> Removal {
        let Some(at) = self.find(key, hash) else {
            return NOT_HELD;
        };
        let holding = Holding::decode(self.entry(at).word);
        let media = self.media_in(holding, slot);
        if media.is_empty() {
            return NOT_HELD;
        }
        // Whether the slot leaves the key's holders, or its GPU holders.
        let changes = match medium {
            None => true,
            Some(medium) => {
                media.contains(medium)
                    && (media.without(medium).is_empty() || medium == Medium::Gpu)
            }
        };
        self.write(|table| {
            if changes {
                table.unlink(at);
            }
            table.remove_inner(at, holding, media, slot, medium)
        })
    }

    fn remove_inner(
        &mut self,
        at: usize,
        holding: Holding,
        media: MediaSet,
        slot: Slot,
        medium: Option<Medium>,
    ) -> Removal {
        let (was_held, left) = match medium {
            Some(medium) => (media.contains(medium), media.without(medium)),
            None => (true, MediaSet::default()),
        };
        if !left.is_empty() {
            match holding {
                Holding::One(_) => self.set_word(at, Holding::One(Holder { slot, media: left })),
                Holding::Narrow(item) => {
                    if let Some(words) = self.storage.narrow.get(item) {
                        for (word, &medium) in words.iter().zip(&MEDIA) {
                            if !left.contains(medium) {
                                word.fetch_and(!(1 << slot), Ordering::Relaxed);
                            }
                        }
                    }
                }
                Holding::Wide(item) => {
                    let mut wide = self.storage.wide.write();
                    if let Some(list) = wide.items.get_mut(item)
                        && let Ok(found) = list.binary_search_by_key(&slot, |h| h.slot)
                    {
                        list[found].media = left;
                    }
                }
                Holding::Vacant => {}
            }
            return Removal {
                was_held,
                slot_gone: false,
                set_empty: false,
            };
        }
        if let Holding::Narrow(item) = holding {
            let mut words = self.storage.narrow_item(item);
            words.iter_mut().for_each(|word| *word &= !(1 << slot));
            if any_medium(&words).count_ones() >= 2 {
                self.storage.set_narrow_item(item, words);
                return Removal {
                    was_held,
                    slot_gone: true,
                    set_empty: false,
                };
            }
        }
        let mut rest = self.take_sorted(holding);
        rest.retain(|h| h.slot != slot);
        let set_empty = rest.is_empty();
        if set_empty {
            self.delete(at);
        } else {
            let placed = self.place(rest);
            self.set_word(at, placed);
        }
        self.shrink_if_sparse();
        Removal {
            was_held,
            slot_gone: true,
            set_empty,
        }
    }

    /// Empties entry `at`, shifting later entries of its probe run back into the hole.
    fn delete(&mut self, mut hole: usize) {
        let capacity = self.capacity();
        // Probe distance from `from` forward to `to`, wrapping.
        let distance = |from: usize, to: usize| (to + capacity - from) % capacity;
        let mut next = next_of(hole, capacity);
        loop {
            let entry = self.entry(next);
            if entry.word == 0 {
                break;
            }
            let home = self.home(self.hasher.mix(entry.key));
            // The entry may fill the hole when the hole lies on its probe run (home..next).
            if distance(hole, next) <= distance(home, next) {
                self.set_entry(hole, entry);
                hole = next;
            }
            next = next_of(next, capacity);
        }
        self.set_entry(hole, Entry::default());
        self.len -= 1;
    }

    /// Makes room for one more key (load stays at most 3/4).
    fn reserve_one(&mut self) {
        if (self.len + 1) * 4 > self.capacity() * 3 {
            self.rebuild(lines_for(self.capacity() * 2) * LINE);
        }
    }

    /// Gives memory back once the table is under 1/8 full, or its arenas' free items outnumber
    /// 1/8 of its entries, so a replica restart does not leave the high-water mark allocated.
    /// (Either way the O(entries) rebuild is paid for by at least entries/8 removals.)
    fn shrink_if_sparse(&mut self) {
        let sparse = self.len * 8 < self.capacity() && self.capacity() > MIN_CAPACITY;
        let wide_free = self.storage.wide.read().free.len();
        let arenas_sparse = (self.narrow_free.len() + wide_free) * 8 > self.capacity();
        if self.len == 0 {
            self.narrow_used = 0;
            self.narrow_free = Vec::new();
            let storage = Storage::new(new_lines(0), new_narrow(0), Arc::default());
            self.install(storage);
        } else if sparse || arenas_sparse {
            let capacity = lines_for(self.len * 2) * LINE;
            self.rebuild(capacity.min(self.capacity()));
        }
    }

    /// Re-inserts every key into a new storage of `capacity` entries (whole lines) with
    /// compacted arenas, and publishes it.
    fn rebuild(&mut self, capacity: usize) {
        let old = Arc::clone(&self.storage);
        let narrow_live = self.narrow_used - self.narrow_free.len();
        let narrow_capacity = if narrow_live == 0 {
            0
        } else {
            narrow_live.next_power_of_two().max(MIN_NARROW)
        };
        let mut old_wide = std::mem::take(&mut *old.wide.write());
        let mut wide = Arena::default();
        let storage = Storage::new(
            new_lines(capacity / LINE),
            new_narrow(narrow_capacity),
            Arc::default(),
        );
        let mut narrow_used = 0;
        for at in 0..old.capacity() {
            let entry = old.load(at);
            let holding = match Holding::decode(entry.word) {
                Holding::Vacant => continue,
                Holding::Narrow(item) => {
                    storage.set_narrow_item(narrow_used, old.narrow_item(item));
                    narrow_used += 1;
                    Holding::Narrow(narrow_used - 1)
                }
                Holding::Wide(item) => Holding::Wide(wide.alloc(old_wide.release(item))),
                one => one,
            };
            let at = Self::vacancy(&storage, self.hasher.mix(entry.key));
            storage.store(
                at,
                Entry {
                    key: entry.key,
                    word: keeping_run(entry.word, holding),
                },
            );
        }
        *storage.wide.write() = wide;
        self.narrow_used = narrow_used;
        self.narrow_free = Vec::new();
        self.install(storage);
    }

    /// Whether no key is present.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keys present.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// (key, holder) pairs present.
    pub(crate) fn holdings(&self) -> usize {
        let wide = self.storage.wide.read();
        (0..self.capacity())
            .map(|at| match Holding::decode(self.entry(at).word) {
                Holding::Vacant => 0,
                Holding::One(_) => 1,
                Holding::Narrow(item) => {
                    any_medium(&self.storage.narrow_item(item)).count_ones() as usize
                }
                Holding::Wide(item) => wide.items.get(item).map_or(0, Vec::len),
            })
            .sum()
    }

    /// Bytes allocated: lines, arenas and spilled lists.
    pub(crate) fn memory_bytes(&self) -> usize {
        let wide = self.storage.wide.read();
        let lists: usize = wide
            .items
            .iter()
            .map(|list| list.capacity() * size_of::<Holder>())
            .sum();
        self.storage.lines.len() * size_of::<Line>()
            + self.storage.narrow.len() * size_of::<AtomicMediaWords>()
            + wide.items.capacity() * size_of::<Vec<Holder>>()
            + (self.narrow_free.capacity() + wide.free.capacity()) * size_of::<usize>()
            + lists
    }
}

#[cfg(test)]
mod tests;
