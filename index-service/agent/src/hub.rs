//! The agent's hub: ingest writes into per-replica mirrors and pending deltas; index
//! connections subscribe to get a snapshot followed by every later delta.
//!
//! One mutex guards mirrors, pending deltas and subscribers together, so a new subscriber's
//! snapshot and the deltas it receives afterwards cannot overlap or leave a hole: pending
//! deltas are flushed to the existing subscribers *before* the snapshot is cut.
//!
//! Deltas are "net" within a batch window: a reset or `AllBlocksCleared` drops the pending
//! events before it. A subscriber whose queue is full is dropped (its connection then
//! reconnects and starts over from a snapshot) rather than buffering without bound.
//!
//! The replica set can change while running ([`Hub::set_replicas`]: discovery, a config
//! reload). The index learns which replicas an agent claims from the `Hello` of each stream, so
//! a change ends every subscription (after a reset delta for each removed replica, so the index
//! forgets its blocks at once); the streams reopen with a `Hello` claiming the new set and a
//! fresh snapshot.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::metrics::AgentMetrics;
use super::mirror::ReplicaMirror;
use kvroute_index_api::agent_protocol::event_to_proto;
use kvroute_index_api::api;
use kvroute_index_core::event::{EventBatch, KvEvent};
use kvroute_ingest::{EventSink, ReplicaKey, ResetReason};

/// Rough protobuf size of an event, to keep messages far below gRPC's 4 MiB default.
fn approx_size(event: &KvEvent) -> usize {
    match event {
        KvEvent::BlockStored(s) => 32 + s.block_hashes.len() * 10 + s.token_ids.len() * 5,
        KvEvent::BlockRemoved(r) => 8 + r.block_hashes.len() * 10,
        KvEvent::AllBlocksCleared => 2,
    }
}

#[derive(Debug, Default)]
struct PendingDelta {
    reset: bool,
    events: Vec<KvEvent>,
    bytes: usize,
}

#[derive(Debug)]
struct Subscriber {
    tx: mpsc::Sender<api::AgentMessage>,
}

#[derive(Debug, Default)]
struct HubState {
    mirrors: BTreeMap<Arc<str>, ReplicaMirror>,
    pending: BTreeMap<Arc<str>, PendingDelta>,
    pending_bytes: usize,
    subscribers: Vec<Subscriber>,
    /// Bumped whenever the replica set changes: a subscription of an older generation claims
    /// a stale set.
    generation: u64,
}

/// What an index stream sends on (re)connecting: the `Hello` claims, the snapshot, then the
/// deltas as they come.
#[derive(Debug)]
pub struct Subscription {
    /// The replicas to claim in `Hello` (those the snapshot covers).
    pub replicas: Vec<String>,
    /// Snapshot messages, one or more per replica.
    pub snapshot: Vec<api::AgentMessage>,
    /// Later deltas; closed when the hub drops the subscription (queue full, replica set
    /// changed).
    pub deltas: mpsc::Receiver<api::AgentMessage>,
    /// The replica-set generation the subscription was cut at ([`Hub::generation`]).
    pub generation: u64,
}

/// Limits of the hub.
#[derive(Debug, Clone, Copy)]
pub struct HubLimits {
    /// Blocks mirrored per replica.
    pub max_blocks_per_replica: usize,
    /// Pending delta size (approximate bytes) that triggers an immediate flush.
    pub max_batch_bytes: usize,
    /// Messages queued per subscriber before it is dropped.
    pub subscriber_queue: usize,
}

/// Mirrors + fan-out. Implements [`EventSink`] for the ingest tasks.
#[derive(Debug)]
pub struct Hub {
    state: Mutex<HubState>,
    limits: HubLimits,
    metrics: AgentMetrics,
}

impl Hub {
    /// A hub for `replicas` (their mirrors exist, empty, from the start).
    pub fn new(replicas: &[Arc<str>], limits: HubLimits, metrics: AgentMetrics) -> Self {
        let mut state = HubState::default();
        for replica in replicas {
            state.mirrors.insert(
                Arc::clone(replica),
                ReplicaMirror::new(limits.max_blocks_per_replica),
            );
        }
        Self {
            state: Mutex::new(state),
            limits,
            metrics,
        }
    }

