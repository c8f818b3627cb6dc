//! Pickers sharing their decisions through the index: the `kvroute.index.v1.KvIndex/
//! ShareDecisions` RPC.
//!
//! Every ext-proc replica keeps a stream open and writes what it decides (replica, prompt keys,
//! queued prefill) and when the engine answered; the index relays each message, unchanged, to
//! every other open stream. That is the whole protocol: nothing is stored, ordered across
//! pickers or acknowledged. The index is already the one service every picker talks to, so the
//! relay adds no component; a picker that loses it routes on its own state, as with one picker.
//!
//! Bounds: one relay channel of [`RELAY_CAPACITY`] messages; a stream that reads too slowly
//! skips what it missed (counted `lagged`) rather than growing the index's memory. A message is
//! refused (counted, the stream goes on) when it names no picker, another picker than the
//! stream's first message, or carries more than `MAX_MATCH_KEYS` keys or oversized names.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge};
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use super::grpc::MAX_MATCH_KEYS;
use kvroute_index_api::api;

/// Messages in flight between pickers; a stream further behind than this skips ahead.
pub const RELAY_CAPACITY: usize = 4096;
/// Longest picker id, model name or replica id accepted.
const MAX_NAME_BYTES: usize = 256;

/// What became of a picker's message (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Relayed to the other pickers.
    Relayed,
    /// Malformed or from another picker than its stream's.
    Refused,
    /// Skipped by a stream that read too slowly.
    Lagged,
}

impl Outcome {
    fn as_label(self) -> &'static str {
        match self {
            Self::Relayed => "relayed",
            Self::Refused => "refused",
            Self::Lagged => "lagged",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// The relay every `ShareDecisions` stream joins.
#[derive(Debug)]
pub(crate) struct PeerRelay {
    relay: broadcast::Sender<Arc<api::PickerNews>>,
    streams: Gauge,
    news: Family<OutcomeLabel, Counter>,
    shutdown: CancellationToken,
}

impl PeerRelay {
    pub(crate) fn new(registry: &mut Registry, shutdown: CancellationToken) -> Arc<Self> {
        let streams = Gauge::default();
        registry.register(
            "peer_streams",
            "Pickers connected to share their decisions",
            streams.clone(),
        );
        let news = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "peer_news",
            "Pickers' decision messages: relayed, refused (malformed), lagged (skipped by a slow reader)",
            news.clone(),
        );
        let (relay, _) = broadcast::channel(RELAY_CAPACITY);
        Arc::new(Self {
            relay,
            streams,
            news,
            shutdown,
        })
    }

    fn count(&self, outcome: Outcome, n: u64) {
        self.news
            .get_or_create(&OutcomeLabel {
                outcome: outcome.as_label(),
            })
            .inc_by(n);
    }

    /// The response stream of one picker's `ShareDecisions`: every other picker's news, while
    /// its own are read and relayed.
    pub(crate) fn join(self: &Arc<Self>, inbound: Streaming<api::PickerNews>) -> NewsStream {
        let session = Session {
            relay: Arc::clone(self),
            inbound,
            received: self.relay.subscribe(),
            picker: None,
            _connected: Connected::new(&self.streams),
        };
        Box::pin(futures::stream::unfold(
            Some(session),
            |session| async move {
                let mut session = session?;
                loop {
                    tokio::select! {
                        () = session.relay.shutdown.cancelled() => {
                            let closing = Status::unavailable("kvroute-index is shutting down");
                            return Some((Err(closing), None));
                        }
                        message = session.inbound.message() => match message {
                            Ok(Some(news)) => session.relay_own(news),
                            Ok(None) | Err(_) => return None,
                        },
                        relayed = session.received.recv() => match relayed {
                            Ok(news) if session.picker.as_deref() == Some(news.picker.as_str()) => {}
                            Ok(news) => return Some((Ok((*news).clone()), Some(session))),
                            Err(broadcast::error::RecvError::Lagged(missed)) => {
                                session.relay.count(Outcome::Lagged, missed);
                            }
                            Err(broadcast::error::RecvError::Closed) => return None,
                        },
                    }
                }
            },
        ))
    }
}

/// Another picker's news, as the response stream yields it.
pub(crate) type NewsStream = Pin<Box<dyn Stream<Item = Result<api::PickerNews, Status>> + Send>>;

/// One open stream.
struct Session {
    relay: Arc<PeerRelay>,
    inbound: Streaming<api::PickerNews>,
    received: broadcast::Receiver<Arc<api::PickerNews>>,
    /// The stream's picker, from its first message.
    picker: Option<String>,
    _connected: Connected,
}

impl Session {
    fn relay_own(&mut self, news: api::PickerNews) {
        if !well_formed(&news) {
            self.relay.count(Outcome::Refused, 1);
            return;
        }
        let picker = self.picker.get_or_insert_with(|| news.picker.clone());
        if *picker != news.picker {
            self.relay.count(Outcome::Refused, 1);
            return;
        }
        // No receiver is no error: a lone picker's news reach nobody.
        let _ = self.relay.relay.send(Arc::new(news));
        self.relay.count(Outcome::Relayed, 1);
    }
}

fn well_formed(news: &api::PickerNews) -> bool {
    let name = |s: &str| !s.is_empty() && s.len() <= MAX_NAME_BYTES;
    name(&news.picker)
        && match &news.news {
            Some(api::picker_news::News::Decided(decided)) => {
                name(&decided.model)
                    && name(&decided.replica_id)
                    && decided.keys.len() <= MAX_MATCH_KEYS
            }
            Some(api::picker_news::News::Answered(_)) => true,
            None => false,
        }
}

/// Counts an open stream while it lives.
struct Connected(Gauge);

impl Connected {
    fn new(streams: &Gauge) -> Self {
        streams.inc();
        Self(streams.clone())
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.dec();
    }
}
