//! Image prompts through real Envoy and kvroute in render mode, in front of
//! `kvroute-engine-sim` replicas whose processor expands images into placeholder runs and hashes
//! each image into the blocks it overlaps, as vLLM 0.32 does (the sim's `media` module): an
//! image conversation's next turn goes to the replica holding it and kvroute's predicted cached
//! tokens are the engine's; a changed image breaks the match at the image's first block, and a
//! client's `uuid` is the image's identifier.
//!
//! The image's place in the prompt is read from the sim's own render endpoint
//! (`features.mm_placeholders`); the engine's cached tokens from each API's usage; the
//! prediction from `x-kvroute-predicted-cached-tokens`.
//!
//! Needs the binaries: `cargo build --bins` before `cargo nextest run -p kvroute-tests images`.

use kvroute_ext_proc::server::{DECISION_HEADER, PREDICTED_CACHED_HEADER};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{DebugHeaders, MODEL, Stack, StackOptions, StackTokenizer};
use serde_json::{Value, json};

use super::common::until_indexed;
use super::routing::{ext_proc_metrics, route_response, text};

/// Tokens per block in the stack.
const BLOCK: u64 = 32;

/// The three request shapes that carry images.
#[derive(Debug, Clone, Copy)]
enum Api {
    Chat,
    Responses,
    Messages,
}

/// An image as a client sends it: base64 text (the sims hash the payload, not pixels).
fn image(seed: u64) -> String {
    text(seed, 12).replace(' ', "")
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// A conversation: system `prefix`, a user turn with text and the image (with the client's
    /// `uuid`, chat only), then `later` (assistant answer, user question) turns.
    fn body(self, prefix: &str, image: &str, uuid: Option<&str>, later: &[(&str, &str)]) -> Value {
        let url = format!("data:image/png;base64,{image}");
        let first = "what is in this picture?";
        let mut turns = Vec::new();
        match self {
            Api::Chat => {
                let mut part = json!({"type": "image_url", "image_url": {"url": url}});
                if let Some(uuid) = uuid {
                    part["uuid"] = uuid.into();
                }
                turns.push(json!({"role": "system", "content": prefix}));
                turns.push(json!({"role": "user", "content": [
                    {"type": "text", "text": first}, part]}));
            }
            Api::Responses => turns.push(json!({"role": "user", "content": [
                {"type": "input_text", "text": first},
                {"type": "input_image", "image_url": url}]})),
            Api::Messages => turns.push(json!({"role": "user", "content": [
                {"type": "text", "text": first},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                    "data": image}}]})),
        }
        for (answer, question) in later {
            turns.push(json!({"role": "assistant", "content": answer}));
            turns.push(json!({"role": "user", "content": question}));
        }
        match self {
            Api::Chat => json!({"model": MODEL, "max_tokens": 2, "messages": turns}),
            Api::Responses => json!({"model": MODEL, "max_output_tokens": 2,
                "instructions": prefix, "input": turns}),
            Api::Messages => json!({"model": MODEL, "max_tokens": 2,
                "system": [{"type": "text", "text": prefix}], "messages": turns}),
        }
    }

    /// Prompt tokens the engine found cached, from each API's usage shape.
    fn cached_tokens(self, answer: &Value) -> u64 {
        let usage = &answer["usage"];
        match self {
            Api::Chat => usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Api::Responses => usage["input_tokens_details"]["cached_tokens"].as_u64(),
            Api::Messages => usage["cache_read_input_tokens"].as_u64(),
        }
        .unwrap_or(0)
    }
}

struct Routed {
    replica: usize,
    decision: String,
    predicted: u64,
    cached: u64,
}

async fn route(stack: &Stack, api: Api, body: &Value) -> Routed {
    let (replica, response) = route_response(stack, api.path(), body, &[]).await;
    let decision = response.header(DECISION_HEADER);
    let predicted = response.header(PREDICTED_CACHED_HEADER).parse().unwrap();
    let answer: Value = response.json().unwrap();
    Routed {
        replica,
        decision,
        predicted,
        cached: api.cached_tokens(&answer),
    }
}

/// Where the first image of `body` starts in the prompt, by the sim's own render endpoint.
async fn image_offset(stack: &Stack, api: Api, body: &Value) -> u64 {
    let url = format!("{}{}/render", stack.sim_urls()[0], api.path());
    let rendered: Value = http::post_json(&url, body).await.unwrap().json().unwrap();
    rendered["features"]["mm_placeholders"]["image"][0]["offset"]
        .as_u64()
        .unwrap_or_else(|| panic!("no image placed: {rendered}"))
}

