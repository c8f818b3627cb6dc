//! Hybrid-attention replicas: each KV-cache group's holdings apart, and vLLM's hit over them.
//! Blocks of 4 tokens, a sliding window of 8 tokens (`cdiv(8 - 1, 4)` = 2 blocks before a cut).
//! The layouts are vLLM's: Gemma 2/3 and gpt-oss put a sliding group first, other models a full
//! one; Mistral-style models slide in every layer. Real captures are checked in `capture`.

use super::*;
use crate::event::CacheKind;
use crate::index::{FlagReason, RejectReason, ReplicaState};

const WINDOW: u32 = 8;

/// One group's store of `blocks` of `tokens`, as vLLM publishes it: the token span of
/// `span` blocks, the hashes of `blocks` only (a sliding group lists the blocks it keeps).
fn group_stored(
    tokens: &[u32],
    span: std::ops::Range<usize>,
    blocks: &[usize],
    group: u32,
    kind: CacheKind,
) -> KvEvent {
    let hashes = engine_hashes(tokens);
    let bs = BS as usize;
    let dense = kind.is_full_attention();
    KvEvent::BlockStored(BlockStored {
        block_hashes: blocks.iter().map(|&b| hashes[b]).collect(),
        // vLLM names the parent only when the span continues cached blocks.
        parent_block_hash: span
            .start
            .checked_sub(1)
            .map(|p| hashes[p])
            .filter(|_| dense),
        token_ids: tokens[span.start * bs..span.end * bs].to_vec(),
        block_size: BS,
        medium: Medium::Gpu,
        group_idx: Some(group),
        cache_kind: Some(kind),
        sliding_window: (kind == CacheKind::SlidingWindow).then_some(WINDOW),
        ..BlockStored::default()
    })
}

fn group_removed(tokens: &[u32], blocks: &[usize], group: u32) -> KvEvent {
    let hashes = engine_hashes(tokens);
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: blocks.iter().map(|&b| hashes[b]).collect(),
        medium: Medium::Gpu,
        group_idx: Some(group),
    })
}

fn full(tokens: &[u32], blocks: std::ops::Range<usize>, group: u32) -> KvEvent {
    let listed: Vec<usize> = blocks.clone().collect();
    group_stored(tokens, blocks, &listed, group, CacheKind::FullAttention)
}

fn sliding(tokens: &[u32], span: std::ops::Range<usize>, kept: &[usize], group: u32) -> KvEvent {
    group_stored(tokens, span, kept, group, CacheKind::SlidingWindow)
}

/// The exact pool's match of replica 0 for `tokens`: (any medium, GPU, precise, state).
fn answer(index: &BlockIndex, tokens: &[u32]) -> (u32, bool, ReplicaState) {
    let found = index
        .find_matches(EXACT, &engine_hashes(tokens), None)
        .unwrap();
    let mine = found.iter().find(|m| m.replica == ReplicaId(0)).unwrap();
    assert_eq!(mine.matched_blocks, mine.gpu_blocks, "all on the GPU here");
    (mine.matched_blocks, mine.precise, mine.state)
}

/// Replica 0's `prefix_blocks` for `tokens`.
fn prefix(index: &BlockIndex, tokens: &[u32]) -> u32 {
    let found = index
        .find_matches(EXACT, &engine_hashes(tokens), None)
        .unwrap();
    found
        .iter()
        .find(|m| m.replica == ReplicaId(0))
        .unwrap()
        .prefix_blocks
}

fn apply(index: &BlockIndex, event: KvEvent) -> crate::index::ApplyOutcome {
    index.apply_event(ReplicaId(0), &event).unwrap()
}

fn new_index() -> BlockIndex {
    let index = block_index(1000);
    setup(&index, 1);
    index
}

/// The group layouts of a two-group hybrid: (sliding group, full group).
const LAYOUTS: [(u32, u32); 2] = [(0, 1), (1, 0)];

#[test]
fn a_prefix_needs_the_window_before_the_cut() {
    for (window_group, full_group) in LAYOUTS {
        let index = new_index();
        let tokens = prompt(1, 0, 8);
        // One prefill of 8 blocks: full attention keeps all, the window the last two.
        apply(&index, sliding(&tokens, 0..8, &[6, 7], window_group));
        apply(&index, full(&tokens, 0..8, full_group));
        let layout = format!("sliding group {window_group}");
        assert_eq!(answer(&index, &tokens).0, 8, "{layout}");
        // A shorter prompt of the same prefix cuts at 5: its window (3, 4) was dropped, and
        // with nothing held from block 0 on in the window group, vLLM reuses nothing.
        assert_eq!(answer(&index, &tokens[..5 * 4]).0, 0, "{layout}");
        // Full attention holds all five: a longer prompt could still hit.
        assert_eq!(prefix(&index, &tokens[..5 * 4]), 5, "{layout}");
        // A later request kept blocks 3 and 4 in the window group: now 5 blocks.
        apply(&index, sliding(&tokens, 0..5, &[3, 4], window_group));
        assert_eq!(answer(&index, &tokens[..5 * 4]).0, 5, "{layout}");
        // The dense walk alone (full attention) would have said 8 for the whole prompt and 5
        // for the short one either way; the replica stays precise.
        assert!(answer(&index, &tokens).1, "{layout}");
    }
}

