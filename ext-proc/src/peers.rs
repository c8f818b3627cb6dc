//! Several ext-proc replicas acting as one: each tells the others every request it sent and when
//! the engine answered, through the index service they all stream from
//! (`kvroute.index.v1.KvIndex/ShareDecisions`), and counts theirs as its own.
//!
//! Why: the precise index is shared already, but each picker's in-flight accounting and
//! routed-prefix memory cover only the requests it decided. Behind Envoy's round robin, N
//! pickers each see 1/N of the load between scrapes and pile requests on the replicas that hold
//! a prefix (kvroute-replay: 4 pickers lose 4-20 % of one picker's max rate at the SLO; sharing
//! within a millisecond recovers it — BENCHMARKS.md, "Several pickers").
//!
//! Consistency: none beyond "soon". News is relayed as sent, unordered across pickers, not
//! acknowledged; a picker applies a peer's decision on arrival exactly as it commits its own
//! (`Router::record_peer_decision`: in flight on the replica with its queued prefill, the
//! prefix remembered there) and releases it when the peer's answer arrives. Bounded staleness:
//! news older than `peers.max_staleness` on arrival is dropped; a peer decision whose answer
//! never comes stops counting after `limits.inflight_max_age`; at most
//! [`MAX_PEER_DECISIONS`] are held. No new single point of failure: without the stream (index
//! down, restarting, unreachable) a picker routes on its own state as a lone picker does, says
//! so in a log line and `kvroute_extproc_peer_sharing 0`, forgets what peers told it, and
//! reconnects.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_index_api::api::{self, PickerNews, picker_news::News};
use kvroute_routing::load::InflightGuard;
use kvroute_routing::{PeerDecision, Router};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::metrics::{Metrics, OutcomeLabel};
use crate::picker::Picker;

/// Peer decisions held at once; more are dropped (counted `overflow`).
pub const MAX_PEER_DECISIONS: usize = 65_536;
/// News queued for the index; more are dropped (counted `send_dropped`).
const OUTGOING_CAPACITY: usize = 4096;
/// Wait before reconnecting a lost stream.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);
/// How often unanswered peer decisions are checked for age.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// What became of a piece of news (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// One of ours, handed to the stream.
    Sent,
    /// One of ours, dropped: the stream's queue was full.
    SendDropped,
    /// A peer's decision, now counted here.
    Applied,
    /// A peer's answer, its decision released.
    Answered,
    /// A peer's, older than `peers.max_staleness` on arrival.
    Stale,
    /// A peer's decision for a model or replica this config does not have.
    Unknown,
    /// A peer's decision beyond [`MAX_PEER_DECISIONS`].
    Overflow,
    /// A peer's decision whose answer never came within `limits.inflight_max_age`.
    Expired,
}

impl Outcome {
    fn as_label(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::SendDropped => "send_dropped",
            Self::Applied => "applied",
            Self::Answered => "answered",
            Self::Stale => "stale",
            Self::Unknown => "unknown",
            Self::Overflow => "overflow",
            Self::Expired => "expired",
        }
    }
}

/// This picker's side of the sharing.
#[derive(Debug)]
pub struct Peers {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// This process among the pickers.
    id: String,
    next_decision: AtomicU64,
    /// Open while a stream is: where our news go.
    outgoing: Mutex<Option<mpsc::Sender<PickerNews>>>,
    /// Peers' decisions counted here, by (peer, decision).
    received: Mutex<HashMap<(String, u64), Held>>,
    metrics: Metrics,
}

#[derive(Debug)]
struct Held {
    _guard: InflightGuard,
    since: Instant,
}

/// Tells the peers, when dropped (the response began or the stream ended), that the decision
/// it stands for was answered.
#[derive(Debug)]
pub struct PeerTicket {
    inner: Arc<Inner>,
    decision: u64,
}

