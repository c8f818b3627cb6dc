//! [`BlockIndex`]-specific behaviour: hash validation, token-chain namespaces, status and
//! metrics, memory per holding, and concurrent ingest with queries.

use kvroute_block_keys::{HashAlgo, HashValue, KeyScheme, LoraRef, VllmHasher};
use prometheus_client::registry::Registry;

use super::*;
use crate::index::{FlagReason, RejectReason, VerifyHashes};

/// vLLM golden vector: sha256_cbor, PYTHONHASHSEED "42", tokens 1..=48, block size 16.
const GOLDEN: [u64; 3] = [
    16300212363532267629,
    8671309795006503672,
    3527878332947511115,
];

fn golden_tokens() -> Vec<u32> {
    (1..=48).collect()
}

fn hasher(seed: &str) -> VllmHasher {
    VllmHasher::new(HashAlgo::Sha256Cbor, Some(seed)).unwrap()
}

/// An index with one validated vLLM-exact pool (block size 16) and replicas 0 and 1.
fn validated_index(registry: &mut Registry) -> BlockIndex {
    index_verifying(registry, VerifyHashes::Flag)
}

/// [`validated_index`] with the given verification policy.
fn index_verifying(registry: &mut Registry, verify: VerifyHashes) -> BlockIndex {
    let index = BlockIndex::new(IndexConfig::default(), IndexMetrics::register(registry));
    let keys = PoolKeys::from_scheme(
        &KeyScheme::VllmExact {
            hasher: hasher("42"),
            era: kvroute_block_keys::ExtraKeysEra::From0_31,
        },
        verify,
    );
    index
        .add_pool(PoolConfig {
            model: "m".into(),
            block_size: 16,
            keys,
            attention_chunk_size: None,
        })
        .unwrap();
    index.add_replica(ReplicaId(0), "r0", "m").unwrap();
    index.add_replica(ReplicaId(1), "r1", "m").unwrap();
    index
}

fn golden_event(hashes: &[u64], extra_keys: Option<Vec<Option<HashValue>>>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        token_ids: golden_tokens(),
        block_size: 16,
        extra_keys,
        ..BlockStored::default()
    })
}