    /// Replica ids mirrored (what the agent claims in `Hello`).
    pub fn replicas(&self) -> Vec<String> {
        self.state
            .lock()
            .mirrors
            .keys()
            .map(|r| r.to_string())
            .collect()
    }

    /// Sorted block hashes of one replica's mirror.
    pub fn block_hashes(&self, replica: &str) -> Option<Vec<u64>> {
        self.state
            .lock()
            .mirrors
            .get(replica)
            .map(ReplicaMirror::hashes)
    }

    /// Sends the pending deltas to every subscriber.
    pub fn flush(&self) {
        let mut state = self.state.lock();
        self.flush_locked(&mut state);
    }

    /// The replica-set generation: changes whenever [`Hub::set_replicas`] changes the set.
    pub fn generation(&self) -> u64 {
        self.state.lock().generation
    }

    /// Makes `replicas` the mirrored set. Mirrors of the others are dropped (the connected
    /// indexes first get a reset delta for each, so they forget its blocks); new ones start
    /// empty. `restarted` are kept replicas whose engine changed (a new pod behind the same
    /// id): their mirrors start over empty, with a reset delta. If the set changed, every
    /// subscription ends (after its queued deltas) so the streams reopen claiming the new set.
    /// Returns whether the set changed.
    pub fn set_replicas(&self, replicas: &[Arc<str>], restarted: &[Arc<str>]) -> bool {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let wanted: std::collections::BTreeSet<&Arc<str>> = replicas.iter().collect();
        let removed: Vec<Arc<str>> = state
            .mirrors
            .keys()
            .filter(|r| !wanted.contains(r))
            .cloned()
            .collect();
        let added: Vec<&Arc<str>> = replicas
            .iter()
            .filter(|r| !state.mirrors.contains_key(*r))
            .collect();
        let changed = !removed.is_empty() || !added.is_empty();
        for replica in removed.iter().chain(restarted) {
            if let Some(mirror) = state.mirrors.get_mut(replica) {
                mirror.clear();
                let pending = state.pending.entry(Arc::clone(replica)).or_default();
                state.pending_bytes -= pending.bytes.min(state.pending_bytes);
                *pending = PendingDelta {
                    reset: true,
                    events: Vec::new(),
                    bytes: 0,
                };
            }
        }
        self.flush_locked(state);
        for replica in &removed {
            state.mirrors.remove(replica);
            self.metrics.forget_replica(replica);
        }
        for replica in restarted {
            self.metrics.set_mirror_blocks(replica, 0);
        }
        for replica in added {
            state.mirrors.insert(
                Arc::clone(replica),
                ReplicaMirror::new(self.limits.max_blocks_per_replica),
            );
            self.metrics.set_mirror_blocks(replica, 0);
        }
        if changed {
            state.generation += 1;
            // Dropping the senders ends each stream once its queued deltas are sent.
            state.subscribers.clear();
        }
        changed
    }

    /// Registers a subscriber: the `Hello` claims and snapshot to send first, the delta queue
    /// after it.
    pub fn subscribe(&self) -> Subscription {
        let mut state = self.state.lock();
        self.flush_locked(&mut state);
        let mut messages = Vec::new();
        for (replica, mirror) in &state.mirrors {
            let chunks = chunk(mirror.snapshot(), self.limits.max_batch_bytes);
            let last = chunks.len().saturating_sub(1);
            let mut sent = 0;
            for (i, events) in chunks.into_iter().enumerate() {
                sent += events.len();
                messages.push(api::AgentMessage {
                    body: Some(api::agent_message::Body::Snapshot(api::Snapshot {
                        replica_id: replica.to_string(),
                        first: i == 0,
                        last: i == last,
                        events: events.iter().map(event_to_proto).collect(),
                    })),
                });
            }
            self.metrics.snapshot_built(mirror.len(), sent);
        }
        // Streams that ended since the last flush (an index that refuses every stream, idle
        // engines) would otherwise pile up one closed sender per reconnect.
        state
            .subscribers
            .retain(|subscriber| !subscriber.tx.is_closed());
        let (tx, rx) = mpsc::channel(self.limits.subscriber_queue);
        state.subscribers.push(Subscriber { tx });
        Subscription {
            replicas: state.mirrors.keys().map(|r| r.to_string()).collect(),
            snapshot: messages,
            deltas: rx,
            generation: state.generation,
        }
    }

