//! The conformance suite: index semantics every [`KvIndex`] implementation must have. Each case
//! runs against [`BlockIndex`] and the reference model, in both key schemes.

use super::*;
use crate::index::{FlagReason, IndexError, RejectReason, ReplicaState};

/// (model, id of its replica 0) for both schemes.
const POOLS: [(&str, u32); 2] = [(EXACT, 0), (CHAIN, 100)];

fn matches(index: &dyn KvIndex, model: &str, tokens: &[u32]) -> Vec<ReplicaMatch> {
    sorted(
        index
            .find_matches(model, &query_keys(model, tokens), None)
            .unwrap(),
    )
}

fn leading_blocks_stop_at_first_miss(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 2);
    for (model, r0) in POOLS {
        let tokens = prompt(1, 0, 8);
        index
            .apply_event(ReplicaId(r0), &stored(&tokens, 0, 3, Medium::Gpu))
            .unwrap();
        index
            .apply_event(ReplicaId(r0), &stored(&tokens, 3, 5, Medium::Gpu))
            .unwrap();
        // Replica 1 holds blocks 0..2 only.
        index
            .apply_event(ReplicaId(r0 + 1), &stored(&tokens, 0, 2, Medium::Gpu))
            .unwrap();
        let found = matches(&*index, model, &tokens);
        assert_eq!(counts(&found, r0), Some((5, 5)), "{model}");
        assert_eq!(counts(&found, r0 + 1), Some((2, 2)), "{model}");
        assert!(found.iter().all(|m| m.precise));
        // A prompt diverging after block 1 matches 2 blocks on both.
        let other = [&tokens[..2 * BS as usize], &prompt(9, 0, 3)[..]].concat();
        let found = matches(&*index, model, &other);
        assert_eq!(counts(&found, r0), Some((2, 2)), "{model}");
        // A hole: removing block 1 cuts the leading run even though 2..5 remain.
        index
            .apply_event(ReplicaId(r0), &removed(&tokens, 1, 2, Medium::Gpu))
            .unwrap();
        let found = matches(&*index, model, &tokens);
        assert_eq!(counts(&found, r0), Some((1, 1)), "{model}");
        // Full match of the whole query is the query length.
        let found = index
            .find_matches(model, &query_keys(model, &tokens[..4]), None)
            .unwrap();
        assert_eq!(counts(&found, r0), Some((1, 1)), "{model}");
    }
}

fn gpu_blocks_count_leading_gpu_holdings(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 1);
    for (model, r0) in POOLS {
        let tokens = prompt(2, 0, 6);
        let r = ReplicaId(r0);
        index
            .apply_event(r, &stored(&tokens, 0, 4, Medium::Gpu))
            .unwrap();
        index
            .apply_event(r, &stored(&tokens, 2, 6, Medium::Cpu))
            .unwrap();
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((6, 4)),
            "{model}"
        );
        // Evicted from GPU but still in CPU: matched stays, GPU run shrinks.
        index
            .apply_event(r, &removed(&tokens, 2, 3, Medium::Gpu))
            .unwrap();
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((6, 2)),
            "{model}"
        );
        // Removing a medium the block is not held in changes nothing.
        let outcome = index
            .apply_event(r, &removed(&tokens, 0, 1, Medium::Storage))
            .unwrap();
        assert_eq!(outcome.rejection, Some(RejectReason::UnknownBlock));
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((6, 2)),
            "{model}"
        );
        index
            .apply_event(r, &removed(&tokens, 2, 3, Medium::Cpu))
            .unwrap();
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((2, 2)),
            "{model}"
        );
    }
}

fn clearing_empties_only_that_replica(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 2);
    for (model, r0) in POOLS {
        let tokens = prompt(3, 0, 4);
        for r in [r0, r0 + 1] {
            index
                .apply_event(ReplicaId(r), &stored(&tokens, 0, 4, Medium::Gpu))
                .unwrap();
        }
        index
            .apply_event(ReplicaId(r0), &KvEvent::AllBlocksCleared)
            .unwrap();
        let found = matches(&*index, model, &tokens);
        assert_eq!(counts(&found, r0), Some((0, 0)), "{model}");
        assert_eq!(counts(&found, r0 + 1), Some((4, 4)), "{model}");
        index.reset_replica(ReplicaId(r0 + 1)).unwrap();
        let found = matches(&*index, model, &tokens);
        assert_eq!(counts(&found, r0 + 1), Some((0, 0)), "{model}");
        // Cleared replicas index again from scratch.
        index
            .apply_event(ReplicaId(r0), &stored(&tokens, 0, 2, Medium::Gpu))
            .unwrap();
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((2, 2)),
            "{model}"
        );
    }
}