fn metrics_text(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[test]
fn correct_hashes_validate() {
    let mut registry = Registry::default();
    let index = validated_index(&mut registry);
    index
        .apply_event(ReplicaId(0), &golden_event(&GOLDEN, Some(vec![None; 3])))
        .unwrap();
    let found = index.find_matches("m", &GOLDEN, None).unwrap();
    assert_eq!(counts(&found, 0), Some((3, 3)));
    assert!(found.iter().all(|m| m.precise));
    assert_eq!(index.replica_status(ReplicaId(0)).unwrap().flag, None);
}

#[test]
fn mismatching_hashes_flag_and_exclude_the_replica() {
    let mut registry = Registry::default();
    let index = validated_index(&mut registry);
    // Replica 0 publishes hashes of another seed: the pool config and engine disagree.
    let wrong = KeyScheme::VllmExact {
        hasher: hasher("7"),
        era: kvroute_block_keys::ExtraKeysEra::From0_31,
    };
    let wrong_keys = wrong.prompt_keys(&golden_tokens(), 16, None, None).unwrap();
    index
        .apply_event(
            ReplicaId(0),
            &golden_event(&wrong_keys, Some(vec![None; 3])),
        )
        .unwrap();
    index
        .apply_event(ReplicaId(1), &golden_event(&GOLDEN, Some(vec![None; 3])))
        .unwrap();

    let found = index.find_matches("m", &wrong_keys, None).unwrap();
    let flagged = found.iter().find(|m| m.replica == ReplicaId(0)).unwrap();
    assert!(!flagged.precise);
    assert_eq!(flagged.matched_blocks, 0);
    assert_eq!(
        counts(&index.find_matches("m", &GOLDEN, None).unwrap(), 1),
        Some((3, 3))
    );
    let status = index.replica_status(ReplicaId(0)).unwrap();
    assert_eq!(status.flag, Some(FlagReason::HashMismatch));
    assert_eq!(status.flag.map(FlagReason::as_label), Some("hash_mismatch"));
    assert!(metrics_text(&registry).contains("flagged_replicas{reason=\"hash_mismatch\"} 1"));

    // A reset (engine restart after the operator fixed the seed) trusts the replica again.
    index.reset_replica(ReplicaId(0)).unwrap();
    assert_eq!(index.replica_status(ReplicaId(0)).unwrap().flag, None);
    assert!(metrics_text(&registry).contains("flagged_replicas{reason=\"hash_mismatch\"} 0"));
    index
        .apply_event(ReplicaId(0), &golden_event(&GOLDEN, Some(vec![None; 3])))
        .unwrap();
    assert_eq!(
        counts(&index.find_matches("m", &GOLDEN, None).unwrap(), 0),
        Some((3, 3))
    );
}

#[test]
fn unpublished_extra_keys_need_a_mismatch_streak() {
    let mut registry = Registry::default();
    let index = validated_index(&mut registry);
    // vLLM < 0.17 publishes no extra keys: a hidden cache_salt may explain one mismatch.
    let mut salted = GOLDEN;
    salted[0] ^= 1;
    for _ in 1..8 {
        index
            .apply_event(ReplicaId(0), &golden_event(&salted, None))
            .unwrap();
    }
    assert_eq!(index.replica_status(ReplicaId(0)).unwrap().flag, None);
    // A verified run resets the streak; eight mismatches in a row flag.
    index
        .apply_event(ReplicaId(0), &golden_event(&GOLDEN, None))
        .unwrap();
    for _ in 1..8 {
        index
            .apply_event(ReplicaId(0), &golden_event(&salted, None))
            .unwrap();
    }
    assert_eq!(index.replica_status(ReplicaId(0)).unwrap().flag, None);
    index
        .apply_event(ReplicaId(0), &golden_event(&salted, None))
        .unwrap();
    assert_eq!(
        index.replica_status(ReplicaId(0)).unwrap().flag,
        Some(FlagReason::HashMismatch)
    );
}

#[test]
fn mid_chain_runs_validate_only_with_parent_digests() {
    let mut registry = Registry::default();
    let index = validated_index(&mut registry);
    let digests = hasher("42")
        .chain(None, &golden_tokens(), 16, |_| None)
        .unwrap();
    let mid_chain = |hashes: &[u64], parent_digest: Option<Vec<u8>>| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: Some(GOLDEN[0]),
            token_ids: golden_tokens()[16..].to_vec(),
            block_size: 16,
            extra_keys: Some(vec![None, None]),
            parent_digest,
            ..BlockStored::default()
        })
    };
    let parent = Some(digests[0].as_bytes().to_vec());
    index
        .apply_event(ReplicaId(0), &mid_chain(&GOLDEN[1..], parent.clone()))
        .unwrap();
    assert_eq!(index.replica_status(ReplicaId(0)).unwrap().flag, None);
    // Without the digest a wrong hash cannot be detected (the u64 parent cannot continue it).
    index
        .apply_event(ReplicaId(1), &mid_chain(&[1, 2], None))
        .unwrap();
    assert_eq!(index.replica_status(ReplicaId(1)).unwrap().flag, None);
    index
        .apply_event(ReplicaId(1), &mid_chain(&[1, 2], parent))
        .unwrap();
    assert_eq!(
        index.replica_status(ReplicaId(1)).unwrap().flag,
        Some(FlagReason::HashMismatch)
    );
}

