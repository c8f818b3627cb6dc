//! Prompt paths: runs of consecutive prompt keys that have the same holders, each stored as one
//! contiguous array, so a match walk compares a run's keys with the prompt's in one sequential
//! loop instead of looking each key up in the shard tables.
//!
//! Runs are built two ways, the same way once their keys and holders are known: keys are
//! grouped into stretches of equal holders and each key's table entry is linked to its run
//! and offset (the spare high half of its holder word).
//! - **From a `BlockStored`**, right after the writer stored its keys (a chain, in order): a
//!   prompt's first walk then follows the runs of the events that stored it instead of looking
//!   2,000 keys up one by one (a 32k-token prompt's first walk: ≈ 0.15 ms).
//! - **From a walk**: the keys a match walk had to look up one by one (with their holders,
//!   which it read anyway) are grouped, and a stretch met by a walk for the second time is
//!   linked (what events' runs do not cover: stretches another replica's store cut, prompts
//!   stored before a restart of the index).
//!
//! Runs are compared by bisection, trusting that their keys are a chain (see
//! [`common_prefix`]). A walk's runs are kvroute's own prompt keys. An event's keys are the
//! engine's chain (vLLM hashes each block with its parent's hash) or, in token-chain pools,
//! keys the index chained itself from the event's tokens. An engine that published keys out of
//! order gains little: a compare stops right after a key it found equal (short of a writer's
//! cut racing it), so a walk credits the run's holders, who all hold that key, with the prompt
//! keys before it — which a replica holding a chained key computed, and which a lying engine
//! could claim outright by publishing them.
//!
//! The run is a cache beside the exact per-key tables, never the truth:
//!
//! - **Invariant:** every key at an offset below a live run's length holds exactly the run's
//!   holders (any medium, GPU). A key is linked, and the length grown over it, under the key's
//!   shard lock after its holders were checked; a writer changing which slots hold a key (under
//!   the same lock) first cuts the key's run to end before it (`len = min(len, offset)`), then
//!   changes the key. A later walk reads the cut-off keys from the tables and links them again.
//! - **Readers never wait.** A run's fields and keys are atomics under a generation (a seqlock:
//!   odd while the slot is dead or being filled): a reader notes the generation, compares, and
//!   accepts what it compared only if the generation is unchanged and only up to the length it
//!   reads last (a cut during the compare shortens the answer, it does not spoil it).
//! - **Bounded.** At most [`MAX_KEYS`] keys and [`MAX_RUNS`] runs per pool, allocated in segments
//!   as needed and reused in a ring: the builder's cursor wraps, and entering a key segment (or
//!   a run slot) again drops the runs still there, the oldest; the whole cache is freed when the
//!   pool empties. Keys still naming a dropped run only cost a needless cut later: a run trusts
//!   nothing a key's entry says, it checks its own keys.
//!
//! Only walks of pools of up to 64 slots use runs (their holders are one word per medium).

use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwapOption;
use parking_lot::{Mutex, MutexGuard};

/// Offset bits of a [`RunRef`]: runs are at most `1 << OFFSET_BITS` keys.
const OFFSET_BITS: u32 = 10;
/// Longest run, in keys.
pub(crate) const MAX_RUN: usize = 1 << OFFSET_BITS;
/// Shortest stretch worth a run (a run saves lookups only after its first key).
pub(crate) const MIN_RUN: usize = 4;
/// Shortest stretch of a stored event built into a run (1,024 tokens at block size 16). The
/// events worth it are long prefills' (vLLM publishes a step's new full blocks per request: a
/// 32k-token prompt comes as chunks of hundreds of blocks). Shorter ones — a decode step's
/// block, a short prompt, an engine publishing in small batches — cost a walk two or three
/// chunks of lookups, while a run for each would cost the writer a second pass over its keys
/// and a walk one run entered per event (the writer's and the walk's cost by event size:
/// BENCHMARKS.md, index against Dynamo's, `kvroute-bench-dynamo event-blocks N`).
pub(crate) const MIN_STORED_RUN: usize = 64;
/// Keys per key segment (a run never spans two).
pub(crate) const KEY_SEGMENT: usize = 1 << 14;
const KEY_SEGMENTS: usize = 64;
/// Most keys held in runs per pool (8 MiB).
pub(crate) const MAX_KEYS: usize = KEY_SEGMENT * KEY_SEGMENTS;
/// Stretches remembered between walks (a stretch is built the second time it is looked up),
/// two per set: a walk meets tens of stretches, and two that share a way would evict each other
/// on every walk and never be built.
const SEEN: usize = 4096;
/// Prompts' first keys remembered with their runs (32 KiB).
const HEADS: usize = 4096;
/// Run records per segment.
const RUN_SEGMENT: usize = 1 << 10;
const RUN_SEGMENTS: usize = 128;
/// Most runs per pool (6 MiB of 48-byte records).
pub(crate) const MAX_RUNS: usize = RUN_SEGMENT * RUN_SEGMENTS;
const _: () = assert!(
    MAX_RUNS < 1 << (32 - OFFSET_BITS),
    "a run slot fits a RunRef"
);
const _: () = assert!(MAX_RUN <= KEY_SEGMENT);
/// Longest pause between builds, in walks, while writers keep cutting runs (see
/// [`Paths::try_build`]).
pub(crate) const MAX_BUILD_BACKOFF: u64 = 256;

