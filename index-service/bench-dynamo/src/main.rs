//! kvroute's `BlockIndex` beside NVIDIA Dynamo's KV router index (`dynamo-kv-router` from
//! crates.io: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`, the indexer Dynamo's router
//! builds when it runs more than one event thread), fed the same events and asked the same
//! prompts in one process, A/B interleaved. Prints one markdown table; see BENCHMARKS.md.
//!
//! `cargo run --release --manifest-path index-service/bench-dynamo/Cargo.toml` (add `-- quick`
//! for a smaller run that checks the harness; `-- profile <idle|flat-out|prefix-churn> <seconds>
//! [prompt]` for kvroute alone under one load, to profile its walk; `-- profile first
//! <prompts>` for first walks; `-- event-blocks <n>` for stored events of n blocks, 16 by
//! default).

// A bench panics on setup errors like a test does; its table goes to stdout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::ThreadPoolIndexer;
use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use futures::executor::block_on;
use kvroute_index_core::event::{BlockRemoved, BlockStored, KvEvent, Medium};
use kvroute_index_core::index::{
    BlockIndex, IndexConfig, IndexMetrics, KvIndex, PathStats, PoolConfig, PoolKeys, ReplicaId,
};

/// Live heap bytes, so both indexes' memory is measured the same way (what they allocated,
/// not what they report).
struct CountingAlloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const BLOCK_SIZE: u32 = 16;
/// Blocks per stored event (a scheduler step's worth for one request); `-- event-blocks <n>`
/// for another (vLLM publishes a long prefill's chunk as hundreds).
const EVENT_BLOCKS: usize = 16;

fn event_blocks() -> usize {
    static BLOCKS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BLOCKS.get_or_init(|| {
        let args: Vec<String> = std::env::args().collect();
        args.iter()
            .position(|a| a == "event-blocks")
            .and_then(|at| args.get(at + 1)?.parse().ok())
            .filter(|&blocks| blocks > 0)
            .unwrap_or(EVENT_BLOCKS)
    })
}
/// Blocks per unrelated conversation filling the replicas.
const CHAIN_BLOCKS: usize = 64;
const PROMPT_BLOCKS: usize = 1_000;
const MODEL: &str = "m";

/// CPU time of every thread of this process (ns), from the scheduler's own accounting.
fn process_cpu_ns() -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("schedstat"))
            && let Some(ns) = text.split_whitespace().next()
        {
            total += ns.parse::<u64>().unwrap_or(0);
        }
    }
    total
}

fn mix(a: u64, b: u64) -> u64 {
    let x = (a ^ b.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 31)
}

/// One block: its content hash (Dynamo's `LocalBlockHash`) and its chained hash (the engine's
/// published block hash, kvroute's vLLM-exact key and Dynamo's `ExternalSequenceBlockHash`).
#[derive(Clone, Copy)]
struct Block {
    local: u64,
    seq: u64,
}

/// A chain of blocks; `parent` is the chained hash before the first.
fn chain(seed: u64, parent: Option<u64>, blocks: usize) -> Vec<Block> {
    let mut seq = parent.unwrap_or(0x5EED);
    (0..blocks as u64)
        .map(|i| {
            let local = mix(seed, i + 1);
            seq = mix(seq, local);
            Block { local, seq }
        })
        .collect()
}

/// The same events for both indexes.
enum Event {
    Stored {
        replica: u32,
        parent: Option<u64>,
        blocks: Vec<Block>,
    },
    Removed {
        replica: u32,
        blocks: Vec<u64>,
    },
}

impl Event {
    fn block_events(&self) -> usize {
        match self {
            Event::Stored { blocks, .. } => blocks.len(),
            Event::Removed { blocks, .. } => blocks.len(),
        }
    }