#[test]
fn a_window_removal_leaves_the_full_groups_block() {
    for (window_group, full_group) in LAYOUTS {
        let index = new_index();
        let tokens = prompt(2, 0, 6);
        apply(&index, sliding(&tokens, 0..6, &[4, 5], window_group));
        apply(&index, full(&tokens, 0..6, full_group));
        assert_eq!(answer(&index, &tokens).0, 6);
        // The window group evicts block 5 (same hash as the full group's block 5).
        let outcome = apply(&index, group_removed(&tokens, &[5], window_group));
        assert_eq!(outcome.blocks_removed, 1);
        let hashes = engine_hashes(&tokens);
        let groups = index.replica_group_hashes(ReplicaId(0)).unwrap();
        let full_held = &groups.iter().find(|(g, _)| *g == full_group).unwrap().1;
        let window_held = &groups.iter().find(|(g, _)| *g == window_group).unwrap().1;
        assert!(full_held.contains(&hashes[5]), "the full group keeps it");
        assert!(!window_held.contains(&hashes[5]));
        // Cut at 6 needs 4 and 5 in the window group: gone. Cut at 5 needs 3 and 4: 3 was
        // never kept. Nothing from block 0: no hit, though full attention holds all six.
        assert_eq!(answer(&index, &tokens).0, 0);
        // And the reverse: the full group evicts block 5, the window group keeps block 4.
        apply(&index, group_removed(&tokens, &[5], full_group));
        apply(&index, sliding(&tokens, 0..6, &[5], window_group));
        assert_eq!(answer(&index, &tokens).0, 0);
        assert_eq!(answer(&index, &tokens[..5 * 4]).0, 0);
    }
}

#[test]
fn copies_are_counted_per_group() {
    let index = new_index();
    let tokens = prompt(3, 0, 4);
    // Two requests recomputed the same window blocks: two copies in the window group.
    apply(&index, sliding(&tokens, 0..4, &[2, 3], 0));
    apply(&index, sliding(&tokens, 0..4, &[2, 3], 0));
    apply(&index, full(&tokens, 0..4, 1));
    apply(&index, group_removed(&tokens, &[2, 3], 0));
    assert_eq!(answer(&index, &tokens).0, 4, "one copy of each is left");
    apply(&index, group_removed(&tokens, &[2, 3], 0));
    assert_eq!(answer(&index, &tokens).0, 0);
    // A third removal has nothing to remove: counted, not applied.
    let outcome = apply(&index, group_removed(&tokens, &[2], 0));
    assert_eq!(
        (outcome.blocks_removed, outcome.rejection),
        (0, Some(RejectReason::UnknownBlock))
    );
}

#[test]
fn non_dense_and_empty_stores_are_taken_as_published() {
    let index = new_index();
    let tokens = prompt(4, 0, 8);
    // Gapped (blocks 1 and 6 of an 8-block span) and empty (one block of tokens, no hash):
    // both as real vLLM publishes them.
    let outcome = apply(&index, sliding(&tokens, 0..8, &[1, 6], 0));
    assert_eq!((outcome.blocks_stored, outcome.blocks_rejected), (2, 0));
    let outcome = apply(&index, sliding(&tokens, 7..8, &[], 0));
    assert_eq!((outcome.blocks_stored, outcome.blocks_rejected), (0, 0));
    apply(&index, full(&tokens, 0..8, 1));
    // Cut at 8 needs 6 and 7: 7 missing; 6..: no run of two; from block 0: 0 not held.
    assert_eq!(answer(&index, &tokens).0, 0);
    // A span shorter than its hashes, or not whole blocks, is refused.
    let KvEvent::BlockStored(mut bad) = sliding(&tokens, 0..2, &[0, 1, 2], 0) else {
        panic!()
    };
    let outcome = apply(&index, KvEvent::BlockStored(bad.clone()));
    assert_eq!(outcome.rejection, Some(RejectReason::Malformed));
    bad.block_hashes.truncate(1);
    bad.token_ids.pop();
    let outcome = apply(&index, KvEvent::BlockStored(bad));
    assert_eq!(outcome.rejection, Some(RejectReason::Malformed));
    // A store describing group 0 otherwise than before is refused.
    let KvEvent::BlockStored(mut other) = sliding(&tokens, 0..2, &[0, 1], 0) else {
        panic!()
    };
    other.sliding_window = Some(16);
    let outcome = apply(&index, KvEvent::BlockStored(other));
    assert_eq!(outcome.rejection, Some(RejectReason::GroupConflict));
    // A layout that contradicts itself cannot be vouched for.
    assert_eq!(
        answer(&index, &tokens).2,
        ReplicaState::Flagged(FlagReason::UnmodelledCacheGroup)
    );
}

