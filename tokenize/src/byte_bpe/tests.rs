use std::borrow::Cow;
use std::path::PathBuf;

use unicode_normalization_alignments::UnicodeNormalization;

fn whole_nfc(text: &str) -> String {
    text.nfc().map(|(c, _)| c).collect()
}

#[test]
fn chunked_nfc_equals_nfc_of_the_whole_text() {
    let adversarial = [
        "",
        "e\u{301}",
        "\u{301}e",
        "e\u{301}\u{327}x\u{327}\u{301}",
        "ab\u{301}c\u{308}\u{304}",
        "\u{1100}\u{1161}\u{11a8} \u{1100}\u{1161}",
        "A\u{30a}\u{1e0a}\u{323}\u{301}",
        "\u{0b47}\u{0b3e}z\u{0dd9}\u{0dcf}",
        "e\u{301}\u{301}\u{301}e",
        "\u{fb01}\u{212b}\u{2126}q",
        "x\u{338}=\u{338}<\u{338}",
        "already é nfc ü",
    ];
    for text in adversarial {
        assert_eq!(super::nfc(text), whole_nfc(text), "{text:?}");
    }
    let mut normalized = 0;
    for seed in 0..300 {
        let text = crate::testing::mixed_text(seed, 4096, &[]);
        let chunked = super::nfc(&text);
        assert_eq!(chunked, whole_nfc(&text), "seed {seed}");
        match chunked {
            Cow::Borrowed(_) => assert_eq!(text, whole_nfc(&text), "seed {seed}: not NFC"),
            Cow::Owned(_) => normalized += 1,
        }
    }
    assert!(
        normalized > 100,
        "only {normalized} of 300 texts needed normalizing"
    );
}

/// The tiny model's encoder, and each real tokenizer folder's present (found as
/// `real_tests` finds them); prints a skip line for each missing one.
fn encoders(test: &str) -> Vec<(String, super::FastBpe)> {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
    let mut dirs = vec![(
        "tiny".to_owned(),
        PathBuf::from(format!("{fixtures}/tiny-model")),
    )];
    let models = crate::testing::real_models_dir();
    for name in crate::testing::REAL_MODELS {
        match models.as_ref().map(|models| models.join(name)) {
            Some(dir) if dir.join("tokenizer.json").is_file() => {
                dirs.push((name.to_owned(), dir));
            }
            _ => eprintln!(
                "SKIP {test} for {name}: no tokenizer folder; run `bash scripts/models.sh` \
                 (sets KVROUTE_MODELS)"
            ),
        }
    }
    dirs.into_iter()
        .map(|(name, dir)| {
            let bytes = std::fs::read(dir.join("tokenizer.json")).unwrap();
            let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let bpe = super::FastBpe::from_tokenizer_json(&json).unwrap().unwrap();
            (name, bpe)
        })
        .collect()
}

/// A batch whose word cache is held elsewhere (here: by the test) is encoded without it, at once and
/// exactly: cold (nothing cached), warm, and while held (the held call returns, so it did not
/// wait for the holder).
#[test]
fn encoding_while_the_word_cache_is_held_elsewhere_is_exact() {
    for (name, bpe) in encoders("encoding_while_the_word_cache_is_held_elsewhere_is_exact") {
        for seed in 0..20 {
            let text = crate::testing::mixed_text(seed, 4096, &[]);
            let cold = bpe.encode(&text, true);
            let warm = bpe.encode(&text, true);
            let held = {
                let _holder = bpe.cache.lock();
                bpe.encode(&text, true)
            };
            assert_eq!(cold, warm, "{name} seed {seed}");
            assert_eq!(
                held, warm,
                "{name} seed {seed}: encoded with the cache held"
            );
        }
    }
}

