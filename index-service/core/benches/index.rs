//! Index core throughput: applying `BlockStored`/`BlockRemoved` events (block events per second,
//! one core) and `find_matches` for a 1,000-block prompt against 64 replicas, of a dense model
//! and of a hybrid one (full attention beside a sliding window).
//!
//! Targets: apply well above 2 M block events/s (ingest budget for decode + apply); a match in
//! ≤ 20 µs.

// A bench panics on setup errors like a test does.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_block_keys::TokenChain;
use kvroute_index_core::event::{BlockRemoved, BlockStored, CacheKind, KvEvent, Medium};
use kvroute_index_core::index::{
    BlockIndex, IndexConfig, IndexMetrics, KvIndex, PoolConfig, PoolKeys, ReplicaId,
};

const BLOCK_SIZE: u32 = 16;
const BLOCKS_PER_EVENT: usize = 4;
/// Blocks a replica holds in steady state (a mid-size GPU's KV cache in 16-token blocks).
const RESIDENT_BLOCKS: u64 = 100_000;

/// A 64-bit LCG: hash-like values, cheap enough not to show up in the measurement.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 ^ (self.0 >> 29)
    }
}

fn index_with(keys: PoolKeys, replicas: u32) -> BlockIndex {
    let index = BlockIndex::new(IndexConfig::default(), IndexMetrics::unregistered());
    index
        .add_pool(PoolConfig {
            model: "m".into(),
            block_size: BLOCK_SIZE,
            keys,
            attention_chunk_size: None,
        })
        .unwrap();
    for r in 0..replicas {
        index
            .add_replica(ReplicaId(r), &format!("r{r}"), "m")
            .unwrap();
    }
    index
}

/// Applies one 4-block `BlockStored` (a new request's prefix) and one 4-block `BlockRemoved`
/// (eviction of the run stored `RESIDENT_BLOCKS` blocks earlier), so the replica stays at
/// steady-state size. Returns the time for `iters` such pairs.
fn steady_state(keys: PoolKeys, iters: u64) -> Duration {
    let index = index_with(keys, 1);
    let replica = ReplicaId(0);
    let mut stored = BlockStored {
        block_hashes: vec![0; BLOCKS_PER_EVENT],
        token_ids: (0..BLOCKS_PER_EVENT as u32 * BLOCK_SIZE)
            .map(|t| t * 7919 % 151_936)
            .collect(),
        block_size: BLOCK_SIZE,
        medium: Medium::Gpu,
        ..BlockStored::default()
    };
    let mut removed = BlockRemoved {
        block_hashes: vec![0; BLOCKS_PER_EVENT],
        ..Default::default()
    };
    let runs = RESIDENT_BLOCKS / BLOCKS_PER_EVENT as u64;
    // Engine hashes of run i are a pure function of i, so eviction can name them again.
    let run_hashes = |run: u64, out: &mut [u64]| {
        let mut lcg = Lcg(run);
        out.iter_mut().for_each(|h| *h = lcg.next());
    };
    let store_run = |run: u64, stored: &mut BlockStored| {
        run_hashes(run, &mut stored.block_hashes);
        // A different first token per run: distinct token-chain keys, root runs only.
        stored.token_ids[0] = run as u32;
        let event = KvEvent::BlockStored(std::mem::take(stored));
        index.apply_event(replica, &event).unwrap();
        let KvEvent::BlockStored(back) = event else {
            unreachable!()
        };
        *stored = back;
    };
    for run in 0..runs {
        store_run(run, &mut stored);
    }
    let start = Instant::now();
    for run in runs..runs + iters {
        store_run(run, &mut stored);
        run_hashes(run - runs, &mut removed.block_hashes);
        let event = KvEvent::BlockRemoved(std::mem::take(&mut removed));
        black_box(index.apply_event(replica, &event).unwrap());
        let KvEvent::BlockRemoved(back) = event else {
            unreachable!()
        };
        removed = back;
    }
    start.elapsed()
}

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply");
    // Each iteration is one stored and one removed event of 4 blocks: 8 block events.
    group.throughput(Throughput::Elements(2 * BLOCKS_PER_EVENT as u64));
    group.bench_function("vllm_exact", |b| {
        b.iter_custom(|iters| steady_state(PoolKeys::VllmExact { validator: None }, iters))
    });
    group.bench_function("token_chain", |b| {
        b.iter_custom(|iters| steady_state(PoolKeys::TokenChain, iters))
    });
    group.finish();
}

const PROMPT_BLOCKS: usize = 1_000;
const REPLICAS: u32 = 64;

