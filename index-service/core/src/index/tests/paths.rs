//! Runs of prompt keys (`index::paths`): answers read from runs equal the reference model's as
//! holders change under them, and every lock-free read that checks a version or generation
//! takes its retry when a writer changes the data between the read and the check (forced on
//! the reader's own thread with `paths::interleave` hooks, so the interleaving is certain).
//! Most tests build runs from walks alone (`runs_from_events` off), so they count exactly what
//! walks build; the tests at the end build them from stored events.

use std::sync::Arc;

use super::*;
use crate::index::PathStats;
use crate::index::paths::interleave::{self, Point};
use crate::index::paths::{KEY_SEGMENT, MAX_KEYS, MAX_RUN, MAX_RUNS, MIN_STORED_RUN};

fn indexes() -> (Arc<BlockIndex>, Box<dyn KvIndex>) {
    indexes_with(false)
}

fn indexes_with(runs_from_events: bool) -> (Arc<BlockIndex>, Box<dyn KvIndex>) {
    let index = Arc::new(block_index_with(10_000, runs_from_events));
    let reference = make_reference(10_000);
    setup(&*index, 4);
    setup(&*reference, 4);
    (index, reference)
}

/// Applies `event` of exact replica `r` (and the same blocks to chain replica `100 + r`).
fn apply(index: &dyn KvIndex, reference: &dyn KvIndex, r: u32, event: &KvEvent) {
    for replica in [ReplicaId(r), ReplicaId(100 + r)] {
        let found = index.apply_event(replica, event).unwrap();
        let expected = reference.apply_event(replica, event).unwrap();
        assert_eq!(found, expected, "{replica}: {event:?}");
    }
}

/// Asks both pools three times (a stretch looked up key by key is built the second time, read
/// from its run the third) and checks every answer against the reference.
fn agree(index: &BlockIndex, reference: &dyn KvIndex, tokens: &[u32], candidates: Option<&[u32]>) {
    for model in [EXACT, CHAIN] {
        let keys = query_keys(model, tokens);
        let offset = if model == EXACT { 0 } else { 100 };
        let ids: Option<Vec<ReplicaId>> =
            candidates.map(|c| c.iter().map(|&r| ReplicaId(offset + r)).collect());
        let expected = sorted(
            reference
                .find_matches(model, &keys, ids.as_deref())
                .unwrap(),
        );
        for walk in 0..3 {
            let found = sorted(index.find_matches(model, &keys, ids.as_deref()).unwrap());
            assert_eq!(found, expected, "{model}, walk {walk}");
        }
    }
}

fn stats(index: &BlockIndex) -> PathStats {
    index.path_stats(EXACT).unwrap()
}

#[test]
fn runs_answer_like_the_tables_while_holders_change() {
    let (index, reference) = indexes();
    // Two prompts sharing their first 50 blocks.
    let tokens = prompt(1, 50, 120);
    let other = prompt(2, 50, 120);
    let (index, reference) = (&*index, &*reference);
    apply(index, reference, 0, &stored(&tokens, 0, 100, Medium::Gpu));
    apply(index, reference, 1, &stored(&tokens, 0, 60, Medium::Gpu));
    apply(index, reference, 2, &stored(&tokens, 0, 60, Medium::Cpu));
    apply(index, reference, 3, &stored(&tokens, 0, 30, Medium::Gpu));
    apply(
        index,
        reference,
        3,
        &stored(&tokens, 30, 45, Medium::Storage),
    );
    apply(index, reference, 3, &stored(&other, 0, 80, Medium::Gpu));
    agree(index, reference, &tokens, None);
    // Blocks 0..50 (replicas 0–3, replica 3 through the shared prefix), 50..60 (0–2), 60..100
    // (0): one run each, built by the second walk; the third starts from the run built from
    // block 0 (the prompt's head), follows the runs from one to the next, and looks up block
    // 100 (held by nobody): its only lookup.
    let built = stats(index);
    assert_eq!(
        (built.runs_built, built.keys_by_run),
        (3, 50 + 10 + 40),
        "{built:?}"
    );
    let before = stats(index);
    index
        .find_matches(EXACT, &query_keys(EXACT, &tokens), None)
        .unwrap();
    let after = stats(index);
    assert_eq!(after.keys_looked_up - before.keys_looked_up, 1, "{after:?}");

    let changes: Vec<(u32, KvEvent)> = vec![
        // A new holder inside a run, then a removal inside another.
        (3, stored(&tokens, 45, 52, Medium::Storage)),
        (1, removed(&tokens, 40, 41, Medium::Gpu)),
        // Another medium of a block already held on the GPU: the same holders.
        (0, stored(&tokens, 40, 60, Medium::Cpu)),
        (0, removed(&tokens, 40, 60, Medium::Cpu)),
        // The GPU holders change, not the holders.
        (2, stored(&tokens, 10, 20, Medium::Gpu)),
        (2, removed(&tokens, 12, 14, Medium::Gpu)),
        (0, removed(&tokens, 90, 100, Medium::Gpu)),
        (1, KvEvent::AllBlocksCleared),
        (1, stored(&tokens, 0, 70, Medium::Gpu)),
        (3, removed(&other, 0, 80, Medium::Gpu)),
    ];
    for (r, event) in &changes {
        apply(index, reference, *r, event);
        agree(index, reference, &tokens, None);
        agree(index, reference, &other, None);
        agree(index, reference, &tokens[..50 * BS as usize], Some(&[1, 3]));
    }
    for r in [2, 0] {
        index.reset_replica(ReplicaId(r)).unwrap();
        reference.reset_replica(ReplicaId(r)).unwrap();
        agree(index, reference, &tokens, None);
    }
    let after = stats(index);
    assert!(after.keys_by_run > built.keys_by_run, "{after:?}");
    assert!(after.runs_built > built.runs_built, "{after:?}");
}

