//! The discrete-event loop: arrivals, engine steps, delayed KV-event delivery and router ticks
//! in virtual time (µs).
//!
//! - An arrival is routed at once ([`Router::route`]) and queued on its replica; an idle
//!   replica starts a step.
//! - A step's end applies it, reports first tokens and completions to the router, and queues
//!   the step's KV events for delivery to the router `kv_delay_us` later (one FIFO per replica:
//!   the delay is constant, so order is kept).
//! - Routers that poll engine metrics get a tick every [`Router::tick_interval_us`].
//!
//! Events at the same instant run in the order they were scheduled, so a run is a pure function
//! of its inputs and the router's seed.
//!
//! [`run_checked`] can stop a run as soon as a TTFT objective is missed for certain (more
//! measured requests late than the percentile allows, counting requests still unserved past the
//! objective): the max-rate search probes overloaded rates, where a full run would be slow and
//! tell nothing more.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use kvroute_index_core::event::KvEvent;

use crate::engine::{Engine, EngineConfig};
use crate::routers::{Router, View};
use crate::trace::Request;
use kvroute_engine_model::Leg;
use kvroute_engine_model::MockerFit;

/// Simulation parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Replicas.
    pub replicas: usize,
    /// Each replica's limits.
    pub engine: EngineConfig,
    /// Step timing.
    pub timing: MockerFit,
    /// Delay between a step's end and its KV events reaching the router, µs.
    pub kv_delay_us: u64,
    /// For a disaggregating router ([`Router::disaggregated`]): replicas `0..prefill_replicas`
    /// are prefill-only, the rest decode. Other routers serve every replica whole.
    pub prefill_replicas: usize,
}

impl Default for SimConfig {
    /// `kvroute-replay run`'s defaults: 4 whole replicas of the default engine and timing, KV
    /// events 50 ms after their step.
    fn default() -> Self {
        SimConfig {
            replicas: 4,
            engine: EngineConfig::default(),
            timing: MockerFit::default(),
            kv_delay_us: 50_000,
            prefill_replicas: 0,
        }
    }
}

impl SimConfig {
    /// One replica of `blocks` KV blocks, its events delivered at once: what its cache holds is
    /// then what an LRU over the requests' blocks holds (the checks against one).
    pub fn one_replica(blocks: u32) -> Self {
        SimConfig {
            replicas: 1,
            engine: EngineConfig {
                blocks,
                ..EngineConfig::default()
            },
            kv_delay_us: 0,
            ..SimConfig::default()
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestOutcome {
    /// Replica it was routed to (the decode replica when split).
    pub replica: usize,
    /// Prefill replica that computed its prompt, when split.
    pub prefill: Option<usize>,
    /// Arrival to first token, µs.
    pub ttft_us: u64,
    /// Leading prompt blocks found cached at admission (on the prefill replica when split).
    pub hit_blocks: u32,
    /// Leading blocks the router believed cached there, if it keeps such a belief.
    pub predicted_blocks: Option<u32>,
}

/// A finished run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// Per request, by id.
    pub outcomes: Vec<RequestOutcome>,
    /// Per replica, time spent stepping, µs.
    pub busy_us: Vec<u64>,
    /// Virtual time when the last request finished, µs.
    pub end_us: u64,
}

/// A TTFT objective a run can stop at ([`run_checked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SloCheck {
    /// The objective, µs.
    pub ttft_us: u64,
    /// Requests (by id) before this one are warm-up and not measured.
    pub skip: usize,
    /// Measured requests that may take longer than `ttft_us` with the objective still met.
    pub max_late: usize,
}

/// How a checked run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Checked {
    /// It ran to the end.
    Done(RunResult),
    /// More than `max_late` measured requests missed the objective; stopped there.
    MissedSlo,
}

/// A run that could not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// A request needs more KV blocks than a replica has.
    #[error("request {request} needs {blocks} blocks, a replica has {capacity}")]
    RequestTooLarge {
        /// Request id.
        request: usize,
        /// Blocks it needs at its peak.
        blocks: u32,
        /// Blocks per replica.
        capacity: u32,
    },
    /// The router chose a replica that does not exist.
    #[error("router chose replica {replica} of {replicas}")]
    BadReplica {
        /// The choice.
        replica: usize,
        /// Replicas configured.
        replicas: usize,
    },
    /// A run's requests could not be written out (`--outcomes`).
    #[error("writing outcomes: {0}")]
    Output(String),
    /// Some requests never got their first token.
    #[error("{unserved} requests never served")]
    Stalled {
        /// How many.
        unserved: usize,
    },
    /// No replicas configured.
    #[error("no replicas")]
    NoReplicas,
}