/// A run continuing block 0 of the golden chain: blocks 1 and 2 (`hashes`), with or without
/// the parent's full digest.
fn mid_chain(hashes: &[u64], parent_digest: Option<Vec<u8>>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: Some(GOLDEN[0]),
        token_ids: golden_tokens()[16..].to_vec(),
        block_size: 16,
        extra_keys: Some(vec![None, None]),
        parent_digest,
        ..BlockStored::default()
    })
}

/// The golden tokens as a run of a LoRA adapter (the index cannot recompute its hashes).
fn lora_event(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        token_ids: golden_tokens(),
        block_size: 16,
        extra_keys: Some(vec![None; 3]),
        lora_id: Some(3),
        ..BlockStored::default()
    })
}

/// Block 0 of the golden chain alone.
fn golden_first_block() -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: vec![GOLDEN[0]],
        token_ids: golden_tokens()[..16].to_vec(),
        block_size: 16,
        extra_keys: Some(vec![None]),
        ..BlockStored::default()
    })
}

fn golden_parent_digest() -> Vec<u8> {
    let digests = hasher("42")
        .chain(None, &golden_tokens(), 16, |_| None)
        .unwrap();
    digests[0].as_bytes().to_vec()
}

fn rejected(registry: &Registry, reason: &str) -> String {
    let text = metrics_text(registry);
    let series = format!("blocks_rejected_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series} in {text}"))
        .to_owned()
}

#[test]
fn flag_mode_indexes_what_it_cannot_verify() {
    // Today's default: unverifiable runs (no parent digest, LoRA) are indexed unchecked.
    let mut registry = Registry::default();
    let index = index_verifying(&mut registry, VerifyHashes::Flag);
    let lora = lora_event(&[7, 8, 9]);
    let outcome = index.apply_event(ReplicaId(0), &lora).unwrap();
    assert_eq!(outcome.blocks_stored, 3);
    let outcome = index
        .apply_event(ReplicaId(1), &mid_chain(&[1, 2], None))
        .unwrap();
    assert_eq!(outcome.blocks_stored, 2);
    assert_eq!(rejected(&registry, "unverifiable"), "0");
}

#[test]
fn required_mode_indexes_verified_runs() {
    let mut registry = Registry::default();
    let index = index_verifying(&mut registry, VerifyHashes::Required);
    index
        .apply_event(ReplicaId(0), &golden_first_block())
        .unwrap();
    let outcome = index
        .apply_event(
            ReplicaId(0),
            &mid_chain(&GOLDEN[1..], Some(golden_parent_digest())),
        )
        .unwrap();
    assert_eq!(outcome.blocks_stored, 2);
    assert_eq!(outcome.rejection, None);
    assert_eq!(
        counts(&index.find_matches("m", &GOLDEN, None).unwrap(), 0),
        Some((3, 3))
    );
    assert_eq!(rejected(&registry, "unverifiable"), "0");
}

#[test]
fn required_mode_refuses_unverifiable_runs() {
    let mut registry = Registry::default();
    let index = index_verifying(&mut registry, VerifyHashes::Required);
    // A rogue publisher's forged run continuing a chain: no parent digest to check it against.
    let outcome = index
        .apply_event(ReplicaId(0), &mid_chain(&[1, 2], None))
        .unwrap();
    assert_eq!(outcome.blocks_stored, 0);
    assert_eq!(outcome.blocks_rejected, 2);
    assert_eq!(outcome.rejection, Some(RejectReason::Unverifiable));
    // LoRA blocks: their hashed form depends on the adapter, which the index cannot recompute.
    let lora = lora_event(&[7, 8, 9]);
    let outcome = index.apply_event(ReplicaId(0), &lora).unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::Unverifiable));
    // No published extra keys (vLLM < 0.17): a mismatch a hidden cache_salt may explain.
    let mut salted = GOLDEN;
    salted[0] ^= 1;
    let outcome = index
        .apply_event(ReplicaId(0), &golden_event(&salted, None))
        .unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::Unverifiable));

    assert_eq!(rejected(&registry, "unverifiable"), "8");
    let status = index.replica_status(ReplicaId(0)).unwrap();
    assert_eq!(status.blocks, 0, "nothing unverified is indexed");
    assert_eq!(status.blocks_rejected, 8);
    // Nothing was wrong for sure, so the replica stays in precise scoring.
    assert_eq!(status.flag, None);
}

