//! Hostile ZMTP peers against the real `kvroute-index` and `kvroute-agent` processes, on every
//! socket kind they read: a bound SUB (anyone who can reach it connects), a connected SUB (a
//! malicious "engine" the index subscribes to) and the replay DEALER (a malicious replay ROUTER).
//!
//! Each peer plays the probes that aborted the processes on the `zeromq` crate: a frame header
//! declaring 2^40 bytes before and after the handshake, 64 random bytes, and a 1 GiB frame
//! streamed as fast as the victim takes it. The processes must stay up, drop the peer (the
//! connection is closed from their side), keep their peak memory far below what the peers
//! declared, count each refusal by reason, and keep ingesting from the honest engines.
//!
//! Needs the binaries: `cargo build --bins`.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvroute_ingest::testing::zmtp_bytes::{self, greeting, ready};
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher, PubMode};
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::metrics::{proc_status_kib, sum};
use kvroute_tests::harness::{ChildGuard, http, reserve_port};
use kvroute_tests::stack::binary_dir;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::agent::{index_process, payload, stored};

/// How long a test waits for the victims and the honest engines to reach a state.
fn converge() -> Duration {
    deadline(Duration::from_secs(20))
}
/// How long a probe waits for the victim to close the connection.
fn close_deadline() -> Duration {
    deadline(Duration::from_secs(10))
}
/// The slow 1 GiB frame stops after this many body bytes if the victim never closes.
const SLOW_FRAME_GIVE_UP: usize = 256 << 20;
/// Peak resident memory allowed to a victim process (kB): a fraction of what one probe declares.
const MAX_PEAK_RSS_KB: u64 = 256 << 10;

/// A long command frame declaring 2^40 bytes: the 9 bytes that aborted the index.
const COMMAND_2_40: [u8; 9] = [0x06, 0, 0, 0x01, 0, 0, 0, 0, 0];
/// A long message frame declaring 2^40 bytes.
const MESSAGE_2_40: [u8; 9] = [0x02, 0, 0, 0x01, 0, 0, 0, 0, 0];
/// A long message frame declaring 1 GiB.
const MESSAGE_1_GIB: [u8; 9] = [0x02, 0, 0, 0, 0, 0x40, 0, 0, 0];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Probe {
    /// Greeting, then a 2^40-byte command frame where READY belongs.
    HeaderBeforeHandshake,
    /// Greeting and READY, then a 2^40-byte message frame.
    HeaderAfterReady,
    /// 64 random bytes.
    Garbage,
    /// Greeting and READY, then a 1 GiB frame header and its body as fast as it is taken.
    SlowGigabyte,
}

const PROBES: [Probe; 4] = [
    Probe::HeaderBeforeHandshake,
    Probe::HeaderAfterReady,
    Probe::Garbage,
    Probe::SlowGigabyte,
];

/// What a probe saw.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    /// The victim closed the connection before the deadline.
    closed_by_victim: bool,
    /// Body bytes of the slow frame the victim accepted before closing.
    body_sent: usize,
}