/// Replicas 0 and 1 hold blocks 0..40 of the exact pool, in a run a second walk builds and a
/// third reads whole, from its head: no lookup.
fn held_in_a_run() -> (Arc<BlockIndex>, Box<dyn KvIndex>, Vec<u32>, Vec<u64>) {
    let (index, reference) = indexes();
    let tokens = prompt(3, 0, 40);
    for r in [0, 1] {
        let event = stored(&tokens, 0, 40, Medium::Gpu);
        index.apply_event(ReplicaId(r), &event).unwrap();
        reference.apply_event(ReplicaId(r), &event).unwrap();
    }
    let keys = query_keys(EXACT, &tokens);
    for _ in 0..2 {
        index.find_matches(EXACT, &keys, None).unwrap();
    }
    let before = stats(&index);
    index.find_matches(EXACT, &keys, None).unwrap();
    let after = stats(&index);
    assert_eq!(
        (
            after.keys_by_run - before.keys_by_run,
            after.keys_looked_up - before.keys_looked_up
        ),
        (40, 0)
    );
    (index, reference, tokens, keys)
}

/// Runs `change` (on exact replica `replica`) at `point` of the next walk, on its thread.
fn at_point(point: Point, index: &Arc<BlockIndex>, replica: u32, change: KvEvent) {
    let index = Arc::clone(index);
    interleave::set(point, move || {
        index.apply_event(ReplicaId(replica), &change).unwrap();
    });
}

#[test]
fn a_run_cut_while_it_is_compared_vouches_only_for_the_keys_before_the_cut() {
    let (index, reference, tokens, keys) = held_in_a_run();
    let change = removed(&tokens, 20, 21, Medium::Gpu);
    at_point(Point::RunCompared, &index, 1, change.clone());
    let before = stats(&index);
    let found = index.find_matches(EXACT, &keys, None).unwrap();
    assert!(interleave::fired());
    reference.apply_event(ReplicaId(1), &change).unwrap();
    // Trusting the compare's length would say replica 1 holds all 40.
    assert_eq!(counts(&found, 1), Some((20, 20)));
    assert_eq!(
        sorted(found),
        sorted(reference.find_matches(EXACT, &keys, None).unwrap())
    );
    let after = stats(&index);
    assert_eq!(
        after.runs_changed_under_read,
        before.runs_changed_under_read + 1
    );
}

