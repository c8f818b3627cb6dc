//! Cache-blind baselines: random, round-robin, least-loaded and session hash.

use rand::Rng;
use rand::rngs::StdRng;

use super::{Decision, InFlight, Router, View, argmin_random};
use crate::trace::Request;

/// Uniformly random replica.
#[derive(Debug)]
pub struct Random {
    rng: StdRng,
}

impl Random {
    /// With its own RNG.
    pub fn new(rng: StdRng) -> Self {
        Random { rng }
    }
}

impl Router for Random {
    fn route(&mut self, _request: &Request, view: &View<'_>) -> Decision {
        Decision::to(self.rng.random_range(0..view.engines.len()))
    }
}

/// Replicas in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Router for RoundRobin {
    fn route(&mut self, _request: &Request, view: &View<'_>) -> Decision {
        let replica = self.next % view.engines.len();
        self.next = replica + 1;
        Decision::to(replica)
    }
}

/// Fewest in-flight requests as the router counts them (Envoy's least-request), ties random.
#[derive(Debug)]
pub struct LeastLoaded {
    inflight: InFlight,
    rng: StdRng,
}

impl LeastLoaded {
    /// For `replicas` replicas.
    pub fn new(replicas: usize, rng: StdRng) -> Self {
        LeastLoaded {
            inflight: InFlight::new(replicas),
            rng,
        }
    }
}

impl Router for LeastLoaded {
    fn route(&mut self, _request: &Request, view: &View<'_>) -> Decision {
        let inflight = &self.inflight;
        let replica = argmin_random(
            view.engines.len(),
            |i| f64::from(inflight.get(i)),
            &mut self.rng,
        )
        .unwrap_or(0);
        self.inflight.add(replica);
        Decision::to(replica)
    }

    fn on_finish(&mut self, replica: usize, _request: &Request, _now_us: u64) {
        self.inflight.remove(replica);
    }
}

/// Sticky sessions (a proxy hashing a session header): [`Request::session`], the record's
/// session id when the trace has one (the generated workloads do: user, conversation, agent),
/// else the key of its first [`crate::trace::SESSION_PREFIX_BLOCKS`] blocks. The first block
/// alone was the key before: on a trace whose every request opens with the same system prompt
/// block it sent everything to one replica.
#[derive(Debug)]
pub struct SessionHash;

impl Router for SessionHash {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        Decision::to((request.session % view.engines.len() as u64) as usize)
    }
}