#[test]
fn without_full_attention_a_hit_needs_only_the_window() {
    // Mistral-style: one sliding group. The start of a long prompt evicted, its end kept.
    let index = new_index();
    let tokens = prompt(5, 0, 10);
    apply(&index, sliding(&tokens, 0..10, &[8, 9], 0));
    assert_eq!(answer(&index, &tokens).0, 10);
    assert_eq!(answer(&index, &tokens[..9 * 4]).0, 0);
    // Without full attention, any longer prompt may hit: every key counts as a prefix.
    assert_eq!(prefix(&index, &tokens[..9 * 4]), 9);
}

#[test]
fn a_group_without_a_modelled_rule_flags_the_replica() {
    let index = new_index();
    let tokens = prompt(6, 0, 4);
    apply(&index, full(&tokens, 0..4, 0));
    assert_eq!(answer(&index, &tokens), (4, true, ReplicaState::Ready));
    let outcome = apply(
        &index,
        group_stored(&tokens, 0..4, &[3], 1, CacheKind::Mamba),
    );
    assert_eq!(outcome.rejection, Some(RejectReason::UnmodelledGroup));
    // Approximate: the modelled groups' answer, never precise.
    let flagged = ReplicaState::Flagged(FlagReason::UnmodelledCacheGroup);
    assert_eq!(answer(&index, &tokens), (4, false, flagged));
    assert_eq!(
        index.replica_status(ReplicaId(0)).unwrap().flag,
        Some(FlagReason::UnmodelledCacheGroup)
    );
    // Chunked local attention without the pool's chunk size: the same.
    let index = new_index();
    apply(
        &index,
        group_stored(&tokens, 0..4, &[3], 1, CacheKind::ChunkedLocalAttention),
    );
    assert_eq!(answer(&index, &tokens).2, flagged);
    // A restart (reset) forgets the layout and the flag.
    index.reset_replica(ReplicaId(0)).unwrap();
    assert!(answer(&index, &tokens).1);
}

#[test]
fn a_token_chain_pool_cannot_place_side_groups() {
    let index = new_index();
    let tokens = prompt(7, 0, 4);
    let chain = ReplicaId(100);
    index
        .apply_event(chain, &sliding(&tokens, 0..4, &[2, 3], 0))
        .unwrap();
    let found = index
        .find_matches(CHAIN, &chain_keys(&tokens), None)
        .unwrap();
    let mine = found.iter().find(|m| m.replica == chain).unwrap();
    assert_eq!(
        mine.state,
        ReplicaState::Flagged(FlagReason::UnmodelledCacheGroup)
    );
}

#[test]
fn chunked_local_attention_with_the_pools_chunk_size() {
    let index = block_index(1000);
    index
        .add_pool(PoolConfig {
            model: EXACT.into(),
            block_size: BS,
            keys: PoolKeys::VllmExact { validator: None },
            attention_chunk_size: Some(16),
        })
        .unwrap();
    index.add_replica(ReplicaId(0), "r0", EXACT).unwrap();
    let tokens = prompt(8, 0, 7);
    apply(&index, full(&tokens, 0..7, 0));
    // The chunked group holds only blocks 4 and 5 (the cut's chunk starts at 16 tokens).
    apply(
        &index,
        group_stored(&tokens, 0..7, &[4, 5], 1, CacheKind::ChunkedLocalAttention),
    );
    // 7 blocks = 28 tokens: the chunk starts at 16 (block 4); 4 and 5 held, 6 not: 6 blocks.
    assert_eq!(answer(&index, &tokens).0, 6);
    // A cut at 4 blocks (16 tokens) starts a chunk: nothing of it is needed.
    assert_eq!(answer(&index, &tokens[..4 * 4]).0, 4);
}

