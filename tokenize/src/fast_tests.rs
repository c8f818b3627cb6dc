//! The fast byte-level BPE path against the `tokenizers` crate (the reference).

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

fn tokenizer_json() -> Value {
    let bytes = std::fs::read(format!("{FIXTURES}/tiny-model/tokenizer.json")).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

fn from_json(json: &Value) -> ModelTokenizer {
    ModelTokenizer::from_parts(&serde_json::to_vec(json).unwrap(), "{}", None).unwrap()
}

fn corpus(max_bytes: usize) -> String {
    let mut text = String::new();
    let mut files: Vec<_> = std::fs::read_dir(format!("{FIXTURES}/corpus"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    for file in files {
        text.push_str(&std::fs::read_to_string(file).unwrap());
    }
    let mut end = max_bytes.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

/// Asserts the fast path is on and equals `tokenizers` on `text`, both flag values.
fn assert_same(tokenizer: &ModelTokenizer, text: &str) {
    assert!(tokenizer.uses_fast_path());
    for add in [true, false] {
        assert_eq!(
            tokenizer.encode_prompt(text, add).unwrap(),
            tokenizer.encode_with_tokenizers(text, add).unwrap(),
            "{text:?} add_special_tokens={add}"
        );
    }
}

/// Fragments that exercise every branch of the GPT-2 pattern and the added-token split.
const FRAGMENTS: &[&str] = &[
    "a",
    "Z",
    "hello",
    " world",
    "The",
    "0",
    "42",
    "3.14",
    "!",
    "?!",
    "(",
    ")",
    ".",
    ",",
    "-",
    "_",
    "'",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "\"",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " \n",
    "\r\n",
    "\u{b}",
    "\u{c}",
    "\u{1c}",
    "\u{85}",
    "\u{a0}",
    "\u{1680}",
    "\u{2000}",
    "\u{2028}",
    "\u{2029}",
    "\u{202f}",
    "\u{3000}",
    "\u{180e}",
    "\u{200b}",
    "\u{feff}",
    "é",
    "ß",
    "中",
    "文字",
    "Ω",
    "ǅ",
    "ʰ",
    "٣",
    "Ⅷ",
    "½",
    "²",
    "e\u{301}",
    "\u{308}",
    "\u{20dd}",
    "😀",
    "👍🏽",
    "€",
    "∑",
    "\u{e000}",
    "\u{10ffff}",
    "<s>",
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<",
    "|",
    "<|",
    "|>",
    "<s",
    "s>",
    "license",
    " License",
    " the",
    " of",
    "Software",
    " Foundation",
    "GNU",
];

fn text_strategy() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        4 => proptest::sample::select(FRAGMENTS).prop_map(str::to_owned),
        1 => any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(fragment, 0..48).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn fast_path_equals_tokenizers_on_random_text(text in text_strategy()) {
        let tokenizer = tiny();
        prop_assert!(tokenizer.uses_fast_path());
        for add in [true, false] {
            prop_assert_eq!(
                tokenizer.encode_prompt(&text, add).unwrap(),
                tokenizer.encode_with_tokenizers(&text, add).unwrap(),
                "add_special_tokens={}", add
            );
        }
    }
}

/// One tokenizer for all proptest cases (loading runs the self-check).
fn tiny() -> &'static ModelTokenizer {
    static TINY: std::sync::OnceLock<ModelTokenizer> = std::sync::OnceLock::new();
    TINY.get_or_init(|| ModelTokenizer::from_dir(format!("{FIXTURES}/tiny-model")).unwrap())
}

#[test]
fn fixture_uses_the_fast_path_and_matches_on_corpus_text() {
    let tokenizer = tiny();
    assert_same(tokenizer, &corpus(200_000));
    assert_same(tokenizer, "");
    assert_same(tokenizer, SELF_CHECK_SAMPLE);
    // A long whitespace run and a long punctuation run are single pieces.
    assert_same(
        tokenizer,
        &format!("a{}b{}c", " ".repeat(5000), "-=".repeat(3000)),
    );
}

#[test]
fn legacy_merges_ignore_merges_and_no_post_processor_are_modelled() {
    let mut legacy = tokenizer_json();
    let merges: Vec<Value> = legacy["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| {
            json!(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            ))
        })
        .collect();
    legacy["model"]["merges"] = Value::Array(merges);
    let text = corpus(20_000);
    assert_same(&from_json(&legacy), &text);

    let mut ignore = tokenizer_json();
    ignore["model"]["ignore_merges"] = json!(true);
    // Give a word a vocab entry its merges would not produce, so ignore_merges matters.
    let vocab_len = ignore["model"]["vocab"].as_object().unwrap().len();
    ignore["model"]["vocab"]["Ġzebra"] = json!(vocab_len);
    let ignore = from_json(&ignore);
    assert_same(&ignore, &format!("{text} zebra zebras"));
    assert_eq!(
        ignore.encode_prompt(" zebra", false).unwrap(),
        [vocab_len as u32]
    );

    let mut plain = tokenizer_json();
    plain["post_processor"] = Value::Null;
    let plain = from_json(&plain);
    assert_same(&plain, &text);
    assert_eq!(plain.encode_prompt("", true).unwrap(), Vec::<u32>::new());
}