impl Drop for PeerTicket {
    fn drop(&mut self) {
        self.inner.send(News::Answered(api::PickerAnswered {
            decision: self.decision,
        }));
    }
}

impl Peers {
    /// Not sharing until [`share_loop`] connects.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                id: format!("{:016x}", rand::random::<u64>()),
                next_decision: AtomicU64::new(0),
                outgoing: Mutex::new(None),
                received: Mutex::new(HashMap::new()),
                metrics,
            }),
        }
    }

    /// Tells the peers `replica` got a request of `model` whose prompt of `prompt_tokens` tokens
    /// has `keys` and leaves `pending_prompt_tokens` to compute there. `None` while not sharing.
    pub fn announce(
        &self,
        model: &str,
        replica: &str,
        keys: &[u64],
        prompt_tokens: usize,
        pending_prompt_tokens: usize,
    ) -> Option<PeerTicket> {
        if self.inner.outgoing.lock().is_none() {
            return None;
        }
        let decision = self.inner.next_decision.fetch_add(1, Ordering::Relaxed);
        let sent = self.inner.send(News::Decided(api::PickerDecided {
            decision,
            model: model.to_owned(),
            replica_id: replica.to_owned(),
            keys: keys.to_vec(),
            pending_prompt_tokens: pending_prompt_tokens as u64,
            prompt_tokens: prompt_tokens as u64,
        }));
        sent.then(|| PeerTicket {
            inner: Arc::clone(&self.inner),
            decision,
        })
    }

    /// Counts a peer's news here: its decision as if decided here, its answer by releasing it.
    pub fn apply(&self, news: PickerNews, router: &Router, config: &Config) {
        let inner = &self.inner;
        if news.picker == inner.id {
            return;
        }
        let age_us = unix_micros().saturating_sub(news.sent_at_unix_us);
        inner.metrics.peer_news_age.observe(age_us as f64 / 1e6);
        if Duration::from_micros(age_us) > config.peers.max_staleness {
            inner.count(Outcome::Stale);
            return;
        }
        match news.news {
            Some(News::Decided(decided)) => {
                let pool = config.pool_for_model(&decided.model).map(|(i, _)| i);
                let known = pool.filter(|&pool| {
                    config
                        .replicas
                        .iter()
                        .any(|r| r.pool == pool && r.id == decided.replica_id)
                });
                let Some(pool) = known else {
                    inner.count(Outcome::Unknown);
                    return;
                };
                let mut received = inner.received.lock();
                if received.len() >= MAX_PEER_DECISIONS {
                    inner.count(Outcome::Overflow);
                    return;
                }
                let tokens = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
                let guard = router.record_peer_decision(
                    &decided.replica_id,
                    config.pools[pool].approx_capacity_blocks,
                    config.pools[pool].block_size,
                    PeerDecision {
                        keys: decided.keys,
                        prompt_tokens: tokens(decided.prompt_tokens),
                        pending_prompt_tokens: tokens(decided.pending_prompt_tokens),
                    },
                    Instant::now(),
                );
                received.insert(
                    (news.picker, decided.decision),
                    Held {
                        _guard: guard,
                        since: Instant::now(),
                    },
                );
                inner.count(Outcome::Applied);
            }
            Some(News::Answered(answered))
                if inner
                    .received
                    .lock()
                    .remove(&(news.picker, answered.decision))
                    .is_some() =>
            {
                inner.count(Outcome::Answered);
            }
            Some(News::Answered(_)) | None => {}
        }
    }

    /// Peer decisions held right now.
    pub fn held(&self) -> usize {
        self.inner.received.lock().len()
    }

    /// Whether a stream is open (news are being shared).
    pub fn is_sharing(&self) -> bool {
        self.inner.outgoing.lock().is_some()
    }

    fn connected(&self, outgoing: mpsc::Sender<PickerNews>) {
        *self.inner.outgoing.lock() = Some(outgoing);
        self.inner.metrics.peer_sharing.set(1);
    }

    /// The stream is gone: nothing more is sent, and what peers told us is forgotten (their
    /// answers would not arrive).
    fn disconnected(&self) {
        *self.inner.outgoing.lock() = None;
        self.inner.received.lock().clear();
        self.inner.metrics.peer_sharing.set(0);
    }

    fn expire(&self, max_age: Duration) {
        let mut received = self.inner.received.lock();
        let before = received.len();
        received.retain(|_, held| held.since.elapsed() < max_age);
        for _ in received.len()..before {
            self.inner.count(Outcome::Expired);
        }
    }
}