fn removed_replicas_disappear(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 2);
    let tokens = prompt(4, 0, 3);
    index
        .apply_event(ReplicaId(0), &stored(&tokens, 0, 3, Medium::Gpu))
        .unwrap();
    index.remove_replica(ReplicaId(0)).unwrap();
    let found = matches(&*index, EXACT, &tokens);
    assert_eq!(
        found.iter().map(|m| m.replica).collect::<Vec<_>>(),
        [ReplicaId(1)]
    );
    assert_eq!(counts(&found, 1), Some((0, 0)));
    let err = index
        .apply_event(ReplicaId(0), &stored(&tokens, 0, 1, Medium::Gpu))
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::UnknownReplica {
            replica: ReplicaId(0)
        }
    );
    assert_eq!(err.as_label(), "unknown_replica");
    assert!(index.remove_replica(ReplicaId(0)).is_err());
    // Re-registering starts empty (a reused slot must not inherit blocks).
    index.add_replica(ReplicaId(7), "exact-7", EXACT).unwrap();
    assert_eq!(counts(&matches(&*index, EXACT, &tokens), 7), Some((0, 0)));
}

fn candidates_filter_and_order(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 3);
    let tokens = prompt(5, 0, 2);
    for r in 0..3 {
        index
            .apply_event(ReplicaId(r), &stored(&tokens, 0, 2, Medium::Gpu))
            .unwrap();
    }
    let keys = query_keys(EXACT, &tokens);
    // Unknown ids and other pools' replicas are ignored; duplicates reported once.
    let candidates = [
        ReplicaId(2),
        ReplicaId(100),
        ReplicaId(0),
        ReplicaId(55),
        ReplicaId(2),
    ];
    let found = index.find_matches(EXACT, &keys, Some(&candidates)).unwrap();
    let ids: Vec<ReplicaId> = found.iter().map(|m| m.replica).collect();
    assert_eq!(ids, [ReplicaId(2), ReplicaId(0)]);
    assert!(found.iter().all(|m| m.matched_blocks == 2));
    assert!(
        index
            .find_matches(EXACT, &keys, Some(&[]))
            .unwrap()
            .is_empty()
    );
    assert_eq!(index.find_matches(EXACT, &[], None).unwrap().len(), 3);
    assert!(matches!(
        index.find_matches("nope", &keys, None),
        Err(IndexError::UnknownPool { .. })
    ));
}

fn pools_do_not_share_keys(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 1);
    let tokens = prompt(6, 0, 2);
    index
        .apply_event(ReplicaId(0), &stored(&tokens, 0, 2, Medium::Gpu))
        .unwrap();
    // The exact pool's keys, asked of the chain pool, match nothing there.
    let found = index
        .find_matches(CHAIN, &engine_hashes(&tokens), None)
        .unwrap();
    assert_eq!(counts(&found, 100), Some((0, 0)));
    assert!(
        index
            .add_pool(PoolConfig {
                model: EXACT.into(),
                block_size: 8,
                keys: PoolKeys::TokenChain,
                attention_chunk_size: None,
            })
            .is_err()
    );
    assert!(index.add_replica(ReplicaId(0), "dup", CHAIN).is_err());
    assert!(index.add_replica(ReplicaId(9), "x", "nope").is_err());
}

fn unusable_events_are_rejected(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 1);
    for (model, r0) in POOLS {
        let r = ReplicaId(r0);
        let tokens = prompt(7, 0, 2);
        let KvEvent::BlockStored(good) = stored(&tokens, 0, 2, Medium::Gpu) else {
            panic!()
        };
        let cases = [
            (
                BlockStored {
                    block_size: 0,
                    token_ids: Vec::new(),
                    ..good.clone()
                },
                RejectReason::Placeholder,
            ),
            (
                BlockStored {
                    block_size: 8,
                    ..good.clone()
                },
                RejectReason::BlockSizeMismatch,
            ),
            (
                BlockStored {
                    token_ids: good.token_ids[1..].to_vec(),
                    ..good.clone()
                },
                RejectReason::Malformed,
            ),
        ];
        for (event, reason) in cases {
            let outcome = index.apply_event(r, &KvEvent::BlockStored(event)).unwrap();
            assert_eq!(outcome.rejection, Some(reason), "{model}");
            assert_eq!(
                (outcome.blocks_rejected, outcome.blocks_stored),
                (2, 0),
                "{model}"
            );
        }
        // A removal for a group no store described: none of its blocks is held.
        let group_two = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: good.block_hashes.clone(),
            medium: Medium::Gpu,
            group_idx: Some(2),
        });
        let outcome = index.apply_event(r, &group_two).unwrap();
        assert_eq!(outcome.rejection, Some(RejectReason::UnknownBlock));
        // Another block size makes the whole stream unusable: the replica is flagged (not
        // precise) until it is reset.
        let flagged = matches(&*index, model, &tokens);
        let mine = flagged.iter().find(|m| m.replica == r).unwrap();
        assert!(!mine.precise, "{model}");
        assert_eq!(
            mine.state,
            ReplicaState::Flagged(FlagReason::BlockSizeMismatch),
            "{model}"
        );
        index.reset_replica(r).unwrap();
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((0, 0)),
            "{model}"
        );
        // group_idx 0 is the full-attention group and applies.
        let group_zero = BlockStored {
            group_idx: Some(0),
            ..good
        };
        index
            .apply_event(r, &KvEvent::BlockStored(group_zero.clone()))
            .unwrap();
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((2, 2)),
            "{model}"
        );
        // Another group of unstated kind (vLLM 0.20–0.21 published no kinds): its hit rule is
        // unknown, so the replica's answers cannot be vouched for: flagged, not precise.
        let unknown_kind = BlockStored {
            group_idx: Some(1),
            ..group_zero
        };
        let outcome = index
            .apply_event(r, &KvEvent::BlockStored(unknown_kind))
            .unwrap();
        assert_eq!(outcome.rejection, Some(RejectReason::UnmodelledGroup));
        let flagged = matches(&*index, model, &tokens);
        let mine = flagged.iter().find(|m| m.replica == r).unwrap();
        assert!(!mine.precise, "{model}");
        assert_eq!(
            mine.state,
            ReplicaState::Flagged(FlagReason::UnmodelledCacheGroup),
            "{model}"
        );
        index.reset_replica(r).unwrap();
    }
}