/// The short-word merge must give the heap's ids: on repeated-symbol words (ties of one
/// rank everywhere), words made of a few frequent tokens' bytes, random bytes, and every
/// length up to past the threshold.
#[test]
fn short_word_merge_equals_the_heap_merge() {
    const ALPHABETS: &[&[u8]] = &[
        b"a",
        b" ",
        b"ab",
        b"ing ther",
        b" theandofis",
        b"0123456789",
        "\u{e9}\u{4e2d}\u{6587}\u{1f600}".as_bytes(),
        b"{}\":, \n\t",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut scratch = super::Scratch::default();
    let mut short = Vec::new();
    for (name, bpe) in encoders("short_word_merge_equals_the_heap_merge") {
        let mut words: Vec<Vec<u8>> = Vec::new();
        for len in 2..=super::SHORT_WORD {
            for alphabet in ALPHABETS {
                for _ in 0..40 {
                    words.push(
                        (0..len)
                            .map(|_| alphabet[next() as usize % alphabet.len()])
                            .collect(),
                    );
                }
            }
            for _ in 0..40 {
                words.push((0..len).map(|_| next() as u8).collect());
            }
            for byte in [b'a', b' ', b'0', b'=', b'\n'] {
                words.push(vec![byte; len]);
            }
        }
        let super::Alphabet::Bytes(byte_ids) = &bpe.alphabet else {
            continue;
        };
        for word in &words {
            let initial: Vec<u32> = word.iter().map(|&b| byte_ids[usize::from(b)]).collect();
            bpe.merge_word(&initial, &mut scratch);
            bpe.merge_short(&initial, &mut short);
            assert_eq!(short, scratch.word, "{name}: {word:?}");
        }
    }
}

/// The prefiltered added-token split equals the automaton run over the whole text, on
/// tokens that overlap, nest and share first bytes, and text dense with near misses.
#[test]
fn added_token_split_equals_the_whole_text_automaton() {
    use daachorse::{DoubleArrayAhoCorasickBuilder, MatchKind};

    let tokens = [
        "<|a|>",
        "<|ab|>",
        "<|",
        "<s>",
        "</s>",
        "ab",
        "b<",
        "\u{e9}t\u{e9}",
        "\u{e9}",
        "|>x",
    ];
    let matcher = super::matcher(
        tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (Cow::Borrowed(*t), id as u32))
            .collect(),
    )
    .ok()
    .flatten()
    .unwrap();
    let whole = DoubleArrayAhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build_with_values(tokens.iter().enumerate().map(|(id, t)| (*t, id as u32)))
        .unwrap();
    let fragments = ["<", "|", ">", "a", "b", "s", "/", "\u{e9}", "t", "x", " "];
    let mut rng = crate::testing::Rng::new(9);
    for _ in 0..20_000 {
        let text: String = (0..rng.below(30)).map(|_| *rng.pick(&fragments)).collect();
        let mut expected = Vec::new();
        let mut start = 0;
        for found in whole.leftmost_find_iter(&text) {
            if found.start() > start {
                expected.push(Err(text[start..found.start()].to_owned()));
            }
            expected.push(Ok(found.value()));
            start = found.end();
        }
        if start < text.len() {
            expected.push(Err(text[start..].to_owned()));
        }
        let mut got = Vec::new();
        super::split_on(Some(&matcher), &text, &mut |segment| {
            got.push(match segment {
                super::Segment::Added(id) => Ok(id),
                super::Segment::Text(t) => Err(t.to_owned()),
            });
        });
        assert_eq!(got, expected, "{text:?}");
    }
}

/// Words seen once take the second way only: a word found again stays cached through any
/// number of new words of its bucket.
#[test]
fn new_words_do_not_evict_a_recurring_word() {
    let word = |text: &str, id: u32| super::CachedWord::new(text.as_bytes(), &[id]).unwrap();
    let mut bucket = super::CacheBucket::EMPTY;
    let mut out = Vec::new();
    bucket.store(word("alpha", 1));
    bucket.store(word("beta", 2));
    assert!(bucket.ids_of(b"beta", &mut out));
    for (i, new) in ["gamma", "delta", "epsilon"].into_iter().enumerate() {
        bucket.store(word(new, 3 + i as u32));
        assert!(bucket.ids_of(b"beta", &mut out), "{new}");
    }
    assert!(!bucket.ids_of(b"alpha", &mut out));
    assert!(!bucket.ids_of(b"gamma", &mut out));
    assert!(bucket.ids_of(b"epsilon", &mut out));
    assert_eq!(out, [2, 2, 2, 2, 5]);
}

#[test]
fn text_in_nfc_is_not_copied() {
    assert!(matches!(super::nfc("plain ascii"), Cow::Borrowed(_)));
    assert!(matches!(super::nfc("déjà vu, ☃ 中文"), Cow::Borrowed(_)));
    assert!(matches!(super::nfc("de\u{301}ja\u{300}"), Cow::Owned(_)));
}