/// A salted prompt with an image over blocks 1 and 2 as a vLLM 0.32 engine stores it: the
/// hashes with the image and salt hashed in, the extra keys as its events publish them.
fn image_event(identifier: &str) -> (Vec<u64>, KvEvent) {
    let scheme = KeyScheme::VllmExact {
        hasher: hasher("42"),
        era: kvroute_block_keys::ExtraKeysEra::From0_31,
    };
    let items = [kvroute_block_keys::MultiModalItem {
        identifier,
        offset: 20,
        length: 20,
    }];
    let keys = scheme
        .media_prompt_keys(&golden_tokens(), 16, None, Some("salt"), &items)
        .unwrap();
    let extra = kvroute_block_keys::ExtraKeys::with_multimodal(
        kvroute_block_keys::ExtraKeysEra::From0_31,
        None,
        Some("salt"),
        &items,
        16,
    )
    .unwrap();
    let published = (0..3).map(|i| extra.published_for_block(i)).collect();
    (keys.clone(), golden_event(&keys, Some(published)))
}

#[test]
fn image_runs_verify_with_their_published_extra_keys() {
    let mut registry = Registry::default();
    let index = index_verifying(&mut registry, VerifyHashes::Required);
    let (keys, event) = image_event("0123abcd");
    let KvEvent::BlockStored(stored) = &event else {
        unreachable!()
    };
    // (salt) on block 0, (identifier, offset) pairs on blocks 1 and 2.
    assert_eq!(
        stored.extra_keys.as_ref().unwrap()[2],
        Some(HashValue::Tuple(vec![HashValue::Tuple(vec![
            HashValue::Str("0123abcd".into()),
            HashValue::Int(-12),
        ])]))
    );
    let outcome = index.apply_event(ReplicaId(0), &event).unwrap();
    assert_eq!(outcome.rejection, None);
    assert_eq!(outcome.blocks_stored, 3);
    assert_eq!(
        counts(&index.find_matches("m", &keys, None).unwrap(), 0),
        Some((3, 3))
    );
    // Another image's hashes published with this image's extra keys: a sure mismatch at the
    // image's first block.
    let (forged_keys, _) = image_event("ffff");
    let KvEvent::BlockStored(mut forged) = event else {
        unreachable!()
    };
    forged.block_hashes = forged_keys;
    let outcome = index
        .apply_event(ReplicaId(1), &KvEvent::BlockStored(forged))
        .unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::HashMismatch));
    assert_eq!(
        index.replica_status(ReplicaId(1)).unwrap().flag,
        Some(FlagReason::HashMismatch)
    );
}

#[test]
fn required_mode_refuses_mismatching_runs_and_keeps_refusing_once_flagged() {
    let mut registry = Registry::default();
    let index = index_verifying(&mut registry, VerifyHashes::Required);
    let forged = golden_event(&[11, 12, 13], Some(vec![None; 3]));
    let outcome = index.apply_event(ReplicaId(0), &forged).unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::HashMismatch));
    assert_eq!(outcome.blocks_stored, 0);
    assert_eq!(
        index.replica_status(ReplicaId(0)).unwrap().flag,
        Some(FlagReason::HashMismatch)
    );
    // Flagged replicas are not re-verified in flag mode; a required pool still checks.
    let outcome = index.apply_event(ReplicaId(0), &forged).unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::HashMismatch));
    let outcome = index
        .apply_event(ReplicaId(0), &mid_chain(&[1, 2], None))
        .unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::Unverifiable));
    assert_eq!(index.replica_status(ReplicaId(0)).unwrap().blocks, 0);
    assert_eq!(rejected(&registry, "hash_mismatch"), "6");
    // The honest replica is unaffected.
    let outcome = index
        .apply_event(ReplicaId(1), &golden_event(&GOLDEN, Some(vec![None; 3])))
        .unwrap();
    assert_eq!(outcome.blocks_stored, 3);
}