/// A key's run and its offset in it, as kept in the high half of the key's holder word; 0 is
/// none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RunRef(pub(crate) u32);

impl RunRef {
    pub(crate) fn new(slot: usize, offset: usize) -> Self {
        RunRef(((slot as u32 + 1) << OFFSET_BITS) | offset as u32)
    }

    fn get(self) -> Option<(usize, usize)> {
        let slot = (self.0 >> OFFSET_BITS) as usize;
        let offset = (self.0 & ((1 << OFFSET_BITS) - 1)) as usize;
        slot.checked_sub(1).map(|slot| (slot, offset))
    }

    pub(crate) fn is_some(self) -> bool {
        self.0 != 0
    }
}

/// One run's record. `gen` is odd while the slot is dead or being filled; `start`, `present`,
/// `gpu` and the keys change only while it is odd; `len` only shrinks while it is even, except
/// that the builder grows it key by key (under each key's shard lock) right after publishing.
#[derive(Debug, Default)]
struct Run {
    generation: AtomicU64,
    len: AtomicU64,
    /// Index of its first key in the key segments.
    start: AtomicU64,
    present: AtomicU64,
    gpu: AtomicU64,
    /// The run built right after it over the next keys of the same walk's prompt (a
    /// [`RunRef`] at offset 0, or 0): where a walk reaching its end looks first. Only a hint:
    /// the next run checks its own first key.
    next: AtomicU64,
}

impl Run {
    fn fresh() -> Self {
        Run {
            generation: AtomicU64::new(1),
            ..Run::default()
        }
    }
}

/// The runs and their keys, in segments allocated on first use (they never move, so a writer
/// cutting a run and a reader comparing it always address the same atomics).
#[derive(Debug)]
pub(crate) struct Arena {
    keys: Box<[OnceLock<Box<[AtomicU64]>>]>,
    runs: Box<[OnceLock<Box<[Run]>>]>,
    /// Runs built from a prompt's first key (a [`RunRef`] at offset 0, or 0), by a hash of
    /// that key: a walk starts from one without looking its first key up in the tables. Only
    /// a hint, like a run's `next`: the run checks its own first key.
    heads: Box<[AtomicU64]>,
}

