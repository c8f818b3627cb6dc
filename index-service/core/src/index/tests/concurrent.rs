//! Writers and readers at once: match walks read the shard tables without locks while ingest
//! changes them (see `index::table`). Readers check what must hold at every moment (a replica
//! nobody writes always reports its exact counts, however the keys it shares with the writers
//! change representation, grow or shrink their tables); at each quiescent point, every answer
//! must be the reference model's after the same events.

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

const WRITERS: u32 = 3;
/// Replica 3 of each pool holds every prompt and is never written after setup.
const STABLE: u32 = 3;
const PROMPTS: u32 = 12;
const PROMPT_BLOCKS: usize = 24;
const ROUNDS: usize = 6;
const OPS_PER_ROUND: usize = 300;

/// Prompts sharing 4–10 leading blocks: the stable replica shares keys with every writer.
fn prompts() -> Vec<Vec<u32>> {
    (0..PROMPTS)
        .map(|seed| prompt(seed + 1, 4 + seed as usize % 7, PROMPT_BLOCKS))
        .collect()
}

struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// One writer's events for one round: runs stored and removed in several media, and now and
/// then everything cleared (tables shrink to nothing and grow again under the readers).
fn writer_events(writer: u32, round: usize, prompts: &[Vec<u32>]) -> Vec<KvEvent> {
    let mut lcg = Lcg(u64::from(writer) << 32 | round as u64);
    let media = [Medium::Gpu, Medium::Gpu, Medium::Cpu, Medium::Storage];
    (0..OPS_PER_ROUND)
        .map(|_| {
            let tokens = &prompts[lcg.below(prompts.len())];
            let start = lcg.below(PROMPT_BLOCKS);
            let end = (start + 1 + lcg.below(8)).min(PROMPT_BLOCKS);
            let medium = media[lcg.below(media.len())];
            match lcg.below(20) {
                0 => KvEvent::AllBlocksCleared,
                1..=12 => stored(tokens, start, end, medium),
                _ => removed(tokens, start, end, medium),
            }
        })
        .collect()
}

/// One thread per writer, applying its events to its two replicas (`w` and `100 + w`).
fn spawn_writers<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    index: &'scope BlockIndex,
    events: &'scope [Vec<KvEvent>],
) -> Vec<std::thread::ScopedJoinHandle<'scope, ()>> {
    (0..WRITERS)
        .map(|w| {
            let events = &events[w as usize];
            scope.spawn(move || {
                for event in events {
                    for replica in [ReplicaId(w), ReplicaId(100 + w)] {
                        index.apply_event(replica, event).unwrap();
                    }
                }
            })
        })
        .collect()
}

#[test]
fn lock_free_reads_agree_with_reference_model_at_quiescent_points() {
    let index = block_index(10_000);
    let reference = make_reference(10_000);
    let prompts = prompts();
    for model in [&index as &dyn KvIndex, &*reference] {
        setup(model, STABLE + 1);
        for (stable, _) in [(ReplicaId(STABLE), EXACT), (ReplicaId(100 + STABLE), CHAIN)] {
            for tokens in &prompts {
                let event = stored(tokens, 0, PROMPT_BLOCKS, Medium::Gpu);
                model.apply_event(stable, &event).unwrap();
            }
        }
    }
    let queries: Vec<(&str, Vec<u64>)> = [EXACT, CHAIN]
        .into_iter()
        .flat_map(|model| prompts.iter().map(move |p| (model, query_keys(model, p))))
        .collect();

    for round in 0..ROUNDS {
        let events: Vec<Vec<KvEvent>> = (0..WRITERS)
            .map(|w| writer_events(w, round, &prompts))
            .collect();
        let writing = AtomicBool::new(true);
        std::thread::scope(|scope| {
            let writers = spawn_writers(scope, &index, &events);
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    let (index, queries, writing) = (&index, &queries, &writing);
                    scope.spawn(move || {
                        let mut walks = 0;
                        while writing.load(Ordering::Relaxed) || walks < queries.len() {
                            let (model, keys) = &queries[walks % queries.len()];
                            walks += 1;
                            let found = index.find_matches(model, keys, None).unwrap();
                            let stable = if *model == EXACT {
                                STABLE
                            } else {
                                100 + STABLE
                            };
                            let full = keys.len() as u32;
                            assert_eq!(counts(&found, stable), Some((full, full)), "{found:?}");
                            for m in &found {
                                assert!(
                                    m.gpu_blocks <= m.matched_blocks && m.matched_blocks <= full
                                );
                            }
                        }
                        walks
                    })
                })
                .collect();
            for writer in writers {
                writer.join().unwrap();
            }
            writing.store(false, Ordering::Relaxed);
            for reader in readers {
                assert!(reader.join().unwrap() > 0);
            }
        });

        // Quiescent: replay the same events into the reference (replicas are independent, so
        // each one's own order is all that matters) and compare every answer.
        for (w, events) in (0..WRITERS).zip(&events) {
            for event in events {
                for replica in [ReplicaId(w), ReplicaId(100 + w)] {
                    reference.apply_event(replica, event).unwrap();
                }
            }
        }
        for (model, keys) in &queries {
            let found = sorted(index.find_matches(model, keys, None).unwrap());
            let expected = sorted(reference.find_matches(model, keys, None).unwrap());
            assert_eq!(found, expected, "round {round}, {model}");
        }
    }
}

