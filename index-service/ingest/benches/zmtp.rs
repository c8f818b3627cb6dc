//! Receive throughput of kvroute's SUB socket against the `zeromq` crate's (the transport it
//! replaced), same bytes, same run, interleaved.
//!
//! A minimal publisher on loopback speaks ZMTP 3.0 by hand and writes pre-encoded vLLM-shaped
//! messages (`[topic, seq, payload]`, the payload a real vLLM 0.32 batch of 64 stored blocks) as
//! fast as the socket takes them; each side subscribes and receives `MESSAGES` of them. Reports
//! messages/s and MB/s for both and their ratio.
//!
//! `cargo bench -p kvroute-ingest --features test-util --bench zmtp`

#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::disallowed_methods,
    reason = "benchmark: setup failures abort the run, results go to stdout, the publisher task is joined"
)]

use std::time::{Duration, Instant};

use kvroute_index_core::event::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::wire::{Encoding, encode_batch};
use kvroute_ingest::testing::zmtp_bytes;
use kvroute_ingest::zmtp::{Endpoint, Limits, SubEvent, SubSocket};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use zeromq::{Socket as _, SocketRecv as _};

const MESSAGES: usize = 100_000;
const ROUNDS: usize = 5;

fn payload() -> Vec<u8> {
    let hashes: Vec<u64> = (0..64u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    encode_batch(
        &EventBatch {
            ts: 1.0,
            dp_rank: Some(0),
            events: vec![KvEvent::BlockStored(BlockStored {
                token_ids: (0..64 * 16).map(|t| t * 37 % 151_936).collect(),
                block_hashes: hashes,
                block_size: 16,
                medium: Medium::Gpu,
                ..BlockStored::default()
            })],
        },
        Encoding::V0_32,
    )
}

/// Serves one subscriber: handshake, then `MESSAGES` pre-encoded messages.
async fn publish_once(listener: &TcpListener, messages: &[u8]) {
    let (mut stream, _) = listener.accept().await.unwrap();
    let mut hello = zmtp_bytes::greeting();
    hello.extend(zmtp_bytes::ready("PUB"));
    stream.write_all(&hello).await.unwrap();
    // The subscriber's greeting, READY and subscription: read and ignored.
    let mut peer = [0u8; 64];
    stream.read_exact(&mut peer).await.unwrap();
    stream.write_all(messages).await.unwrap();
    // Keep the connection until the subscriber is done (it closes first).
    let mut sink = [0u8; 1024];
    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
}

async fn receive_kvroute(endpoint: &str) -> Duration {
    let mut socket = SubSocket::connect(&Endpoint::parse(endpoint).unwrap(), "", Limits::default())
        .await
        .unwrap();
    let start = Instant::now();
    let mut received = 0;
    while received < MESSAGES {
        if let SubEvent::Message(frames) = socket.recv().await.unwrap() {
            assert_eq!(frames.len(), 3);
            received += 1;
        }
    }
    start.elapsed()
}

async fn receive_zeromq(endpoint: &str) -> Duration {
    let mut socket = zeromq::SubSocket::new();
    socket.subscribe("").await.unwrap();
    socket.connect(endpoint).await.unwrap();
    let start = Instant::now();
    for _ in 0..MESSAGES {
        let message = socket.recv().await.unwrap();
        assert_eq!(message.len(), 3);
    }
    start.elapsed()
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let payload = payload();
    let mut stream = Vec::with_capacity(MESSAGES * (payload.len() + 32));
    for seq in 0..MESSAGES as u64 {
        stream.extend(zmtp_bytes::message(&[b"", &seq.to_be_bytes(), &payload]));
    }
    let bytes_per_message = stream.len() / MESSAGES;
    println!(
        "zmtp receive: {MESSAGES} messages of {bytes_per_message} bytes (payload {} bytes), {ROUNDS} interleaved rounds",
        payload.len()
    );
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        for _ in 0..ROUNDS {
            for kvroute in [true, false] {
                let publisher = async { publish_once(&listener, &stream).await };
                let receiver = async {
                    if kvroute {
                        receive_kvroute(&endpoint).await
                    } else {
                        receive_zeromq(&endpoint).await
                    }
                };
                let ((), elapsed) = tokio::join!(publisher, receiver);
                if kvroute {
                    ours.push(elapsed);
                } else {
                    theirs.push(elapsed);
                }
            }
        }
    });
    let median = |times: &mut Vec<Duration>| {
        times.sort();
        times[times.len() / 2]
    };
    let (ours, theirs) = (median(&mut ours), median(&mut theirs));
    let rate = |d: Duration| MESSAGES as f64 / d.as_secs_f64();
    let mbps = |d: Duration| (MESSAGES * bytes_per_message) as f64 / d.as_secs_f64() / 1e6;
    println!(
        "kvroute zmtp   {:>10.0} msg/s {:>8.1} MB/s (median of {ROUNDS})",
        rate(ours),
        mbps(ours)
    );
    println!(
        "zeromq crate   {:>10.0} msg/s {:>8.1} MB/s (median of {ROUNDS})",
        rate(theirs),
        mbps(theirs)
    );
    println!(
        "ratio kvroute / zeromq: {:.2}x messages per second",
        rate(ours) / rate(theirs)
    );
}