impl Inner {
    fn count(&self, outcome: Outcome) {
        self.metrics
            .peer_news
            .get_or_create(&OutcomeLabel {
                outcome: outcome.as_label(),
            })
            .inc();
    }

    /// Queues `news` for the peers; whether it was queued.
    fn send(&self, news: News) -> bool {
        let outgoing = self.outgoing.lock();
        let Some(outgoing) = outgoing.as_ref() else {
            return false;
        };
        let message = PickerNews {
            picker: self.id.clone(),
            sent_at_unix_us: unix_micros(),
            news: Some(news),
        };
        match outgoing.try_send(message) {
            Ok(()) => {
                self.count(Outcome::Sent);
                true
            }
            Err(_) => {
                self.count(Outcome::SendDropped);
                false
            }
        }
    }
}

fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Keeps a `ShareDecisions` stream open while the config asks for sharing and has an index
/// address, applying the peers' news as they arrive; reconnects after a loss, and follows
/// reloads.
pub async fn share_loop(picker: Arc<Picker>, cancel: CancellationToken) {
    let mut lost_before = false;
    loop {
        let runtime = picker.runtime();
        let config = &runtime.config;
        if !config.peers.share || config.index_addresses.is_empty() {
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(config.reload_interval) => continue,
            }
        }
        let (outgoing, queued) = mpsc::channel(OUTGOING_CAPACITY);
        let opened = runtime
            .index_client()
            .share_decisions(tokio_stream::wrappers::ReceiverStream::new(queued))
            .await;
        let (index, mut incoming) = match opened {
            Ok(opened) => opened,
            Err(error) => {
                if !lost_before {
                    tracing::warn!(%error, "cannot share decisions with the other pickers: routing on this picker's own state; retrying");
                    lost_before = true;
                }
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(RECONNECT_AFTER) => continue,
                }
            }
        };
        let peers = picker.peers();
        peers.connected(outgoing);
        tracing::info!(%index, "sharing decisions with the other pickers through the index");
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        let ended = loop {
            tokio::select! {
                () = cancel.cancelled() => break None,
                _ = sweep.tick() => {
                    let current = picker.runtime();
                    peers.expire(current.config.inflight_max_age);
                    if current.config.peers.share != config.peers.share
                        || current.config.index_addresses != config.index_addresses
                    {
                        break Some("the config changed");
                    }
                }
                received = incoming.message() => match received {
                    Ok(Some(news)) => {
                        let current = picker.runtime();
                        peers.apply(news, picker.router(), &current.config);
                    }
                    Ok(None) => break Some("the index closed the stream"),
                    Err(_) => break Some("the stream failed"),
                },
            }
        };
        peers.disconnected();
        let Some(why) = ended else { break };
        tracing::warn!(%index, why, "stopped sharing decisions with the other pickers: routing on this picker's own state; reconnecting");
        lost_before = true;
        tokio::select! {
            () = cancel.cancelled() => break,
            () = tokio::time::sleep(RECONNECT_AFTER) => {}
        }
    }
    picker.peers().disconnected();
    tracing::debug!(exit_reason = "cancelled", "decision sharing stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_routing::load::LoadBoard;

    fn config() -> Config {
        Config::from_yaml(
            "pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
             replicas:\n- {id: r0, pool: p, address: \"127.0.0.1:8000\"}\n",
        )
        .unwrap()
    }

    fn decided(picker: &str, decision: u64, replica: &str, age: Duration) -> PickerNews {
        PickerNews {
            picker: picker.to_owned(),
            sent_at_unix_us: unix_micros() - age.as_micros() as u64,
            news: Some(News::Decided(api::PickerDecided {
                decision,
                model: "m".to_owned(),
                replica_id: replica.to_owned(),
                keys: vec![1, 2, 3],
                pending_prompt_tokens: 48,
                prompt_tokens: 50,
            })),
        }
    }

    fn outcome(metrics: &Metrics, outcome: &'static str) -> u64 {
        metrics
            .peer_news
            .get_or_create(&OutcomeLabel { outcome })
            .get()
    }

    #[test]
    fn a_peers_decision_counts_until_its_answer_and_bad_or_late_news_is_dropped() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::register(&mut registry);
        let peers = Peers::new(metrics.clone());
        let router = Router::new(LoadBoard::default());
        let config = config();
        let load = router.loads().replica("r0");

        peers.apply(decided("other", 1, "r0", Duration::ZERO), &router, &config);
        assert_eq!(load.snapshot().inflight_prompt_tokens, 48.0);
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3]), 3);
        assert_eq!(peers.held(), 1);

        // Too old, an unknown replica, our own: dropped.
        let late = config.peers.max_staleness + Duration::from_millis(1);
        peers.apply(decided("other", 2, "r0", late), &router, &config);
        peers.apply(decided("other", 3, "r9", Duration::ZERO), &router, &config);
        let own = peers.inner.id.clone();
        peers.apply(decided(&own, 4, "r0", Duration::ZERO), &router, &config);
        assert_eq!(peers.held(), 1);
        assert_eq!(
            (outcome(&metrics, "stale"), outcome(&metrics, "unknown")),
            (1, 1)
        );
        // Every peer's news is timed on arrival, the late one too; our own is not.
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("kvroute_extproc_peer_news_age_seconds_count 3"),
            "{text}"
        );
        let sum: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("kvroute_extproc_peer_news_age_seconds_sum "))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!(sum >= late.as_secs_f64(), "{sum}");

        // Its answer releases it.
        let answered = PickerNews {
            picker: "other".to_owned(),
            sent_at_unix_us: unix_micros(),
            news: Some(News::Answered(api::PickerAnswered { decision: 1 })),
        };
        peers.apply(answered, &router, &config);
        assert_eq!(peers.held(), 0);
        assert_eq!(load.snapshot().inflight_requests, 0.0);
        assert_eq!(outcome(&metrics, "answered"), 1);

        // One whose answer never comes expires.
        peers.apply(decided("other", 5, "r0", Duration::ZERO), &router, &config);
        peers.expire(Duration::ZERO);
        assert_eq!(peers.held(), 0);
        assert_eq!(outcome(&metrics, "expired"), 1);
    }

    #[test]
    fn nothing_is_announced_while_not_sharing_and_a_ticket_answers_when_dropped() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::register(&mut registry);
        let peers = Peers::new(metrics.clone());
        assert!(peers.announce("m", "r0", &[1], 20, 16).is_none());
        let (outgoing, mut queued) = mpsc::channel(8);
        peers.connected(outgoing);
        let ticket = peers.announce("m", "r0", &[1, 2], 36, 16).unwrap();
        let Some(News::Decided(sent)) = queued.try_recv().unwrap().news else {
            panic!("a decision first");
        };
        assert_eq!((sent.replica_id.as_str(), sent.keys.len()), ("r0", 2));
        assert_eq!((sent.prompt_tokens, sent.pending_prompt_tokens), (36, 16));
        drop(ticket);
        let Some(News::Answered(answered)) = queued.try_recv().unwrap().news else {
            panic!("then its answer");
        };
        assert_eq!(answered.decision, sent.decision);
        peers.disconnected();
        assert!(!peers.is_sharing());
    }
}