#[test]
fn flags_set_by_ingest_exclude_until_cleared() {
    let index = block_index(100);
    setup(&index, 1);
    let tokens = prompt(1, 0, 2);
    index
        .apply_event(ReplicaId(0), &stored(&tokens, 0, 2, Medium::Gpu))
        .unwrap();
    index
        .flag_replica(ReplicaId(0), FlagReason::Resyncing)
        .unwrap();
    let found = index
        .find_matches(EXACT, &engine_hashes(&tokens), None)
        .unwrap();
    assert_eq!((found[0].precise, found[0].matched_blocks), (false, 0));
    index.clear_flag(ReplicaId(0)).unwrap();
    let found = index
        .find_matches(EXACT, &engine_hashes(&tokens), None)
        .unwrap();
    assert_eq!((found[0].precise, found[0].matched_blocks), (true, 2));
    assert!(
        index
            .flag_replica(ReplicaId(42), FlagReason::Stale)
            .is_err()
    );
}

fn chain_index() -> BlockIndex {
    let index = block_index(100);
    let pool = PoolConfig {
        model: "c".into(),
        block_size: BS,
        keys: PoolKeys::TokenChain,
        attention_chunk_size: None,
    };
    index.add_pool(pool).unwrap();
    index.add_replica(ReplicaId(0), "c0", "c").unwrap();
    index
}

#[test]
fn token_chain_roots_runs_in_the_adapter_and_salt_namespace() {
    let index = chain_index();
    let tokens = prompt(3, 0, 3);
    let s = |v: &str| HashValue::Str(v.to_owned());
    // vLLM 0.11.1–0.30 shape: (lora_name, salt) on block 0, (lora_name,) after.
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![11, 12, 13],
        token_ids: tokens.clone(),
        block_size: BS,
        lora_name: Some("Alice".into()),
        extra_keys: Some(vec![
            Some(HashValue::Tuple(vec![s("Alice"), s("tenant-a")])),
            Some(HashValue::Tuple(vec![s("Alice")])),
            Some(HashValue::Tuple(vec![s("Alice")])),
        ]),
        ..BlockStored::default()
    });
    index.apply_event(ReplicaId(0), &event).unwrap();
    let lora = LoraRef {
        id: None,
        name: "Alice",
        path: None,
    };
    let router_keys =
        KeyScheme::TokenChain.prompt_keys(&tokens, BS as usize, Some(&lora), Some("tenant-a"));
    let found = index
        .find_matches("c", &router_keys.unwrap(), None)
        .unwrap();
    assert_eq!(counts(&found, 0), Some((3, 3)));
    // The same tokens without the namespace are different keys.
    let found = index.find_matches("c", &chain_keys(&tokens), None).unwrap();
    assert_eq!(counts(&found, 0), Some((0, 0)));
}

#[test]
fn token_chain_skips_blocks_with_multimodal_extra_keys() {
    let index = chain_index();
    let tokens = prompt(4, 0, 3);
    let image = HashValue::Tuple(vec![HashValue::Str("img-1".into()), HashValue::Int(0)]);
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![21, 22, 23],
        token_ids: tokens.clone(),
        block_size: BS,
        extra_keys: Some(vec![None, Some(HashValue::Tuple(vec![image])), None]),
        ..BlockStored::default()
    });
    let outcome = index.apply_event(ReplicaId(0), &event).unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::UnsupportedExtraKeys));
    assert_eq!((outcome.blocks_stored, outcome.blocks_rejected), (1, 2));
    let found = index.find_matches("c", &chain_keys(&tokens), None).unwrap();
    assert_eq!(counts(&found, 0), Some((1, 1)));
}

