//! A router whose every decision is shown to an observer, everything else passed through: what
//! tools that study a router's decisions wrap it in (the regret measure, the decisions example).

use kvroute_index_core::event::KvEvent;

use super::{Decision, Router, View};
use crate::trace::Request;

/// `inner`, each decision shown to `observe` with the request and the view it was made on.
pub struct Observed<F> {
    inner: Box<dyn Router>,
    observe: F,
}

impl<F: FnMut(&Request, &View<'_>, &Decision)> Observed<F> {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn Router>, observe: F) -> Self {
        Observed { inner, observe }
    }
}

impl<F> std::fmt::Debug for Observed<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observed").finish_non_exhaustive()
    }
}

impl<F: FnMut(&Request, &View<'_>, &Decision)> Router for Observed<F> {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        // The view is the cluster as the router saw it: deciding changes nothing in it.
        let decision = self.inner.route(request, view);
        (self.observe)(request, view, &decision);
        decision
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_us: u64) {
        self.inner.on_kv_events(replica, events, now_us);
    }

    fn on_first_token(&mut self, replica: usize, request: &Request, now_us: u64) {
        self.inner.on_first_token(replica, request, now_us);
    }

    fn on_finish(&mut self, replica: usize, request: &Request, now_us: u64) {
        self.inner.on_finish(replica, request, now_us);
    }

    fn tick_interval_us(&self) -> Option<u64> {
        self.inner.tick_interval_us()
    }

    fn on_tick(&mut self, view: &View<'_>) {
        self.inner.on_tick(view);
    }
}