#[test]
fn a_next_run_cut_while_it_is_compared_vouches_only_for_the_keys_before_the_cut() {
    let (index, reference) = indexes();
    let tokens = prompt(5, 0, 40);
    // Blocks 0..20 held by replicas 0 and 1, 20..40 by replica 0: two runs, the second
    // reached from the first without a lookup.
    for (r, end) in [(0, 40), (1, 20)] {
        let event = stored(&tokens, 0, end, Medium::Gpu);
        index.apply_event(ReplicaId(r), &event).unwrap();
        reference.apply_event(ReplicaId(r), &event).unwrap();
    }
    let keys = query_keys(EXACT, &tokens);
    for _ in 0..3 {
        index.find_matches(EXACT, &keys, None).unwrap();
    }
    // Block 30 goes while the second run is compared.
    let change = removed(&tokens, 30, 31, Medium::Gpu);
    let hooked = Arc::clone(&index);
    let event = change.clone();
    interleave::set_after(Point::RunCompared, 1, move || {
        hooked.apply_event(ReplicaId(0), &event).unwrap();
    });
    let before = stats(&index);
    let found = index.find_matches(EXACT, &keys, None).unwrap();
    assert!(interleave::fired());
    reference.apply_event(ReplicaId(0), &change).unwrap();
    assert_eq!(counts(&found, 0), Some((30, 30)));
    assert_eq!(
        sorted(found),
        sorted(reference.find_matches(EXACT, &keys, None).unwrap())
    );
    let after = stats(&index);
    // Block 30 looked up, only: block 0 came from the head run, block 20 from its successor.
    assert_eq!(after.keys_looked_up - before.keys_looked_up, 1);
    assert_eq!(
        after.runs_changed_under_read,
        before.runs_changed_under_read + 1
    );
}

#[test]
fn a_run_dropped_while_it_is_compared_is_not_trusted() {
    let (index, _, _, keys) = held_in_a_run();
    // Both replicas reset: the pool empties and its runs are dropped (generation changes).
    let hooked = Arc::clone(&index);
    interleave::set(Point::RunCompared, move || {
        for r in [0, 1] {
            hooked.reset_replica(ReplicaId(r)).unwrap();
        }
    });
    let before = stats(&index);
    let found = index.find_matches(EXACT, &keys, None).unwrap();
    assert!(interleave::fired());
    // The head run failed its check, so block 0 was looked up, after the reset.
    for r in [0, 1] {
        assert_eq!(counts(&found, r), Some((0, 0)), "{found:?}");
    }
    let after = stats(&index);
    assert_eq!(
        after.runs_changed_under_read,
        before.runs_changed_under_read + 1
    );
    assert_eq!(index.memory_bytes(), 0);
}

#[test]
fn walks_of_keys_kvroute_did_not_compute_build_no_runs() {
    let (index, reference) = indexes();
    let tokens = prompt(6, 0, 40);
    apply_exact(&index, &*reference, 0, &stored(&tokens, 0, 40, Medium::Gpu));
    let keys = query_keys(EXACT, &tokens);
    let expected = sorted(reference.find_matches(EXACT, &keys, None).unwrap());
    for _ in 0..3 {
        let found = index
            .find_matches_without_building(EXACT, &keys, None)
            .unwrap();
        assert_eq!(sorted(found), expected);
    }
    assert_eq!(stats(&index).runs_built, 0);
    // The same prompt from kvroute's own caller builds its run on the second walk.
    for _ in 0..2 {
        index.find_matches(EXACT, &keys, None).unwrap();
    }
    assert_eq!(stats(&index).runs_built, 1);
}

#[test]
fn a_head_run_cut_at_its_first_key_is_not_trusted_for_it() {
    let (index, reference, tokens, keys) = held_in_a_run();
    // Replica 1 drops block 0: the run the prompt's head names is cut to nothing.
    let before = stats(&index);
    apply_exact(&index, &*reference, 1, &removed(&tokens, 0, 1, Medium::Gpu));
    let found = index.find_matches(EXACT, &keys, None).unwrap();
    assert_eq!(counts(&found, 1), Some((0, 0)));
    assert_eq!(counts(&found, 0), Some((40, 40)));
    assert_eq!(
        sorted(found),
        sorted(reference.find_matches(EXACT, &keys, None).unwrap())
    );
    let after = stats(&index);
    assert!(after.keys_looked_up > before.keys_looked_up, "{after:?}");
    assert!(after.cuts > before.cuts, "{after:?}");
}

