//! Tokenization parity: for generated completion and chat requests, the token ids kvroute-ext-proc
//! computes in-process (its own body parser, token cache and in-process tokenizer — the decision
//! path) equal what a running `kvroute-engine-sim` answers on `/tokenize` for the same input.
//!
//! Inputs come from a seeded generator: lengths from empty to ~800 words, many scripts, emoji and
//! combining marks, control characters and JSON escapes (some bodies are serialized ASCII-only with
//! `\uXXXX` escapes, which the parser must un-escape), prompt lists, multi-turn conversations with
//! system messages and text-part lists, and both values of the tokenization flags.

use std::sync::Arc;

use kvroute_ext_proc::tokenizer::{InProcessTokenizer, TokenSource, Tokenizer};
use kvroute_tests::harness::{SimProcess, http, tiny_model_dir};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use tokio_util::task::TaskTracker;

use super::common::{SIM_BIN, decision_path_tokens, sim_args};

const CASES: usize = 200;
const SEED: u64 = 0x6b76_726f_7574_6531;
/// The simulator's default served model name.
const MODEL: &str = "tiny";

/// Word-like fragments the generator strings together.
const FRAGMENTS: &[&str] = &[
    "the",
    "KV",
    "cache",
    "prefix",
    "routing",
    "replica",
    "Envoy",
    "naïve",
    "café",
    "Straße",
    "façade",
    "日本語",
    "テキスト",
    "中文分词测试",
    "한국어",
    "😀",
    "👩‍💻",
    "🇫🇷",
    "مرحبا بالعالم",
    "שלום",
    "Ελληνικά",
    "кириллица",
    "e\u{301}",
    "\u{200b}",
    "tab\there",
    "line\nbreak",
    "crlf\r\n",
    "  spaced   out  ",
    "\"quoted\"",
    "back\\slash",
    "{\"json\": [1, 2]}",
    "<|user|>",
    "</s>",
    "<s>",
    "123456789",
    "3.14159",
    "x=y&z<w>",
    "bell\u{7}",
    "nul\u{0}",
    "\u{fffd}",
    "ǅ",
    "ﬁ",
];

/// One generated request: the endpoint and the body a client sends.
struct Case {
    path: &'static str,
    body: Value,
}

fn text(rng: &mut StdRng) -> String {
    let words = match rng.random_range(0..10) {
        0 => rng.random_range(0..3),
        1..=5 => rng.random_range(1..40),
        6..=8 => rng.random_range(40..250),
        _ => rng.random_range(250..800),
    };
    let mut out = String::new();
    for i in 0..words {
        if i > 0 {
            out.push_str(match rng.random_range(0..12) {
                0 => "",
                1 => "\n",
                2 => ", ",
                _ => " ",
            });
        }
        out.push_str(FRAGMENTS[rng.random_range(0..FRAGMENTS.len())]);
    }
    out
}

fn content(rng: &mut StdRng) -> Value {
    if rng.random_bool(0.3) {
        let parts = rng.random_range(1..=3);
        Value::Array(
            (0..parts)
                .map(|_| json!({"type": "text", "text": text(rng)}))
                .collect(),
        )
    } else {
        Value::String(text(rng))
    }
}

fn completion(rng: &mut StdRng) -> Case {
    let prompt = text(rng);
    let mut body = Map::new();
    body.insert("model".into(), json!(MODEL));
    body.insert(
        "prompt".into(),
        if rng.random_bool(0.2) {
            json!([prompt])
        } else {
            json!(prompt)
        },
    );
    match rng.random_range(0..10) {
        0 | 1 => body.insert("add_special_tokens".into(), json!(false)),
        2 => body.insert("add_special_tokens".into(), json!(true)),
        _ => None,
    };
    body.insert("max_tokens".into(), json!(rng.random_range(1..64)));
    Case {
        path: "/v1/completions",
        body: Value::Object(body),
    }
}

fn chat(rng: &mut StdRng) -> Case {
    let mut messages = Vec::new();
    if rng.random_bool(0.3) {
        messages.push(json!({"role": "system", "content": content(rng)}));
    }
    let turns = rng.random_range(1..=8);
    for turn in 0..turns {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": content(rng)}));
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(MODEL));
    body.insert("messages".into(), Value::Array(messages));
    if rng.random_bool(0.2) {
        body.insert("add_generation_prompt".into(), json!(false));
    }
    body.insert("stream".into(), json!(rng.random_bool(0.5)));
    Case {
        path: "/v1/chat/completions",
        body: Value::Object(body),
    }
}

/// The `/tokenize` request equivalent to a generation request (same input, same flags).
fn tokenize_request(body: &Value) -> Value {
    let mut request = Map::new();
    for key in [
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
    ] {
        if let Some(value) = body.get(key) {
            request.insert(key.to_owned(), value.clone());
        }
    }
    Value::Object(request)
}

/// JSON text with every non-ASCII character written as `\uXXXX` (surrogate pairs beyond the BMP).
/// Non-ASCII characters only occur inside strings, so this is still the same JSON value.
fn ascii_json(value: &Value) -> String {
    let mut out = String::new();
    for c in value.to_string().chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

#[tokio::test]
async fn in_process_tokens_equal_the_engine_tokenize_endpoint() {
    let sim = SimProcess::spawn(SIM_BIN, &sim_args(&[])).await.unwrap();
    let tasks = TaskTracker::new();
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(InProcessTokenizer::load(&tiny_model_dir(), tasks.clone()).unwrap());
    let tokenize_url = format!("{}/tokenize", sim.base_url());
    let mut rng = StdRng::seed_from_u64(SEED);
    let (mut chats, mut longest) = (0, 0);

    for i in 0..CASES {
        let case = if rng.random_bool(0.5) {
            completion(&mut rng)
        } else {
            chat(&mut rng)
        };
        let wire = if rng.random_bool(0.25) {
            ascii_json(&case.body)
        } else {
            case.body.to_string()
        };

        let ours =
            decision_path_tokens(&tokenizer, &tasks, &wire, case.path, &format!("case {i}")).await;
        assert!(ours.exact, "case {i}");
        assert_eq!(ours.source, TokenSource::Tokenizer, "case {i}");

        let response = http::post_json(&tokenize_url, &tokenize_request(&case.body))
            .await
            .unwrap();
        assert_eq!(response.status, 200, "case {i}: {}", response.text());
        let engine: Vec<u32> = serde_json::from_value(response.json().unwrap()["tokens"].clone())
            .unwrap_or_else(|e| panic!("case {i}: bad /tokenize answer: {e}"));

        if *ours.tokens != engine[..] {
            let first_difference = ours
                .tokens
                .iter()
                .zip(&engine)
                .position(|(a, b)| a != b)
                .unwrap_or(ours.tokens.len().min(engine.len()));
            panic!(
                "case {i} ({}): {} tokens in-process vs {} from /tokenize, first difference at \
                 {first_difference}\nbody: {wire}",
                case.path,
                ours.tokens.len(),
                engine.len()
            );
        }
        chats += usize::from(case.path.contains("chat"));
        longest = longest.max(engine.len());
    }
    // The generator really covered both endpoints and long prompts.
    assert!((60..=140).contains(&chats), "{chats} chat cases");
    assert!(longest > 1000, "longest prompt {longest} tokens");
}
