//! Shared helpers: simulator configs, KV event collection over the replay socket.

use std::collections::BTreeSet;
use std::time::Duration;

use clap::Parser as _;
use kvroute_index_core::event::{EventBatch, KvEvent};
use kvroute_index_core::wire::{self, Encoding, ReplayItem};
use kvroute_ingest::testing::MockVllmPublisher;
use kvroute_test_support::{deadline, poll_until};
use kvroute_tests::harness::{http, metrics, tiny_model_dir};
use kvroute_tests::sim::{EngineSim, SimArgs, SimConfig};
use kvroute_tests::stack::Stack;
use zeromq::{DealerSocket, Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

pub const SIM_BIN: &str = env!("CARGO_BIN_EXE_kvroute-engine-sim");

/// A chat template unlike the tiny model's (kvroute's) in a way that breaks prefix reuse: it
/// starts every prompt with the conversation's length, so a conversation's next turn never
/// shares a block with its last (as templates that render history depending on later messages
/// do). For a sim's `--chat-template`.
pub const HISTORY_UNSTABLE_TEMPLATE: &str = "{{ bos_token }}{{ '<|conversation|>' + \
    (messages | length) | string + ' messages\n' }}{% for message in messages %}{{ '<|' + \
    message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}{% endfor %}\
    {% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}";

/// Flags for a fast simulator with events on loopback (port 0) plus `extra`.
pub fn sim_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--model",
        &tiny_model_dir().display().to_string(),
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--python-hash-seed",
        "0",
        "--block-size",
        "32",
        "--time-scale",
        "0.01",
        "--kv-events-config",
        r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0", "topic": "kv@sim@tiny"}"#,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// An in-process simulator.
pub async fn start_sim(extra: &[&str]) -> EngineSim {
    let mut argv = vec!["kvroute-engine-sim".to_owned()];
    argv.extend(sim_args(extra));
    let config = SimConfig::try_from(SimArgs::parse_from(argv)).unwrap();
    EngineSim::start(config).await.unwrap()
}

/// Every batch still in the replay buffer, from seq 0, via a DEALER (vLLM's replay protocol).
pub async fn replay_all(endpoint: &str) -> Vec<(u64, EventBatch)> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    let request: Vec<bytes::Bytes> = wire::replay_request(0)
        .into_iter()
        .map(bytes::Bytes::from)
        .collect();
    dealer
        .send(ZmqMessage::try_from(request).unwrap())
        .await
        .unwrap();
    let mut batches = Vec::new();
    loop {
        let reply = tokio::time::timeout(deadline(Duration::from_secs(10)), dealer.recv())
            .await
            .expect("replay reply in time")
            .unwrap()
            .into_vec();
        match wire::parse_replay_frames(&reply).unwrap() {
            ReplayItem::Batch { seq, payload } => {
                let decoded = wire::decode_batch(payload).unwrap();
                assert_eq!(decoded.unknown_events, 0);
                batches.push((seq, decoded.batch));
            }
            ReplayItem::End => return batches,
        }
    }
}

/// Polls the replay buffer until its events satisfy `done`; returns them flattened.
pub async fn events_until(endpoint: &str, done: impl Fn(&[KvEvent]) -> bool) -> Vec<KvEvent> {
    poll_until("kv events", deadline(Duration::from_secs(10)), || async {
        let events: Vec<KvEvent> = replay_all(endpoint)
            .await
            .into_iter()
            .flat_map(|(_, b)| b.events)
            .collect();
        done(&events).then_some(events)
    })
    .await
}

pub fn stored(events: &[KvEvent]) -> Vec<&kvroute_index_core::event::BlockStored> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