#[test]
fn status_and_metrics_report_per_replica_state() {
    let mut registry = Registry::default();
    let index = BlockIndex::new(
        IndexConfig {
            max_blocks_per_replica: 2,
            ..IndexConfig::default()
        },
        IndexMetrics::register(registry.sub_registry_with_prefix("index")),
    );
    setup(&index, 1);
    let tokens = prompt(5, 0, 3);
    index
        .apply_event(ReplicaId(0), &stored(&tokens, 0, 3, Medium::Gpu))
        .unwrap();
    index
        .apply_event(ReplicaId(0), &removed(&tokens, 1, 2, Medium::Cpu))
        .unwrap();
    let status = index.replica_status(ReplicaId(0)).unwrap();
    assert_eq!(
        (
            status.name.as_str(),
            status.model.as_str(),
            status.blocks,
            status.events_applied
        ),
        ("exact-0", EXACT, 2, 2)
    );
    assert_eq!(status.blocks_rejected, 2);
    assert_eq!(index.replica_statuses(Some(CHAIN)).len(), 1);
    assert_eq!(index.replica_statuses(None).len(), 2);

    let text = metrics_text(&registry);
    for line in [
        "index_events_applied_total{kind=\"block_stored\"} 1",
        "index_events_applied_total{kind=\"block_removed\"} 1",
        "index_blocks_stored_total{medium=\"gpu\"} 2",
        "index_blocks_rejected_total{reason=\"replica_capacity\"} 1",
        "index_blocks_rejected_total{reason=\"unknown_block\"} 1",
        "index_replica_blocks{replica=\"exact-0\"} 2",
        "index_flagged_replicas{reason=\"hash_mismatch\"} 0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    index.remove_replica(ReplicaId(0)).unwrap();
    assert!(!metrics_text(&registry).contains("replica=\"exact-0\""));
}

/// Memory per (block, replica) holding, computed from table capacities. Realistic shape: 64
/// replicas, each holding a shared 64-block system prompt plus its own conversations.
#[test]
fn memory_per_holding_is_small() {
    for model in [EXACT, CHAIN] {
        let index = block_index(1_000_000);
        setup(&index, 64);
        let system = prompt(0, 64, 64);
        for r in 0..64u32 {
            let replica = ReplicaId(if model == CHAIN { 100 + r } else { r });
            for conversation in 0..20 {
                let tokens = [&system[..], &prompt(r * 100 + conversation + 1, 0, 16)[..]].concat();
                for start in (0..80).step_by(4) {
                    index
                        .apply_event(replica, &stored(&tokens, start, start + 4, Medium::Gpu))
                        .unwrap();
                }
            }
        }
        let holdings = index.holdings();
        assert_eq!(holdings, 64 * (64 + 20 * 16));
        let per_holding = index.memory_bytes() as f64 / holdings as f64;
        println!("{model}: {holdings} holdings, {per_holding:.1} bytes per holding");
        assert!(
            per_holding <= 64.0,
            "{model}: {per_holding:.1} bytes per holding"
        );
    }
}

#[test]
fn queries_run_concurrently_with_ingest() {
    let index = block_index(100_000);
    setup(&index, 4);
    let tokens: Vec<Vec<u32>> = (0..4).map(|r| prompt(r + 1, 8, 32)).collect();
    std::thread::scope(|scope| {
        for r in 0..4u32 {
            let (index, tokens) = (&index, &tokens[r as usize]);
            scope.spawn(move || {
                for round in 0..50 {
                    for start in (0..32).step_by(4) {
                        index
                            .apply_event(
                                ReplicaId(r),
                                &stored(tokens, start, start + 4, Medium::Gpu),
                            )
                            .unwrap();
                    }
                    if round < 49 {
                        index
                            .apply_event(ReplicaId(r), &KvEvent::AllBlocksCleared)
                            .unwrap();
                    }
                }
            });
        }
        scope.spawn(|| {
            for _ in 0..2_000 {
                let keys = engine_hashes(&tokens[0]);
                for m in index.find_matches(EXACT, &keys, None).unwrap() {
                    assert!(m.matched_blocks as usize <= keys.len());
                    // Replicas 1..4 share only the first 8 blocks with replica 0's prompt.
                    assert!(m.replica == ReplicaId(0) || m.matched_blocks <= 8, "{m:?}");
                }
            }
        });
    });
    let found = sorted(
        index
            .find_matches(EXACT, &engine_hashes(&tokens[0]), None)
            .unwrap(),
    );
    let matched: Vec<u32> = found.iter().map(|m| m.matched_blocks).collect();
    assert_eq!(matched, [32, 8, 8, 8]);
}

/// Pools of more than 64 replicas use the multi-word walk and spilled holder lists; they must
/// agree with the reference model like small pools do (the property tests use 3 replicas).
#[test]
fn large_pools_agree_with_reference_model() {
    const REPLICAS: u32 = 150;
    let index = block_index(10_000);
    let reference = make_reference(10_000);
    let prompts: Vec<Vec<u32>> = (0..4).map(|seed| prompt(seed + 1, 6, 12)).collect();
    let media = [Medium::Gpu, Medium::Cpu, Medium::Gpu, Medium::Storage];
    for model in [&index as &dyn KvIndex, &*reference] {
        let pool = PoolConfig {
            model: EXACT.into(),
            block_size: BS,
            keys: PoolKeys::VllmExact { validator: None },
            attention_chunk_size: None,
        };
        model.add_pool(pool).unwrap();
        for r in 0..REPLICAS {
            model
                .add_replica(ReplicaId(r), &format!("r{r}"), EXACT)
                .unwrap();
        }
        for r in 0..REPLICAS {
            let tokens = &prompts[r as usize % prompts.len()];
            let held = 1 + (r as usize * 7) % 12;
            let medium = media[r as usize % media.len()];
            model
                .apply_event(ReplicaId(r), &stored(tokens, 0, held, medium))
                .unwrap();
            if r % 5 == 0 {
                // A CPU copy of the first blocks, then the GPU copy of one of them goes.
                model
                    .apply_event(ReplicaId(r), &stored(tokens, 0, 2, Medium::Cpu))
                    .unwrap();
                model
                    .apply_event(ReplicaId(r), &removed(tokens, 1, 2, medium))
                    .unwrap();
            }
        }
        // Freed slots are reused by new replicas.
        for r in (3..REPLICAS).step_by(11) {
            model.remove_replica(ReplicaId(r)).unwrap();
        }
        for r in (3..REPLICAS).step_by(22) {
            model
                .add_replica(ReplicaId(1_000 + r), &format!("new{r}"), EXACT)
                .unwrap();
            model
                .apply_event(
                    ReplicaId(1_000 + r),
                    &stored(&prompts[0], 0, 9, Medium::Gpu),
                )
                .unwrap();
        }
    }
    let some: Vec<ReplicaId> = (0..REPLICAS).step_by(3).map(ReplicaId).collect();
    for tokens in &prompts {
        let keys = engine_hashes(tokens);
        for candidates in [None, Some(&some[..])] {
            let found = sorted(index.find_matches(EXACT, &keys, candidates).unwrap());
            let expected = sorted(reference.find_matches(EXACT, &keys, candidates).unwrap());
            assert_eq!(found, expected);
        }
        // Replicas hold up to 9..12 blocks of each prompt, past the 6 shared ones.
        let all = index.find_matches(EXACT, &keys, None).unwrap();
        assert!(
            all.iter()
                .any(|m| m.matched_blocks > 6 && m.replica.0 >= 64)
        );
    }
}
