//! Decode + apply: what one ingest task does per engine step, in block events per second.
//!
//! Each iteration decodes and applies two vLLM 0.32 payloads: a step that stores 16 runs of
//! 4 blocks × 16 tokens (64 block events) and a step that evicts those 64 blocks again, so the
//! replica stays at a steady 100k indexed blocks. Throughput counts the 128 block events.
//! Two pools: one trusting the engine's hashes, one re-hashing chain-start runs (`sha256_cbor`)
//! to validate them, which is the default for `vllm-exact` pools.

#![allow(
    clippy::expect_used,
    reason = "benchmark setup: a failure aborts the run"
)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_block_keys::{HashAlgo, VllmHasher};
use kvroute_index_core::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::index::{
    BlockIndex, HashValidator, IndexConfig, IndexMetrics, KvIndex, PoolConfig, PoolKeys, ReplicaId,
};
use kvroute_index_core::wire::{Encoding, decode_batch, encode_batch};

const RUNS: usize = 16;
const BLOCKS_PER_RUN: usize = 4;
const BLOCK_SIZE: usize = 16;
const RESIDENT_BLOCKS: usize = 100_000;

fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *state
}

fn stored_run(hashes: Vec<u64>, parent: Option<u64>, seed: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        token_ids: (0..hashes.len() * BLOCK_SIZE)
            .map(|t| (t as u32 * 7919 + seed * 31) % 151_936)
            .collect(),
        block_hashes: hashes,
        parent_block_hash: parent,
        block_size: BLOCK_SIZE as u32,
        medium: Medium::Gpu,
        extra_keys: Some(vec![None; BLOCKS_PER_RUN]),
        group_idx: Some(0),
        ..BlockStored::default()
    })
}

fn batch(events: Vec<KvEvent>) -> Vec<u8> {
    encode_batch(
        &EventBatch {
            ts: 1.0,
            dp_rank: Some(0),
            events,
        },
        Encoding::V0_32,
    )
}

fn index_with_resident_blocks(keys: PoolKeys) -> BlockIndex {
    let index = BlockIndex::new(IndexConfig::default(), IndexMetrics::unregistered());
    index
        .add_pool(PoolConfig {
            model: "m".into(),
            block_size: BLOCK_SIZE as u32,
            keys,
            attention_chunk_size: None,
        })
        .expect("pool");
    index.add_replica(ReplicaId(0), "r0", "m").expect("replica");
    let mut state = 7u64;
    let mut parent = None;
    for run in 0..RESIDENT_BLOCKS / BLOCKS_PER_RUN {
        let hashes: Vec<u64> = (0..BLOCKS_PER_RUN).map(|_| lcg(&mut state)).collect();
        let next_parent = hashes.last().copied();
        index
            .apply_event(ReplicaId(0), &stored_run(hashes, parent, run as u32))
            .expect("apply");
        parent = if run % 8 == 7 { None } else { next_parent };
    }
    index
}

fn bench_decode_apply(c: &mut Criterion) {
    // Chain-start runs carry real sha256_cbor hashes so validation passes (and costs what it costs).
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).expect("hasher");
    let mut state = 11u64;
    let mut events = Vec::with_capacity(RUNS);
    let mut all_hashes = Vec::with_capacity(RUNS * BLOCKS_PER_RUN);
    for run in 0..RUNS {
        let seed = 1_000_000 + run as u32;
        let hashes: Vec<u64> = if run % 2 == 0 {
            let tokens: Vec<u32> = (0..BLOCKS_PER_RUN * BLOCK_SIZE)
                .map(|t| (t as u32 * 7919 + seed * 31) % 151_936)
                .collect();
            hasher
                .chain(None, &tokens, BLOCK_SIZE, |_| None)
                .expect("chain")
                .iter()
                .map(|d| d.published_u64())
                .collect()
        } else {
            (0..BLOCKS_PER_RUN).map(|_| lcg(&mut state)).collect()
        };
        all_hashes.extend_from_slice(&hashes);
        let parent = (run % 2 == 1).then(|| lcg(&mut state));
        events.push(stored_run(hashes, parent, seed));
    }
    let store = batch(events);
    let evict = batch(vec![KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: all_hashes,
        medium: Medium::Gpu,
        group_idx: Some(0),
    })]);

    let mut group = c.benchmark_group("decode_apply");
    group.throughput(Throughput::Elements((2 * RUNS * BLOCKS_PER_RUN) as u64));
    let pools = [
        (
            "vllm_exact_trusted",
            PoolKeys::VllmExact { validator: None },
        ),
        (
            "vllm_exact_validated",
            PoolKeys::VllmExact {
                validator: Some(HashValidator {
                    hasher: hasher.clone(),
                    era: kvroute_block_keys::ExtraKeysEra::From0_31,
                    required: false,
                }),
            },
        ),
    ];
    for (name, keys) in pools {
        let index = index_with_resident_blocks(keys);
        group.bench_function(name, |b| {
            b.iter(|| {
                for payload in [&store, &evict] {
                    let decoded = decode_batch(black_box(payload)).expect("decode");
                    let outcome = index.apply_events(ReplicaId(0), &decoded.batch.events);
                    black_box(outcome.expect("apply"));
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_decode_apply);
criterion_main!(benches);
