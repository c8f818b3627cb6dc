//! SGLang's events on the wire: the project's own captures of SGLang's radix tree and
//! `ZmqEventPublisher` (`tests/fixtures/sglang/capture-sglang-*.jsonl`, recorded by
//! `tests/sglang/record_events.py`: 0.5.19 positional arrays, 0.5.22/0.5.23 maps, 0.5.23 EAGLE
//! bigrams and kv-events format dynamo with an empty topic), and hand-made edge cases.

use std::path::PathBuf;

use kvroute_block_keys::testing::fixture;
use serde_json::Value;

use super::*;
use crate::event::{Engine, KvEvent, Medium, SglangRun, TokenLayout};

const CAPTURES: [&str; 5] = [
    "sglang/capture-sglang-0.5.19-ps16.jsonl",
    "sglang/capture-sglang-0.5.22-ps16.jsonl",
    "sglang/capture-sglang-0.5.23-ps16.jsonl",
    "sglang/capture-sglang-0.5.23-ps16-eagle.jsonl",
    "sglang/capture-sglang-0.5.23-ps32-dynamo.jsonl",
];

fn capture(rel: &str) -> Vec<Value> {
    let path: PathBuf = fixture(rel);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn frames(line: &Value) -> Vec<Vec<u8>> {
    line["frames_hex"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| hex::decode(f.as_str().unwrap()).unwrap())
        .collect()
}

/// What a capture's `decoded` event (msgspec's own decoding, as JSON) says, in domain terms.
fn expected_event(event: &Value) -> Option<KvEvent> {
    // Positional (≤0.5.19): [tag, hashes, parent, tokens, block_size, lora_id, medium, {meta}].
    let field = |name: &str, index: usize| -> Value {
        match event {
            Value::Array(items) => items.get(index).cloned().unwrap_or(Value::Null),
            Value::Object(map) => map.get(name).cloned().unwrap_or(Value::Null),
            _ => panic!("event {event}"),
        }
    };
    let tag = field("type", 0);
    let hashes = |v: Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_i64().unwrap() as u64)
            .collect()
    };
    let medium = Medium::from_wire(field("medium", 6).as_str());
    match tag.as_str().unwrap() {
        "BlockStored" => {
            let salt = match event {
                Value::Array(_) => field("", 7)["cache_salt"].as_str().map(str::to_owned),
                _ => field("cache_salt", 0).as_str().map(str::to_owned),
            };
            let tokens = field("token_ids", 3);
            let tokens = tokens.as_array().unwrap();
            let bigram = tokens.first().is_some_and(Value::is_array);
            let mut raw: Vec<u64> = tokens
                .iter()
                .map(|t| if bigram { &t[0] } else { t })
                .map(|t| t.as_u64().unwrap())
                .collect();
            if bigram {
                raw.push(tokens.last().unwrap()[1].as_u64().unwrap());
            }
            let token_ids = raw
                .iter()
                .take(tokens.len())
                .map(|&t| u32::try_from(t).unwrap_or(u32::MAX))
                .collect();
            let token_layout = if raw.iter().any(|&t| t > u64::from(u32::MAX)) {
                TokenLayout::Wide {
                    tokens: raw,
                    bigram,
                }
            } else if bigram {
                TokenLayout::Bigram {
                    next: *raw.last().unwrap() as u32,
                }
            } else {
                TokenLayout::Plain
            };
            let sglang = (salt.is_some() || token_layout != TokenLayout::Plain).then(|| {
                Box::new(SglangRun {
                    cache_salt: salt,
                    token_layout,
                })
            });
            Some(KvEvent::BlockStored(crate::event::BlockStored {
                block_hashes: hashes(field("block_hashes", 1)),
                parent_block_hash: field("parent_block_hash", 2).as_i64().map(|h| h as u64),
                token_ids,
                block_size: field("block_size", 4).as_u64().unwrap() as u32,
                lora_id: field("lora_id", 5).as_i64(),
                lora_name: match event {
                    Value::Array(_) => None,
                    _ => field("lora_name", 0).as_str().map(str::to_owned),
                },
                medium,
                sglang,
                ..Default::default()
            }))
        }
        "BlockRemoved" => Some(KvEvent::BlockRemoved(crate::event::BlockRemoved {
            block_hashes: hashes(field("block_hashes", 1)),
            medium: Medium::from_wire(field("medium", 2).as_str()),
            group_idx: None,
        })),
        "AllBlocksCleared" => Some(KvEvent::AllBlocksCleared),
        other => panic!("unexpected tag {other}"),
    }
}

fn check_batch(decoded: &DecodedBatch, json: &Value, context: &str) {
    let events: Vec<KvEvent> = json[1]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(expected_event)
        .collect();
    assert_eq!(decoded.batch.events, events, "{context}");
    assert_eq!(decoded.unknown_events, 0, "{context}");
    assert_eq!(
        decoded.batch.dp_rank,
        json[2].as_u64().map(|r| r as u32),
        "{context}"
    );
}