#[test]
fn a_key_changed_between_its_read_and_its_check_is_read_again() {
    let (index, reference) = indexes();
    let tokens = prompt(3, 0, 40);
    for r in [0, 1] {
        apply_exact(&index, &*reference, r, &stored(&tokens, 0, 40, Medium::Gpu));
    }
    let keys = query_keys(EXACT, &tokens);
    // No run yet, so a walk reads block 0 alone; replica 2 comes to hold it after the read.
    let change = stored(&tokens, 0, 1, Medium::Gpu);
    at_point(Point::KeyRead, &index, 2, change.clone());
    let found = index.find_matches(EXACT, &keys, None).unwrap();
    assert!(interleave::fired());
    reference.apply_event(ReplicaId(2), &change).unwrap();
    assert_eq!(counts(&found, 2), Some((1, 1)));
    assert_eq!(
        sorted(found),
        sorted(reference.find_matches(EXACT, &keys, None).unwrap())
    );
}

#[test]
fn a_chunk_changed_between_its_read_and_its_check_is_read_again() {
    let (index, reference) = indexes();
    let tokens = prompt(4, 0, 40);
    let event = stored(&tokens, 0, 40, Medium::Gpu);
    index.apply_event(ReplicaId(0), &event).unwrap();
    reference.apply_event(ReplicaId(0), &event).unwrap();
    let keys = query_keys(EXACT, &tokens);
    // No run yet: blocks 1..33 are read as a chunk; block 5 goes while they are checked.
    let change = removed(&tokens, 5, 6, Medium::Gpu);
    at_point(Point::ChunkRead, &index, 0, change.clone());
    let found = index.find_matches(EXACT, &keys, None).unwrap();
    assert!(interleave::fired());
    reference.apply_event(ReplicaId(0), &change).unwrap();
    assert_eq!(counts(&found, 0), Some((5, 5)));
    assert_eq!(
        sorted(found),
        sorted(reference.find_matches(EXACT, &keys, None).unwrap())
    );
}

#[test]
fn a_prefix_cut_on_every_walk_is_rebuilt_with_backoff_then_again_once_quiet() {
    let (index, reference, tokens, keys) = held_in_a_run();
    let before = stats(&index);
    // Before every walk a writer removes blocks 10..30 of replica 1 or stores them back: each
    // change cuts whatever run the last walk built over them.
    let walks = 64;
    for walk in 0..walks {
        let change = if walk % 2 == 0 {
            removed(&tokens, 10, 30, Medium::Gpu)
        } else {
            stored(&tokens, 10, 30, Medium::Gpu)
        };
        apply_exact(&index, &*reference, 1, &change);
        let found = sorted(index.find_matches(EXACT, &keys, None).unwrap());
        let expected = sorted(reference.find_matches(EXACT, &keys, None).unwrap());
        assert_eq!(found, expected, "walk {walk}");
    }
    let churned = stats(&index);
    // (Cuts are counted only where a run was there to cut.)
    assert!(churned.cuts > before.cuts, "{churned:?}");
    // Without the backoff every walk rebuilds what the last change cut (about one run per
    // walk); with it the waits double: 1, 2, 4, … walks.
    let built = churned.runs_built - before.runs_built;
    assert!(
        built <= 2 * 8,
        "{built} runs built in {walks} walks: {churned:?}"
    );
    assert!(
        churned.builds_deferred > before.builds_deferred,
        "{churned:?}"
    );
    // Once the writer stops, builds resume within the longest wait and the prompt is read
    // from runs again.
    for _ in 0..=crate::index::paths::MAX_BUILD_BACKOFF + 2 {
        index.find_matches(EXACT, &keys, None).unwrap();
    }
    let quiet = stats(&index);
    index.find_matches(EXACT, &keys, None).unwrap();
    let last = stats(&index);
    assert!(
        last.keys_looked_up - quiet.keys_looked_up <= 3,
        "{quiet:?} -> {last:?}"
    );
    assert_eq!(
        sorted(index.find_matches(EXACT, &keys, None).unwrap()),
        sorted(reference.find_matches(EXACT, &keys, None).unwrap())
    );
}

/// Applies `event` of exact replica `r` to both indexes.
fn apply_exact(index: &BlockIndex, reference: &dyn KvIndex, r: u32, event: &KvEvent) {
    let found = index.apply_event(ReplicaId(r), event).unwrap();
    let expected = reference.apply_event(ReplicaId(r), event).unwrap();
    assert_eq!(found, expected, "{event:?}");
}

/// Blocks of the prompt [`stored_in_two_events`] stores.
const TWO_EVENTS: usize = 2 * MIN_STORED_RUN + 20;