    fn kvroute(&self) -> (ReplicaId, KvEvent) {
        match self {
            Event::Stored {
                replica,
                parent,
                blocks,
            } => (
                ReplicaId(*replica),
                KvEvent::BlockStored(BlockStored {
                    block_hashes: blocks.iter().map(|b| b.seq).collect(),
                    parent_block_hash: *parent,
                    token_ids: vec![1; blocks.len() * BLOCK_SIZE as usize],
                    block_size: BLOCK_SIZE,
                    medium: Medium::Gpu,
                    ..BlockStored::default()
                }),
            ),
            Event::Removed { replica, blocks } => (
                ReplicaId(*replica),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: blocks.clone(),
                    medium: Medium::Gpu,
                    group_idx: None,
                }),
            ),
        }
    }

    fn dynamo(&self, event_id: u64) -> RouterEvent {
        let (worker, data) = match self {
            Event::Stored {
                replica,
                parent,
                blocks,
            } => (
                *replica,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|b| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(b.seq),
                            tokens_hash: LocalBlockHash(b.local),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
            ),
            Event::Removed { replica, blocks } => (
                *replica,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: blocks
                        .iter()
                        .copied()
                        .map(ExternalSequenceBlockHash)
                        .collect(),
                }),
            ),
        };
        RouterEvent::new(
            u64::from(worker),
            KvCacheEvent {
                event_id,
                data,
                dp_rank: 0,
            },
        )
    }
}

/// A chain as stored events of [`event_blocks`], in order.
fn store_events(replica: u32, parent: Option<u64>, blocks: &[Block]) -> Vec<Event> {
    let mut parent = parent;
    blocks
        .chunks(event_blocks())
        .map(|run| {
            let event = Event::Stored {
                replica,
                parent,
                blocks: run.to_vec(),
            };
            parent = run.last().map(|b| b.seq);
            event
        })
        .collect()
}

/// A chain's removal, tail first (how engines evict).
fn remove_events(replica: u32, blocks: &[Block]) -> Vec<Event> {
    blocks
        .chunks(event_blocks())
        .rev()
        .map(|run| Event::Removed {
            replica,
            blocks: run.iter().rev().map(|b| b.seq).collect(),
        })
        .collect()
}

/// Each replica's unrelated conversations (their seeds: blocks are regenerated, so the bench's
/// own bookkeeping stays out of the memory measured), oldest first, and which one is replaced
/// next.
struct Fleet {
    replicas: u32,
    chains: Vec<std::collections::VecDeque<u64>>,
    next_seed: u64,
    next_replica: u32,
}

impl Fleet {
    fn new(replicas: u32) -> Self {
        Fleet {
            replicas,
            chains: (0..replicas).map(|_| Default::default()).collect(),
            next_seed: 1 << 40,
            next_replica: 0,
        }
    }

    /// A new conversation for `replica`.
    fn grow(&mut self, replica: u32) -> Vec<Event> {
        self.next_seed += 1;
        let seed = self.next_seed;
        let blocks = chain(seed, None, CHAIN_BLOCKS);
        let events = store_events(replica, None, &blocks);
        self.chains[replica as usize].push_back(seed);
        events
    }

    /// Steady state: the next replica evicts its oldest conversation and stores a new one.
    fn churn(&mut self) -> Vec<Event> {
        let replica = self.next_replica;
        self.next_replica = (self.next_replica + 1) % self.replicas;
        let mut events = Vec::new();
        if let Some(old) = self.chains[replica as usize].pop_front() {
            events = remove_events(replica, &chain(old, None, CHAIN_BLOCKS));
        }
        events.extend(self.grow(replica));
        events
    }
}

type Dynamo = ThreadPoolIndexer<ConcurrentRadixTreeCompressed>;

/// The two indexes under test.
enum Subject {
    Kvroute(Box<BlockIndex>),
    Dynamo(Dynamo, AtomicUsize),
}

impl Subject {
    fn kvroute(replicas: u32) -> Self {
        let config = IndexConfig::default();
        let index = BlockIndex::new(config, IndexMetrics::unregistered());
        index
            .add_pool(PoolConfig {
                model: MODEL.into(),
                block_size: BLOCK_SIZE,
                keys: PoolKeys::VllmExact { validator: None },
                attention_chunk_size: None,
            })
            .unwrap();
        for r in 0..replicas {
            index
                .add_replica(ReplicaId(r), &format!("r{r}"), MODEL)
                .unwrap();
        }
        Subject::Kvroute(Box::new(index))
    }