#[test]
fn clearing_forgets_every_group() {
    let index = new_index();
    let tokens = prompt(9, 0, 4);
    apply(&index, sliding(&tokens, 0..4, &[2, 3], 0));
    apply(&index, full(&tokens, 0..4, 1));
    let outcome = apply(&index, KvEvent::AllBlocksCleared);
    assert_eq!(outcome.blocks_removed, 6);
    assert_eq!(answer(&index, &tokens).0, 0);
    assert!(
        index
            .replica_group_hashes(ReplicaId(0))
            .unwrap()
            .iter()
            .all(|(_, h)| h.is_empty())
    );
    // The layout is learnt again, in either order.
    apply(&index, full(&tokens, 0..4, 1));
    apply(&index, sliding(&tokens, 0..4, &[2, 3], 0));
    assert_eq!(answer(&index, &tokens).0, 4);
}

#[test]
fn side_groups_share_the_replicas_cap() {
    // However many groups a stream declares, they hold no more than the cap between them.
    let index = block_index(3);
    setup(&index, 1);
    let tokens = prompt(10, 0, 4);
    let outcome = apply(&index, sliding(&tokens, 0..4, &[0, 1], 1));
    assert_eq!((outcome.blocks_stored, outcome.blocks_rejected), (2, 0));
    let outcome = apply(&index, sliding(&tokens, 0..4, &[2, 3], 2));
    assert_eq!(
        (
            outcome.blocks_stored,
            outcome.blocks_rejected,
            outcome.rejection
        ),
        (1, 1, Some(RejectReason::ReplicaCapacity))
    );
    // Another copy of a held block is not a new block.
    let outcome = apply(&index, sliding(&tokens, 0..4, &[0], 1));
    assert_eq!((outcome.blocks_stored, outcome.blocks_rejected), (1, 0));
}

#[test]
fn a_pool_of_verified_hashes_cannot_vouch_for_a_window() {
    // `verify_hashes: required`: a sliding window's non-dense stores cannot be recomputed (where
    // each hash sits in the span is not published), so the replica is flagged, not precise.
    let index = block_index(1000);
    let hasher =
        kvroute_block_keys::VllmHasher::new(kvroute_block_keys::HashAlgo::Sha256Cbor, Some("0"))
            .unwrap();
    let keys = PoolKeys::from_scheme(
        &kvroute_block_keys::KeyScheme::VllmExact {
            hasher,
            era: kvroute_block_keys::ExtraKeysEra::From0_31,
        },
        crate::index::VerifyHashes::Required,
    );
    index
        .add_pool(PoolConfig {
            model: EXACT.into(),
            block_size: BS,
            keys,
            attention_chunk_size: None,
        })
        .unwrap();
    index.add_replica(ReplicaId(0), "r0", EXACT).unwrap();
    let tokens = prompt(11, 0, 4);
    let outcome = apply(&index, sliding(&tokens, 0..4, &[2, 3], 0));
    assert_eq!(outcome.rejection, Some(RejectReason::UnmodelledGroup));
    assert_eq!(
        answer(&index, &tokens).2,
        ReplicaState::Flagged(FlagReason::UnmodelledCacheGroup)
    );
}

#[test]
fn groups_of_one_spec_are_looked_up_together_per_medium() {
    // Two window groups of one spec (vLLM's one group per few layers): a block counts only if
    // both hold it; a window held only off the GPU counts in `matched_blocks`, not on the GPU.
    let index = new_index();
    let tokens = prompt(12, 0, 4);
    apply(&index, full(&tokens, 0..4, 2));
    apply(&index, sliding(&tokens, 0..4, &[2, 3], 0));
    let found = |index: &BlockIndex| {
        let found = index
            .find_matches(EXACT, &engine_hashes(&tokens), None)
            .unwrap();
        let mine = found.iter().find(|m| m.replica == ReplicaId(0)).unwrap();
        (mine.matched_blocks, mine.gpu_blocks)
    };
    assert_eq!(found(&index), (4, 4));
    // The second window group holds block 3 only: no window of two before the cut at 4.
    apply(&index, sliding(&tokens, 0..4, &[3], 1));
    assert_eq!(found(&index), (0, 0));
    // Its block 2 arrives on the CPU tier: held in some medium by both, not on both GPUs.
    let KvEvent::BlockStored(mut on_cpu) = sliding(&tokens, 0..4, &[2], 1) else {
        panic!()
    };
    on_cpu.medium = Medium::Cpu;
    apply(&index, KvEvent::BlockStored(on_cpu));
    assert_eq!(found(&index), (4, 0));
    // Removing the CPU copy takes it back.
    let KvEvent::BlockRemoved(mut removal) = group_removed(&tokens, &[2], 1) else {
        panic!()
    };
    removal.medium = Medium::Cpu;
    apply(&index, KvEvent::BlockRemoved(removal));
    assert_eq!(found(&index), (0, 0));
}