impl Arena {
    fn new() -> Self {
        Arena {
            keys: (0..KEY_SEGMENTS).map(|_| OnceLock::new()).collect(),
            runs: (0..RUN_SEGMENTS).map(|_| OnceLock::new()).collect(),
            heads: (0..HEADS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn head(&self, key: u64) -> &AtomicU64 {
        let at = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % HEADS;
        &self.heads[at]
    }

    #[inline]
    fn run(&self, slot: usize) -> Option<&Run> {
        self.runs
            .get(slot / RUN_SEGMENT)?
            .get()?
            .get(slot % RUN_SEGMENT)
    }

    /// Keys `start..start + len` (within one segment), if allocated.
    #[inline]
    fn keys(&self, start: usize, len: usize) -> Option<&[AtomicU64]> {
        let segment = self.keys.get(start / KEY_SEGMENT)?.get()?;
        let at = start % KEY_SEGMENT;
        segment.get(at..at.checked_add(len)?)
    }

    fn run_or_alloc(&self, slot: usize) -> Option<&Run> {
        self.runs
            .get(slot / RUN_SEGMENT)?
            .get_or_init(|| (0..RUN_SEGMENT).map(|_| Run::fresh()).collect())
            .get(slot % RUN_SEGMENT)
    }

    fn keys_or_alloc(&self, start: usize, len: usize) -> Option<&[AtomicU64]> {
        let segment = self
            .keys
            .get(start / KEY_SEGMENT)?
            .get_or_init(|| (0..KEY_SEGMENT).map(|_| AtomicU64::new(0)).collect());
        let at = start % KEY_SEGMENT;
        segment.get(at..at.checked_add(len)?)
    }

    fn memory_bytes(&self) -> usize {
        let keys = self.keys.iter().filter(|s| s.get().is_some()).count();
        let runs = self.runs.iter().filter(|s| s.get().is_some()).count();
        keys * KEY_SEGMENT * size_of::<AtomicU64>()
            + runs * RUN_SEGMENT * size_of::<Run>()
            + HEADS * size_of::<AtomicU64>()
    }
}

/// The builder's allocation state (under [`Paths::builder`]).
#[derive(Debug)]
struct Allocation {
    /// Next free key index.
    next_key: usize,
    /// Next run slot (the ring's cursor: the slot may hold an old run, dropped first).
    next_run: usize,
    /// Per key segment, the run slots allocated into it since it was last entered (first slot,
    /// count): the runs to drop when the ring comes back to it.
    segment_runs: [(usize, usize); KEY_SEGMENTS],
    /// Runs cut by writers when the last build began.
    cuts_at_build: u64,
    /// Walks to let pass after a build before the next, while writers keep cutting runs.
    backoff: u64,
    /// The walk count before which no build starts.
    resume_at_walk: u64,
}

/// What walks did with runs, for benches and tests (counted per walk, relaxed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathStats {
    /// Match walks that used the path cache (pools of up to 64 slots).
    pub walks: u64,
    /// Keys answered from a run (compared, not looked up).
    pub keys_by_run: u64,
    /// Keys looked up in the exact per-key tables (a run's first key, keys no run covers).
    pub keys_looked_up: u64,
    /// Runs built.
    pub runs_built: u64,
    /// Builds skipped because another walk was building.
    pub builds_skipped: u64,
    /// Builds put off because writers were cutting runs as fast as walks built them.
    pub builds_deferred: u64,
    /// Runs shortened by a writer's change to one of their keys.
    pub cuts: u64,
    /// Run reads that met a cut or a dropped run before validating (answered per key instead).
    pub runs_changed_under_read: u64,
    /// Runs built from `BlockStored` events (of `runs_built`).
    pub runs_from_events: u64,
    /// Live runs dropped to make room for newer ones (the ring came back to their keys or slot).
    pub runs_recycled: u64,
    /// Bytes allocated for runs now.
    pub bytes: u64,
}

impl Default for Allocation {
    fn default() -> Self {
        Allocation {
            next_key: 0,
            next_run: 0,
            segment_runs: [(0, 0); KEY_SEGMENTS],
            cuts_at_build: 0,
            backoff: 0,
            resume_at_walk: 0,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    walks: AtomicU64,
    keys_by_run: AtomicU64,
    keys_looked_up: AtomicU64,
    runs_built: AtomicU64,
    builds_skipped: AtomicU64,
    builds_deferred: AtomicU64,
    cuts: AtomicU64,
    runs_changed_under_read: AtomicU64,
    runs_from_events: AtomicU64,
    runs_recycled: AtomicU64,
}

/// One pool's runs. See the module docs.
#[derive(Debug)]
pub(crate) struct Paths {
    arena: ArcSwapOption<Arena>,
    /// First keys of stretches walks looked up one by one, by a hash of the key: a stretch is
    /// built only when a walk meets it again, so a prompt asked about once (most prompts: the
    /// next turn asks about a longer one) costs no build.
    seen: Box<[AtomicU64]>,
    /// Serialises builders (walks take it with `try_lock` only, so none waits).
    builder: Mutex<Allocation>,
    counters: Counters,
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            arena: ArcSwapOption::default(),
            seen: (0..SEEN).map(|_| AtomicU64::new(0)).collect(),
            builder: Mutex::default(),
            counters: Counters::default(),
        }
    }
}

/// What a run said about a prompt from one of its keys on.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Span {
    /// The key itself is still covered.
    vouched: bool,
    /// Keys after it vouched for (same keys, the run's holders).
    pub(crate) covered: usize,
    /// The run to try at the key after them, when they reached the run's end.
    pub(crate) next: RunRef,
}

/// A walk's view of the runs: one load per walk.
pub(crate) type PathsView = arc_swap::Guard<Option<Arc<Arena>>>;

impl Paths {
    #[inline]
    pub(crate) fn view(&self) -> PathsView {
        self.arena.load()
    }