/// 64 deterministic pseudo-random bytes (xorshift).
fn garbage() -> Vec<u8> {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..64)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// Plays `probe` as a peer of type `peer_type` and waits for the victim to close.
async fn play(stream: &mut TcpStream, probe: Probe, peer_type: &str) -> Outcome {
    let mut opening = Vec::new();
    match probe {
        Probe::HeaderBeforeHandshake => {
            opening.extend(greeting());
            opening.extend(COMMAND_2_40);
        }
        Probe::HeaderAfterReady => {
            opening.extend(greeting());
            opening.extend(ready(peer_type));
            opening.extend(MESSAGE_2_40);
        }
        Probe::Garbage => opening.extend(garbage()),
        Probe::SlowGigabyte => {
            opening.extend(greeting());
            opening.extend(ready(peer_type));
            opening.extend(MESSAGE_1_GIB);
        }
    }
    let mut body_sent = 0;
    if stream.write_all(&opening).await.is_ok() && probe == Probe::SlowGigabyte {
        let chunk = vec![0x5a; 64 << 10];
        while body_sent < SLOW_FRAME_GIVE_UP {
            if stream.write_all(&chunk).await.is_err() {
                break;
            }
            body_sent += chunk.len();
        }
    }
    let closed = tokio::time::timeout(close_deadline(), async {
        let mut sink = [0u8; 4096];
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok();
    Outcome {
        closed_by_victim: closed,
        body_sent,
    }
}

/// A listener that plays the probes, in order and then again, on whoever connects: a malicious
/// engine's PUB or replay ROUTER.
struct RogueEngine {
    addr: std::net::SocketAddr,
    outcomes: Arc<Mutex<Vec<(Probe, Outcome)>>>,
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl RogueEngine {
    async fn start(peer_type: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let (outcomes2, stop2) = (Arc::clone(&outcomes), stop.clone());
        tasks.spawn(async move {
            for probe in PROBES.iter().cycle() {
                let accepted = tokio::select! {
                    () = stop2.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut stream, _)) = accepted else {
                    continue;
                };
                let outcome = play(&mut stream, *probe, peer_type).await;
                outcomes2.lock().push((*probe, outcome));
            }
        });
        Self {
            addr,
            outcomes,
            stop,
            tasks,
        }
    }

    fn endpoint(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    fn played(&self) -> usize {
        self.outcomes.lock().len()
    }

    /// Every probe was played at least once.
    fn played_all(&self) -> bool {
        let outcomes = self.outcomes.lock();
        PROBES
            .iter()
            .all(|probe| outcomes.iter().any(|(p, _)| p == probe))
    }

    async fn shutdown(self) -> Vec<(Probe, Outcome)> {
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        std::mem::take(&mut *self.outcomes.lock())
    }
}

/// Every probe was refused by the victim closing the connection, and the slow frame was cut off
/// long before its declared size.
fn assert_refused(what: &str, outcomes: &[(Probe, Outcome)]) {
    let mut seen = BTreeMap::new();
    for (probe, outcome) in outcomes {
        assert!(outcome.closed_by_victim, "{what}: {probe:?} left open");
        assert!(
            outcome.body_sent < SLOW_FRAME_GIVE_UP,
            "{what}: {probe:?}: the victim took {} bytes of a frame it should refuse from its header",
            outcome.body_sent
        );
        seen.insert(*probe, ());
    }
    assert_eq!(seen.len(), PROBES.len(), "{what}: not every probe played");
}

/// A hand-written ZMTP PUB connected to `endpoint` (`tcp://host:port`): it ignores what the
/// subscriber sends, subscriptions included.
async fn raw_publisher(endpoint: &str) -> TcpStream {
    let addr = endpoint.strip_prefix("tcp://").unwrap().to_owned();
    let mut stream = poll_until("the bound SUB accepts", converge(), || async {
        TcpStream::connect(&addr).await.ok()
    })
    .await;
    let mut hello = greeting();
    hello.extend(ready("PUB"));
    stream.write_all(&hello).await.unwrap();
    stream
}

/// An index config with the tests' one pool (synthetic hashes: validation off) and `replicas`
/// (YAML list items).
fn index_yaml(replicas: &str) -> String {
    format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}, verify_hashes: off}}
replicas:
{replicas}"#
    )
}

/// An honest engine whose PUB connects to a socket the index binds.
async fn connecting_publisher(endpoint: String, topic: &str) -> MockVllmPublisher {
    MockVllmPublisher::start(MockPublisherConfig {
        endpoint,
        mode: PubMode::Connect,
        replay_endpoint: None,
        topic: topic.into(),
        ..MockPublisherConfig::loopback()
    })
    .await
    .unwrap()
}