#[test]
fn sglang_captures_decode_live_and_replayed_in_every_release_layout() {
    let mut stores = [0usize; CAPTURES.len()];
    for (file, stores) in CAPTURES.iter().zip(&mut stores) {
        let lines = capture(file);
        let mut replies = 0;
        let mut ends = 0;
        for line in &lines {
            match line["kind"].as_str().unwrap() {
                "zmq_pub" => {
                    let frames = frames(line);
                    let (topic, seq, decoded) =
                        decode_engine_message(Engine::Sglang, &frames).unwrap();
                    assert_eq!(topic, line["topic"].as_str().unwrap());
                    assert_eq!(seq, line["seq"].as_u64().unwrap());
                    check_batch(&decoded, &line["decoded"], file);
                    *stores += decoded
                        .batch
                        .events
                        .iter()
                        .filter(|e| matches!(e, KvEvent::BlockStored(_)))
                        .count();
                }
                "zmq_replay_reply" => match parse_replay_frames(&frames(line)).unwrap() {
                    ReplayItem::Batch { seq, payload } => {
                        assert_eq!(seq, line["seq"].as_u64().unwrap(), "{file}");
                        decode_engine_batch(Engine::Sglang, payload).unwrap();
                        replies += 1;
                    }
                    ReplayItem::End => {
                        assert_eq!(line["seq"], -1, "{file}");
                        ends += 1;
                    }
                },
                _ => {}
            }
        }
        assert!(replies >= 5, "{file}: {replies} replay replies");
        assert_eq!(ends, 1, "{file}");
    }
    assert!(
        stores.iter().all(|&n| n >= 8),
        "stores per capture: {stores:?}"
    );
}

#[test]
fn salted_positional_stores_need_the_sglang_decoder() {
    let lines = capture(CAPTURES[0]);
    let salted = lines
        .iter()
        .find(|line| {
            line["kind"] == "zmq_pub"
                && line["decoded"][1]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|e| e.as_array().is_some_and(|e| e.len() == 8))
        })
        .expect("a salted 0.5.19 store");
    let frames = frames(salted);
    let (_, _, decoded) = decode_engine_message(Engine::Sglang, &frames).unwrap();
    assert!(decoded.batch.events.iter().any(|e| matches!(
        e,
        KvEvent::BlockStored(stored) if stored.cache_salt() == Some("tenant-a")
    )));
    // vLLM's position 7 is `lora_name`, a string: the map is not one.
    assert_eq!(
        decode_message(&frames).map(drop).unwrap_err().as_label(),
        "unexpected_type"
    );
}

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
    fn nil(mut self) -> Self {
        rmp::encode::write_nil(&mut self.0).unwrap();
        self
    }
    /// `[ts, [<one event follows>` — the caller appends it, then the rank.
    fn batch() -> Self {
        Mp::default().arr(3).u(1).arr(1)
    }
    /// A map `BlockStored` with one page of two positions, its tokens written by `tokens`.
    fn stored_with(self, tokens: impl FnOnce(Mp) -> Mp) -> Self {
        let head = self
            .map(5)
            .s("type")
            .s("BlockStored")
            .s("block_hashes")
            .arr(1)
            .i(-2)
            .s("parent_block_hash")
            .nil()
            .s("block_size")
            .u(2)
            .s("token_ids");
        tokens(head)
    }
}

fn decode_sglang(mp: Mp) -> Result<DecodedBatch, WireError> {
    decode_engine_batch(Engine::Sglang, &mp.0)
}

