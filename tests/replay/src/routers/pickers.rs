//! Several kvroute pickers acting on one fleet, as several ext-proc replicas behind Envoy's round
//! robin: request `i` is decided by picker `i mod N`.
//!
//! Each picker is a whole [`Kvroute`]: its own in-flight accounting (requests it routed and not
//! yet at their first token), its own routed-prefix memory (speculative inserts, the approximate
//! tier), its own scrapes of the engines. What they share is the index: every picker's index is
//! fed every engine event at the same delay, which is what one index service answering all of
//! them gives. So a picker sees its siblings' decisions only once the engines' events report
//! them (or their load shows in a scrape): the state kvroute does not share today.
//!
//! With sharing (`kvroute-x<N>-s<ms>`, `ms` a fraction too), every decision also reaches the other
//! pickers `ms` later (the staleness of whatever carries it): each counts the request in flight
//! on its replica, with the prefill it queues there, and remembers the prefix there, exactly as if
//! it had decided it itself; the first token is shared the same way and ends it.

use std::collections::{HashMap, VecDeque};

use kvroute_index_core::event::KvEvent;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::{Decision, Kvroute, Router, View};
use crate::trace::Request;

/// N pickers behind round robin.
#[derive(Debug)]
pub struct Pickers {
    pickers: Vec<Kvroute>,
    next: usize,
    /// Which picker decided each request still in flight (its guards live there).
    owner: HashMap<usize, usize>,
    /// Sharing: how long a decision or an answer takes to reach the other pickers, µs.
    share_delay_us: Option<u64>,
    /// Shared messages not yet delivered, by delivery time (sent in time order, so in order).
    in_transit: VecDeque<(u64, Shared)>,
}

/// What one picker tells the others.
#[derive(Debug)]
enum Shared {
    /// `request` was sent to `replica`, leaving `pending_tokens` to compute there.
    Decided {
        from: usize,
        request: Request,
        replica: usize,
        pending_tokens: usize,
    },
    /// The request reached its first token.
    Answered {
        from: usize,
        request_id: usize,
        replica: usize,
    },
}

impl Pickers {
    /// `count` pickers (at least one) for `replicas` replicas of `blocks` blocks each.
    /// The first picker takes `rng` itself, so one picker decides exactly as [`Kvroute`].
    pub fn new(count: usize, replicas: usize, blocks: u32, rng: StdRng) -> Self {
        let mut seeds = rng.clone();
        let pickers = (0..count.max(1))
            .map(|i| {
                let rng = if i == 0 {
                    rng.clone()
                } else {
                    StdRng::from_rng(&mut seeds)
                };
                Kvroute::new(replicas, blocks, rng)
            })
            .collect();
        Pickers {
            pickers,
            next: 0,
            owner: HashMap::new(),
            share_delay_us: None,
            in_transit: VecDeque::new(),
        }
    }

    /// Pickers that tell each other every decision and answer, `delay_us` late.
    pub fn sharing(mut self, delay_us: u64) -> Self {
        self.share_delay_us = Some(delay_us);
        self
    }

    /// Hands the others every message due by `now_us`.
    fn deliver(&mut self, now_us: u64) {
        while self.in_transit.front().is_some_and(|(at, _)| *at <= now_us) {
            let Some((at, message)) = self.in_transit.pop_front() else {
                break;
            };
            for (i, picker) in self.pickers.iter_mut().enumerate() {
                match &message {
                    Shared::Decided {
                        from,
                        request,
                        replica,
                        pending_tokens,
                    } if *from != i => {
                        picker.record_peer_decision(request, *replica, *pending_tokens, at);
                    }
                    Shared::Answered {
                        from,
                        request_id,
                        replica,
                    } if *from != i => picker.peer_answered(*request_id, *replica),
                    _ => {}
                }
            }
        }
    }

    fn send(&mut self, now_us: u64, message: Shared) {
        if let Some(delay) = self.share_delay_us
            && self.pickers.len() > 1
        {
            self.in_transit.push_back((now_us + delay, message));
        }
    }

    fn owner_of(&mut self, request: &Request) -> Option<&mut Kvroute> {
        let picker = *self.owner.get(&request.id)?;
        self.pickers.get_mut(picker)
    }
}

impl Router for Pickers {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        self.deliver(view.now_us);
        let picker = self.next;
        self.next = (self.next + 1) % self.pickers.len();
        self.owner.insert(request.id, picker);
        let decision = self.pickers[picker].route(request, view);
        let pending_tokens = self.pickers[picker].last_pending_tokens(request);
        self.send(
            view.now_us,
            Shared::Decided {
                from: picker,
                request: request.clone(),
                replica: decision.replica,
                pending_tokens,
            },
        );
        decision
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_us: u64) {
        self.deliver(now_us);
        for picker in &mut self.pickers {
            picker.on_kv_events(replica, events, now_us);
        }
    }

    fn on_first_token(&mut self, replica: usize, request: &Request, now_us: u64) {
        self.deliver(now_us);
        let Some(&from) = self.owner.get(&request.id) else {
            return;
        };
        if let Some(picker) = self.pickers.get_mut(from) {
            picker.on_first_token(replica, request, now_us);
        }
        self.send(
            now_us,
            Shared::Answered {
                from,
                request_id: request.id,
                replica,
            },
        );
    }

    fn on_finish(&mut self, replica: usize, request: &Request, now_us: u64) {
        if let Some(picker) = self.owner_of(request) {
            picker.on_finish(replica, request, now_us);
        }
        self.owner.remove(&request.id);
    }

    fn tick_interval_us(&self) -> Option<u64> {
        self.pickers.first().and_then(Router::tick_interval_us)
    }

    fn on_tick(&mut self, view: &View<'_>) {
        self.deliver(view.now_us);
        for picker in &mut self.pickers {
            picker.on_tick(view);
        }
    }
}
