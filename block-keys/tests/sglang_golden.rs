//! Reproduces SGLang's page hashes and published event hashes from the project's own golden
//! vectors (`tests/fixtures/sglang/golden-hashes.json`: computed by SGLang 0.5.19, 0.5.22 and
//! 0.5.23's own functions, `tests/sglang/golden.py`). Every vector kind is checked, or said
//! here why kvroute does not reproduce it: `storage_namespace_seed` seeds SGLang's storage
//! chains, which no event publishes; `lora_id` is SGLang's adapter id (a UUID5), which kvroute
//! does not compute, so LoRA requests of an `sglang-exact` pool are not keyed (the namespace it
//! seeds is checked here from the id the fixture gives).
#![allow(
    clippy::unwrap_used,
    reason = "test code: helpers outside #[test] fns panic on bad fixtures by design"
)]

use kvroute_block_keys::testing::fixture;
use kvroute_block_keys::{Digest, KeyScheme, SglangHasher};
use serde_json::Value;

const GOLDEN: &str = "sglang/golden-hashes.json";

fn golden() -> Value {
    let path = fixture(GOLDEN);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// Every (version, vector) of a kind; panics when a kind has none, so a renamed kind fails.
fn vectors(kind: &str) -> Vec<(String, Value)> {
    let golden = golden();
    let mut out = Vec::new();
    for (version, release) in golden["versions"].as_object().unwrap() {
        for vector in release["vectors"].as_array().unwrap() {
            if vector["kind"] == kind {
                out.push((version.clone(), vector.clone()));
            }
        }
    }
    assert!(!out.is_empty(), "no {kind} vectors in {GOLDEN}");
    out
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    u64s(v)
        .into_iter()
        .map(|t| u32::try_from(t).unwrap())
        .collect()
}

/// SGLang's signed i64 hashes as kvroute keeps them: the same 64 bits.
fn i64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_i64().unwrap() as u64)
        .collect()
}

fn digest(hex_str: &Value) -> Digest {
    Digest::from_slice(&hex::decode(hex_str.as_str().unwrap()).unwrap()).unwrap()
}

fn opt_str(v: &Value) -> Option<&str> {
    v.as_str()
}

#[test]
fn page_chains_match_sglang_digests_and_published_values() {
    let mut pages = 0;
    for (version, vector) in vectors("page_chain") {
        let inputs = &vector["inputs"];
        let page_size = inputs["page_size"].as_u64().unwrap() as usize;
        let tokens = u32s(&inputs["tokens"]);
        let mut prior = (!inputs["prior_hex"].is_null()).then(|| digest(&inputs["prior_hex"]));
        // A trailing partial page is hashed too (SGLang's events only ever carry full pages).
        for (page, expected) in tokens
            .chunks(page_size)
            .zip(vector["pages"].as_array().unwrap())
        {
            let d = SglangHasher::page_digest(prior.as_ref(), page);
            let name = &vector["name"];
            assert_eq!(d, digest(&expected["digest_hex"]), "{version} {name}");
            assert_eq!(
                SglangHasher::published_u64(&d),
                expected["published_i64"].as_i64().unwrap() as u64,
                "{version} {name}"
            );
            prior = Some(d);
            pages += 1;
        }
    }
    assert!(pages >= 3 * 20, "{pages} pages checked");
}

#[test]
fn pages_with_tokens_past_u32_hash_wide_from_0_5_23_and_are_refused_before() {
    for (version, vector) in vectors("wide_tokens") {
        let inputs = &vector["inputs"];
        let page_size = inputs["page_size"].as_u64().unwrap() as usize;
        let tokens = u64s(&inputs["tokens"]);
        assert!(tokens.iter().any(|&t| u32::try_from(t).is_err()));
        if !vector["error"].is_null() {
            // SGLang before 0.5.23 cannot hash such a page (its pads fit u32 there).
            assert_ne!(version, "0.5.23");
            continue;
        }
        let mut prior = None;
        let expected = vector["pages"].as_array().unwrap();
        assert_eq!(expected.len(), tokens.len().div_ceil(page_size));
        for (page, expected) in tokens.chunks(page_size).zip(expected) {
            let d = SglangHasher::wide_page_digest(prior.as_ref(), page);
            assert_eq!(d, digest(&expected["digest_hex"]), "{version} wide page");
            assert_eq!(
                SglangHasher::published_u64(&d),
                expected["published_i64"].as_i64().unwrap() as u64
            );
            prior = Some(d);
        }
    }
}

#[test]
fn eagle_bigram_pages_match_as_prompt_keys() {
    let bigram = KeyScheme::SglangExact(SglangHasher {
        bigram: true,
        dynamo_format: false,
    });
    for (version, vector) in vectors("bigram_pages") {
        let inputs = &vector["inputs"];
        let page_size = inputs["page_size"].as_u64().unwrap() as usize;
        let raw = u32s(&inputs["raw_tokens"]);
        let pages = vector["pages"].as_array().unwrap();
        let expected: Vec<u64> = pages
            .iter()
            .map(|p| p["published_i64"].as_i64().unwrap() as u64)
            .collect();
        let keys = bigram.prompt_keys(&raw, page_size, None, None).unwrap();
        assert_eq!(keys, expected, "{version}");
        let mut prior = None;
        for page in pages {
            let d = SglangHasher::page_digest(prior.as_ref(), &u32s(&page["hash_words"]));
            assert_eq!(d, digest(&page["digest_hex"]), "{version}");
            prior = Some(d);
        }
    }
}

/// The published hashes of a store's events, in order.
fn stored_hashes(stored: &Value) -> Vec<u64> {
    stored
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|event| i64s(&event["block_hashes"]))
        .collect()
}

