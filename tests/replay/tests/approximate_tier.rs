//! kvroute on a fleet without KV events (`kvroute-approx`): its routed-prefix memory stands in for
//! the engines' caches, so it must not forget what a replica still holds.
#![allow(clippy::unwrap_used, reason = "test code")]

use kvroute_replay::bounds::lru_hit_blocks;
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::{self, SimConfig};
use kvroute_replay::trace;
use kvroute_replay::workload::{self, Kind};

/// One replica, requests one at a time (each long after the previous one finished), a cache
/// small enough to evict: every block the replica holds was routed there, so a memory that keeps
/// at least the last cache-full of routed keys believes every block the engine reuses.
#[test]
fn the_memory_never_forgets_what_the_replica_still_holds() {
    let router = RouterSpec::parse("kvroute-approx").unwrap();
    assert_eq!(router.name(), "kvroute-approx");
    let mut requests = trace::prepare_all(&workload::generate(Kind::MultiTurn, 1)).unwrap();
    requests.truncate(1500);
    for (i, request) in requests.iter_mut().enumerate() {
        request.arrival_us = i as u64 * 1_000_000_000;
    }
    let blocks = 512;
    let config = SimConfig::one_replica(blocks);
    let reused = |capacity| lru_hit_blocks(&requests, capacity).iter().sum::<u32>();
    assert!(
        reused(usize::MAX) > reused(blocks as usize),
        "the replica evicts under this cache"
    );

    let mut built = router.build(1, blocks, 0);
    let result = sim::run(&requests, &config, built.as_mut()).unwrap();
    let mut held = 0;
    for (request, outcome) in requests.iter().zip(&result.outcomes) {
        let believed = outcome.predicted_blocks.unwrap();
        assert!(
            believed >= outcome.hit_blocks,
            "request {}: believed {believed} blocks cached, the replica held {}",
            request.id,
            outcome.hit_blocks
        );
        held += outcome.hit_blocks;
    }
    assert!(held > 1000, "the replica reused {held} blocks");
}
