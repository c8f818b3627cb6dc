//! Sequence-number bookkeeping for one publisher: in order, duplicate, restart or gap.
//!
//! Pure state, no I/O, so every transition is unit-tested here.

use std::collections::VecDeque;

/// How many recently applied messages are remembered to recognise a duplicate.
///
/// ZMQ PUB/SUB never redelivers, so a repeat can only come from a second publisher on the same
/// socket or a bug; remembering the payload fingerprint means an engine restart that happens to
/// reuse a recent sequence number is not mistaken for one.
pub const DUPLICATE_WINDOW: usize = 64;

/// What to do with a message, given what was applied before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The first message of the stream: apply it and start counting from it.
    First,
    /// The first message this tracker ever sees, and the engine published batches `0..seq`
    /// before it: catch up on them (replay from 0) before applying it. Asked once per tracker:
    /// after [`SequenceTracker::caught_up`] (whatever the outcome), a resync or any applied
    /// message, a fresh stream start is [`Verdict::First`].
    Joined,
    /// The expected next message: apply it.
    Next,
    /// Already applied (same sequence number and payload): drop it.
    Duplicate,
    /// The counter went backwards: the engine restarted. Reset, call [`SequenceTracker::restart`],
    /// then classify the message again.
    Restart,
    /// Messages `missing_from..seq` never arrived.
    Gap {
        /// The first missing sequence number.
        missing_from: u64,
    },
}

/// Where the stream stands: which sequence number, if any, the next message must carry.
///
/// The counter is a u64 that vLLM starts at 0 and never wraps in practice, but a peer can send
/// any value: after `u64::MAX` no message can be the next one (`MAX + 1` does not exist), so
/// the position after it is its own state instead of a saturated `MAX` that would accept every
/// repeat of `MAX` as "next".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Position {
    /// Before the first message (or after a resync): any message starts the stream.
    #[default]
    Unstarted,
    /// The next message must carry this sequence number.
    Expect(u64),
    /// `u64::MAX` was applied: every later message is a duplicate of it or a restart.
    PastMax,
}

/// Tracks the last applied sequence number of one publisher.
#[derive(Debug, Default)]
pub(crate) struct SequenceTracker {
    /// The sequence number the next message must carry.
    position: Position,
    /// `(seq, payload fingerprint)` of the last [`DUPLICATE_WINDOW`] applied messages.
    recent: VecDeque<(u64, u64)>,
    /// Whether anything has happened on this stream (applied, caught up, restarted, resynced):
    /// only a fresh tracker asks for a catch-up, so a failing one cannot repeat.
    has_history: bool,
}

impl SequenceTracker {
    pub(crate) fn classify(&self, seq: u64, fingerprint: u64) -> Verdict {
        let expected = match self.position {
            Position::Unstarted => {
                return if seq > 0 && !self.has_history {
                    Verdict::Joined
                } else {
                    Verdict::First
                };
            }
            Position::Expect(expected) => expected,
            // Nothing comes after MAX: whatever arrives is behind the last applied message.
            Position::PastMax => return self.behind(seq, fingerprint),
        };
        if seq == expected {
            Verdict::Next
        } else if seq > expected {
            Verdict::Gap {
                missing_from: expected,
            }
        } else {
            self.behind(seq, fingerprint)
        }
    }

    /// A message at or before the last applied one: a repeat, or a new engine stream.
    fn behind(&self, seq: u64, fingerprint: u64) -> Verdict {
        if self.recent.contains(&(seq, fingerprint)) {
            Verdict::Duplicate
        } else {
            Verdict::Restart
        }
    }

