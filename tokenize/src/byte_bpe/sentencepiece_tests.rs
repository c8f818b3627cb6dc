//! SentencePiece-style pipelines on a tiny hand-built vocabulary, against `tokenizers`: byte
//! fallback, the `▁` rules (normalizer `Prepend`/`Replace`, `Metaspace` with each
//! `prepend_scheme`, `split` on and off), unknown chars, `ignore_merges`, and the cuts.

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::{FastEncoderKind, ModelTokenizer};

/// `<unk>`, `<s>`, `</s>`, the 256 byte tokens, a few chars and the merges of `▁hello`, `▁▁`,
/// `lo▁` and `a▁b` (a token with `▁` inside, so no cut may fall after `a`).
fn tiny_json() -> Value {
    let mut vocab = serde_json::Map::new();
    let mut add = |token: &str| {
        let id = vocab.len();
        vocab.insert(token.to_owned(), json!(id));
    };
    for token in ["<unk>", "<s>", "</s>"] {
        add(token);
    }
    for byte in 0..=255u8 {
        add(&format!("<0x{byte:02X}>"));
    }
    for c in [
        "▁", "a", "b", "e", "h", "l", "o", "w", "r", "d", ".", "\t", "\n",
    ] {
        add(c);
    }
    let merges = [
        ("▁", "h"),
        ("e", "l"),
        ("l", "o"),
        ("▁h", "el"),
        ("▁hel", "lo"),
        ("▁", "▁"),
        ("▁▁", "▁▁"),
        ("w", "o"),
        ("r", "l"),
        ("▁", "wo"),
        ("rl", "d"),
        ("▁wo", "rld"),
        ("lo", "▁"),
        ("a", "▁"),
        ("a▁", "b"),
    ];
    for (left, right) in merges {
        add(&format!("{left}{right}"));
    }
    // A word only `ignore_merges` can produce.
    add("▁bad");
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges.iter().map(|(l, r)| json!([l, r])).collect::<Vec<_>>()},
    })
}

fn load(json: &Value) -> ModelTokenizer {
    ModelTokenizer::from_parts(&serde_json::to_vec(json).unwrap(), "{}", None).unwrap()
}

/// Adds a non-special added token `<x>` (so segments start after an added token) and, when
/// `normalized`, a normalized one whose content has a space.
fn with_added(mut json: Value) -> Value {
    let added = json["added_tokens"].as_array_mut().unwrap();
    added.push(
        json!({"id": 999, "content": "<x>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": false}),
    );
    added.push(
        json!({"id": 999, "content": "o w", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": true, "special": false}),
    );
    json
}

/// Adds non-special added tokens matched in the raw text only, as Gemma's are: `<x>`, runs of
/// `\n` and a run of `▁` (which a normalized space never matches).
fn with_raw_added(mut json: Value) -> Value {
    let added = json["added_tokens"].as_array_mut().unwrap();
    for content in ["<x>", "\n", "\n\n", "▁▁"] {
        added.push(
            json!({"id": 999, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false}),
        );
    }
    json
}

fn gemma_json() -> Value {
    let mut gemma = tiny_json();
    gemma["normalizer"] = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    gemma["pre_tokenizer"] = json!({"type": "Split", "pattern": {"String": " "},
        "behavior": "MergedWithPrevious", "invert": false});
    gemma
}

/// The pipelines whose segments are encoded raw, without the normalizer's copy (`RawSpaces`).
fn raw_pipelines() -> Vec<(String, Value)> {
    let mut replace_only = tiny_json();
    replace_only["normalizer"] = gemma_json()["normalizer"].clone();
    vec![
        (
            "prepend+replace, raw (Llama 2)".to_owned(),
            with_raw_added(tiny_json()),
        ),
        (
            "replace + split, raw (Gemma)".to_owned(),
            with_raw_added(gemma_json()),
        ),
        (
            "replace, raw (Gemma without split)".to_owned(),
            with_raw_added(replace_only),
        ),
    ]
}

/// The `▁` pipelines of real SentencePiece vocabularies and Metaspace's variants.
fn pipelines() -> Vec<(String, Value)> {
    let mut out = vec![(
        "prepend+replace (Llama 2)".to_owned(),
        with_added(tiny_json()),
    )];
    out.push((
        "replace + split (Gemma)".to_owned(),
        with_added(gemma_json()),
    ));
    for scheme in ["always", "first", "never"] {
        for split in [true, false] {
            let mut metaspace = tiny_json();
            metaspace["normalizer"] = Value::Null;
            metaspace["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁",
                "prepend_scheme": scheme, "split": split});
            out.push((
                format!("metaspace {scheme} split={split}"),
                with_added(metaspace),
            ));
        }
    }
    out.extend(raw_pipelines());
    out
}

fn tiny_pipelines() -> &'static [(String, ModelTokenizer)] {
    static LOADED: std::sync::OnceLock<Vec<(String, ModelTokenizer)>> = std::sync::OnceLock::new();
    LOADED.get_or_init(|| {
        pipelines()
            .into_iter()
            .map(|(name, json)| {
                let tokenizer = load(&json);
                // A fast encoder that fails the load's self-check is dropped for `tokenizers`,
                // which would make every comparison below vacuous.
                assert!(tokenizer.uses_fast_path(), "{name}");
                (name, tokenizer)
            })
            .collect()
    })
}