#[test]
fn added_tokens_get_tokenizers_ids_and_normalized_ones_match_second() {
    let mut json = tokenizer_json();
    let added = json["added_tokens"].as_array_mut().unwrap();
    // Listed ids are ignored by tokenizers: new contents get ids from the vocab size on.
    for (content, normalized) in [("<|user|>x", false), ("user|>", true), ("ab", true)] {
        added.push(
            json!({"id": 9999, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": normalized, "special": false}),
        );
    }
    let tokenizer = from_json(&json);
    assert_same(
        &tokenizer,
        "<|user|>xy <|user|> user|> ab cab <|user|>ab <|user|x abab",
    );
    let ab = tokenizer.tokenizer.token_to_id("ab").unwrap();
    assert_eq!(tokenizer.encode_prompt("ab", false).unwrap(), [ab]);
    assert_eq!(tokenizer.tokenizer.token_to_id("user|>"), Some(2001));
}

#[test]
fn unsupported_pipelines_fall_back_to_tokenizers() {
    type Edit = fn(&mut Value);
    let edits: [(&str, Edit); 8] = [
        ("normalizer", |j| j["normalizer"] = json!({"type": "NFKC"})),
        ("split with another behaviour", |j| {
            j["pre_tokenizer"] = split_pipeline(byte_bpe::split::LLAMA3);
            j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = json!("Removed");
        }),
        ("split then ByteLevel with its regex", |j| {
            j["pre_tokenizer"] = split_pipeline(byte_bpe::split::O200K);
            j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = json!(true);
        }),
        ("add_prefix_space", |j| {
            j["pre_tokenizer"]["add_prefix_space"] = json!(true)
        }),
        ("split pre-tokenizer", |j| {
            j["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
        }),
        ("lstrip added token", |j| {
            j["added_tokens"][4]["lstrip"] = json!(true)
        }),
        ("dropout", |j| j["model"]["dropout"] = json!(0.5)),
        ("template with $B", |j| {
            j["post_processor"]["processors"][1]["single"] = json!([{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}])
        }),
    ];
    for (name, edit) in edits {
        let mut json = tokenizer_json();
        edit(&mut json);
        assert!(
            FastBpe::from_tokenizer_json(&json).unwrap().is_none(),
            "{name}"
        );
        if name == "template with $B" {
            continue; // tokenizers itself rejects this template
        }
        let tokenizer = from_json(&json);
        assert!(!tokenizer.uses_fast_path(), "{name}");
        assert!(
            !tokenizer
                .encode_prompt("Hello  world", true)
                .unwrap()
                .is_empty()
        );
    }
    assert!(
        FastBpe::from_tokenizer_json(&tokenizer_json())
            .unwrap()
            .is_some()
    );
}

/// `Sequence [Split(pattern, Isolated), ByteLevel(use_regex: false)]`, as real tokenizers carry.
fn split_pipeline(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
}

/// The tiny model's vocab under each real pipeline (Llama 3, Qwen2 + NFC, o200k): no model
/// folders needed, so this runs everywhere.
fn tiny_with_real_pipelines() -> &'static [(&'static str, ModelTokenizer)] {
    static TOKENIZERS: std::sync::OnceLock<Vec<(&'static str, ModelTokenizer)>> =
        std::sync::OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        use byte_bpe::split::{LLAMA3, O200K, QWEN2};
        [
            ("llama3", LLAMA3, false),
            ("qwen2_nfc", QWEN2, true),
            ("o200k", O200K, false),
        ]
        .into_iter()
        .map(|(name, pattern, nfc)| {
            let mut json = tokenizer_json();
            json["pre_tokenizer"] = split_pipeline(pattern);
            if nfc {
                json["normalizer"] = json!({"type": "NFC"});
            }
            (name, from_json(&json))
        })
        .collect()
    })
}

#[test]
fn split_pipelines_and_nfc_use_the_fast_path_and_match() {
    let text = corpus(50_000);
    let mixed = crate::testing::mixed_text(3, 100_000, &["<s>", "</s>", "<|user|>"]);
    for (name, tokenizer) in tiny_with_real_pipelines() {
        assert!(tokenizer.uses_fast_path(), "{name}");
        assert_same(tokenizer, &text);
        assert_same(tokenizer, &mixed);
        assert_same(tokenizer, SELF_CHECK_SAMPLE);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn split_pipelines_equal_tokenizers_on_random_text(text in text_strategy()) {
        for (name, tokenizer) in tiny_with_real_pipelines() {
            for add in [true, false] {
                prop_assert_eq!(
                    tokenizer.encode_prompt(&text, add).unwrap(),
                    tokenizer.encode_with_tokenizers(&text, add).unwrap(),
                    "{} add_special_tokens={}", name, add
                );
            }
        }
    }
}

#[test]
fn normalized_added_tokens_match_in_nfc_form() {
    let mut json = tokenizer_json();
    json["normalizer"] = json!({"type": "NFC"});
    json["pre_tokenizer"] = split_pipeline(byte_bpe::split::QWEN2);
    json["added_tokens"].as_array_mut().unwrap().push(
        json!({"id": 9999, "content": "cafe\u{301}!", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": true, "special": false}),
    );
    let tokenizer = from_json(&json);
    assert_same(&tokenizer, "x caf\u{e9}! cafe\u{301}! cafe\u{301}!y");
    let id = tokenizer.encode_prompt("caf\u{e9}!", false).unwrap();
    assert_eq!(id.len(), 1);
}

#[test]
fn inconsistent_supported_pipeline_is_an_error() {
    let mut json = tokenizer_json();
    json["model"]["merges"]
        .as_array_mut()
        .unwrap()
        .push(json!(["nosuch", "token"]));
    let err = FastBpe::from_tokenizer_json(&json).unwrap_err();
    assert_eq!(err.as_label(), "config");
}

#[test]
fn model_tokenizer_stays_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<ModelTokenizer>();
    shared::<FastBpe>();
}