/// Stores [`TWO_EVENTS`] blocks of one prompt on replica 0 of both pools as two events (the
/// second naming the first's last block as parent), each long enough to be built into a run,
/// and a prompt in one event too short to be.
fn stored_in_two_events(runs_from_events: bool) -> (Arc<BlockIndex>, Box<dyn KvIndex>, Vec<u32>) {
    let (index, reference) = indexes_with(runs_from_events);
    let tokens = prompt(8, 0, TWO_EVENTS);
    let split = MIN_STORED_RUN + 20;
    apply(
        &*index,
        &*reference,
        0,
        &stored(&tokens, 0, split, Medium::Gpu),
    );
    apply(
        &*index,
        &*reference,
        0,
        &stored(&tokens, split, TWO_EVENTS, Medium::Gpu),
    );
    apply(&*index, &*reference, 0, &short_event());
    (index, reference, tokens)
}

fn short_event() -> KvEvent {
    let blocks = MIN_STORED_RUN - 1;
    stored(&prompt(7, 0, blocks), 0, blocks, Medium::Gpu)
}

/// One walk of `tokens` in `model`, its answer checked against the reference: the keys it
/// answered from runs and the keys it looked up.
fn walk_once(
    index: &BlockIndex,
    reference: &dyn KvIndex,
    model: &str,
    tokens: &[u32],
) -> (u64, u64) {
    let before = index.path_stats(model).unwrap();
    let keys = query_keys(model, tokens);
    let found = sorted(index.find_matches(model, &keys, None).unwrap());
    assert_eq!(
        found,
        sorted(reference.find_matches(model, &keys, None).unwrap()),
        "{model}"
    );
    let after = index.path_stats(model).unwrap();
    (
        after.keys_by_run - before.keys_by_run,
        after.keys_looked_up - before.keys_looked_up,
    )
}

#[test]
fn a_prompts_first_walk_follows_the_runs_its_stored_events_built() {
    let (index, reference, tokens) = stored_in_two_events(true);
    for model in [EXACT, CHAIN] {
        let stats = index.path_stats(model).unwrap();
        assert_eq!(
            (stats.runs_built, stats.runs_from_events),
            (2, 2),
            "{stats:?}"
        );
        // The first walk starts from the head run, goes on to the second event's run (chained
        // after its parent's) and looks nothing up.
        assert_eq!(
            walk_once(&index, &*reference, model, &tokens),
            (TWO_EVENTS as u64, 0),
            "{model}"
        );
    }
    // Without runs from events the same first walk looks every key up.
    let (index, _, tokens) = stored_in_two_events(false);
    index
        .find_matches(EXACT, &query_keys(EXACT, &tokens), None)
        .unwrap();
    let walked = stats(&index);
    assert_eq!(
        (walked.keys_by_run, walked.keys_looked_up),
        (0, TWO_EVENTS as u64)
    );
}

#[test]
fn runs_from_events_answer_like_the_tables_while_holders_change() {
    let (index, reference, tokens) = stored_in_two_events(true);
    let blocks = TWO_EVENTS;
    let other = prompt(9, 40, blocks);
    let (index, reference) = (&*index, &*reference);
    // Replica 1 stores the shared 40 blocks (cutting replica 0's run at its first key) and a
    // branch of its own; replica 2 most of the prompt on the CPU; replica 0 loses blocks
    // 100..105: every answer stays the reference's, whichever runs are left.
    apply(index, reference, 1, &stored(&other, 0, blocks, Medium::Gpu));
    agree(index, reference, &tokens, None);
    agree(index, reference, &other, None);
    apply(
        index,
        reference,
        2,
        &stored(&tokens, 0, blocks - 10, Medium::Cpu),
    );
    apply(
        index,
        reference,
        0,
        &removed(&tokens, 100, 105, Medium::Gpu),
    );
    agree(index, reference, &tokens, None);
    agree(index, reference, &other, Some(&[0, 1]));
    let after = stats(index);
    assert!(after.cuts > 0 && after.runs_from_events > 2, "{after:?}");
    // Everything removed: the pool is empty and the runs' memory is given back.
    let KvEvent::BlockStored(short) = short_event() else {
        unreachable!()
    };
    let short = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: short.block_hashes,
        medium: Medium::Gpu,
        group_idx: None,
    });
    for r in [0, 1, 2] {
        for event in [
            removed(&tokens, 0, blocks, Medium::Gpu),
            removed(&tokens, 0, blocks, Medium::Cpu),
            removed(&other, 0, blocks, Medium::Gpu),
            short.clone(),
        ] {
            apply(index, reference, r, &event);
        }
    }
    assert_eq!(index.holdings(), 0);
    assert_eq!(index.memory_bytes(), 0);
}