impl SimError {
    /// Short label of the error kind.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::RequestTooLarge { .. } => "request_too_large",
            Self::BadReplica { .. } => "bad_replica",
            Self::Stalled { .. } => "stalled",
            Self::NoReplicas => "no_replicas",
            Self::Output(_) => "output",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    StepDone(usize),
    Deliver(usize),
    Tick,
}

/// The event queue: (time, insertion sequence) order.
#[derive(Debug, Default)]
struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64, Event)>>,
    sequence: u64,
}

impl Queue {
    fn push(&mut self, at: u64, event: Event) {
        self.heap.push(Reverse((at, self.sequence, event)));
        self.sequence += 1;
    }

    fn pop(&mut self) -> Option<(u64, Event)> {
        self.heap.pop().map(|Reverse((at, _, event))| (at, event))
    }
}

/// Replays `requests` (sorted by arrival, ids = positions) through `router`.
pub fn run(
    requests: &[Request],
    config: &SimConfig,
    router: &mut dyn Router,
) -> Result<RunResult, SimError> {
    match run_checked(requests, config, router, None)? {
        Checked::Done(result) => Ok(result),
        // Without a check a run always ends.
        Checked::MissedSlo => Err(SimError::Stalled {
            unserved: requests.len(),
        }),
    }
}

/// Counts measured requests that missed a [`SloCheck`], each once.
#[derive(Debug)]
struct Lateness {
    check: SloCheck,
    late: Vec<bool>,
    count: usize,
    /// Requests before this one were looked at for being unserved past the objective.
    scanned: usize,
}

impl Lateness {
    fn mark(&mut self, id: usize) {
        if id >= self.check.skip && !self.late[id] {
            self.late[id] = true;
            self.count += 1;
        }
    }

    /// Marks requests that arrived more than the objective ago and are still unserved; true
    /// once too many are late.
    fn missed(
        &mut self,
        now: u64,
        requests: &[Request],
        served: &[Option<RequestOutcome>],
    ) -> bool {
        while let Some(request) = requests.get(self.scanned) {
            if request.arrival_us.saturating_add(self.check.ttft_us) >= now {
                break;
            }
            if served[self.scanned].is_none() {
                self.mark(self.scanned);
            }
            self.scanned += 1;
        }
        self.count > self.check.max_late
    }
}

