//! Writes seed corpora for the fuzz targets in `fuzz/` (run by `scripts/fuzz.sh`):
//!
//! ```text
//! cargo run -p kvroute-index --features test-util --example fuzz_seeds -- OUT_DIR [CAPTURES_DIR...]
//! ```
//!
//! Seeds come from kvroute's own vLLM-exact encoder (every schema and hash form) and from real
//! vLLM captures (`*.jsonl` in each `CAPTURES_DIR`; by default the project's own
//! `tests/fixtures/vllm/` and, when present, the shared folder's `vllm/captures/`): their live and
//! replay frames, payloads and request bodies. The shared captures are read, never copied
//! anywhere but `OUT_DIR` (which is not committed). Multi-frame seeds use the fuzz crate's
//! format (`fuzz/src/lib.rs`): each frame as a u16 little-endian length, then its bytes.

#![allow(
    clippy::print_stdout,
    reason = "a command-line tool reports what it wrote"
)]

use std::path::{Path, PathBuf};

use kvroute_block_keys::HashValue;
use kvroute_block_keys::testing::{fixture, shared_dir};
use kvroute_index_api::agent_protocol::event_to_proto;
use kvroute_index_api::api;
use kvroute_index_core::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::wire::{self, Encoding, HashForm, Schema};
use kvroute_ingest::testing::zmtp_bytes;
use prost::Message as _;

/// The harness agent of `kvroute_index::server::fuzzing` (same id, token and replicas).
const AGENT_ID: &str = "fuzz-agent";
const TOKEN: &str = "fuzz-token";
const REPLICAS: [&str; 3] = ["engine-a", "engine-b", "engine-c"];

/// Deltas in one agent-stream seed.
const MAX_DELTAS: usize = 24;

/// The fuzz targets seeded here.
const TARGETS: [&str; 5] = [
    "wire_batch",
    "wire_frames",
    "zmtp_frames",
    "agent_message",
    "ext_proc_request",
];

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let out = PathBuf::from(
        args.next()
            .ok_or_else(|| anyhow::anyhow!("usage: fuzz_seeds OUT_DIR [CAPTURES_DIR...]"))?,
    );
    let mut captures: Vec<PathBuf> = args.map(PathBuf::from).collect();
    if captures.is_empty() {
        captures.push(fixture("vllm"));
        captures.extend(shared_dir().map(|dir| dir.join("vllm/captures")));
    }
    let mut seeds = Seeds::new(&out)?;

    let batches = encoder_batches();
    for batch in &batches {
        for schema in Schema::ALL {
            for hashes in [HashForm::Uint, HashForm::SignedInt, HashForm::Bytes] {
                let payload = wire::encode_batch(batch, Encoding { schema, hashes });
                seeds.live_and_replay(&payload, 7)?;
            }
        }
    }
    // The replay end marker.
    seeds.write("wire_frames", &frames(&[b"", &u64::MAX.to_be_bytes(), b""]))?;
    seeds.agent_stream(&batches)?;
    for (endpoint, body) in REQUEST_BODIES {
        seeds.request(endpoint, body.as_bytes())?;
    }

    for dir in &captures {
        if dir.is_dir() {
            seeds.captures(dir)?;
        } else {
            println!("no captures at {}", dir.display());
        }
    }
    println!("{} seeds in {}", seeds.count, out.display());
    Ok(())
}