#[test]
fn the_ring_drops_the_oldest_runs_to_make_room() {
    let index = block_index_with(2 * MAX_KEYS, true);
    let reference = &*make_reference(2 * MAX_KEYS);
    setup(&index, 2);
    setup(reference, 2);
    // One event of MAX_RUN blocks per prompt, one more prompt than the runs' keys hold.
    let prompts = MAX_KEYS / MAX_RUN + 1;
    let tokens = |seed: usize| prompt(seed as u32 + 10, 0, MAX_RUN);
    for seed in 0..prompts {
        let event = stored(&tokens(seed), 0, MAX_RUN, Medium::Gpu);
        index.apply_event(ReplicaId(0), &event).unwrap();
    }
    let filled = stats(&index);
    assert_eq!(filled.runs_from_events, prompts as u64, "{filled:?}");
    // The last prompt's run took the first segment back: the runs there were dropped.
    let per_segment = (KEY_SEGMENT / MAX_RUN) as u64;
    assert_eq!(filled.runs_recycled, per_segment, "{filled:?}");
    assert!(filled.bytes <= (MAX_KEYS * 8 + MAX_RUNS * 48 + 32 * 1024) as u64);
    let walk = |seed: usize| {
        let keys = query_keys(EXACT, &tokens(seed));
        let before = stats(&index);
        let found = index.find_matches(EXACT, &keys, None).unwrap();
        let after = stats(&index);
        let full = MAX_RUN as u32;
        assert_eq!(counts(&found, 0), Some((full, full)), "prompt {seed}");
        after.keys_looked_up - before.keys_looked_up
    };
    // The newest and one still in the ring are followed whole (at most their first key looked
    // up: a later prompt's first key may have taken its head hint); the oldest is looked up.
    assert!(walk(prompts - 1) <= 1);
    assert!(walk(per_segment as usize) <= 1);
    assert_eq!(walk(0), MAX_RUN as u64);
    // A store of the dropped prompt's blocks by another replica is answered exactly.
    let event = stored(&tokens(0), 0, MAX_RUN, Medium::Cpu);
    apply_exact(&index, reference, 1, &event);
    let keys = query_keys(EXACT, &tokens(0));
    let found = sorted(
        index
            .find_matches(EXACT, &keys, Some(&[ReplicaId(1)]))
            .unwrap(),
    );
    assert_eq!(
        found,
        sorted(
            reference
                .find_matches(EXACT, &keys, Some(&[ReplicaId(1)]))
                .unwrap()
        )
    );
}

#[test]
fn an_event_longer_than_a_run_is_followed_whole() {
    let (index, reference) = indexes_with(true);
    let blocks = MAX_RUN + 300;
    let tokens = prompt(11, 0, blocks);
    apply(
        &*index,
        &*reference,
        0,
        &stored(&tokens, 0, blocks, Medium::Gpu),
    );
    for model in [EXACT, CHAIN] {
        assert_eq!(index.path_stats(model).unwrap().runs_from_events, 2);
        assert_eq!(
            walk_once(&index, &*reference, model, &tokens),
            (blocks as u64, 0),
            "{model}"
        );
    }
}

#[test]
fn an_event_sharing_a_prefix_with_a_run_builds_over_its_own_keys() {
    let (index, reference) = indexes_with(true);
    let blocks = MAX_RUN + 300;
    // Two conversations with the same 10-block system prompt, stored by the same replica.
    let first = prompt(12, 10, blocks);
    let second = prompt(13, 10, blocks);
    apply(
        &*index,
        &*reference,
        0,
        &stored(&first, 0, blocks, Medium::Gpu),
    );
    apply(
        &*index,
        &*reference,
        0,
        &stored(&second, 0, blocks, Medium::Gpu),
    );
    for model in [EXACT, CHAIN] {
        // The shared blocks from the first conversation's run, then one lookup names the
        // second's run over the rest.
        assert_eq!(
            walk_once(&index, &*reference, model, &second),
            (blocks as u64 - 1, 1),
            "{model}"
        );
    }
}