fn assert_same(name: &str, tokenizer: &ModelTokenizer, text: &str) {
    assert_eq!(
        tokenizer.fast_encoder_kind(),
        Some(FastEncoderKind::SentencePieceBpe),
        "{name}"
    );
    for add in [true, false] {
        assert_eq!(
            tokenizer.encode_prompt(text, add).unwrap(),
            tokenizer.encode_with_tokenizers(text, add).unwrap(),
            "{name}: {text:?} add_special_tokens={add}"
        );
    }
}

const FRAGMENTS: &[&str] = &[
    " ", "  ", "    ", "hello", " hello", "world", " world", "a", "a ", "a b", "b", "lo ", "hel",
    "bad", " bad", "▁", "▁▁", "\t", "\n", " \n", ".", "é", "中", "😀", "\u{301}", "<x>", "<s>",
    "</s>", "o w", "<", "x>", "ab", "ba",
];

fn text_strategy() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        6 => proptest::sample::select(FRAGMENTS).prop_map(str::to_owned),
        1 => any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(fragment, 0..24).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn sentencepiece_pipelines_equal_tokenizers_on_random_text(text in text_strategy()) {
        for (name, tokenizer) in tiny_pipelines() {
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
fn sentencepiece_leading_space_rules_follow_each_pipeline() {
    let tokenizers = tiny_pipelines();
    let id = |text: &str| {
        let (_, llama2) = &tokenizers[0];
        llama2.tokenizer.token_to_id(text).unwrap()
    };
    let hello = id("▁hello");
    for (name, tokenizer) in tokenizers {
        for text in [
            "hello",
            " hello",
            "<x>hello",
            "hello<x>hello",
            "<x> hello",
            "  hello  world ",
            "",
            " ",
            "<x>",
            "o w",
            "hello o world",
            "a b ab a  b",
        ] {
            assert_same(name, tokenizer, text);
        }
        let ids = tokenizer.encode_prompt("hello<x>hello", false).unwrap();
        let x = tokenizer.tokenizer.token_to_id("<x>").unwrap();
        // Every pipeline but `never` marks the first word; only `first` leaves the word after
        // an added token unmarked (the normalizer's `Prepend` applies to every segment).
        let expected_first = if name.contains("never") || name.contains("Gemma") {
            vec![id("h"), id("el"), id("lo")]
        } else {
            vec![hello]
        };
        let expected_second =
            if name.contains("never") || name.contains("first") || name.contains("Gemma") {
                vec![id("h"), id("el"), id("lo")]
            } else {
                vec![hello]
            };
        let expected = [expected_first, vec![x], expected_second].concat();
        assert_eq!(ids, expected, "{name}");
    }
}

#[test]
fn sentencepiece_byte_fallback_spells_missing_chars_in_bytes() {
    let (name, tokenizer) = &tiny_pipelines()[0];
    let byte = |b: u8| 3 + u32::from(b);
    // `▁` then é (C3 A9) and 中 (E4 B8 AD): chars the vocab lacks.
    assert_eq!(
        tokenizer.encode_prompt("é中", false).unwrap(),
        [
            tokenizer.tokenizer.token_to_id("▁").unwrap(),
            byte(0xC3),
            byte(0xA9),
            byte(0xE4),
            byte(0xB8),
            byte(0xAD)
        ]
    );
    assert_same(name, tokenizer, "é中 hello😀a b\u{301}");
    // A byte token may be missing only where no missing char needs it: `\t` is in the vocab.
    let mut json = tiny_json();
    json["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .remove("<0x09>");
    let tokenizer = load(&json);
    assert_same("without <0x09>", &tokenizer, "a\tb é\t");
    let mut json = tiny_json();
    json["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .remove("<0xC3>");
    let tokenizer = load(&json);
    assert!(
        !tokenizer.uses_fast_path(),
        "a char that needs a missing byte token is not modelled"
    );
}

#[test]
fn sentencepiece_unknown_chars_are_fused_or_not_or_dropped() {
    let text = "hello é中 a😀😀b";
    for (fuse, unk_token) in [
        (true, json!("<unk>")),
        (false, json!("<unk>")),
        (true, Value::Null),
    ] {
        let mut json = tiny_json();
        json["model"]["byte_fallback"] = json!(false);
        json["model"]["fuse_unk"] = json!(fuse);
        json["model"]["unk_token"] = unk_token.clone();
        let tokenizer = load(&json);
        let name = format!("fuse_unk={fuse} unk_token={unk_token}");
        assert_same(&name, &tokenizer, text);
        let unks = tokenizer
            .encode_prompt(text, false)
            .unwrap()
            .iter()
            .filter(|&&id| id == 0)
            .count();
        let expected = match (fuse, unk_token.is_null()) {
            (_, true) => 0,  // dropped
            (true, _) => 2,  // `é中`, `😀😀`
            (false, _) => 4, // one per char
        };
        assert_eq!(unks, expected, "{name}");
    }
}

#[test]
fn sentencepiece_ignore_merges_takes_whole_words_only() {
    for (name, mut json) in pipelines() {
        json["model"]["ignore_merges"] = json!(true);
        let tokenizer = load(&json);
        for text in ["bad", " bad", "bad bad", "hello bad", "a bad", "<x>bad"] {
            assert_same(&name, &tokenizer, text);
        }
    }
}

#[test]
fn sentencepiece_cuts_never_split_a_merged_token() {
    // `a▁b` is one token: no cut after `a`, while `lo▁` keeps cuts after `o` out too.
    let (name, tokenizer) = &tiny_pipelines()[0];
    let id = |t: &str| tokenizer.tokenizer.token_to_id(t).unwrap();
    assert_eq!(
        tokenizer.encode_prompt("a b", false).unwrap(),
        [id("▁"), id("a▁b")]
    );
    for text in ["a b", "hello hello", "aa b", "a  b", "hello world.a b"] {
        assert_same(name, tokenizer, text);
    }
    let long = "hello world a b ".repeat(2000);
    assert_same(name, tokenizer, &long);
}

#[test]
fn sentencepiece_pipelines_take_no_leading_cuts() {
    let (_, tokenizer) = &tiny_pipelines()[0];
    assert!(!tokenizer.leading_cuts);
    let text = "hello world\nhello world ".repeat(200);
    let leading = tokenizer.encode_prompt_leading(&text, true, 64).unwrap();
    assert!(leading.complete);
    assert_eq!(
        leading.tokens,
        tokenizer.encode_with_tokenizers(&text, true).unwrap()
    );
}

/// Exactly the pipelines `raw_pipelines` lists read their segments raw: a normalized added token,
/// `ignore_merges`, another normalizer or a cut char missing from the vocab keeps the copy.
#[test]
fn sentencepiece_raw_reading_is_taken_only_where_it_is_exact() {
    let reads_raw = |json: &Value| load(json).fast.as_ref().unwrap().reads_raw();
    let raw: Vec<String> = raw_pipelines().into_iter().map(|(name, _)| name).collect();
    for (name, json) in pipelines() {
        assert_eq!(reads_raw(&json), raw.contains(&name), "{name}");
    }
    for (_, json) in raw_pipelines() {
        let mut ignore = json.clone();
        ignore["model"]["ignore_merges"] = json!(true);
        assert!(!reads_raw(&ignore), "ignore_merges looks whole words up");
        let mut nfc = json.clone();
        nfc["normalizer"] = json!({"type": "Sequence", "normalizers": [
            {"type": "NFC"}, nfc["normalizer"].clone()]});
        assert!(!reads_raw(&nfc), "NFC changes the text");
        let mut no_metaspace = json.clone();
        no_metaspace["model"]["vocab"]
            .as_object_mut()
            .unwrap()
            .remove("▁");
        // Without `▁` the merges naming it are malformed: drop them too.
        no_metaspace["model"]["merges"] = json!([["e", "l"], ["l", "o"]]);
        let fast = load(&no_metaspace).fast;
        assert!(fast.as_ref().is_none_or(|fast| !fast.reads_raw()));
    }
}

/// Raw reading gives the normalized path's ids on texts dense with its cases: spaces and `▁`
/// side by side, before and after chars that forbid a cut (`a`, `o`), at segment starts (after
/// `<x>` and `\n`, with and without `Prepend`), raw `▁▁` added tokens, and chars sharing `▁`'s
/// first byte (`–`, `…`: E2 80 xx).
#[test]
fn sentencepiece_raw_reading_equals_tokenizers_on_space_cases() {
    let texts = [
        " ",
        "  ",
        "▁",
        " ▁",
        "▁ ",
        "▁▁ ",
        " ▁▁",
        "a b",
        "a▁b",
        "a ▁b",
        "a  b",
        "lo w",
        "lo▁w",
        "\n hello",
        "\nhello\n\n world\n",
        "<x> <x>▁<x>  ",
        "–hello … world–",
        "a–b a…▁b",
        "hello world a b\nhello ▁world\ta b ",
    ];
    for (name, json) in raw_pipelines() {
        let tokenizer = load(&json);
        for text in texts {
            assert_same(&name, &tokenizer, text);
        }
        assert_same(&name, &tokenizer, &texts.concat().repeat(50));
    }
}

/// The eight-bytes-at-a-time searches (one byte, either of two) equal a plain one, from every start, on bytes dense with
/// the needle, its neighbours and high bytes (borrows between lanes).
#[test]
fn find_byte_equals_a_plain_search() {
    let mut rng = crate::testing::Rng::new(0xb1e);
    let alphabet = [0xe2u8, 0xe1, 0xe3, 0x62, 0x00, 0x01, 0x80, 0xff, b' ', b'a'];
    for _ in 0..20_000 {
        let len = rng.below(40);
        let bytes: Vec<u8> = (0..len).map(|_| *rng.pick(&alphabet)).collect();
        let needle = *rng.pick(&alphabet);
        let other = *rng.pick(&alphabet);
        for from in 0..=len + 1 {
            let first = |pick: &dyn Fn(u8) -> bool| {
                bytes
                    .get(from..)
                    .and_then(|tail| tail.iter().position(|&b| pick(b)))
                    .map(|at| from + at)
            };
            assert_eq!(
                super::sentencepiece::find_byte(&bytes, from, needle),
                first(&|b| b == needle),
                "{bytes:?} from {from} needle {needle:#x}"
            );
            assert_eq!(
                super::sentencepiece::find_either_byte(&bytes, from, needle, other),
                first(&|b| b == needle || b == other),
                "{bytes:?} from {from} needles {needle:#x} {other:#x}"
            );
        }
    }
}