    /// How many keys after `key` (whose entry names `run` and whose holders are `holders`)
    /// the run vouches for, compared against `rest` (the prompt's keys after `key`); none when
    /// the run does not cover `key` or changed under the read.
    #[inline]
    pub(crate) fn covered(
        &self,
        view: &PathsView,
        run: RunRef,
        key: u64,
        rest: &[u64],
        holders: (u64, u64),
    ) -> Span {
        match (view.as_deref(), run.get()) {
            (Some(arena), Some((slot, offset))) => self
                .read(arena, slot, offset, key, rest, Some(holders))
                .map_or(Span::default(), |(_, span)| span),
            _ => Span::default(),
        }
    }

    /// The run last built from `key` as a prompt's first key (a hint for [`Self::enter`]).
    #[inline]
    pub(crate) fn head(&self, view: &PathsView, key: u64) -> RunRef {
        view.as_deref().map_or(RunRef::default(), |arena| {
            RunRef(arena.head(key).load(Ordering::Relaxed) as u32)
        })
    }

    /// The holders of `keys[0]` and the keys after it that `run` (a successor hint, offset 0)
    /// vouches for, if its first key is `keys[0]`.
    #[inline]
    pub(crate) fn enter(
        &self,
        view: &PathsView,
        run: RunRef,
        keys: &[u64],
    ) -> Option<((u64, u64), Span)> {
        let arena = view.as_deref()?;
        let (slot, offset) = run.get()?;
        let (&key, rest) = keys.split_first()?;
        let (holders, span) = self.read(arena, slot, offset, key, rest, None)?;
        // The first key itself must still be covered: a cut at offset 0 leaves nothing.
        span.vouched.then_some((holders, span))
    }

    /// One validated read of run `slot` from `offset` (which must hold `key`), its holders
    /// `expected` when given.
    #[inline]
    fn read(
        &self,
        arena: &Arena,
        slot: usize,
        offset: usize,
        key: u64,
        rest: &[u64],
        expected: Option<(u64, u64)>,
    ) -> Option<((u64, u64), Span)> {
        let record = arena.run(slot)?;
        let begun = record.generation.load(Ordering::Acquire);
        let len = record.len.load(Ordering::Relaxed) as usize;
        let holders = (
            record.present.load(Ordering::Relaxed),
            record.gpu.load(Ordering::Relaxed),
        );
        if begun & 1 == 1 || offset >= len || expected.is_some_and(|e| e != holders) {
            return None;
        }
        let start = record.start.load(Ordering::Relaxed) as usize;
        let keys = arena.keys(start, len)?;
        if keys[offset].load(Ordering::Relaxed) != key {
            return None;
        }
        let same = common_prefix(&keys[offset + 1..], rest);
        let next = RunRef(record.next.load(Ordering::Relaxed) as u32);
        interleave::at(interleave::Point::RunCompared);
        // Orders the loads above before the checks below (see `table`'s seqlock).
        fence(Ordering::Acquire);
        let now = record.len.load(Ordering::Relaxed) as usize;
        let dropped = record.generation.load(Ordering::Relaxed) != begun;
        if dropped || now < len {
            self.counters
                .runs_changed_under_read
                .fetch_add(1, Ordering::Relaxed);
        }
        if dropped {
            return None;
        }
        // A cut during the compare leaves the keys before it vouched for.
        let covered = same.min(now.saturating_sub(offset + 1));
        Some((
            holders,
            Span {
                vouched: offset < now,
                covered,
                // Only a walk that reached the run's end goes on to its successor.
                next: if offset + 1 + covered == len && now == len {
                    next
                } else {
                    RunRef::default()
                },
            },
        ))
    }

    /// Whether `run` (named by `key`'s entry) covers `key` now, read lock-free like a walk.
    #[inline]
    pub(crate) fn vouches_in(&self, view: &PathsView, run: RunRef, key: u64) -> bool {
        match (view.as_deref(), run.get()) {
            (Some(arena), Some((slot, offset))) => self
                .read(arena, slot, offset, key, &[], None)
                .is_some_and(|(_, span)| span.vouched),
            _ => false,
        }
    }

    /// Whether `run` is live and covers `key` at its offset (the caller holds the key's shard
    /// lock, so the key's holders are the run's).
    pub(crate) fn vouches(&self, run: RunRef, key: u64) -> bool {
        let Some((slot, offset)) = run.get() else {
            return false;
        };
        let arena = self.arena.load();
        let Some(record) = arena.as_deref().and_then(|arena| arena.run(slot)) else {
            return false;
        };
        let start = record.start.load(Ordering::Acquire) as usize;
        let live = record.generation.load(Ordering::Acquire) & 1 == 0
            && offset < record.len.load(Ordering::Acquire) as usize;
        live && arena
            .as_deref()
            .and_then(|arena| arena.keys(start + offset, 1))
            .is_some_and(|stored| stored[0].load(Ordering::Relaxed) == key)
    }