/// [`run`], stopping early when `slo` is missed for certain.
pub fn run_checked(
    requests: &[Request],
    config: &SimConfig,
    router: &mut dyn Router,
    slo: Option<SloCheck>,
) -> Result<Checked, SimError> {
    if config.replicas == 0 {
        return Err(SimError::NoReplicas);
    }
    if let Some(request) = requests
        .iter()
        .find(|r| r.peak_blocks() > config.engine.blocks)
    {
        return Err(SimError::RequestTooLarge {
            request: request.id,
            blocks: request.peak_blocks(),
            capacity: config.engine.blocks,
        });
    }
    let mut engines: Vec<Engine> = (0..config.replicas)
        .map(|_| Engine::new(config.engine))
        .collect();
    let mut deliveries: Vec<VecDeque<Vec<KvEvent>>> = vec![VecDeque::new(); config.replicas];
    let mut outcomes: Vec<Option<RequestOutcome>> = vec![None; requests.len()];
    let mut routed: Vec<(usize, Option<u32>)> = vec![(0, None); requests.len()];
    let prefill_replicas = if router.disaggregated() {
        config.prefill_replicas.min(config.replicas)
    } else {
        0
    };
    // Split requests: their prefill replica, whether that leg is done, its hit blocks.
    let mut split: Vec<Option<usize>> = vec![None; requests.len()];
    let mut prefill_done = vec![false; requests.len()];
    let mut prefill_hits = vec![0u32; requests.len()];
    let mut finished = 0;
    let mut end_us = 0;
    let mut queue = Queue::default();
    for request in requests {
        queue.push(request.arrival_us, Event::Arrival(request.id));
    }
    let tick = router.tick_interval_us();
    if tick.is_some() {
        queue.push(0, Event::Tick);
    }
    let mut lateness = slo.map(|check| Lateness {
        check,
        late: vec![false; requests.len()],
        count: 0,
        scanned: 0,
    });
    while let Some((now, event)) = queue.pop() {
        if let Some(lateness) = &mut lateness
            && lateness.missed(now, requests, &outcomes)
        {
            return Ok(Checked::MissedSlo);
        }
        match event {
            Event::Arrival(id) => {
                let request = &requests[id];
                let view = View {
                    now_us: now,
                    engines: &engines,
                    requests,
                    timing: &config.timing,
                    prefill_replicas,
                };
                let pair = router.route_pair(request, &view);
                let replica = pair.decode.replica;
                for chosen in std::iter::once(replica).chain(pair.prefill) {
                    if chosen >= engines.len() {
                        return Err(SimError::BadReplica {
                            replica: chosen,
                            replicas: engines.len(),
                        });
                    }
                }
                routed[id] = (replica, pair.decode.predicted_blocks);
                // A split request computes its prompt on the prefill replica first (one
                // output token, as the prefill leg's `max_tokens: 1`); its decode leg is queued
                // when that finishes.
                let first = match pair.prefill {
                    Some(prefill) => {
                        split[id] = Some(prefill);
                        engines[prefill].enqueue_leg(request, Leg::Prefill, 1);
                        prefill
                    }
                    None => {
                        engines[replica].enqueue(request);
                        replica
                    }
                };
                if let Some(end) = engines[first].start_step(now, &config.timing) {
                    queue.push(end, Event::StepDone(first));
                }
            }
            Event::StepDone(replica) => {
                let outcome = engines[replica].finish_step();
                for first in &outcome.first_tokens {
                    let request = &requests[first.id];
                    if split[first.id] == Some(replica) && !prefill_done[first.id] {
                        // The prefill leg's token is not the client's: it is dropped.
                        prefill_hits[first.id] = first.hit_blocks;
                        router.on_first_token(replica, request, now);
                        continue;
                    }
                    let (routed_to, predicted_blocks) = routed[first.id];
                    let prefill = split[first.id];
                    if let Some(prefill) = prefill {
                        // The decode leg has read the prefill's blocks (its load is done
                        // before its first token): the prefill replica frees them.
                        engines[prefill].release_held(first.id);
                        if let Some(end) = engines[prefill].start_step(now, &config.timing) {
                            queue.push(end, Event::StepDone(prefill));
                        }
                    }
                    let ttft_us = now.saturating_sub(request.arrival_us);
                    if let Some(lateness) = &mut lateness
                        && ttft_us > lateness.check.ttft_us
                    {
                        lateness.mark(first.id);
                    }
                    outcomes[first.id] = Some(RequestOutcome {
                        replica: routed_to,
                        prefill,
                        ttft_us,
                        hit_blocks: if prefill.is_some() {
                            prefill_hits[first.id]
                        } else {
                            first.hit_blocks
                        },
                        predicted_blocks,
                    });
                    router.on_first_token(replica, request, now);
                }
                for id in &outcome.finished {
                    router.on_finish(replica, &requests[*id], now);
                    if split[*id] == Some(replica) && !prefill_done[*id] {
                        // The prefill leg is done: the decode leg pulls the whole prompt's KV.
                        prefill_done[*id] = true;
                        let request = &requests[*id];
                        let decode = routed[*id].0;
                        engines[decode].enqueue_leg(
                            request,
                            Leg::Decode {
                                remote_tokens: request.input_tokens,
                            },
                            request.output_tokens,
                        );
                        if let Some(end) = engines[decode].start_step(now, &config.timing) {
                            queue.push(end, Event::StepDone(decode));
                        }
                        continue;
                    }
                    finished += 1;
                    end_us = now;
                }
                if !outcome.events.is_empty() {
                    deliveries[replica].push_back(outcome.events);
                    queue.push(now + config.kv_delay_us, Event::Deliver(replica));
                }
                if let Some(end) = engines[replica].start_step(now, &config.timing) {
                    queue.push(end, Event::StepDone(replica));
                }
            }
            Event::Deliver(replica) => {
                if let Some(events) = deliveries[replica].pop_front() {
                    router.on_kv_events(replica, &events, now);
                }
            }
            Event::Tick => {
                let view = View {
                    now_us: now,
                    engines: &engines,
                    requests,
                    timing: &config.timing,
                    prefill_replicas,
                };
                router.on_tick(&view);
                if let Some(interval) = tick
                    && finished < requests.len()
                {
                    queue.push(now + interval.max(1), Event::Tick);
                }
            }
        }
    }
    let unserved = outcomes.iter().filter(|o| o.is_none()).count();
    if unserved > 0 || finished < requests.len() {
        return Err(SimError::Stalled {
            unserved: unserved.max(requests.len() - finished),
        });
    }
    if lateness.is_some_and(|l| l.count > l.check.max_late) {
        return Ok(Checked::MissedSlo);
    }
    Ok(Checked::Done(RunResult {
        outcomes: outcomes.into_iter().flatten().collect(),
        busy_us: engines.iter().map(Engine::busy_us).collect(),
        end_us,
    }))
}