/// Long prompts (runs of up to 96 keys) whose middles the writers keep changing.
const LONG_BLOCKS: usize = 96;

/// Events per writer per round on long prompts: few enough that most runs keep their first
/// keys, so a run whose middle changed is still entered by the next walk.
const LONG_OPS: usize = 60;

/// One writer's events on long prompts: spans stored and removed inside the prompts (past
/// their first blocks), so runs built by the readers are cut in the middle.
fn mid_prompt_events(writer: u32, round: usize, prompts: &[Vec<u32>]) -> Vec<KvEvent> {
    let mut lcg = Lcg(u64::from(writer) << 40 | round as u64 | 1 << 20);
    let media = [Medium::Gpu, Medium::Cpu, Medium::Gpu, Medium::Storage];
    (0..LONG_OPS)
        .map(|_| {
            let tokens = &prompts[lcg.below(prompts.len())];
            let start = 8 + lcg.below(LONG_BLOCKS - 8);
            let end = (start + 1 + lcg.below(24)).min(LONG_BLOCKS);
            let medium = media[lcg.below(media.len())];
            match lcg.below(60) {
                0 => KvEvent::AllBlocksCleared,
                // Whole prefixes: long stretches of the same holders to build runs over.
                1..=6 => stored(tokens, 0, end, medium),
                7..=30 => stored(tokens, start, end, medium),
                _ => removed(tokens, start, end, medium),
            }
        })
        .collect()
}

#[test]
fn runs_built_beside_writers_agree_with_reference_model_at_quiescent_points() {
    let index = block_index(10_000);
    let reference = make_reference(10_000);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|seed| prompt(seed + 1, 10 * seed as usize, LONG_BLOCKS))
        .collect();
    for model in [&index as &dyn KvIndex, &*reference] {
        setup(model, STABLE + 1);
        for stable in [ReplicaId(STABLE), ReplicaId(100 + STABLE)] {
            for tokens in &prompts {
                let event = stored(tokens, 0, LONG_BLOCKS, Medium::Gpu);
                model.apply_event(stable, &event).unwrap();
            }
        }
    }
    let queries: Vec<(&str, Vec<u64>)> = [EXACT, CHAIN]
        .into_iter()
        .flat_map(|model| prompts.iter().map(move |p| (model, query_keys(model, p))))
        .collect();

    for round in 0..2 * ROUNDS {
        let events: Vec<Vec<KvEvent>> = (0..WRITERS)
            .map(|w| mid_prompt_events(w, round, &prompts))
            .collect();
        let writing = AtomicBool::new(true);
        std::thread::scope(|scope| {
            let writers = spawn_writers(scope, &index, &events);
            // Readers build runs and read them while the writers cut them.
            let readers: Vec<_> = (0..2)
                .map(|reader| {
                    let (index, queries, writing) = (&index, &queries, &writing);
                    scope.spawn(move || {
                        let mut walks = reader;
                        while writing.load(Ordering::Relaxed) || walks < queries.len() {
                            let (model, keys) = &queries[walks % queries.len()];
                            walks += 1;
                            let found = index.find_matches(model, keys, None).unwrap();
                            let stable = if *model == EXACT {
                                STABLE
                            } else {
                                100 + STABLE
                            };
                            let full = keys.len() as u32;
                            assert_eq!(counts(&found, stable), Some((full, full)), "{found:?}");
                            for m in &found {
                                assert!(
                                    m.gpu_blocks <= m.matched_blocks && m.matched_blocks <= full
                                );
                            }
                        }
                    })
                })
                .collect();
            for writer in writers {
                writer.join().unwrap();
            }
            writing.store(false, Ordering::Relaxed);
            for reader in readers {
                reader.join().unwrap();
            }
        });

        for (w, events) in (0..WRITERS).zip(&events) {
            for event in events {
                for replica in [ReplicaId(w), ReplicaId(100 + w)] {
                    reference.apply_event(replica, event).unwrap();
                }
            }
        }
        // Three times: a cut stretch is rebuilt by the second walk, read by the third.
        for pass in 0..3 {
            for (model, keys) in &queries {
                let found = sorted(index.find_matches(model, keys, None).unwrap());
                let expected = sorted(reference.find_matches(model, keys, None).unwrap());
                assert_eq!(found, expected, "round {round}, pass {pass}, {model}");
            }
        }
    }
    for model in [EXACT, CHAIN] {
        let stats = index.path_stats(model).unwrap();
        assert!(stats.keys_by_run > 0 && stats.runs_built > 0, "{stats:?}");
        // Writers built runs from their events beside the walks' (a stored whole prefix).
        assert!(stats.runs_from_events > 0, "{stats:?}");
    }
}
