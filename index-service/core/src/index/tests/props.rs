//! Property tests: [`BlockIndex`] agrees with the reference model on random event sequences,
//! and its invariants hold (matches ≤ query length, store → remove leaves nothing behind).

use proptest::prelude::*;

use super::*;

const REPLICAS: u32 = 3;
const PROMPT_BLOCKS: usize = 8;

/// Prompts sharing 2–5 leading blocks, so replicas overlap the way real traffic does.
fn prompts() -> Vec<Vec<u32>> {
    [(1, 2), (2, 3), (3, 5), (4, 8)]
        .into_iter()
        .map(|(seed, shared)| prompt(seed, shared, PROMPT_BLOCKS))
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        replica: u32,
        prompt: usize,
        start: usize,
        len: usize,
        medium: Medium,
    },
    Remove {
        replica: u32,
        prompt: usize,
        start: usize,
        len: usize,
        medium: Medium,
    },
    Clear {
        replica: u32,
    },
    Reset {
        replica: u32,
    },
    Query {
        prompt: usize,
        blocks: usize,
        candidates: Option<Vec<u32>>,
    },
}

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![4 => Just(Medium::Gpu), 2 => Just(Medium::Cpu), 1 => Just(Medium::Storage)]
}

/// Replica ids of both pools: 0.. (vLLM-exact) and 100.. (token-chain).
fn replica() -> impl Strategy<Value = u32> {
    (0..REPLICAS, any::<bool>()).prop_map(|(r, chain)| if chain { 100 + r } else { r })
}

fn op() -> impl Strategy<Value = Op> {
    let range = (0..4usize, 0..PROMPT_BLOCKS, 1..=4usize);
    prop_oneof![
        8 => (replica(), range.clone(), medium()).prop_map(|(replica, (prompt, start, len), medium)| {
            Op::Store { replica, prompt, start, len, medium }
        }),
        4 => (replica(), range, medium()).prop_map(|(replica, (prompt, start, len), medium)| {
            Op::Remove { replica, prompt, start, len, medium }
        }),
        1 => replica().prop_map(|replica| Op::Clear { replica }),
        1 => replica().prop_map(|replica| Op::Reset { replica }),
        4 => (0..4usize, 0..=PROMPT_BLOCKS, proptest::option::of(proptest::collection::vec(replica(), 0..4)))
            .prop_map(|(prompt, blocks, candidates)| Op::Query { prompt, blocks, candidates }),
    ]
}

fn apply(index: &dyn KvIndex, op: &Op, prompts: &[Vec<u32>]) -> String {
    match *op {
        Op::Store {
            replica,
            prompt,
            start,
            len,
            medium,
        } => {
            let end = (start + len).min(PROMPT_BLOCKS);
            let event = stored(&prompts[prompt], start, end, medium);
            format!("{:?}", index.apply_event(ReplicaId(replica), &event))
        }
        Op::Remove {
            replica,
            prompt,
            start,
            len,
            medium,
        } => {
            let end = (start + len).min(PROMPT_BLOCKS);
            let event = removed(&prompts[prompt], start, end, medium);
            format!("{:?}", index.apply_event(ReplicaId(replica), &event))
        }
        Op::Clear { replica } => {
            format!(
                "{:?}",
                index.apply_event(ReplicaId(replica), &KvEvent::AllBlocksCleared)
            )
        }
        Op::Reset { replica } => format!("{:?}", index.reset_replica(ReplicaId(replica))),
        Op::Query { .. } => String::new(),
    }
}

fn query(index: &dyn KvIndex, op: &Op, prompts: &[Vec<u32>]) -> Vec<(String, Vec<ReplicaMatch>)> {
    let Op::Query {
        prompt,
        blocks,
        ref candidates,
    } = *op
    else {
        return Vec::new();
    };
    let tokens = &prompts[prompt][..blocks * BS as usize];
    [EXACT, CHAIN]
        .into_iter()
        .map(|model| {
            let keys = query_keys(model, tokens);
            let ids: Option<Vec<ReplicaId>> = candidates
                .as_ref()
                .map(|c| c.iter().map(|&r| ReplicaId(r)).collect());
            let found = index.find_matches(model, &keys, ids.as_deref()).unwrap();
            for m in &found {
                assert!(
                    m.matched_blocks as usize <= keys.len(),
                    "{m:?} for {} keys",
                    keys.len()
                );
                assert!(m.gpu_blocks <= m.matched_blocks, "{m:?}");
            }
            (model.to_owned(), sorted(found))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn agrees_with_reference_model(ops in proptest::collection::vec(op(), 1..60), cap in 4..40usize) {
        let prompts = prompts();
        let index = block_index(cap);
        let reference = make_reference(cap);
        setup(&index, REPLICAS);
        setup(&*reference, REPLICAS);
        for op in &ops {
            prop_assert_eq!(apply(&index, op, &prompts), apply(&*reference, op, &prompts), "{:?}", op);
            prop_assert_eq!(query(&index, op, &prompts), query(&*reference, op, &prompts), "{:?}", op);
        }
        // Every prompt prefix agrees at the end, whatever the sequence queried.
        for prompt in 0..prompts.len() {
            let op = Op::Query { prompt, blocks: PROMPT_BLOCKS, candidates: None };
            prop_assert_eq!(query(&index, &op, &prompts), query(&*reference, &op, &prompts));
        }
        // Resetting everything leaves nothing and gives the memory back.
        for r in 0..REPLICAS {
            index.reset_replica(ReplicaId(r)).unwrap();
            index.reset_replica(ReplicaId(100 + r)).unwrap();
        }
        prop_assert_eq!(index.holdings(), 0);
        prop_assert_eq!(index.memory_bytes(), 0);
    }

    #[test]
    fn store_then_remove_leaves_nothing(
        stores in proptest::collection::vec((replica(), 0..4usize, 0..PROMPT_BLOCKS, 1..=4usize, medium()), 1..40),
    ) {
        let prompts = prompts();
        let index = block_index(1_000);
        setup(&index, REPLICAS);
        let baseline = index.memory_bytes();
        for &(replica, prompt, start, len, medium) in &stores {
            let end = (start + len).min(PROMPT_BLOCKS);
            // Store whole prefixes so token-chain parents are always known.
            index.apply_event(ReplicaId(replica), &stored(&prompts[prompt], 0, end, medium)).unwrap();
        }
        prop_assert!(index.holdings() > 0);
        for &(replica, prompt, _, _, medium) in &stores {
            let event = removed(&prompts[prompt], 0, PROMPT_BLOCKS, medium);
            index.apply_event(ReplicaId(replica), &event).unwrap();
        }
        prop_assert_eq!(index.holdings(), 0);
        prop_assert_eq!(index.memory_bytes(), baseline);
        for status in index.replica_statuses(None) {
            prop_assert_eq!(status.blocks, 0);
        }
    }
}