/// Request bodies of every shape ext-proc parses (endpoint: 0 chat, 1 completions, 2 other).
const REQUEST_BODIES: [(u8, &str); 8] = [
    (
        0,
        r#"{"model":"tiny","messages":[{"role":"user","content":"hello"}]}"#,
    ),
    (
        0,
        r#"{"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"cache_salt":"s"}"#,
    ),
    (1, r#"{"model":"tiny","prompt":"once upon a time"}"#),
    (1, r#"{"model":"tiny","prompt":["a","b"]}"#),
    (1, r#"{"model":"tiny","prompt":[1,2,3,4]}"#),
    (1, r#"{"model":"tiny","prompt":[[1,2],[3]]}"#),
    (2, r#"{"model":"tiny","input":"x"}"#),
    (
        0,
        r#"{"model":"tiny","messages":[],"stream":true,"lora_name":"ad"}"#,
    ),
];

fn encoder_batches() -> Vec<EventBatch> {
    let stored = BlockStored {
        block_hashes: vec![11, 12],
        parent_block_hash: Some(10),
        token_ids: (0..8).collect(),
        block_size: 4,
        medium: Medium::Gpu,
        extra_keys: Some(vec![None, Some(HashValue::Str("salt".into()))]),
        group_idx: Some(0),
        block_digests: Some(vec![vec![1; 32], vec![2; 32]]),
        parent_digest: Some(vec![3; 32]),
        ..BlockStored::default()
    };
    let lora = BlockStored {
        lora_id: Some(3),
        lora_name: Some("adapter".into()),
        parent_block_hash: None,
        parent_digest: None,
        ..stored.clone()
    };
    vec![
        EventBatch {
            ts: 1.5,
            dp_rank: Some(0),
            events: vec![
                KvEvent::BlockStored(stored),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![11],
                    medium: Medium::Cpu,
                    group_idx: None,
                }),
            ],
        },
        EventBatch {
            ts: 2.0,
            dp_rank: None,
            events: vec![KvEvent::BlockStored(lora), KvEvent::AllBlocksCleared],
        },
    ]
}

/// Frames in the fuzz crate's length-prefixed format (longer frames are cut at u16::MAX).
fn frames(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for frame in frames {
        let len = u16::try_from(frame.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend(frame.iter().take(usize::from(len)));
    }
    out
}

struct Seeds {
    out: PathBuf,
    count: usize,
}

impl Seeds {
    fn new(out: &Path) -> anyhow::Result<Self> {
        for target in TARGETS {
            std::fs::create_dir_all(out.join(target))?;
        }
        Ok(Self {
            out: out.to_owned(),
            count: 0,
        })
    }

    /// A seed named by its content's hash, so rerunning overwrites instead of piling up.
    fn write(&mut self, target: &str, data: &[u8]) -> anyhow::Result<()> {
        let name = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(data));
        std::fs::write(self.out.join(target).join(name), data)?;
        self.count += 1;
        Ok(())
    }

    fn live_and_replay(&mut self, payload: &[u8], seq: u64) -> anyhow::Result<()> {
        let seq = seq.to_be_bytes();
        self.write("wire_batch", payload)?;
        // What an engine's PUB and replay ROUTER send over the wire (control byte: socket type
        // and arrival chunk size, see fuzz_targets/zmtp_frames.rs).
        let mut live = vec![0x80];
        live.extend(zmtp_bytes::peer_stream(
            "PUB",
            &[b"kv@engine-a@tiny", &seq, payload],
        ));
        self.write("zmtp_frames", &live)?;
        let mut replay = vec![0x01];
        replay.extend(zmtp_bytes::peer_stream("ROUTER", &[b"", &seq, payload]));
        self.write("zmtp_frames", &replay)?;
        self.write(
            "wire_frames",
            &frames(&[b"kv@engine-a@tiny", &seq, payload]),
        )?;
        self.write("wire_frames", &frames(&[b"", &seq, payload]))?;
        Ok(())
    }

    fn agent_stream(&mut self, batches: &[EventBatch]) -> anyhow::Result<()> {
        let hello = api::AgentMessage {
            body: Some(api::agent_message::Body::Hello(api::Hello {
                agent_id: AGENT_ID.into(),
                token: TOKEN.into(),
                replicas: REPLICAS.iter().map(|r| r.to_string()).collect(),
            })),
        };
        let events = |batch: &EventBatch| -> Vec<api::Event> {
            batch.events.iter().map(event_to_proto).collect()
        };
        // Every message stays far below the format's 64 KiB frames: one batch's events each.
        let mut messages = vec![hello.encode_to_vec()];
        let first = batches.first().map(events).unwrap_or_default();
        for replica in REPLICAS {
            let snapshot = api::Snapshot {
                replica_id: replica.into(),
                first: true,
                last: true,
                events: first.clone(),
            };
            messages.push(
                api::AgentMessage {
                    body: Some(api::agent_message::Body::Snapshot(snapshot)),
                }
                .encode_to_vec(),
            );
        }
        for (i, batch) in batches.iter().enumerate().take(MAX_DELTAS) {
            let delta = api::Delta {
                replica_id: REPLICAS[i % REPLICAS.len()].into(),
                reset: i % 5 == 4,
                events: events(batch),
            };
            messages.push(
                api::AgentMessage {
                    body: Some(api::agent_message::Body::Delta(delta)),
                }
                .encode_to_vec(),
            );
        }
        let refs: Vec<&[u8]> = messages.iter().map(Vec::as_slice).collect();
        self.write("agent_message", &frames(&refs))?;
        // Hello alone and Hello + one message, so short inputs start from valid streams too.
        self.write("agent_message", &frames(&refs[..1]))?;
        self.write("agent_message", &frames(&refs[..2]))?;
        Ok(())
    }

    fn request(&mut self, endpoint: u8, body: &[u8]) -> anyhow::Result<()> {
        let mut seed = vec![endpoint];
        seed.extend_from_slice(body);
        self.write("ext_proc_request", &seed)
    }

    /// Seeds from real vLLM captures (`*.jsonl` records with `frames_hex`; request bodies).
    fn captures(&mut self, dir: &Path) -> anyhow::Result<()> {
        let mut batches = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
                continue;
            }
            let text = std::fs::read_to_string(&path)?;
            for line in text.lines() {
                let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                if let Some(hex_frames) = record["frames_hex"].as_array() {
                    let decoded: Vec<Vec<u8>> = hex_frames
                        .iter()
                        .filter_map(|f| hex::decode(f.as_str()?).ok())
                        .collect();
                    let refs: Vec<&[u8]> = decoded.iter().map(Vec::as_slice).collect();
                    self.write("wire_frames", &frames(&refs))?;
                    let mut wire = vec![0x80];
                    wire.extend(zmtp_bytes::peer_stream("PUB", &refs));
                    self.write("zmtp_frames", &wire)?;
                    if let Some(payload) = decoded.last() {
                        self.write("wire_batch", payload)?;
                        if let Ok(batch) = wire::decode_batch(payload) {
                            batches.push(batch.batch);
                        }
                    }
                }
                if record["kind"] == "request"
                    && let Some(body) = record.get("request_body")
                {
                    let endpoint = match record["endpoint"].as_str() {
                        Some(e) if e.ends_with("/chat/completions") => 0,
                        Some(e) if e.ends_with("/completions") => 1,
                        _ => 2,
                    };
                    self.request(endpoint, body.to_string().as_bytes())?;
                }
            }
        }
        if !batches.is_empty() {
            self.agent_stream(&batches)?;
        }
        println!("captures in {}: {} batches", dir.display(), batches.len());
        Ok(())
    }
}