pub fn removed_hashes(events: &[KvEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// The value of the sample written exactly `series` (`name{labels}`, or a bare name); panics,
/// printing the text, when it is absent.
pub fn metric(text: &str, series: &str) -> f64 {
    metrics::sample(text, series).unwrap_or_else(|| panic!("no metric {series} in\n{text}"))
}

/// The sum of `family`'s samples, whatever their labels; panics, printing the text, when it has
/// none.
pub fn family_total(text: &str, family: &str) -> f64 {
    let values: Vec<f64> = metrics::samples(text, family, &[])
        .map(|(_, v)| v)
        .collect();
    assert!(!values.is_empty(), "no metric {family} in\n{text}");
    values.iter().sum()
}

/// The tokens kvroute-ext-proc's decision path computes for a request body sent to `path`: its
/// body parser, a fresh token cache (so the whole prompt is tokenized) and `tokenizer`. Panics
/// naming `case` when ext-proc refuses the body or tokenization fails.
pub async fn decision_path_tokens(
    tokenizer: &std::sync::Arc<dyn kvroute_ext_proc::tokenizer::Tokenizer>,
    tasks: &tokio_util::task::TaskTracker,
    wire: &str,
    path: &str,
    case: &str,
) -> kvroute_ext_proc::tokenizer::PromptTokens {
    use kvroute_ext_proc::request::{Endpoint, parse};
    let parsed = parse(wire.as_bytes(), Endpoint::from_path(path))
        .unwrap_or_else(|e| panic!("{case}: ext-proc refused {wire}: {e}"));
    let cache = kvroute_ext_proc::tokenizer::TokenCache::new(
        kvroute_ext_proc::tokenizer::TokenLimits::default(),
        tasks.clone(),
    );
    cache
        .tokens(
            0,
            &parsed.model,
            &parsed.prompt,
            Some(tokenizer),
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("{case}: in-process tokenization failed: {e}"))
}

/// The hashes a sim holds (its own `/debug/blocks`); `None` if it cannot be read.
pub async fn sim_blocks(sim_url: &str) -> Option<BTreeSet<u64>> {
    let answer = http::get(&format!("{sim_url}/debug/blocks"))
        .await
        .ok()?
        .json()
        .ok()?;
    answer["blocks"]
        .as_array()?
        .iter()
        .map(|b| b["hash"].as_u64())
        .collect()
}

/// The hashes the index at `admin_url` lists for replica `id`; `None` if it cannot be read.
pub async fn index_blocks(admin_url: &str, id: &str) -> Option<BTreeSet<u64>> {
    let response = http::get(&format!("{admin_url}/v1/replicas/{id}/blocks"))
        .await
        .ok()?;
    if !response.status.is_success() {
        return None;
    }
    response.json().ok()?["blocks"]
        .as_array()?
        .iter()
        .map(serde_json::Value::as_u64)
        .collect()
}

/// Waits until kvroute-index holds every block replica `replica`'s sim holds (and it holds some).
pub async fn until_indexed(stack: &Stack, replica: usize) {
    let admin = stack.index_admin_url().unwrap();
    let id = &stack.replica_ids()[replica];
    let sim = &stack.sim_urls()[replica];
    poll_until(
        &format!("{id}: the index holds the engine's blocks"),
        deadline(Duration::from_secs(20)),
        || async {
            let (held, indexed) = (sim_blocks(sim).await?, index_blocks(&admin, id).await?);
            (!held.is_empty() && held.is_subset(&indexed)).then_some(())
        },
    )
    .await;
}

/// Waits out ZMQ's subscription handshake between `publisher` and the index at `admin` (its
/// replica `replica`). A PUB socket drops what it publishes before it has read a new
/// subscriber's subscription, and the index's catch-up replay at connect (after which it says
/// the replica is ready) can come first: a batch published in between is lost with no later
/// batch to reveal the gap. So an empty batch is published until the index counts one received
/// live from the replica; what is published after it arrives. (Each takes a sequence number.)
pub async fn until_received_live(
    admin: std::net::SocketAddr,
    replica: &str,
    dp_rank: u32,
    publisher: &MockVllmPublisher,
) {
    let empty = wire::encode_batch(
        &EventBatch {
            ts: 0.0,
            dp_rank: Some(dp_rank),
            events: Vec::new(),
        },
        Encoding::V0_32,
    );
    let label = format!("replica_id=\"{replica}\"");
    poll_until(
        "the index to receive a batch live",
        deadline(Duration::from_secs(15)),
        || async {
            publisher.publish(empty.clone()).await.ok()?;
            let text = http::get(&format!("http://{admin}/metrics"))
                .await
                .ok()?
                .text();
            (metrics::sum(
                &text,
                "kvroute_index_ingest_messages_received_total",
                &[&label],
            ) > 0.0)
                .then_some(())
        },
    )
    .await;
}
