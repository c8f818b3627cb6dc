//! Decode throughput of vLLM KV-event payloads, in block events per second.
//!
//! The batch is what a vLLM 0.30–0.32 engine step typically publishes: 16 `BlockStored` events of
//! 4 blocks × 16 tokens (map encoding, u64 hashes), i.e. 64 block events. The ingest target is
//! 2 M block events/s for decode + apply, so decode alone must be well above that.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_index_core::event::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::wire::{Encoding, HashForm, Schema, decode_batch, encode_batch};

const EVENTS: usize = 16;
const BLOCKS_PER_EVENT: usize = 4;
const BLOCK_SIZE: usize = 16;

/// A deterministic step batch; hashes are spread over the whole u64 range like real digests.
fn step_batch(with_digests: bool) -> EventBatch {
    let mut next = 0x9e37_79b9_7f4a_7c15u64;
    let mut hash = move || {
        next = next
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        next
    };
    let events = (0..EVENTS)
        .map(|event| {
            let digests: Vec<Vec<u8>> = (0..BLOCKS_PER_EVENT)
                .map(|_| (0..4).flat_map(|_| hash().to_be_bytes()).collect())
                .collect();
            let block_hashes = digests
                .iter()
                .map(|d| d[24..].iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b)))
                .collect();
            KvEvent::BlockStored(BlockStored {
                block_hashes,
                parent_block_hash: (event % 2 == 1).then(&mut hash),
                token_ids: (0..BLOCKS_PER_EVENT * BLOCK_SIZE)
                    .map(|t| (t as u32 * 7919 + event as u32 * 31) % 151_936)
                    .collect(),
                block_size: BLOCK_SIZE as u32,
                medium: Medium::Gpu,
                extra_keys: Some(vec![None; BLOCKS_PER_EVENT]),
                group_idx: Some(0),
                block_digests: with_digests.then_some(digests),
                ..BlockStored::default()
            })
        })
        .collect();
    EventBatch {
        ts: 1_795_992_754.005_640_7,
        dp_rank: Some(0),
        events,
    }
}

fn bench_decode(c: &mut Criterion) {
    let cases = [
        ("map_u64_hashes_0.32", Encoding::V0_32, false),
        (
            "map_bin_hashes_0.32",
            Encoding {
                schema: Schema::S11,
                hashes: HashForm::Bytes,
            },
            true,
        ),
        (
            "array_u64_hashes_0.22",
            Encoding {
                schema: Schema::S7,
                hashes: HashForm::Uint,
            },
            false,
        ),
    ];
    let mut group = c.benchmark_group("wire_decode_batch");
    group.throughput(Throughput::Elements((EVENTS * BLOCKS_PER_EVENT) as u64));
    for (name, encoding, with_digests) in cases {
        let payload = encode_batch(&step_batch(with_digests), encoding);
        assert!(decode_batch(&payload).is_ok());
        group.bench_function(name, |b| {
            b.iter(|| decode_batch(black_box(&payload)));
        });
    }
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