    #[cfg(test)]
    fn subscribers(&self) -> usize {
        self.state.lock().subscribers.len()
    }

    fn flush_locked(&self, state: &mut HubState) {
        if state.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut state.pending);
        state.pending_bytes = 0;
        for (replica, delta) in pending {
            let message = api::AgentMessage {
                body: Some(api::agent_message::Body::Delta(api::Delta {
                    replica_id: replica.to_string(),
                    reset: delta.reset,
                    events: delta.events.iter().map(event_to_proto).collect(),
                })),
            };
            state
                .subscribers
                .retain(|subscriber| match subscriber.tx.try_send(message.clone()) {
                    Ok(()) => true,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        self.metrics.subscriber_dropped("queue_full");
                        false
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => false,
                });
            self.metrics.delta_sent(delta.events.len());
        }
    }
}

/// Splits snapshot events into messages of about `max_bytes` (at least one message, possibly
/// empty, so the index always sees `first` and `last`).
fn chunk(events: Vec<KvEvent>, max_bytes: usize) -> Vec<Vec<KvEvent>> {
    let mut chunks = vec![Vec::new()];
    let mut bytes = 0;
    for event in events {
        let size = approx_size(&event);
        if bytes + size > max_bytes && chunks.last().is_some_and(|c| !c.is_empty()) {
            chunks.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        if let Some(last) = chunks.last_mut() {
            last.push(event);
        }
    }
    chunks
}

impl EventSink for Hub {
    fn apply(&self, replica: &ReplicaKey, _seq: u64, batch: EventBatch) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(mirror) = state.mirrors.get_mut(&replica.replica_id) else {
            return;
        };
        let mut forward = Vec::new();
        for event in &batch.events {
            let outcome = mirror.apply(event);
            if outcome.refused_blocks > 0 {
                self.metrics.blocks_refused(outcome.refused_blocks);
            }
            forward.extend(outcome.forward);
        }
        self.metrics
            .set_mirror_blocks(&replica.replica_id, mirror.len());
        let pending = state
            .pending
            .entry(Arc::clone(&replica.replica_id))
            .or_default();
        for event in forward {
            if matches!(event, KvEvent::AllBlocksCleared) {
                // Net change: nothing before a clear matters.
                state.pending_bytes -= pending.bytes.min(state.pending_bytes);
                pending.events.clear();
                pending.bytes = 0;
            }
            let size = approx_size(&event);
            pending.bytes += size;
            state.pending_bytes += size;
            pending.events.push(event);
        }
        if state.pending_bytes >= self.limits.max_batch_bytes {
            self.flush_locked(state);
        }
    }

    fn reset(&self, replica: &ReplicaKey, reason: ResetReason) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(mirror) = state.mirrors.get_mut(&replica.replica_id) else {
            return;
        };
        tracing::info!(replica_id = %replica.replica_id, reason = reason.as_label(), "mirror reset");
        mirror.clear();
        self.metrics.set_mirror_blocks(&replica.replica_id, 0);
        let pending = state
            .pending
            .entry(Arc::clone(&replica.replica_id))
            .or_default();
        state.pending_bytes -= pending.bytes.min(state.pending_bytes);
        *pending = PendingDelta {
            reset: true,
            events: Vec::new(),
            bytes: 0,
        };
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;
    use kvroute_index_core::event::BlockStored;

    fn hub(max_batch_bytes: usize, subscriber_queue: usize) -> Hub {
        let replicas = [Arc::<str>::from("r")];
        let limits = HubLimits {
            max_blocks_per_replica: 100,
            max_batch_bytes,
            subscriber_queue,
        };
        Hub::new(
            &replicas,
            limits,
            AgentMetrics::register(&mut Registry::default()),
        )
    }

    fn key() -> ReplicaKey {
        ReplicaKey {
            replica_id: Arc::from("r"),
            dp_rank: 0,
        }
    }

    fn batch(hash: u64) -> EventBatch {
        EventBatch {
            ts: 0.0,
            dp_rank: None,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![hash],
                token_ids: vec![1, 2],
                block_size: 2,
                ..Default::default()
            })],
        }
    }

    fn delta_of(message: api::AgentMessage) -> api::Delta {
        match message.body {
            Some(api::agent_message::Body::Delta(delta)) => delta,
            other => panic!("expected a delta, got {other:?}"),
        }
    }

    #[test]
    fn snapshot_then_deltas_without_overlap() {
        let hub = hub(1 << 20, 16);
        hub.apply(&key(), 0, batch(1));
        let Subscription {
            snapshot,
            deltas: mut rx,
            ..
        } = hub.subscribe();
        assert_eq!(snapshot.len(), 1);
        let Some(api::agent_message::Body::Snapshot(s)) = &snapshot[0].body else {
            panic!()
        };
        assert!(s.first && s.last);
        assert_eq!(s.events.len(), 1);
        assert!(rx.try_recv().is_err(), "block 1 is in the snapshot only");

        hub.apply(&key(), 1, batch(2));
        hub.reset(&key(), ResetReason::EngineRestart);
        hub.apply(&key(), 0, batch(3));
        hub.flush();
        let delta = delta_of(rx.try_recv().unwrap());
        assert!(delta.reset, "the reset drops what came before it");
        assert_eq!(delta.events.len(), 1);
        assert_eq!(hub.block_hashes("r"), Some(vec![3]));
    }

    #[test]
    fn ended_subscribers_do_not_pile_up_without_deltas() {
        // An index that refuses every stream: the agent subscribes on each reconnect and drops
        // the queue, and with idle engines no flush ever runs to notice.
        let hub = hub(1 << 20, 4);
        for _ in 0..1000 {
            drop(hub.subscribe());
        }
        assert_eq!(hub.subscribers(), 1, "only the last one, not yet noticed");
        let _live = hub.subscribe();
        assert_eq!(hub.subscribers(), 1, "the ended one is gone");
        let _also_live = hub.subscribe();
        assert_eq!(hub.subscribers(), 2, "live subscribers stay");
    }

    #[test]
    fn a_full_subscriber_is_dropped_not_buffered() {
        let hub = hub(1, 1);
        let mut rx = hub.subscribe().deltas;
        hub.apply(&key(), 0, batch(1)); // flushes at once (tiny batch limit): queue now full
        hub.apply(&key(), 1, batch(2)); // dropped: the channel closes
        assert!(rx.try_recv().is_ok());
        assert!(matches!(
            rx.try_recv(),
            Err(mpsc::error::TryRecvError::Disconnected)
        ));
    }

    #[test]
    fn a_new_replica_set_resets_the_removed_and_ends_every_subscription() {
        let hub = hub(1 << 20, 16);
        hub.apply(&key(), 0, batch(1));
        let mut old = hub.subscribe();
        assert_eq!(old.replicas, ["r"]);
        let (r, s) = (Arc::<str>::from("r"), Arc::<str>::from("s"));
        assert!(!hub.set_replicas(std::slice::from_ref(&r), &[]), "same set");
        assert_eq!(hub.generation(), old.generation);

        assert!(hub.set_replicas(std::slice::from_ref(&s), &[]));
        let delta = delta_of(old.deltas.try_recv().unwrap());
        assert_eq!((delta.replica_id.as_str(), delta.reset), ("r", true));
        assert!(delta.events.is_empty(), "the index forgets r's blocks");
        assert!(matches!(
            old.deltas.try_recv(),
            Err(mpsc::error::TryRecvError::Disconnected)
        ));
        assert_ne!(hub.generation(), old.generation);
        assert_eq!(hub.block_hashes("r"), None, "r's mirror is dropped");
        hub.apply(&key(), 1, batch(2)); // a late batch of the removed engine: ignored
        assert_eq!(hub.block_hashes("r"), None);

        let mut new = hub.subscribe();
        assert_eq!(new.replicas, ["s"]);
        assert_eq!(new.snapshot.len(), 1, "s's (empty) snapshot");
        // A restarted engine behind a kept id: its mirror starts over, the index is told.
        let s_key = ReplicaKey {
            replica_id: Arc::clone(&s),
            dp_rank: 0,
        };
        hub.apply(&s_key, 0, batch(3));
        assert!(!hub.set_replicas(std::slice::from_ref(&s), std::slice::from_ref(&s)));
        assert_eq!(hub.block_hashes("s"), Some(vec![]));
        let delta = delta_of(new.deltas.try_recv().unwrap());
        assert!(delta.reset && delta.events.is_empty(), "{delta:?}");
        assert!(new.deltas.try_recv().is_err(), "the stream stays open");
        assert!(!new.deltas.is_closed());
    }
}
