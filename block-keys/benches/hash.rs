//! Hashing a 1,000-block prompt (block size 16) with each key scheme.
#![expect(
    clippy::unwrap_used,
    reason = "benchmark setup: any failure should abort the run"
)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_block_keys::{ExtraKeysEra, HashAlgo, KeyScheme, VllmHasher};

const BLOCK_SIZE: usize = 16;
const BLOCKS: usize = 1_000;

fn prompt() -> Vec<u32> {
    // Realistic vocabulary spread: ids below and above 65536 (different serialized widths).
    (0..BLOCK_SIZE * BLOCKS)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) % 152_000)
        .collect()
}

fn bench_prompt_keys(c: &mut Criterion) {
    let tokens = prompt();
    let vllm = |algo| KeyScheme::VllmExact {
        hasher: VllmHasher::new(algo, Some("0")).unwrap(),
        era: ExtraKeysEra::From0_31,
    };
    let mut group = c.benchmark_group("prompt_keys_1000_blocks_bs16");
    group.throughput(Throughput::Elements(BLOCKS as u64));
    for (name, scheme) in [
        ("sha256_cbor", vllm(HashAlgo::Sha256Cbor)),
        ("sha256_pickle", vllm(HashAlgo::Sha256)),
        ("xxhash_cbor", vllm(HashAlgo::XxhashCbor)),
        ("token_chain", KeyScheme::TokenChain),
    ] {
        let mut out = Vec::with_capacity(BLOCKS);
        group.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                scheme
                    .prompt_keys_into(black_box(&tokens), BLOCK_SIZE, None, None, &mut out)
                    .unwrap();
                black_box(out.len())
            })
        });
    }
    group.finish();
}

/// Where a vLLM-exact block's time goes: serializing the tuple vs hashing it.
fn bench_block_parts(c: &mut Criterion) {
    let tokens = prompt();
    let block = &tokens[BLOCK_SIZE..2 * BLOCK_SIZE];
    let mut group = c.benchmark_group("one_block_bs16");
    let mut scratch = Vec::with_capacity(256);
    for algo in [HashAlgo::Sha256Cbor, HashAlgo::Sha256] {
        let hasher = VllmHasher::new(algo, Some("0")).unwrap();
        let parent = *hasher.none_hash();
        group.bench_function(format!("{algo}_serialize"), |b| {
            b.iter(|| {
                scratch.clear();
                hasher.write_block_preimage(Some(&parent), black_box(block), None, &mut scratch);
                black_box(scratch.len())
            })
        });
        group.bench_function(format!("{algo}_serialize_and_hash"), |b| {
            b.iter(|| {
                black_box(hasher.hash_block_with(
                    &mut scratch,
                    Some(&parent),
                    black_box(block),
                    None,
                ))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_prompt_keys, bench_block_parts);
criterion_main!(benches);