    /// Records that `seq` was applied.
    pub(crate) fn applied(&mut self, seq: u64, fingerprint: u64) {
        self.has_history = true;
        self.position = match seq.checked_add(1) {
            Some(next) => Position::Expect(next),
            None => Position::PastMax,
        };
        if self.recent.len() == DUPLICATE_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, fingerprint));
    }

    /// A new engine stream: it starts at 0 and nothing of the old one counts as a duplicate.
    pub(crate) fn restart(&mut self) {
        self.has_history = true;
        self.position = Position::Expect(0);
        self.recent.clear();
    }

    /// Forgets the stream after an unrecoverable gap: the next message starts it again.
    pub(crate) fn resync(&mut self) {
        self.has_history = true;
        self.position = Position::Unstarted;
        self.recent.clear();
    }

    /// Nothing has happened on this stream yet (a catch-up may run).
    pub(crate) fn is_fresh(&self) -> bool {
        !self.has_history
    }

    /// The catch-up asked for by [`Verdict::Joined`] has run (complete, partial or failed).
    pub(crate) fn caught_up(&mut self) {
        self.has_history = true;
    }

    /// The last applied sequence number and its payload's fingerprint.
    pub(crate) fn last_applied_entry(&self) -> Option<(u64, u64)> {
        self.recent.back().copied()
    }

    /// Forgets everything: the next stream is joined like a first one (catch-up from 0).
    pub(crate) fn forget(&mut self) {
        *self = SequenceTracker::default();
    }

    /// The last applied sequence number.
    pub(crate) fn last_applied(&self) -> Option<u64> {
        self.recent.back().map(|&(seq, _)| seq)
    }

    /// The sequence number the next message must carry: `None` before the stream has started
    /// and after `u64::MAX` (no number can follow it; see [`Self::is_past_max`]).
    pub(crate) fn expected(&self) -> Option<u64> {
        match self.position {
            Position::Expect(expected) => Some(expected),
            Position::Unstarted | Position::PastMax => None,
        }
    }

    /// Whether the stream has started (a message applied, or a restart expecting 0).
    pub(crate) fn has_started(&self) -> bool {
        self.position != Position::Unstarted
    }

    /// Whether `u64::MAX` was the last applied sequence number: every message, live or
    /// replayed, is then at or behind it.
    pub(crate) fn is_past_max(&self) -> bool {
        self.position == Position::PastMax
    }
}