fn replica_cap_refuses_new_blocks(make: &MakeIndex) {
    let index = make(3);
    setup(&*index, 1);
    for (model, r0) in POOLS {
        let r = ReplicaId(r0);
        let tokens = prompt(8, 0, 5);
        let outcome = index
            .apply_event(r, &stored(&tokens, 0, 5, Medium::Gpu))
            .unwrap();
        assert_eq!(
            (outcome.blocks_stored, outcome.blocks_rejected),
            (3, 2),
            "{model}"
        );
        assert_eq!(outcome.rejection, Some(RejectReason::ReplicaCapacity));
        // Blocks already held still gain media at the cap.
        let outcome = index
            .apply_event(r, &stored(&tokens, 0, 3, Medium::Cpu))
            .unwrap();
        assert_eq!(outcome.blocks_rejected, 0, "{model}");
        assert_eq!(
            counts(&matches(&*index, model, &tokens), r0),
            Some((3, 3)),
            "{model}"
        );
        // Removal makes room again.
        index
            .apply_event(r, &removed(&tokens, 2, 3, Medium::Gpu))
            .unwrap();
        index
            .apply_event(r, &removed(&tokens, 2, 3, Medium::Cpu))
            .unwrap();
        let outcome = index
            .apply_event(r, &stored(&tokens, 2, 4, Medium::Gpu))
            .unwrap();
        assert_eq!(
            (outcome.blocks_stored, outcome.blocks_rejected),
            (1, 1),
            "{model}"
        );
    }
}

fn token_chain_needs_known_parents(make: &MakeIndex) {
    let index = make(1000);
    setup(&*index, 1);
    let r = ReplicaId(100);
    let tokens = prompt(9, 0, 6);
    // A mid-chain run whose parent was never stored cannot be keyed: skipped, not re-rooted.
    let outcome = index
        .apply_event(r, &stored(&tokens, 2, 4, Medium::Gpu))
        .unwrap();
    assert_eq!(outcome.rejection, Some(RejectReason::ParentUnknown));
    assert_eq!(outcome.blocks_rejected, 2);
    let tail = index
        .find_matches(CHAIN, &chain_keys(&tokens)[2..4], None)
        .unwrap();
    assert_eq!(counts(&tail, 100), Some((0, 0)));
    // Stored in order, the index rebuilds exactly the router's keys.
    for (start, end) in [(0, 2), (2, 3), (3, 6)] {
        index
            .apply_event(r, &stored(&tokens, start, end, Medium::Gpu))
            .unwrap();
    }
    let found = index.find_matches(
        CHAIN,
        &TokenChain::keys(&tokens, 4, None, None).unwrap(),
        None,
    );
    assert_eq!(counts(&found.unwrap(), 100), Some((6, 6)));
    // Removal goes by engine hash.
    index
        .apply_event(r, &removed(&tokens, 0, 1, Medium::Gpu))
        .unwrap();
    assert_eq!(counts(&matches(&*index, CHAIN, &tokens), 100), Some((0, 0)));
}

macro_rules! conformance_suite {
    ($($case:ident),* $(,)?) => {
        mod block_index {
            $(#[test] fn $case() { super::$case(&super::make_block_index) })*
        }
        mod reference {
            $(#[test] fn $case() { super::$case(&super::make_reference) })*
        }
    };
}

conformance_suite!(
    leading_blocks_stop_at_first_miss,
    gpu_blocks_count_leading_gpu_holdings,
    clearing_empties_only_that_replica,
    removed_replicas_disappear,
    candidates_filter_and_order,
    pools_do_not_share_keys,
    unusable_events_are_rejected,
    replica_cap_refuses_new_blocks,
    token_chain_needs_known_parents,
);