fn only_stored(decoded: DecodedBatch) -> crate::event::BlockStored {
    match decoded.batch.events.as_slice() {
        [KvEvent::BlockStored(stored)] => stored.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn positional_stores_of_seven_and_eight_elements_and_maps_with_omitted_defaults() {
    // 0.5.19: [tag, hashes, parent, tokens, block_size, lora_id, medium] (+ {cache_salt}).
    let positional = |salted: bool| {
        let mp = Mp::batch()
            .arr(if salted { 8 } else { 7 })
            .s("BlockStored")
            .arr(1)
            .i(-7)
            .i(-9)
            .arr(2)
            .u(5)
            .u(6)
            .u(2)
            .nil()
            .s("CPU_PINNED");
        let mp = if salted {
            mp.map(1).s("cache_salt").s("t")
        } else {
            mp
        };
        only_stored(decode_sglang(mp.u(0)).unwrap())
    };
    let plain = positional(false);
    assert_eq!(plain.block_hashes, [-7i64 as u64]);
    assert_eq!(plain.parent_block_hash, Some(-9i64 as u64));
    assert_eq!(plain.token_ids, [5, 6]);
    assert_eq!(plain.medium, Medium::Cpu);
    assert_eq!(plain.sglang, None);
    assert_eq!(positional(true).cache_salt(), Some("t"));

    // 0.5.20+: a map with only what is set; session_id counted as unused.
    let map = Mp::batch()
        .map(8)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .i(-1)
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .arr(1)
        .u(4)
        .s("block_size")
        .u(1)
        .s("cache_salt")
        .s("s")
        .s("session_id")
        .s("abc")
        .s("medium")
        .s("EXTERNAL")
        .u(1);
    let decoded = decode_sglang(map).unwrap();
    assert_eq!(decoded.ignored_fields.session_id, 1);
    assert_eq!(decoded.batch.dp_rank, Some(1));
    let stored = only_stored(decoded);
    assert_eq!(stored.cache_salt(), Some("s"));
    assert_eq!(stored.medium, Medium::Other);
    assert_eq!(Medium::from_wire(Some("DISK")), Medium::Storage);
}

#[test]
fn bigram_pairs_and_tokens_past_u32_keep_what_sglang_hashed() {
    let bigram = Mp::batch()
        .stored_with(|mp| mp.arr(2).arr(2).u(10).u(11).arr(2).u(11).u(12))
        .nil();
    let stored = only_stored(decode_sglang(bigram).unwrap());
    assert_eq!(stored.token_ids, [10, 11]);
    assert_eq!(*stored.token_layout(), TokenLayout::Bigram { next: 12 });
    let mut words = Vec::new();
    stored
        .token_layout()
        .page_words(&stored.token_ids, 0, 2, &mut words)
        .unwrap();
    assert_eq!(words, [10, 11, 11, 12]);

    let wide = 5_000_000_000u64;
    let pads = Mp::batch().stored_with(|mp| mp.arr(2).u(1).u(wide)).nil();
    let stored = only_stored(decode_sglang(pads).unwrap());
    assert_eq!(stored.token_ids, [1, u32::MAX]);
    assert_eq!(
        *stored.token_layout(),
        TokenLayout::Wide {
            tokens: vec![1, wide],
            bigram: false
        }
    );
    assert!(stored.token_layout().is_wide_page(0, 2));
    // vLLM never publishes such ids: its decoder refuses them.
    let pads = Mp::batch().stored_with(|mp| mp.arr(2).u(1).u(wide)).nil();
    assert_eq!(
        decode_batch(&pads.0).unwrap_err().as_label(),
        "int_out_of_range"
    );
}

#[test]
fn malformed_sglang_tokens_are_refused_with_labels() {
    for (what, payload, label) in [
        (
            "pairs that do not chain",
            Mp::batch().stored_with(|mp| mp.arr(2).arr(2).u(1).u(2).arr(2).u(3).u(4)),
            "inconsistent",
        ),
        (
            "a pair of three",
            Mp::batch().stored_with(|mp| mp.arr(1).arr(3).u(1).u(2).u(3)),
            "inconsistent",
        ),
        (
            "a negative token",
            Mp::batch().stored_with(|mp| mp.arr(2).u(1).i(-1)),
            "int_out_of_range",
        ),
        (
            "a pair after a token",
            Mp::batch().stored_with(|mp| mp.arr(2).u(1).arr(2).u(1).u(2)),
            "unexpected_type",
        ),
        (
            "a metadata salt that is no string",
            Mp::batch()
                .arr(8)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(0)
                .u(1)
                .nil()
                .nil()
                .map(1)
                .s("cache_salt")
                .u(3),
            "unexpected_type",
        ),
    ] {
        let error = decode_sglang(payload.nil()).unwrap_err();
        assert_eq!(error.as_label(), label, "{what}: {error}");
    }
    let truncated = Mp::batch().stored_with(|mp| mp.arr(2).arr(2).u(1));
    assert_eq!(
        decode_sglang(truncated).unwrap_err().as_label(),
        "truncated"
    );
}

#[test]
fn the_simulators_encoder_writes_sglangs_own_bytes() {
    // Every payload of the plain-token captures whose events the domain types carry whole
    // (no LoRA id, no session id), re-encoded, equals what SGLang's publisher sent.
    let mut compared = [0usize; 3];
    let layouts = [
        SglangLayout::Positional,
        SglangLayout::Maps,
        SglangLayout::Maps,
    ];
    for ((file, layout), compared) in CAPTURES.iter().zip(layouts).zip(&mut compared) {
        for line in capture(file) {
            if line["kind"] != "zmq_pub" {
                continue;
            }
            let payload = &frames(&line)[2];
            let decoded = decode_engine_batch(Engine::Sglang, payload).unwrap();
            let carried_whole = decoded.batch.events.iter().all(|event| match event {
                KvEvent::BlockStored(stored) => {
                    stored.lora_id.is_none()
                        && stored
                            .sglang
                            .as_ref()
                            .is_none_or(|run| run.token_layout == TokenLayout::Plain)
                }
                _ => true,
            }) && !line.to_string().contains("session_id");
            if !carried_whole {
                continue;
            }
            assert_eq!(
                hex::encode(encode_sglang_batch(&decoded.batch, layout)),
                hex::encode(payload),
                "{file} seq {}",
                line["seq"]
            );
            *compared += 1;
        }
    }
    assert!(
        compared.iter().all(|&n| n >= 8),
        "payloads compared: {compared:?}"
    );
}