/// Fingerprint of a payload for duplicate detection.
pub(crate) fn fingerprint(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker_after(seqs: &[u64]) -> SequenceTracker {
        let mut tracker = SequenceTracker::default();
        for &seq in seqs {
            tracker.applied(seq, seq.wrapping_mul(10));
        }
        tracker
    }

    #[test]
    fn joining_a_stream_late_asks_for_a_catch_up_once() {
        let mut tracker = SequenceTracker::default();
        assert_eq!(tracker.classify(0, 0), Verdict::First);
        assert_eq!(tracker.classify(4711, 0), Verdict::Joined);
        assert_eq!(tracker.last_applied(), None);
        // A failed catch-up must not be retried by the same message: it starts the stream.
        tracker.caught_up();
        assert_eq!(tracker.classify(4711, 0), Verdict::First);
    }

    #[test]
    fn after_resync_a_late_message_starts_the_stream_without_catch_up() {
        let mut tracker = tracker_after(&[5]);
        tracker.resync();
        assert_eq!(tracker.classify(9, 0), Verdict::First);
        let mut fresh = SequenceTracker::default();
        fresh.resync();
        assert_eq!(fresh.classify(9, 0), Verdict::First);
    }

    #[test]
    fn next_in_order_is_applied() {
        let tracker = tracker_after(&[5, 6]);
        assert_eq!(tracker.classify(7, 0), Verdict::Next);
        assert_eq!(tracker.last_applied(), Some(6));
    }

    #[test]
    fn jump_ahead_is_a_gap_from_the_expected_sequence() {
        let tracker = tracker_after(&[5, 6]);
        assert_eq!(tracker.classify(9, 0), Verdict::Gap { missing_from: 7 });
    }

    #[test]
    fn repeat_with_same_payload_is_a_duplicate() {
        let tracker = tracker_after(&[5, 6, 7]);
        assert_eq!(tracker.classify(6, 60), Verdict::Duplicate);
    }

    #[test]
    fn backwards_with_other_payload_or_zero_is_a_restart() {
        let tracker = tracker_after(&[5, 6, 7]);
        assert_eq!(tracker.classify(6, 61), Verdict::Restart);
        assert_eq!(tracker.classify(0, 0), Verdict::Restart);
        assert_eq!(tracker.classify(2, 20), Verdict::Restart);
    }

    #[test]
    fn duplicates_older_than_the_window_count_as_restart() {
        let seqs: Vec<u64> = (0..(DUPLICATE_WINDOW as u64 + 5)).collect();
        let tracker = tracker_after(&seqs);
        assert_eq!(tracker.classify(1, 10), Verdict::Restart);
        let recent = DUPLICATE_WINDOW as u64;
        assert_eq!(tracker.classify(recent, recent * 10), Verdict::Duplicate);
    }

    #[test]
    fn after_restart_the_new_stream_must_start_at_zero() {
        let mut tracker = tracker_after(&[5, 6, 7]);
        tracker.restart();
        assert_eq!(tracker.classify(0, 0), Verdict::Next);
        assert_eq!(tracker.classify(3, 0), Verdict::Gap { missing_from: 0 });
        // The old stream's payloads are no longer duplicates.
        assert_eq!(tracker.last_applied(), None);
    }

    #[test]
    fn the_message_before_max_expects_max() {
        let tracker = tracker_after(&[u64::MAX - 2, u64::MAX - 1]);
        assert_eq!(tracker.expected(), Some(u64::MAX));
        assert_eq!(tracker.classify(u64::MAX, 0), Verdict::Next);
        assert!(!tracker.is_past_max());
    }

    #[test]
    fn a_jump_to_max_is_a_gap() {
        let tracker = tracker_after(&[5]);
        assert_eq!(
            tracker.classify(u64::MAX, 0),
            Verdict::Gap { missing_from: 6 }
        );
    }

    #[test]
    fn max_as_the_first_message_starts_the_stream() {
        let mut tracker = SequenceTracker::default();
        tracker.caught_up();
        assert_eq!(tracker.classify(u64::MAX, 1), Verdict::First);
        tracker.applied(u64::MAX, 1);
        assert!(tracker.is_past_max());
        assert!(tracker.has_started());
        assert_eq!(tracker.expected(), None);
        assert_eq!(tracker.last_applied(), Some(u64::MAX));
    }

    #[test]
    fn nothing_after_max_is_next() {
        // The old tracker saturated `expected` at MAX, so every repeat of MAX was "next".
        let mut tracker = SequenceTracker::default();
        tracker.applied(u64::MAX - 1, 1);
        tracker.applied(u64::MAX, 2);
        // The same payload again: a duplicate, dropped.
        assert_eq!(tracker.classify(u64::MAX, 2), Verdict::Duplicate);
        assert_eq!(tracker.classify(u64::MAX - 1, 1), Verdict::Duplicate);
        // Another payload under MAX, or anything else: the counter started over.
        assert_eq!(tracker.classify(u64::MAX, 3), Verdict::Restart);
        assert_eq!(tracker.classify(u64::MAX - 1, 3), Verdict::Restart);
        assert_eq!(tracker.classify(0, 0), Verdict::Restart);
        assert_eq!(tracker.classify(7, 0), Verdict::Restart);
    }

    #[test]
    fn a_restart_after_max_expects_zero_and_max_is_then_a_gap() {
        let mut tracker = tracker_after(&[u64::MAX]);
        tracker.restart();
        assert!(!tracker.is_past_max());
        assert_eq!(tracker.expected(), Some(0));
        assert_eq!(tracker.classify(0, 0), Verdict::Next);
        assert_eq!(
            tracker.classify(u64::MAX, 4),
            Verdict::Gap { missing_from: 0 }
        );
    }

    #[test]
    fn a_resync_after_max_starts_over() {
        let mut tracker = tracker_after(&[u64::MAX]);
        tracker.resync();
        assert!(!tracker.has_started());
        assert_eq!(tracker.classify(u64::MAX, 5), Verdict::First);
        assert_eq!(tracker.classify(3, 5), Verdict::First);
    }

    #[test]
    fn max_repeated_with_new_payloads_lands_on_a_reset_replica_every_time() {
        // What the ingest loop does with each verdict, for a peer that sends MAX over and over
        // (the old tracker applied every one of them on top of the last).
        let mut tracker = tracker_after(&[10]);
        let mut reset_since_apply = true;
        for payload in 0..100u64 {
            let mut verdict = tracker.classify(u64::MAX, payload);
            if verdict == Verdict::Restart {
                reset_since_apply = true;
                tracker.restart();
                verdict = tracker.classify(u64::MAX, payload);
            }
            match verdict {
                Verdict::First | Verdict::Next => {
                    assert!(
                        reset_since_apply,
                        "message {payload} applied without a reset"
                    );
                    tracker.applied(u64::MAX, payload);
                    reset_since_apply = false;
                }
                // The batches before MAX cannot be replayed: the replica is reset.
                Verdict::Gap { .. } => {
                    reset_since_apply = true;
                    tracker.resync();
                }
                Verdict::Duplicate | Verdict::Restart | Verdict::Joined => {}
            }
        }
    }

    #[test]
    fn resync_accepts_any_next_message() {
        let mut tracker = tracker_after(&[5, 6, 7]);
        tracker.resync();
        assert_eq!(tracker.classify(42, 0), Verdict::First);
        assert_eq!(tracker.classify(0, 0), Verdict::First);
    }
}
