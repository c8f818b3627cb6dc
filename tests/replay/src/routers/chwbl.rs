//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), as in
//! Envoy's ring hash / HAProxy's `hash-balance-factor`.
//!
//! The key is the chained key of the first two prompt blocks (the whole prompt when shorter):
//! requests sharing 1024 tokens of prefix land together. Each replica owns `VNODES` points on
//! a ring; a request walks clockwise from its key's point to the first replica whose in-flight
//! count is below `ceil(BALANCE_FACTOR · (in-flight + 1) / replicas)`.

use super::{Decision, InFlight, Router, View};
use crate::trace::Request;

/// Ring points per replica.
const VNODES: usize = 100;
/// Load bound over the mean (`c` in the paper; 1.25 is HAProxy's common setting).
const BALANCE_FACTOR: f64 = 1.25;
/// Prefix blocks hashed.
const KEY_BLOCKS: usize = 2;

/// The router.
#[derive(Debug)]
pub struct ConsistentHashBoundedLoad {
    /// (point, replica), sorted.
    ring: Vec<(u64, usize)>,
    inflight: InFlight,
}

impl ConsistentHashBoundedLoad {
    /// For `replicas` replicas.
    pub fn new(replicas: usize) -> Self {
        let mut ring: Vec<(u64, usize)> = (0..replicas)
            .flat_map(|r| {
                (0..VNODES).map(move |v| {
                    let point = xxhash_rust::xxh3::xxh3_64(format!("replica-{r}-{v}").as_bytes());
                    (point, r)
                })
            })
            .collect();
        ring.sort_unstable();
        ConsistentHashBoundedLoad {
            ring,
            inflight: InFlight::new(replicas),
        }
    }
}

impl Router for ConsistentHashBoundedLoad {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let replicas = view.engines.len();
        let key = request
            .chain
            .get(KEY_BLOCKS.min(request.chain.len()).saturating_sub(1))
            .copied()
            .unwrap_or(0);
        let bound =
            (BALANCE_FACTOR * f64::from(self.inflight.total() + 1) / replicas as f64).ceil() as u32;
        let start = self.ring.partition_point(|(point, _)| *point < key);
        let replica = (0..self.ring.len())
            .map(|step| self.ring[(start + step) % self.ring.len()].1)
            .find(|r| self.inflight.get(*r) < bound)
            .unwrap_or(0);
        self.inflight.add(replica);
        Decision::to(replica)
    }

    fn on_finish(&mut self, replica: usize, _request: &Request, _now_us: u64) {
        self.inflight.remove(replica);
    }
}