    /// One event thread: ingest runs on one thread for both indexes (Dynamo's default of four
    /// would only take CPU from the queries on a 2-core machine).
    fn dynamo() -> Self {
        let indexer = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK_SIZE);
        Subject::Dynamo(indexer, AtomicUsize::new(0))
    }

    /// kvroute's path-cache counters (Dynamo has none).
    fn path_stats(&self) -> Option<PathStats> {
        match self {
            Subject::Kvroute(index) => index.path_stats(MODEL),
            Subject::Dynamo(..) => None,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Subject::Kvroute(_) => "kvroute",
            Subject::Dynamo(..) => "dynamo",
        }
    }

    /// Applies `events` and returns once they are applied.
    fn apply(&self, events: &[Event]) {
        match self {
            Subject::Kvroute(index) => {
                for event in events {
                    let (replica, event) = event.kvroute();
                    index.apply_event(replica, &event).unwrap();
                }
            }
            Subject::Dynamo(indexer, ids) => {
                let converted: Vec<RouterEvent> = events
                    .iter()
                    .map(|e| e.dynamo(ids.fetch_add(1, Ordering::Relaxed) as u64))
                    .collect();
                block_on(async {
                    for event in converted {
                        indexer.apply_event(event).await;
                    }
                    indexer.flush().await;
                });
            }
        }
    }

    /// Applies `events` converted ahead, counting only the applying's CPU time.
    fn apply_timed(&self, events: &[Event]) -> u64 {
        match self {
            Subject::Kvroute(index) => {
                let converted: Vec<(ReplicaId, KvEvent)> =
                    events.iter().map(Event::kvroute).collect();
                let start = process_cpu_ns();
                for (replica, event) in &converted {
                    index.apply_event(*replica, event).unwrap();
                }
                process_cpu_ns() - start
            }
            Subject::Dynamo(indexer, ids) => {
                let converted: Vec<RouterEvent> = events
                    .iter()
                    .map(|e| e.dynamo(ids.fetch_add(1, Ordering::Relaxed) as u64))
                    .collect();
                let start = process_cpu_ns();
                block_on(async {
                    for event in converted {
                        indexer.apply_event(event).await;
                    }
                    indexer.flush().await;
                });
                process_cpu_ns() - start
            }
        }
    }

    /// Per replica, leading blocks of the prompt held (replicas holding none left out).
    fn matches(&self, prompt: &Prompt) -> Vec<(u32, u32)> {
        let mut found: Vec<(u32, u32)> = match self {
            Subject::Kvroute(index) => index
                .find_matches(MODEL, &prompt.seq, None)
                .unwrap()
                .into_iter()
                .map(|m| (m.replica.0, m.matched_blocks))
                .collect(),
            Subject::Dynamo(indexer, _) => indexer
                .backend()
                .find_matches(&prompt.local, false)
                .scores
                .into_iter()
                .map(|(worker, score)| (worker.worker_id as u32, score))
                .collect(),
        };
        found.retain(|&(_, blocks)| blocks > 0);
        found.sort_unstable();
        found
    }

    /// One query as the router asks it (Dynamo: inline on the caller's thread, as
    /// `ThreadPoolIndexer::find_matches` runs it).
    #[inline]
    fn query(&self, prompt: &Prompt) {
        match self {
            Subject::Kvroute(index) => {
                black_box(index.find_matches(MODEL, &prompt.seq, None).unwrap());
            }
            Subject::Dynamo(indexer, _) => {
                black_box(indexer.backend().find_matches(&prompt.local, false));
            }
        }
    }
}

/// A query prompt in both indexes' terms.
struct Prompt {
    name: &'static str,
    local: Vec<LocalBlockHash>,
    seq: Vec<u64>,
}

impl Prompt {
    fn new(name: &'static str, blocks: &[Block]) -> Self {
        Prompt {
            name,
            local: blocks.iter().map(|b| LocalBlockHash(b.local)).collect(),
            seq: blocks.iter().map(|b| b.seq).collect(),
        }
    }
}