/// A port for a socket the index binds after the test picked it ([`reserve_port`]).
fn free_port() -> u16 {
    reserve_port().unwrap()
}

async fn text(url: &str) -> String {
    http::get(url).await.map(|r| r.text()).unwrap_or_default()
}

/// Blocks the index holds for `id`, from `/v1/replicas`.
async fn index_blocks(admin: &str, id: &str) -> Option<u64> {
    let body: Value = http::get(&format!("{admin}/v1/replicas"))
        .await
        .ok()?
        .json()
        .ok()?;
    body.as_array()?
        .iter()
        .find(|r| r["id"] == id)?
        .get("blocks")?
        .as_u64()
}

fn batch(hashes: &[u64]) -> Vec<u8> {
    payload(stored(hashes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_survives_hostile_peers_on_every_socket_kind() {
    let honest = MockVllmPublisher::bind_loopback().await.unwrap();
    // An honest live stream whose replay ROUTER is hostile: every catch-up or gap repair meets it.
    let honest_live = MockVllmPublisher::start(MockPublisherConfig {
        replay_endpoint: None,
        ..MockPublisherConfig::loopback()
    })
    .await
    .unwrap();
    let rogue_pub = RogueEngine::start("PUB").await;
    let rogue_router = RogueEngine::start("ROUTER").await;
    let bound = format!("127.0.0.1:{}", free_port());
    let yaml = index_yaml(&format!(
        r#"  - {{id: honest, pool: tiny, events: {{endpoint: "{}", replay_endpoint: "{}"}}}}
  - {{id: bound, pool: tiny, events: {{endpoint: "tcp://{bound}", mode: bind}}}}
  - {{id: rogue-pub, pool: tiny, events: {{endpoint: "{}"}}}}
  - {{id: rogue-replay, pool: tiny, events: {{endpoint: "{}", replay_endpoint: "{}"}}}}
"#,
        honest.pub_endpoint().unwrap(),
        honest.replay_endpoint().unwrap(),
        rogue_pub.endpoint(),
        honest_live.pub_endpoint().unwrap(),
        rogue_router.endpoint(),
    ));
    let mut index = index_process(&yaml).await;
    let admin = index.admin_url();

    // The bound SUB: anyone can connect and play every probe.
    let mut bound_outcomes = Vec::new();
    for probe in PROBES {
        let mut stream = poll_until("the bound SUB accepts", converge(), || async {
            TcpStream::connect(&bound).await.ok()
        })
        .await;
        bound_outcomes.push((probe, play(&mut stream, probe, "PUB").await));
    }
    // The connected SUB reconnects (with backoff) to the rogue PUB and meets every probe.
    try_poll_until(
        "every probe played on the connected SUB",
        converge(),
        || async { rogue_pub.played_all().then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", index.log()));
    // The replay DEALER meets the rogue ROUTER at each gap on the honest live stream.
    let mut hash = 1_000;
    try_poll_until(
        "every probe played on the replay DEALER",
        converge(),
        || {
            hash += 2;
            let (live, played) = (&honest_live, rogue_router.played_all());
            async move {
                if played {
                    return Some(());
                }
                live.skip_seq(batch(&[hash])).await;
                live.publish(batch(&[hash + 1])).await.ok()?;
                None
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", index.log()));

    assert!(
        index.exited().is_none(),
        "kvroute-index died:\n{}",
        index.log()
    );
    assert_refused("bound SUB", &bound_outcomes);
    let played_pub = rogue_pub.played();
    assert_refused("connected SUB", &rogue_pub.shutdown().await);
    assert_refused("replay DEALER", &rogue_router.shutdown().await);
    assert!(played_pub >= PROBES.len());
    let peak = proc_status_kib(index.pid().unwrap(), "VmHWM").unwrap();
    assert!(peak < MAX_PEAK_RSS_KB, "kvroute-index peaked at {peak} kB");

    // Every refusal is counted by reason, per replica.
    let metrics = text(&format!("{admin}/metrics")).await;
    let refused = "kvroute_index_ingest_refused_total";
    for (replica, reasons) in [
        ("bound", &["oversized", "handshake"][..]),
        ("rogue-pub", &["oversized", "handshake"][..]),
        ("rogue-replay", &["oversized", "handshake"][..]),
    ] {
        for reason in reasons {
            let labels = [
                &format!("replica_id=\"{replica}\"")[..],
                &format!("reason=\"{reason}\""),
            ];
            assert!(
                sum(&metrics, refused, &labels) >= 1.0,
                "{replica} {reason} not counted in\n{metrics}"
            );
        }
    }

    // Honest engines keep ingesting, on the attacked bound socket too.
    let engine_on_bound = connecting_publisher(format!("tcp://{bound}"), "").await;
    try_poll_until("honest engines indexed", converge(), || async {
        // PUB/SUB drops what is sent before the subscription arrives: repeat until it lands.
        let _ = engine_on_bound.publish(batch(&[7, 8])).await;
        let _ = honest.publish(batch(&[1, 2, 3])).await;
        let honest_blocks = index_blocks(&admin, "honest").await?;
        let bound_blocks = index_blocks(&admin, "bound").await?;
        (honest_blocks >= 3 && bound_blocks >= 2).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", index.log()));
    assert!(
        index.exited().is_none(),
        "kvroute-index died:\n{}",
        index.log()
    );
    engine_on_bound.shutdown().await;
    honest.shutdown().await;
    honest_live.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_mode_refuses_peers_outside_the_allow_list_and_foreign_topics() {
    let bound = format!("127.0.0.1:{}", free_port());
    // Both sockets have an allow-list: `guarded` admits only 127.0.0.2, so the test's peers (from
    // 127.0.0.1) are refused; `open` admits loopback and checks the topic.
    let yaml = index_yaml(&format!(
        r#"  - {{id: guarded, pool: tiny, events: {{endpoint: "tcp://{bound}", mode: bind, allowed_peers: ["127.0.0.2"]}}}}
  - {{id: open, pool: tiny, events: {{endpoint: "tcp://127.0.0.1:{open_port}", mode: bind, topic: "kv@open", allowed_peers: ["127.0.0.0/8"]}}}}
"#,
        open_port = free_port(),
    ));
    let index = index_process(&yaml).await;
    let admin = index.admin_url();
    let open_endpoint = yaml
        .lines()
        .find(|l| l.contains("id: open"))
        .and_then(|l| l.split('"').nth(1))
        .unwrap()
        .to_owned();

    // A rogue publisher from a refused address: dropped at once, its forged batch never read.
    let refused = "kvroute_index_ingest_refused_total";
    let mut rogue = raw_publisher(&format!("tcp://{bound}")).await;
    let _ = rogue
        .write_all(&zmtp_bytes::message(&[
            b"",
            &0u64.to_be_bytes(),
            &batch(&[66]),
        ]))
        .await;
    let outcome_closed = tokio::time::timeout(close_deadline(), async {
        let mut sink = [0u8; 256];
        while matches!(rogue.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await
    .is_ok();
    assert!(outcome_closed, "the refused peer was left connected");
    poll_until("the refusal is counted", converge(), || async {
        let metrics = text(&format!("{admin}/metrics")).await;
        let labels = ["replica_id=\"guarded\"", "reason=\"not_allowed\""];
        (sum(&metrics, refused, &labels) == 1.0).then_some(())
    })
    .await;

    // A publisher on the right socket that ignores the subscription, as a rogue PUB may: its
    // message with another replica's topic is refused; the right topic is applied.
    let impostor = Arc::new(tokio::sync::Mutex::new(raw_publisher(&open_endpoint).await));
    let mut seq = 0u64;
    poll_until("the foreign topic is refused", converge(), || {
        seq += 1;
        let message = zmtp_bytes::message(&[b"kv@other", &seq.to_be_bytes(), &batch(&[77])]);
        let (impostor, admin) = (Arc::clone(&impostor), admin.clone());
        async move {
            impostor.lock().await.write_all(&message).await.ok()?;
            let metrics = text(&format!("{admin}/metrics")).await;
            (sum(
                &metrics,
                refused,
                &["replica_id=\"open\"", "reason=\"topic_mismatch\""],
            ) >= 1.0)
                .then_some(())
        }
    })
    .await;
    drop(impostor);
    let engine = connecting_publisher(open_endpoint, "kv@open").await;
    poll_until("the right topic is applied", converge(), || async {
        let _ = engine.publish(batch(&[88])).await;
        (index_blocks(&admin, "open").await? >= 1).then_some(())
    })
    .await;
    assert_eq!(
        index_blocks(&admin, "guarded").await,
        Some(0),
        "forged blocks indexed"
    );
    let metrics = text(&format!("{admin}/metrics")).await;
    assert!(
        sum(
            &metrics,
            "kvroute_index_ingest_batches_applied_total",
            &["replica_id=\"guarded\""]
        ) == 0.0
    );
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_survives_a_hostile_engine() {
    let dir = tempfile::tempdir().unwrap();
    let honest = MockVllmPublisher::bind_loopback().await.unwrap();
    let rogue_pub = RogueEngine::start("PUB").await;
    let token = dir.path().join("token");
    std::fs::write(&token, "secret").unwrap();
    let config = dir.path().join("agent.yaml");
    std::fs::write(
        &config,
        format!(
            r#"
agent_id: node-a
token_file: "{}"
indexes: ["http://127.0.0.1:1"]
admin: 127.0.0.1:0
engines:
  - {{replica: honest, endpoint: "{}", replay_endpoint: "{}"}}
  - {{replica: rogue, endpoint: "{}"}}
"#,
            token.display(),
            honest.pub_endpoint().unwrap(),
            honest.replay_endpoint().unwrap(),
            rogue_pub.endpoint(),
        ),
    )
    .unwrap();
    let ready = dir.path().join("agent.ready");
    let mut command = Command::new(binary_dir(None).join("kvroute-agent"));
    command
        .arg("--config")
        .arg(&config)
        .arg("--ready-file")
        .arg(&ready);
    let mut agent =
        ChildGuard::spawn("kvroute-agent", command, dir.path().join("agent.log")).unwrap();
    let admin = try_poll_until("agent ready file", converge(), || async {
        let text = std::fs::read_to_string(&ready).ok()?;
        Some(format!("http://{}", text.trim().strip_prefix("admin=")?))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));

    try_poll_until("every probe played on the agent", converge(), || async {
        rogue_pub.played_all().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));
    assert!(
        agent.exited().is_none(),
        "kvroute-agent died:\n{}",
        agent.log()
    );
    assert_refused("agent SUB", &rogue_pub.shutdown().await);
    let peak = proc_status_kib(agent.id(), "VmHWM").unwrap();
    assert!(peak < MAX_PEAK_RSS_KB, "kvroute-agent peaked at {peak} kB");
    let metrics = text(&format!("{admin}/metrics")).await;
    assert!(
        sum(
            &metrics,
            "kvroute_agent_ingest_refused_total",
            &["replica_id=\"rogue\""]
        ) >= 2.0,
        "{metrics}"
    );

    // The honest engine is still mirrored.
    try_poll_until("honest engine mirrored", converge(), || async {
        let _ = honest.publish(batch(&[5, 6])).await;
        let body = http::get(&format!("{admin}/debug/replicas/honest/blocks"))
            .await
            .ok()?
            .json()
            .ok()?;
        (body["blocks"].as_array()?.len() >= 2).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));
    assert!(
        agent.exited().is_none(),
        "kvroute-agent died:\n{}",
        agent.log()
    );
    honest.shutdown().await;
}
