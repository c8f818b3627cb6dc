//! Several kvroute pickers acting on one fleet, as several ext-proc replicas behind Envoy's round
//! robin: request `i` is decided by picker `i mod N`.
//!
//! Each picker is a whole [`Kvroute`]: its own in-flight accounting (requests it routed and not
//! yet at their first token), its own routed-prefix memory (speculative inserts, the approximate
//! tier), its own scrapes of the engines. What they share is the index: every picker's index is
//! fed every engine event at the same delay, which is what one index service answering all of
//! them gives. So a picker sees its siblings' decisions only once the engines' events report
//! them (or their load shows in a scrape): the state kvroute does not share today.

use std::collections::HashMap;

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
        }
    }

    fn owner_of(&mut self, request: &Request) -> Option<&mut Kvroute> {
        let picker = *self.owner.get(&request.id)?;
        self.pickers.get_mut(picker)
    }
}

impl Router for Pickers {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let picker = self.next;
        self.next = (self.next + 1) % self.pickers.len();
        self.owner.insert(request.id, picker);
        self.pickers[picker].route(request, view)
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_us: u64) {
        for picker in &mut self.pickers {
            picker.on_kv_events(replica, events, now_us);
        }
    }

    fn on_first_token(&mut self, replica: usize, request: &Request, now_us: u64) {
        if let Some(picker) = self.owner_of(request) {
            picker.on_first_token(replica, request, now_us);
        }
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
        for picker in &mut self.pickers {
            picker.on_tick(view);
        }
    }
}