/// The prompts' holdings: `realistic_overlap` and `all_hold_all` as in benches/index.rs, and
/// `diverging` (replica r shares the prompt's first 15·(r+1) blocks, then has its own).
fn shape_events(replicas: u32) -> (Vec<Event>, Vec<Prompt>, Vec<Block>) {
    let overlap = chain(11, None, PROMPT_BLOCKS);
    let all = chain(12, None, PROMPT_BLOCKS);
    let diverging = chain(13, None, PROMPT_BLOCKS);
    let mut events = Vec::new();
    for r in 0..replicas {
        let held = match r {
            0 => 900,
            1..=8 => 400,
            _ => 200,
        };
        events.extend(store_events(r, None, &overlap[..held]));
        events.extend(store_events(r, None, &all));
        let shared = (15 * (r as usize + 1)).min(PROMPT_BLOCKS);
        events.extend(store_events(r, None, &diverging[..shared]));
        let own = chain(1_000 + u64::from(r), Some(diverging[shared - 1].seq), 16);
        events.extend(store_events(r, Some(diverging[shared - 1].seq), &own));
    }
    let prompts = vec![
        Prompt::new("realistic_overlap", &overlap),
        Prompt::new("all_hold_all", &all),
        Prompt::new("diverging", &diverging),
    ];
    (events, prompts, overlap)
}

/// What runs beside the queries.
#[derive(Clone, Copy, PartialEq)]
enum Load {
    Idle,
    FlatOut,
    /// Block events per second.
    Paced(u64),
    /// Replicas 1..=8 evict and store again blocks 300..400 of the `realistic_overlap` prompt.
    PrefixChurn,
}

impl Load {
    fn label(self) -> String {
        match self {
            Load::Idle => "idle".into(),
            Load::FlatOut => "one thread ingesting flat out".into(),
            Load::Paced(rate) => {
                format!("ingest paced at {:.1} M block events/s", rate as f64 / 1e6)
            }
            Load::PrefixChurn => "churn on the queried prefix (flat out)".into(),
        }
    }
}

/// Runs `load` on its own thread against `subject` until `stop`; returns block events applied.
fn run_load(
    progress: &AtomicUsize,
    subject: &Subject,
    fleet: &mut Fleet,
    overlap: &[Block],
    load: Load,
    stop: &AtomicBool,
) -> usize {
    let mut applied = 0;
    let start = Instant::now();
    let mut round = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let events = match load {
            Load::Idle => return 0,
            Load::FlatOut | Load::Paced(_) => fleet.churn(),
            Load::PrefixChurn => {
                round += 1;
                let replica = 1 + (round % 8) as u32;
                let tail = &overlap[300..400];
                let mut events = remove_events(replica, tail);
                events.extend(store_events(replica, Some(overlap[299].seq), tail));
                events
            }
        };
        applied += events.iter().map(Event::block_events).sum::<usize>();
        subject.apply(&events);
        progress.fetch_add(1, Ordering::Release);
        if let Load::Paced(rate) = load {
            let due = start + Duration::from_secs_f64(applied as f64 / rate as f64);
            while Instant::now() < due && !stop.load(Ordering::Relaxed) {
                // Pacing a load generator (not synchronisation): wait out the schedule.
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(
                    due.saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(1)),
                );
            }
        }
    }
    applied
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[at] as f64 / 1_000.0
}

struct Config {
    replicas: u32,
    blocks_per_replica: usize,
    rounds: usize,
    queries: usize,
    fleet_replicas: u32,
    fleet_blocks: usize,
}

/// Fills `subject` with `replicas` × `blocks` unrelated blocks; returns (fill CPU ns per block
/// event, live bytes after).
fn fill(subject: &Subject, fleet: &mut Fleet, blocks: usize) -> (f64, usize) {
    let conversations = blocks / CHAIN_BLOCKS;
    let (mut cpu, mut count) = (0u64, 0usize);
    for _ in 0..conversations {
        let mut events = Vec::new();
        for r in 0..fleet.replicas {
            events.extend(fleet.grow(r));
        }
        count += events.iter().map(Event::block_events).sum::<usize>();
        cpu += subject.apply_timed(&events);
    }
    (cpu as f64 / count as f64, LIVE.load(Ordering::Relaxed))
}

/// Steady-state churn until `block_events` were applied: CPU ns per block event.
fn churn(subject: &Subject, fleet: &mut Fleet, block_events: usize) -> f64 {
    let (mut cpu, mut count) = (0u64, 0usize);
    while count < block_events {
        let mut events = Vec::new();
        for _ in 0..fleet.replicas.min(64) {
            events.extend(fleet.churn());
        }
        count += events.iter().map(Event::block_events).sum::<usize>();
        cpu += subject.apply_timed(&events);
    }
    cpu as f64 / count as f64
}