/// 64 replicas with realistic overlap on a 1,000-block prompt: every replica holds the shared
/// 200-block system prompt; 8 hold the first 400 blocks (same document, other questions);
/// replica 0 holds 900 (the previous turn of this conversation). Each replica also holds
/// 20,000 unrelated blocks so the tables are large, as in production.
fn match_index(everyone_holds_all: bool) -> (BlockIndex, Vec<u64>) {
    let index = index_with(PoolKeys::TokenChain, REPLICAS);
    let tokens: Vec<u32> = (0..PROMPT_BLOCKS as u32 * BLOCK_SIZE).collect();
    let keys = TokenChain::keys(&tokens, BLOCK_SIZE as usize, None, None).unwrap();
    let mut lcg = Lcg(7);
    for r in 0..REPLICAS {
        let held = match r {
            _ if everyone_holds_all => PROMPT_BLOCKS,
            0 => 900,
            1..=8 => 400,
            _ => 200,
        };
        // One BlockStored per replica for its leading run (engine hashes are arbitrary ids).
        let event = |tokens: &[u32], blocks: usize, lcg: &mut Lcg| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..blocks).map(|_| lcg.next()).collect(),
                token_ids: tokens[..blocks * BLOCK_SIZE as usize].to_vec(),
                block_size: BLOCK_SIZE,
                ..BlockStored::default()
            })
        };
        index
            .apply_event(ReplicaId(r), &event(&tokens, held, &mut lcg))
            .unwrap();
        for _ in 0..20_000 / 64 {
            let other: Vec<u32> = (0..64 * BLOCK_SIZE)
                .map(|_| (lcg.next() % 151_936) as u32)
                .collect();
            index
                .apply_event(ReplicaId(r), &event(&other, 64, &mut lcg))
                .unwrap();
        }
    }
    (index, keys)
}

/// Blocks of a Gemma-3-like sliding window: 1,024 tokens in blocks of 16 (`cdiv(1023, 16)`).
const WINDOW_BLOCKS: usize = 64;

/// [`match_index`]'s overlap on a hybrid model (vLLM-exact keys): each replica's full-attention
/// group (group 1) holds its leading run, its sliding-window group (group 0, 1,024 tokens) the
/// window before that run's end (`window_held`: each replica's hit is its whole run) or nothing
/// (every replica's hit is 0 and its window group is searched through).
fn hybrid_match_index(window_held: bool) -> (BlockIndex, Vec<u64>) {
    let index = index_with(PoolKeys::VllmExact { validator: None }, REPLICAS);
    let mut lcg = Lcg(11);
    let keys: Vec<u64> = (0..PROMPT_BLOCKS).map(|_| lcg.next()).collect();
    let tokens: Vec<u32> = (0..PROMPT_BLOCKS as u32 * BLOCK_SIZE).collect();
    let stored = |hashes: &[u64], span: usize, group: u32, kind: CacheKind| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            token_ids: tokens[..span * BLOCK_SIZE as usize].to_vec(),
            block_size: BLOCK_SIZE,
            group_idx: Some(group),
            cache_kind: Some(kind),
            sliding_window: (kind == CacheKind::SlidingWindow).then_some(1024),
            ..BlockStored::default()
        })
    };
    for r in 0..REPLICAS {
        let held = match r {
            0 => 900,
            1..=8 => 400,
            _ => 200,
        };
        let window = if window_held {
            &keys[held - WINDOW_BLOCKS..held]
        } else {
            &[]
        };
        let events = [
            stored(window, held, 0, CacheKind::SlidingWindow),
            stored(&keys[..held], held, 1, CacheKind::FullAttention),
        ];
        index.apply_events(ReplicaId(r), &events).unwrap();
    }
    (index, keys)
}

fn find_matches(c: &mut Criterion) {
    let mut group = c.benchmark_group("find_matches");
    let cases = [
        ("realistic_overlap", match_index(false)),
        ("all_hold_all", match_index(true)),
        ("hybrid_window_held", hybrid_match_index(true)),
        ("hybrid_window_evicted", hybrid_match_index(false)),
    ];
    for (name, (index, keys)) in cases {
        let candidates: Vec<ReplicaId> = (0..REPLICAS).map(ReplicaId).collect();
        group.bench_with_input(
            BenchmarkId::new("1000_blocks_64_replicas", name),
            &keys,
            |b, keys| {
                b.iter(|| black_box(index.find_matches("m", keys, Some(&candidates)).unwrap()))
            },
        );
    }
    group.finish();
}

criterion_group!(benches, apply, find_matches);
criterion_main!(benches);