    /// Cuts `run` to end before `key`'s offset, if `key` is the run's key there: called by a
    /// writer, under the key's shard lock, before it changes which slots hold the key. (A
    /// reference left from a run dropped to make room names a slot that may hold another run
    /// now; only a key linked under this same lock can be at its offset.)
    pub(crate) fn cut(&self, run: RunRef, key: u64) {
        let Some((slot, offset)) = run.get() else {
            return;
        };
        let arena = self.arena.load();
        let Some(arena) = arena.as_deref() else {
            return;
        };
        let Some(record) = arena.run(slot) else {
            return;
        };
        let start = record.start.load(Ordering::Acquire) as usize;
        if arena
            .keys(start + offset, 1)
            .is_some_and(|stored| stored[0].load(Ordering::Relaxed) == key)
        {
            let before = record.len.fetch_min(offset as u64, Ordering::SeqCst);
            if before > offset as u64 {
                self.counters.cuts.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether a walk met the stretch starting with `key` before (and remembers it if not).
    pub(crate) fn seen_before(&self, key: u64) -> bool {
        let set = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % (SEEN / 2) * 2;
        let (Some(first), Some(second)) = (self.seen.get(set), self.seen.get(set + 1)) else {
            return false;
        };
        if first.load(Ordering::Relaxed) == key || second.load(Ordering::Relaxed) == key {
            return true;
        }
        // The newest first: two stretches sharing the set both stay.
        second.store(first.swap(key, Ordering::Relaxed), Ordering::Relaxed);
        false
    }

    /// The builder, unless another walk is building or builds are backing off.
    ///
    /// Backoff: a writer changing a run's key cuts the run, and the keys after the cut are read
    /// from the tables until a walk builds them again. Where writers keep changing the keys of
    /// a prefix walks keep asking about (churn on the queried prefix), every walk rebuilt
    /// what the last cut, and the builds — a shard `try_lock` per key — cost the walk several
    /// times its lookups. So when runs were cut since the last build began, the next build
    /// waits twice as many walks as the last wait (up to [`MAX_BUILD_BACKOFF`]); a build with
    /// no cut since the last one clears it. Answers never depend on it: unbuilt keys are
    /// looked up.
    pub(crate) fn try_build(&self) -> Option<Builder<'_>> {
        let Some(mut allocation) = self.builder.try_lock() else {
            self.counters.builds_skipped.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let walks = self.counters.walks.load(Ordering::Relaxed);
        if walks < allocation.resume_at_walk {
            self.counters
                .builds_deferred
                .fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let cuts = self.counters.cuts.load(Ordering::Relaxed);
        allocation.backoff = if cuts == allocation.cuts_at_build {
            0
        } else {
            (allocation.backoff * 2).clamp(1, MAX_BUILD_BACKOFF)
        };
        allocation.cuts_at_build = cuts;
        allocation.resume_at_walk = walks + allocation.backoff;
        Some(Builder::new(self, allocation, false))
    }

    /// The builder for the runs of a `BlockStored` just applied, unless another builder holds
    /// it (a walk's or another writer's: the event's keys are then left to walks). Not held
    /// back by the walks' backoff, which is about walks rebuilding what writers cut; an event
    /// builds its keys once.
    pub(crate) fn try_build_stored(&self) -> Option<Builder<'_>> {
        let Some(allocation) = self.builder.try_lock() else {
            self.counters.builds_skipped.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        Some(Builder::new(self, allocation, true))
    }

    /// Frees every run (the pool emptied). Waits for a builder in progress. The runs are
    /// dropped first, for walks still holding the old view.
    pub(crate) fn release(&self) {
        let allocation = self.builder.lock();
        if let Some(arena) = self.arena.load_full() {
            let mut builder = Builder::new(self, allocation, false);
            builder.drop_all(&arena);
            self.arena.store(None);
        }
    }

    pub(crate) fn record_walk(&self, by_run: usize, looked_up: usize) {
        self.counters.walks.fetch_add(1, Ordering::Relaxed);
        self.counters
            .keys_by_run
            .fetch_add(by_run as u64, Ordering::Relaxed);
        self.counters
            .keys_looked_up
            .fetch_add(looked_up as u64, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> PathStats {
        let c = &self.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        PathStats {
            walks: get(&c.walks),
            keys_by_run: get(&c.keys_by_run),
            keys_looked_up: get(&c.keys_looked_up),
            runs_built: get(&c.runs_built),
            builds_skipped: get(&c.builds_skipped),
            builds_deferred: get(&c.builds_deferred),
            cuts: get(&c.cuts),
            runs_changed_under_read: get(&c.runs_changed_under_read),
            runs_from_events: get(&c.runs_from_events),
            runs_recycled: get(&c.runs_recycled),
            bytes: self.memory_bytes() as u64,
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.arena.load().as_deref().map_or(0, Arena::memory_bytes)
    }
}

/// Builds runs: one walk at a time holds it.
#[derive(Debug)]
pub(crate) struct Builder<'a> {
    paths: &'a Paths,
    allocation: MutexGuard<'a, Allocation>,
    /// The arena, once loaded (it changes only under the builder's lock).
    arena: Option<Arc<Arena>>,
    /// Building a stored event's runs (counted apart).
    from_event: bool,
}

/// A run being built: keys are linked to it one by one ([`Builder::extend`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewRun {
    slot: usize,
}

impl NewRun {
    pub(crate) fn at(self, offset: usize) -> RunRef {
        RunRef::new(self.slot, offset)
    }
}

impl<'a> Builder<'a> {
    fn new(paths: &'a Paths, allocation: MutexGuard<'a, Allocation>, from_event: bool) -> Self {
        Builder {
            paths,
            allocation,
            arena: None,
            from_event,
        }
    }

    fn arena(&mut self) -> Arc<Arena> {
        if let Some(arena) = &self.arena {
            return Arc::clone(arena);
        }
        let arena = match self.paths.arena.load_full() {
            Some(arena) => arena,
            None => {
                let arena = Arc::new(Arena::new());
                self.paths.arena.store(Some(Arc::clone(&arena)));
                arena
            }
        };
        self.arena = Some(Arc::clone(&arena));
        arena
    }

    /// Publishes an empty run of `keys` (at most [`MAX_RUN`]) with holders `holders`, at the
    /// ring's cursor: the runs whose keys or slot it reuses are dropped first.
    pub(crate) fn allocate(&mut self, keys: &[u64], holders: (u64, u64)) -> Option<NewRun> {
        let arena = self.arena();
        let len = keys.len();
        if len == 0 || len > MAX_RUN {
            return None;
        }
        let mut start = self.allocation.next_key;
        // A run stays within one segment.
        if start % KEY_SEGMENT + len > KEY_SEGMENT {
            start = start.next_multiple_of(KEY_SEGMENT);
        }
        if start + len > MAX_KEYS {
            start = 0;
        }
        let segment = start / KEY_SEGMENT;
        let slot = self.allocation.next_run;
        let mut dropped = 0;
        if start.is_multiple_of(KEY_SEGMENT) {
            dropped += self.drop_segment(&arena, segment);
            self.allocation.segment_runs[segment] = (slot, 0);
        }
        let record = arena.run_or_alloc(slot)?;
        let stored = arena.keys_or_alloc(start, len)?;
        dropped += usize::from(kill(record));
        if dropped > 0 {
            // The odd generations are visible before any key or field is reused.
            fence(Ordering::Release);
            self.paths
                .counters
                .runs_recycled
                .fetch_add(dropped as u64, Ordering::Relaxed);
        }
        self.allocation.next_run = (slot + 1) % MAX_RUNS;
        self.allocation.next_key = start + len;
        self.allocation.segment_runs[segment].1 += 1;
        // The slot is dead (odd) from `kill` or from birth: fill it, then make it even.
        debug_assert!(record.generation.load(Ordering::Relaxed) & 1 == 1);
        record.len.store(0, Ordering::Relaxed);
        record.start.store(start as u64, Ordering::Relaxed);
        record.present.store(holders.0, Ordering::Relaxed);
        record.gpu.store(holders.1, Ordering::Relaxed);
        record.next.store(0, Ordering::Relaxed);
        for (slot, &key) in stored.iter().zip(keys) {
            slot.store(key, Ordering::Relaxed);
        }
        record.generation.fetch_add(1, Ordering::Release);
        let counters = &self.paths.counters;
        counters.runs_built.fetch_add(1, Ordering::Relaxed);
        if self.from_event {
            counters.runs_from_events.fetch_add(1, Ordering::Relaxed);
        }
        Some(NewRun { slot })
    }

    /// Drops the live runs whose keys are in key segment `segment` (the ring is back at it);
    /// returns how many. A slot the ring reused since holds a run elsewhere and is kept.
    fn drop_segment(&self, arena: &Arena, segment: usize) -> usize {
        let (first, count) = self.allocation.segment_runs[segment];
        let keys = segment * KEY_SEGMENT..(segment + 1) * KEY_SEGMENT;
        (0..count)
            .filter_map(|n| arena.run((first + n) % MAX_RUNS))
            .filter(|record| keys.contains(&(record.start.load(Ordering::Relaxed) as usize)))
            .map(|record| usize::from(kill(record)))
            .sum()
    }

    /// Grows `run` over its key at `offset` (just linked, its shard lock still held); false when
    /// a writer cut the run meanwhile (building it further would cover a changed key).
    pub(crate) fn extend(&self, run: NewRun, offset: usize) -> bool {
        let Some(record) = self.arena.as_deref().and_then(|arena| arena.run(run.slot)) else {
            return false;
        };
        record
            .len
            .compare_exchange(
                offset as u64,
                offset as u64 + 1,
                Ordering::SeqCst,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Hints that a walk reaching `run`'s end goes on with `next`.
    pub(crate) fn chain(&self, run: NewRun, next: NewRun) {
        if let Some(record) = self.arena.as_deref().and_then(|arena| arena.run(run.slot)) {
            record
                .next
                .store(u64::from(next.at(0).0), Ordering::Relaxed);
        }
    }

    /// Hints that a walk reaching the end of the run `previous` names goes on with `next`, if
    /// `previous` is a live run ending at that offset (an event's parent block ends the run
    /// its own event built, as a rule).
    pub(crate) fn chain_after(&self, previous: RunRef, next: NewRun) {
        let (Some(arena), Some((slot, offset))) = (self.arena.as_deref(), previous.get()) else {
            return;
        };
        if let Some(record) = arena.run(slot)
            && record.generation.load(Ordering::Acquire) & 1 == 0
            && record.len.load(Ordering::Acquire) == offset as u64 + 1
        {
            record
                .next
                .store(u64::from(next.at(0).0), Ordering::Relaxed);
        }
    }

    /// Remembers `run` as built from `key`, a prompt's first key.
    pub(crate) fn head(&self, key: u64, run: NewRun) {
        if let Some(arena) = self.arena.as_deref() {
            arena
                .head(key)
                .store(u64::from(run.at(0).0), Ordering::Relaxed);
        }
    }

    /// Kills every run so their slots and keys can be reused.
    fn drop_all(&mut self, arena: &Arena) {
        for slot in 0..MAX_RUNS {
            if let Some(record) = arena.run(slot) {
                kill(record);
            }
        }
        // The odd generations are visible before any key or field is reused.
        fence(Ordering::Release);
        *self.allocation = Allocation {
            cuts_at_build: self.allocation.cuts_at_build,
            backoff: self.allocation.backoff,
            resume_at_walk: self.allocation.resume_at_walk,
            ..Allocation::default()
        };
    }
}

/// Makes `record` dead (odd generation, no length) if it is live; whether it was. The caller
/// fences before reusing its keys or fields.
fn kill(record: &Run) -> bool {
    let generation = record.generation.load(Ordering::Relaxed);
    let live = generation & 1 == 0;
    if live {
        record.generation.store(generation + 1, Ordering::Relaxed);
    }
    record.len.store(0, Ordering::Relaxed);
    live
}

/// How many leading keys of `stored` and `prompt` are equal, for two stretches of prompt keys
/// that start right after an equal key. Prompt keys are chained: each commits to the one before
/// it (vLLM's block hash and kvroute's token-chain key both hash their parent's), so two
/// stretches equal at a position are equal everywhere before it. The first difference is
/// therefore found by bisection — the last key first, so a run the prompt follows to its end
/// costs one compare — instead of reading both stretches whole: a 1,000-block prompt's walk
/// read 16 KiB for the compares, and beside an ingest thread on the same core that traffic was
/// most of its tail.
fn common_prefix(stored: &[AtomicU64], prompt: &[u64]) -> usize {
    let n = stored.len().min(prompt.len());
    let equal = |at: usize| stored[at].load(Ordering::Relaxed) == prompt[at];
    if n == 0 || equal(n - 1) {
        return n;
    }
    // Keys below `low` are equal; the key at `high` differs.
    let (mut low, mut high) = (0, n - 1);
    while low < high {
        let mid = low + (high - low) / 2;
        if equal(mid) {
            low = mid + 1;
        } else {
            high = mid;
        }
    }
    low
}

/// Test hooks between a lock-free read and its validation, so a test can make a writer change
/// the data at exactly that moment (on the reader's own thread); no-ops outside tests.
pub(crate) mod interleave {
    /// Where a hook can run.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Point {
        /// After a run's keys were compared, before its generation and length are checked.
        RunCompared,
        /// After one key's holders were read, before its shard version is checked.
        KeyRead,
        /// After a chunk's holders were read, before their shard versions are checked.
        ChunkRead,
    }

    /// A hook, where it runs, and how many passes there to let by first.
    #[cfg(test)]
    type Hook = (Point, usize, Box<dyn FnOnce()>);

    #[cfg(test)]
    thread_local! {
        static HOOK: std::cell::RefCell<Option<Hook>> = const { std::cell::RefCell::new(None) };
    }

    /// Runs `hook` the next time this thread passes `point`.
    #[cfg(test)]
    pub(crate) fn set(point: Point, hook: impl FnOnce() + 'static) {
        set_after(point, 0, hook);
    }

    /// Runs `hook` when this thread passes `point` for the `skip + 1`th time.
    #[cfg(test)]
    pub(crate) fn set_after(point: Point, skip: usize, hook: impl FnOnce() + 'static) {
        HOOK.with(|slot| *slot.borrow_mut() = Some((point, skip, Box::new(hook))));
    }

    /// Whether the hook set on this thread has run.
    #[cfg(test)]
    pub(crate) fn fired() -> bool {
        HOOK.with(|slot| slot.borrow().is_none())
    }

    #[cfg(test)]
    pub(crate) fn at(point: Point) {
        let hook = HOOK.with(|slot| {
            let mut slot = slot.borrow_mut();
            match slot.take() {
                Some((at, 0, hook)) if at == point => Some(hook),
                Some((at, skip, hook)) if at == point => {
                    *slot = Some((at, skip - 1, hook));
                    None
                }
                other => {
                    *slot = other;
                    None
                }
            }
        });
        if let Some(hook) = hook {
            hook();
        }
    }

    #[cfg(not(test))]
    #[inline(always)]
    pub(crate) fn at(_: Point) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stretches whose first keys share a set are both remembered from one walk to the
    /// next (a single way would let them evict each other on every walk: never built).
    #[test]
    fn stretches_sharing_a_set_are_both_seen_again() {
        let paths = Paths::default();
        let set = |key: u64| (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % (SEEN / 2);
        let first = 1;
        let second = (2..).find(|&key| set(key) == set(first)).unwrap();
        for walk in 0..3 {
            let again = walk > 0;
            assert_eq!(paths.seen_before(first), again, "walk {walk}");
            assert_eq!(paths.seen_before(second), again, "walk {walk}");
        }
    }

    /// Two prompts' first keys sharing a head slot: the slot names the run built last, and the
    /// other prompt's walk is not let into it (the run checks its own first key).
    #[test]
    fn a_head_slot_shared_by_two_first_keys_names_only_its_own_prompts_run() {
        let paths = Paths::default();
        let slot = |key: u64| (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % HEADS;
        let first = 1;
        let other = (2..).find(|&key| slot(key) == slot(first)).unwrap();
        let keys: Vec<u64> = (0..8).map(|k| first + 1_000 * k).collect();
        let mut builder = paths.try_build().unwrap();
        let run = builder.allocate(&keys, (0b11, 0b01)).unwrap();
        for offset in 0..keys.len() {
            assert!(builder.extend(run, offset));
        }
        builder.head(first, run);
        drop(builder);
        let view = paths.view();
        let head = paths.head(&view, first);
        let (holders, span) = paths.enter(&view, head, &keys).unwrap();
        assert_eq!((holders, span.covered), ((0b11, 0b01), 7));
        let shared = paths.head(&view, other);
        assert_eq!(shared, head);
        let mut other_prompt = keys.clone();
        other_prompt[0] = other;
        assert!(paths.enter(&view, shared, &other_prompt).is_none());
    }

    /// Chains that part at `differs` (every key from there on differs, as chained keys do).
    #[test]
    fn common_prefix_stops_at_the_first_difference() {
        let prompt: Vec<u64> = (0..23).collect();
        for differs in 0..=23 {
            let stored: Vec<AtomicU64> = (0..23)
                .map(|k| AtomicU64::new(if k >= differs { 1_000 + k } else { k }))
                .collect();
            assert_eq!(common_prefix(&stored, &prompt), differs as usize);
            assert_eq!(
                common_prefix(&stored[..5], &prompt),
                differs.min(5) as usize
            );
            assert_eq!(common_prefix(&stored, &prompt[..0]), 0);
        }
    }
}