struct Row {
    label: String,
    kvroute: String,
    dynamo: String,
    ratio: String,
}

/// A kvroute-only figure.
fn note(label: impl Into<String>, kvroute: String) -> Row {
    Row {
        label: label.into(),
        kvroute,
        dynamo: "—".into(),
        ratio: "—".into(),
    }
}

/// How kvroute's walks answered between two counter readings: keys compared in runs vs looked
/// up in the tables, runs built, builds put off (writers cutting runs), run reads that met a
/// writer's change.
fn path_row(label: &str, before: PathStats, after: PathStats) -> Row {
    let by_run = after.keys_by_run - before.keys_by_run;
    let looked_up = after.keys_looked_up - before.keys_looked_up;
    let walks = (after.walks - before.walks).max(1);
    note(
        format!(
            "kvroute walks, {label}: keys by run / looked up per walk; runs built; builds put off; run reads changed under them"
        ),
        format!(
            "{:.1} / {:.1}; {}; {}; {}",
            by_run as f64 / walks as f64,
            looked_up as f64 / walks as f64,
            after.runs_built - before.runs_built,
            after.builds_deferred - before.builds_deferred,
            after.runs_changed_under_read - before.runs_changed_under_read,
        ),
    )
}

fn row(label: impl Into<String>, kvroute: f64, dynamo: f64, unit: &str) -> Row {
    Row {
        label: label.into(),
        kvroute: format!("{kvroute:.2}{unit}"),
        dynamo: format!("{dynamo:.2}{unit}"),
        ratio: format!("{:.2}", kvroute / dynamo),
    }
}

/// Ingest cost and bytes per holding at one fleet size, each index built alone (memory is the
/// process's live heap, so the two are measured one after the other).
fn fleet_scale(replicas: u32, blocks: usize, churn_events: usize, rows: &mut Vec<Row>) {
    let mut results = Vec::new();
    for make in [Subject::kvroute as fn(u32) -> Subject, |_| {
        Subject::dynamo()
    }] {
        let before = LIVE.load(Ordering::Relaxed);
        let subject = make(replicas);
        let mut fleet = Fleet::new(replicas);
        let (fill_ns, after_fill) = fill(&subject, &mut fleet, blocks);
        let holdings = (replicas as usize * (blocks / CHAIN_BLOCKS) * CHAIN_BLOCKS) as f64;
        let churn_ns = churn(&subject, &mut fleet, churn_events);
        let after_churn = LIVE.load(Ordering::Relaxed);
        results.push((
            fill_ns,
            churn_ns,
            (after_fill - before) as f64 / holdings,
            (after_churn - before) as f64 / holdings,
        ));
        eprintln!(
            "{replicas}×{blocks} {}: {:?}",
            subject.name(),
            results.last().map(|r| (r.0, r.1, r.2, r.3))
        );
        drop(subject);
    }
    let (k, d) = (results[0], results[1]);
    let scale = format!("{replicas} × {}k", blocks / 1000);
    rows.push(row(
        format!("ingest fill, CPU ns per block event ({scale})"),
        k.0,
        d.0,
        "",
    ));
    rows.push(row(
        format!("ingest steady churn, CPU ns per block event ({scale})"),
        k.1,
        d.1,
        "",
    ));
    rows.push(row(
        format!("bytes per holding after fill ({scale})"),
        k.2,
        d.2,
        "",
    ));
    rows.push(row(
        format!("bytes per holding after churn ({scale})"),
        k.3,
        d.3,
        "",
    ));
}