#[test]
fn stored_events_publish_the_salted_chain_in_every_namespace_variant() {
    let mut reproduced = 0;
    for (version, vector) in vectors("store") {
        let name = format!("{version} {}", vector["name"]);
        let inputs = &vector["inputs"];
        let page_size = inputs["page_size"].as_u64().unwrap() as usize;
        let dynamo = inputs["format"] == "dynamo";
        let salt = opt_str(&inputs["cache_salt"]);
        let extra_key = opt_str(&inputs["extra_key"]);
        if inputs["is_eagle"] == true {
            let scheme = KeyScheme::SglangExact(SglangHasher {
                bigram: true,
                dynamo_format: dynamo,
            });
            let raw = u32s(&inputs["raw_tokens"]);
            assert_eq!(
                scheme.prompt_keys(&raw, page_size, None, None).unwrap(),
                stored_hashes(&vector["stored"]),
                "{name}"
            );
            reproduced += 1;
            continue;
        }

        // The event chain: seeded by the salt, never by extra_key.
        let chain = |tokens: &[u32]| {
            let mut prior = SglangHasher::chain_seed(salt);
            tokens
                .chunks_exact(page_size)
                .map(|page| {
                    let d = SglangHasher::page_digest(prior.as_ref(), page);
                    prior = Some(d);
                    d
                })
                .collect::<Vec<_>>()
        };
        if !vector["event_chain_seed_hex"].is_null() {
            assert_eq!(
                SglangHasher::chain_seed(salt),
                Some(digest(&vector["event_chain_seed_hex"])),
                "{name}"
            );
        }
        for (tokens, digests, stored) in [
            ("tokens", "event_digests_hex", "stored"),
            ("then_tokens", "then_event_digests_hex", "then_stored"),
        ] {
            let digests: Vec<Digest> = vector[digests]
                .as_array()
                .unwrap()
                .iter()
                .map(digest)
                .collect();
            let tokens = u32s(&inputs[tokens]);
            assert_eq!(chain(&tokens), digests, "{name}");

            // What is published: the chain, namespaced when the vector names a seed. SGLang's
            // dynamo format namespaces by (extra_key, salt), 0.5.23's default by a named LoRA's
            // extra_key only.
            let namespace = (!vector["namespace_seed_hex"].is_null()).then(|| {
                let seed = if dynamo {
                    SglangHasher::namespace_seed(extra_key, salt)
                } else {
                    SglangHasher::namespace_seed(extra_key, None)
                }
                .unwrap();
                assert_eq!(
                    hex::encode(seed),
                    vector["namespace_seed_hex"].as_str().unwrap(),
                    "{name}"
                );
                seed
            });
            let published: Vec<u64> = digests
                .iter()
                .map(|d| {
                    let h = SglangHasher::published_u64(d);
                    namespace.map_or(h, |seed| SglangHasher::namespaced(h, &seed))
                })
                .collect();
            // `then_stored` holds only the pages the second prompt added.
            let events = stored_hashes(&vector[stored]);
            assert_eq!(
                published[published.len() - events.len()..],
                events,
                "{name}"
            );

            // A router reproduces every variant without an extra_key.
            if extra_key.is_none() {
                let scheme = KeyScheme::SglangExact(SglangHasher {
                    bigram: false,
                    dynamo_format: dynamo,
                });
                let keys = scheme.prompt_keys(&tokens, page_size, None, salt).unwrap();
                assert_eq!(keys, published, "{name}");
                reproduced += 1;
            }
        }
    }
    assert!(
        reproduced >= 20,
        "{reproduced} stores reproduced as prompt keys"
    );
}

#[test]
fn namespaced_block_hashes_match() {
    for (version, vector) in vectors("namespaced_block_hash") {
        let inputs = &vector["inputs"];
        let seed = SglangHasher::namespace_seed(
            opt_str(&inputs["extra_key"]),
            opt_str(&inputs["cache_salt"]),
        )
        .unwrap();
        assert_eq!(hex::encode(seed), vector["seed_hex"].as_str().unwrap());
        let outputs: Vec<u64> = i64s(&inputs["block_hashes"])
            .into_iter()
            .map(|h| SglangHasher::namespaced(h, &seed))
            .collect();
        assert_eq!(outputs, i64s(&vector["outputs"]), "{version}");
    }
}

/// Every prompt of the project's SGLang captures (`tests/sglang/record_events.py`: SGLang's own
/// radix tree and event recorder) without an `extra_key` (LoRA): its published hashes are the
/// prompt keys kvroute computes for the pool, EAGLE and kv-events format dynamo included.
#[test]
fn captured_prompts_publish_their_prompt_keys() {
    let mut reproduced = 0;
    for name in [
        "0.5.19-ps16",
        "0.5.22-ps16",
        "0.5.23-ps16",
        "0.5.23-ps16-eagle",
        "0.5.23-ps32-dynamo",
    ] {
        let path = fixture(&format!("sglang/capture-sglang-{name}.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let records: Vec<Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let setup = &records[0];
        let page_size = setup["page_size"].as_u64().unwrap() as usize;
        let scheme = KeyScheme::SglangExact(SglangHasher {
            bigram: setup["is_eagle"] == true,
            dynamo_format: setup["format"] == "dynamo",
        });
        for prompt in records.iter().filter(|r| r["kind"] == "prompt") {
            if !prompt["extra_key"].is_null() {
                continue;
            }
            let keys = scheme
                .prompt_keys(
                    &u32s(&prompt["token_ids"]),
                    page_size,
                    None,
                    opt_str(&prompt["cache_salt"]),
                )
                .unwrap();
            assert_eq!(
                keys,
                i64s(&prompt["published_block_hashes"]),
                "{name} {}",
                prompt["step"]
            );
            reproduced += 1;
        }
    }
    assert!(reproduced >= 50, "{reproduced} prompts");
}
