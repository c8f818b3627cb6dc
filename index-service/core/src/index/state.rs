//! What the index can vouch for about one replica: the state of its event feeds and its flag,
//! folded into one [`ReplicaState`]. Only a [`ReplicaState::Ready`] replica's match is precise.

use super::FlagReason;

/// Where a replica's events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feed {
    /// The engine's ZMQ PUB socket, subscribed to by this index.
    Socket,
    /// A kvroute-agent's stream.
    Agent,
}

/// How one feed of a replica stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FeedState {
    /// Configured, never connected since the index started.
    NeverConnected,
    /// Connected, catching up (replay, snapshot) or checking that the engine's stream is the one
    /// indexed (after a reconnect): what the index holds may not be what the engine holds.
    Syncing,
    /// Connected and caught up: the index follows the engine.
    Ready,
    /// Was connected, is not now: the engine may be gone or restarting.
    Disconnected,
}

impl FeedState {
    /// Which of two feeds keeps a replica more current (either one being ready is enough).
    fn rank(self) -> u8 {
        match self {
            FeedState::Ready => 3,
            FeedState::Syncing => 2,
            FeedState::Disconnected => 1,
            FeedState::NeverConnected => 0,
        }
    }
}

/// A replica as the Match API reports it. Only `Ready` is precise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaState {
    /// Its feed is connected and caught up, nothing flags it: its matches are the engine's.
    Ready,
    /// Catching up (connect, reconnect, engine restart, agent snapshot).
    Syncing,
    /// Its agent has been gone longer than the grace period.
    Stale,
    /// Its feed was connected and is not now.
    Disconnected,
    /// Its feed never connected.
    NeverConnected,
    /// Its events are unusable (hash or block-size mismatch, undecodable stream).
    Flagged(FlagReason),
}

impl ReplicaState {
    /// Whether its matches can be trusted.
    pub fn is_precise(self) -> bool {
        self == ReplicaState::Ready
    }

    /// `ready`, `syncing`, `stale`, `disconnected`, `never_connected`, `flagged` (API text and
    /// metric label).
    pub fn as_label(self) -> &'static str {
        match self {
            ReplicaState::Ready => "ready",
            ReplicaState::Syncing => "syncing",
            ReplicaState::Stale => "stale",
            ReplicaState::Disconnected => "disconnected",
            ReplicaState::NeverConnected => "never_connected",
            ReplicaState::Flagged(_) => "flagged",
        }
    }

    /// Why it is not ready: the flag's label, or the state's (empty when ready).
    pub fn reason(self) -> &'static str {
        match self {
            ReplicaState::Ready => "",
            ReplicaState::Flagged(flag) => flag.as_label(),
            other => other.as_label(),
        }
    }
}

/// The feeds configured for one replica and how each stands. A replica registered without any
/// (the index used as a library: tests, the replay simulator) is judged by its flag alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Feeds {
    pub(crate) socket: Option<FeedState>,
    pub(crate) agent: Option<FeedState>,
}

impl Feeds {
    pub(crate) fn set(&mut self, feed: Feed, state: FeedState) {
        match feed {
            Feed::Socket => self.socket = Some(state),
            Feed::Agent => self.agent = Some(state),
        }
    }

    /// The best of the configured feeds (`None`: no feed configured).
    fn best(self) -> Option<FeedState> {
        match (self.socket, self.agent) {
            (Some(a), Some(b)) => Some(if b.rank() > a.rank() { b } else { a }),
            (one, None) | (None, one) => one,
        }
    }

    /// The replica's state given its flag. The agent plane's flags `Resyncing` (snapshot in
    /// progress) and `Stale` (agent gone past its grace) are states, not stream faults.
    pub(crate) fn state(self, flag: Option<FlagReason>) -> ReplicaState {
        match flag {
            Some(FlagReason::Resyncing) => return ReplicaState::Syncing,
            Some(FlagReason::Stale) => return ReplicaState::Stale,
            Some(flag) => return ReplicaState::Flagged(flag),
            None => {}
        }
        match self.best() {
            None | Some(FeedState::Ready) => ReplicaState::Ready,
            Some(FeedState::Syncing) => ReplicaState::Syncing,
            Some(FeedState::Disconnected) => ReplicaState::Disconnected,
            Some(FeedState::NeverConnected) => ReplicaState::NeverConnected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_ready_feed_without_a_flag_is_precise() {
        assert!(Feeds::default().state(None).is_precise());
        let mut feeds = Feeds::default();
        feeds.set(Feed::Socket, FeedState::NeverConnected);
        assert_eq!(feeds.state(None), ReplicaState::NeverConnected);
        feeds.set(Feed::Socket, FeedState::Syncing);
        assert_eq!(feeds.state(None), ReplicaState::Syncing);
        feeds.set(Feed::Socket, FeedState::Ready);
        assert!(feeds.state(None).is_precise());
        assert_eq!(
            feeds.state(Some(FlagReason::BlockSizeMismatch)),
            ReplicaState::Flagged(FlagReason::BlockSizeMismatch)
        );
        assert_eq!(feeds.state(Some(FlagReason::Stale)), ReplicaState::Stale);
        feeds.set(Feed::Socket, FeedState::Disconnected);
        assert_eq!(feeds.state(None), ReplicaState::Disconnected);
        // Either feed being ready is enough.
        feeds.set(Feed::Agent, FeedState::Ready);
        assert!(feeds.state(None).is_precise());
    }
}