/// `-- profile <idle|flat-out|prefix-churn> <seconds>`: kvroute alone, filled as the full run fills it,
/// asked the three prompts in a loop under one load, for `perf record` of the walk.
fn profile(load: Load, seconds: u64) {
    let subject = Subject::kvroute(64);
    let mut fleet = Fleet::new(64);
    fill(&subject, &mut fleet, 100_032);
    let (shape, mut prompts, overlap) = shape_events(64);
    subject.apply(&shape);
    // `-- profile <load> <seconds> <prompt>`: only that prompt.
    if let Some(only) = std::env::args().skip_while(|a| a != "profile").nth(3) {
        prompts.retain(|prompt| prompt.name == only);
    }
    for prompt in &prompts {
        subject.query(prompt);
        subject.query(prompt);
    }
    let stop = AtomicBool::new(false);
    let progress = AtomicUsize::new(0);
    let mut samples = vec![Vec::new(); prompts.len()];
    std::thread::scope(|scope| {
        scope.spawn(|| run_load(&progress, &subject, &mut fleet, &overlap, load, &stop));
        let end = Instant::now() + Duration::from_secs(seconds);
        while Instant::now() < end {
            for (at, prompt) in prompts.iter().enumerate() {
                let start = Instant::now();
                subject.query(prompt);
                samples[at].push(start.elapsed().as_nanos() as u64);
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    for (prompt, mut samples) in prompts.iter().zip(samples) {
        samples.sort_unstable();
        println!(
            "{} ({}): p50 {:.2} µs, p99 {:.2} µs, {} walks",
            prompt.name,
            load.label(),
            percentile(&samples, 0.5),
            percentile(&samples, 0.99),
            samples.len()
        );
    }
}

/// `-- profile first <prompts>`: kvroute alone, filled as the full run fills it, then
/// `prompts` new 1,000-block prompts held like `realistic_overlap`, each walked once.
fn profile_first_walks(prompts: u64) {
    let subject = Subject::kvroute(64);
    let mut fleet = Fleet::new(64);
    fill(&subject, &mut fleet, 100_032);
    let prompts: Vec<Prompt> = (0..prompts)
        .map(|seed| {
            let blocks = chain(1 << 50 | seed, None, PROMPT_BLOCKS);
            let mut events = Vec::new();
            for r in 0..64 {
                let held = match r {
                    0 => 900,
                    1..=8 => 400,
                    _ => 200,
                };
                events.extend(store_events(r, None, &blocks[..held]));
            }
            subject.apply(&events);
            Prompt::new("first", &blocks)
        })
        .collect();
    let mut samples: Vec<u64> = prompts
        .iter()
        .map(|prompt| {
            let start = Instant::now();
            subject.query(prompt);
            start.elapsed().as_nanos() as u64
        })
        .collect();
    samples.sort_unstable();
    println!(
        "first walks of {} prompts: p50 {:.2} µs, p99 {:.2} µs",
        samples.len(),
        percentile(&samples, 0.5),
        percentile(&samples, 0.99)
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "profile") {
        if args.get(at + 1).map(String::as_str) == Some("first") {
            let prompts = args.get(at + 2).and_then(|s| s.parse().ok()).unwrap_or(200);
            return profile_first_walks(prompts);
        }
        let load = match args.get(at + 1).map(String::as_str) {
            Some("flat-out") => Load::FlatOut,
            Some("prefix-churn") => Load::PrefixChurn,
            _ => Load::Idle,
        };
        let seconds = args.get(at + 2).and_then(|s| s.parse().ok()).unwrap_or(10);
        return profile(load, seconds);
    }
    let quick = args.iter().any(|a| a == "quick");
    let config = if quick {
        Config {
            replicas: 64,
            blocks_per_replica: 4_096,
            rounds: 2,
            queries: 300,
            fleet_replicas: 100,
            fleet_blocks: 1_024,
        }
    } else {
        Config {
            replicas: 64,
            blocks_per_replica: 100_032,
            rounds: 6,
            queries: 2_000,
            fleet_replicas: 1_000,
            fleet_blocks: 20_032,
        }
    };
    let mut rows = Vec::new();

    // Latency: both indexes filled alike, then queried in alternating rounds under each load.
    let subjects = [Subject::kvroute(config.replicas), Subject::dynamo()];
    let mut fleets: Vec<Fleet> = subjects
        .iter()
        .map(|_| Fleet::new(config.replicas))
        .collect();
    let (shape, prompts, overlap) = shape_events(config.replicas);
    for (subject, fleet) in subjects.iter().zip(&mut fleets) {
        fill(subject, fleet, config.blocks_per_replica);
        subject.apply(&shape);
    }
    // The first walk of each prompt (kvroute's builds its runs), then both agree on every
    // prompt, asked again (kvroute's from its runs).
    for prompt in &prompts {
        let mut first = [0.0; 2];
        for (which, subject) in subjects.iter().enumerate() {
            let start = Instant::now();
            subject.query(prompt);
            first[which] = start.elapsed().as_nanos() as f64 / 1_000.0;
        }
        rows.push(row(
            format!("match {}, first walk after the fill: µs", prompt.name),
            first[0],
            first[1],
            "",
        ));
        let expected = subjects[0].matches(prompt);
        assert_eq!(
            expected,
            subjects[1].matches(prompt),
            "{}: the indexes disagree",
            prompt.name
        );
    }
    let loads = [
        Load::Idle,
        Load::FlatOut,
        Load::Paced(100_000),
        Load::PrefixChurn,
    ];
    for load in loads {
        let paths_before = subjects[0].path_stats().unwrap_or_default();
        let mut samples: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); prompts.len()]; 2];
        let mut rates = [0.0f64; 2];
        for round in 0..config.rounds {
            for turn in 0..2 {
                let which = (round + turn) % 2;
                let subject = &subjects[which];
                let fleet = &mut fleets[which];
                let stop = AtomicBool::new(false);
                let progress = AtomicUsize::new(0);
                let begun = Instant::now();
                let applied = std::thread::scope(|scope| {
                    let loader =
                        scope.spawn(|| run_load(&progress, subject, fleet, &overlap, load, &stop));
                    // Measure only once the load is applying (a few batches in), within a second.
                    let deadline = Instant::now() + Duration::from_secs(1);
                    while load != Load::Idle
                        && progress.load(Ordering::Acquire) < 4
                        && Instant::now() < deadline
                    {
                        std::thread::yield_now();
                    }
                    for _ in 0..config.queries {
                        for (at, prompt) in prompts.iter().enumerate() {
                            let start = Instant::now();
                            subject.query(prompt);
                            samples[which][at].push(start.elapsed().as_nanos() as u64);
                        }
                    }
                    stop.store(true, Ordering::Relaxed);
                    loader.join().unwrap()
                });
                rates[which] +=
                    applied as f64 / begun.elapsed().as_secs_f64() / config.rounds as f64;
            }
        }
        for (at, prompt) in prompts.iter().enumerate() {
            let mut stats = [(0.0, 0.0); 2];
            for which in 0..2 {
                samples[which][at].sort_unstable();
                stats[which] = (
                    percentile(&samples[which][at], 0.5),
                    percentile(&samples[which][at], 0.99),
                );
            }
            let label = format!("match {}, {}", prompt.name, load.label());
            rows.push(row(format!("{label}: p50 µs"), stats[0].0, stats[1].0, ""));
            rows.push(row(format!("{label}: p99 µs"), stats[0].1, stats[1].1, ""));
        }
        if load != Load::Idle {
            rows.push(row(
                format!("ingest rate achieved, {}: M block events/s", load.label()),
                rates[0] / 1e6,
                rates[1] / 1e6,
                "",
            ));
        }
        let paths_after = subjects[0].path_stats().unwrap_or_default();
        rows.push(path_row(&load.label(), paths_before, paths_after));
    }
    let paths = subjects[0].path_stats().unwrap_or_default();
    rows.push(note(
        "kvroute runs after the latency rounds: bytes allocated; runs built from events; live runs dropped for room",
        format!(
            "{}; {}; {}",
            paths.bytes, paths.runs_from_events, paths.runs_recycled
        ),
    ));
    drop(subjects);

    fleet_scale(
        config.replicas,
        config.blocks_per_replica,
        2 * config.replicas as usize * config.blocks_per_replica,
        &mut rows,
    );
    fleet_scale(
        config.fleet_replicas,
        config.fleet_blocks,
        4_000_000.min(config.fleet_replicas as usize * config.fleet_blocks),
        &mut rows,
    );

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "| {} replicas × {} blocks in events of {}; load average at end: {} | kvroute | Dynamo CRTC | kvroute / Dynamo |",
        config.replicas,
        config.blocks_per_replica,
        event_blocks(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} |",
            r.label, r.kvroute, r.dynamo, r.ratio
        );
    }
}