async fn start() -> Stack {
    let options = StackOptions::default();
    assert_eq!(u64::from(options.block_size), BLOCK);
    Stack::start(StackOptions {
        replicas: 3,
        debug_headers: DebugHeaders::Always,
        tokenizer: StackTokenizer::RenderSim {
            sim: 0,
            timeout: options.budgets.tokenize,
        },
        ..options
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn image_conversations_route_by_prefix_and_a_changed_image_breaks_at_its_first_block() {
    let stack = start().await;
    for (seed, api) in [(71, Api::Chat), (72, Api::Responses), (73, Api::Messages)] {
        let prefix = text(seed, 60);
        let (picture, other) = (image(seed * 10), image(seed * 10 + 1));
        let first = route(&stack, api, &api.body(&prefix, &picture, None, &[])).await;
        assert_eq!(first.cached, 0, "{api:?}");
        until_indexed(&stack, first.replica).await;

        // The next turn holds the whole first turn, the image included.
        let next = api.body(&prefix, &picture, None, &[("a cat", "what colour is it?")]);
        let routed = route(&stack, api, &next).await;
        let what = format!("{api:?} next turn ({})", routed.decision);
        assert_eq!(routed.replica, first.replica, "{what}\n{}", stack.logs());
        assert!(routed.decision.starts_with("precise/"), "{what}");
        let offset = image_offset(&stack, api, &next).await;
        assert!(
            routed.cached > offset,
            "{what}: the engine's hit ({}) reaches past the image at {offset}",
            routed.cached
        );
        assert!(
            routed.predicted.abs_diff(routed.cached) <= BLOCK,
            "{what}: predicted {} cached, the engine {}",
            routed.predicted,
            routed.cached
        );

        // Another image in the same place: only the blocks before the image's first block.
        let changed = api.body(&prefix, &other, None, &[]);
        let offset = image_offset(&stack, api, &changed).await;
        let before_image = offset / BLOCK * BLOCK;
        assert!(before_image >= 2 * BLOCK, "{api:?}: image at {offset}");
        let routed = route(&stack, api, &changed).await;
        let what = format!("{api:?} changed image ({})", routed.decision);
        assert_eq!(routed.replica, first.replica, "{what}");
        assert_eq!(routed.cached, before_image, "{what}: the engine's hit");
        assert_eq!(
            routed.predicted, before_image,
            "{what}: kvroute's prediction"
        );
    }
    let metrics = ext_proc_metrics(&stack).await;
    let tokenize_fallbacks = metrics::sum(
        &metrics,
        "kvroute_extproc_fallbacks_total",
        &["stage=\"tokenize\""],
    );
    assert_eq!(tokenize_fallbacks, 0.0, "{metrics}");
}

#[tokio::test]
async fn a_client_uuid_is_the_images_identifier_through_render() {
    let stack = start().await;
    let prefix = text(81, 60);
    let picture = image(810);
    let with_uuid = Api::Chat.body(&prefix, &picture, Some("photo-1"), &[]);
    let first = route(&stack, Api::Chat, &with_uuid).await;
    until_indexed(&stack, first.replica).await;
    let offset = image_offset(&stack, Api::Chat, &with_uuid).await;

    // The same uuid on the next turn: a hit past the image.
    let next = Api::Chat.body(&prefix, &picture, Some("photo-1"), &[("a dog", "and now?")]);
    let routed = route(&stack, Api::Chat, &next).await;
    assert_eq!(routed.replica, first.replica, "{}", routed.decision);
    assert!(routed.cached > offset, "engine hit {}", routed.cached);
    assert!(
        routed.predicted.abs_diff(routed.cached) <= BLOCK,
        "predicted {} cached, the engine {}",
        routed.predicted,
        routed.cached
    );

    // The same picture without the uuid is hashed: another identifier, so the match ends at the
    // image's first block, in kvroute's prediction as in the engine.
    let hashed = Api::Chat.body(&prefix, &picture, None, &[]);
    let routed = route(&stack, Api::Chat, &hashed).await;
    let before_image = offset / BLOCK * BLOCK;
    assert_eq!(routed.replica, first.replica, "{}", routed.decision);
    assert_eq!(routed.cached, before_image);
    assert_eq!(routed.predicted, before_image);
}
