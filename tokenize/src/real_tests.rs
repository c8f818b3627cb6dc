//! The fast encoder against `tokenizers` on the real tokenizer folders that `scripts/models.sh`
//! caches — byte-level BPE: Qwen3, Qwen2.5, Llama 3.1, gpt-oss, DeepSeek-V3, Mistral NeMo
//! (Tekken); SentencePiece-style BPE: Llama 2, Gemma 2, Gemma 3 — on seeded mixed text plus
//! adversarial cases, token for token. Skipped, saying so, when the folders are absent.
//!
//! 10 MiB per tokenizer, in the normal debug test build: the workspace's `profile.dev` optimises
//! this crate and `tokenizers` (a fully unoptimised `tokenizers` needs minutes for it).

use std::sync::OnceLock;

use super::*;
use crate::testing::{REAL_MODELS, Rng, mixed_text, real_models_dir};

/// The fast encoder each folder must be served by.
fn expected_kind(name: &str) -> FastEncoderKind {
    match name {
        "llama2" | "gemma2" | "gemma3" => FastEncoderKind::SentencePieceBpe,
        _ => FastEncoderKind::ByteBpe,
    }
}

/// Each real tokenizer present, loaded once per test process (`None` if that folder is absent).
fn real(name: &str) -> Option<&'static ModelTokenizer> {
    static LOADED: OnceLock<Vec<(&'static str, Option<ModelTokenizer>)>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        REAL_MODELS
            .iter()
            .map(|&model| {
                let dir = real_models_dir().map(|d| d.join(model));
                let tokenizer = dir
                    .filter(|d| d.join("tokenizer.json").is_file())
                    .map(|d| ModelTokenizer::from_dir(&d).unwrap());
                (model, tokenizer)
            })
            .collect()
    });
    loaded
        .iter()
        .find(|(model, _)| *model == name)
        .and_then(|(_, tokenizer)| tokenizer.as_ref())
}

/// The real tokenizers present; prints a skip line for each missing one.
fn present(test: &str) -> Vec<(&'static str, &'static ModelTokenizer)> {
    REAL_MODELS
        .iter()
        .filter_map(|&name| {
            let tokenizer = real(name);
            if tokenizer.is_none() {
                eprintln!(
                    "SKIP {test} for {name}: no tokenizer folder; run `bash scripts/models.sh` \
                     (sets KVROUTE_MODELS)"
                );
            }
            Some((name, tokenizer?))
        })
        .collect()
}

fn added_contents(tokenizer: &ModelTokenizer) -> Vec<String> {
    let mut added: Vec<_> = tokenizer
        .tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .collect();
    added.sort_unstable_by_key(|(id, _)| *id);
    added.into_iter().map(|(_, token)| token.content).collect()
}

/// Asserts fast == `tokenizers` on `text`, reporting the first differing token in context.
fn assert_exact(name: &str, tokenizer: &ModelTokenizer, text: &str, add_special_tokens: bool) {
    let fast = tokenizer.encode_prompt(text, add_special_tokens).unwrap();
    let reference = tokenizer
        .encode_with_tokenizers(text, add_special_tokens)
        .unwrap();
    if fast == reference {
        return;
    }
    let at = fast
        .iter()
        .zip(&reference)
        .position(|(a, b)| a != b)
        .unwrap_or(fast.len().min(reference.len()));
    let window = |ids: &[u32]| {
        let lo = at.saturating_sub(3);
        let hi = (at + 4).min(ids.len());
        ids[lo..hi]
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect::<Vec<_>>()
    };
    panic!(
        "{name}: fast != tokenizers at token {at} (add_special_tokens={add_special_tokens}, \
         {} bytes of text)\n fast: {:?}\n   hf: {:?}\n text: {:?}",
        text.len(),
        window(&fast),
        window(&reference),
        if text.len() < 2000 { text } else { "(long)" },
    );
}

/// Hand-picked inputs at the edges of the patterns, the normalizer and the added tokens.
fn adversarial(specials: &[String]) -> Vec<String> {
    let mut cases: Vec<String> = [
        "", " ", "  ", "\n", "\r\n", "\r\n\r\n", " \r\n ", "\t\t\n  \n", "a  ", "  a", "a \n b",
        "I'LL DON'T we'Re it'\u{17f} 'tis ''s '", "HTTPServer getHTTPResponse iPhone ABCdef",
        "123456789012345678901234567890", "\u{663}\u{664}\u{665}\u{666} \u{ff11}\u{ff12}",
        "e\u{301} \u{e9} a\u{323}\u{301} a\u{301}\u{323} \u{212b} \u{f900} \u{1100}\u{1161}\u{11a8}",
        "\u{301}\u{301}x \u{301}", "x\u{301}Y\u{301}z", "\u{1f468}\u{200d}\u{1f469}\u{200d}\u{1f467}\u{1f44d}\u{1f3fd}",
        "\u{a0}\u{a0}x \u{3000}\u{3000}y \u{2028}z\u{2029}", "!!!\n\n/// ...\r\n/x", "a/b/c //d",
        "\u{4e2d}\u{6587}Abc\u{4e2d}", "\u{645}\u{64e}\u{631}\u{652}\u{62d}\u{64e}\u{628}\u{64b}\u{627}",
        "\u{928}\u{92e}\u{938}\u{94d}\u{924}\u{947}", "\u{e2a}\u{e27}\u{e31}\u{e2a}\u{e14}\u{e35}",
        "\u{1c5}ungla \u{2b0}\u{2b0}a \u{2160}\u{2161}",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    cases.push(" ".repeat(10_000));
    cases.push(format!("a{}b", "\n".repeat(3000)));
    cases.push("x".repeat(20_000));
    cases.push("\u{4e2d}".repeat(5000));
    cases.push("e\u{301}".repeat(3000));
    cases.push("9".repeat(5000));
    for special in specials {
        cases.push(special.clone());
        cases.push(format!(
            "x{special}y {special}\n{special}{special} {special}"
        ));
        cases.push(format!("e\u{301}{special}\u{301}"));
        cases.push(format!("'{special}s"));
    }
    cases
}

fn check_model(name: &str, tokenizer: &ModelTokenizer, seed: u64, bytes: usize) {
    assert_eq!(
        tokenizer.fast_encoder_kind(),
        Some(expected_kind(name)),
        "{name}: not served by its fast encoder"
    );
    let specials = added_contents(tokenizer);
    for case in adversarial(&specials) {
        for add in [true, false] {
            assert_exact(name, tokenizer, &case, add);
        }
    }
    let special_refs: Vec<&str> = specials.iter().map(String::as_str).collect();
    let text = mixed_text(seed, bytes, &special_refs);
    // Documents of varied length, cut anywhere (at a char boundary).
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + 1 + rng.below(64 * 1024)).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        assert_exact(name, tokenizer, &text[start..end], rng.below(2) == 0);
        start = end;
    }
}

#[test]
fn real_tokenizers_fast_equals_tokenizers_on_10_mib() {
    for (name, tokenizer) in present("real_tokenizers_fast_equals_tokenizers_on_10_mib") {
        check_model(name, tokenizer, 10, 10 * 1024 * 1024);
    }
}

/// Asserts, for cuts at several offsets of `text`, that the leading tokens are exactly the first
/// tokens of the whole text's — by `tokenizers` alone too (the property is HF's, not only the
/// fast encoder's) — and that some cuts were taken; returns how many.
fn assert_leading_prefix(
    name: &str,
    tokenizer: &ModelTokenizer,
    text: &str,
    rng: &mut Rng,
) -> usize {
    let add = rng.below(2) == 0;
    let whole = tokenizer.encode_prompt(text, add).unwrap();
    let whole_hf = tokenizer.encode_with_tokenizers(text, false).unwrap();
    let mut cuts = 0;
    for _ in 0..8 {
        let min = rng.below(text.len().max(1));
        let leading = tokenizer.encode_prompt_leading(text, add, min).unwrap();
        assert_eq!(leading.total_bytes, Some(text.len()));
        if leading.complete {
            assert_eq!(
                leading.tokens, whole,
                "{name}: complete leading tokens differ"
            );
            continue;
        }
        cuts += 1;
        let cut = leading.text_bytes;
        assert!(
            cut >= min && cut < text.len(),
            "{name}: cut {cut} for min {min}"
        );
        assert!(
            whole.starts_with(&leading.tokens),
            "{name}: tokens of text[..{cut}] are not a prefix (add_special_tokens={add}); around \
             the cut: {:?}",
            &text[text.floor_char_boundary(cut.saturating_sub(40))
                ..text.ceil_char_boundary(cut + 40)],
        );
        let hf = tokenizer
            .encode_with_tokenizers(&text[..cut], false)
            .unwrap();
        assert!(
            whole_hf.starts_with(&hf),
            "{name}: tokenizers' tokens of text[..{cut}] are not a prefix"
        );
    }
    cuts
}

/// Cuts from `leading_cut` keep the tokens before them, on mixed text (prose, code, JSON,
/// scripts, emoji, combining marks and NFD forms, whitespace runs, added tokens whole and cut)
/// and the adversarial cases, for every real tokenizer.
#[test]
fn real_tokenizers_leading_tokens_are_the_prompts_first_tokens() {
    for (name, tokenizer) in present("real_tokenizers_leading_tokens_are_the_prompts_first_tokens")
    {
        if expected_kind(name) == FastEncoderKind::SentencePieceBpe {
            // No cuts: the leading tokens are the whole prompt's.
            assert!(!tokenizer.leading_cuts, "{name}: leading cuts enabled");
            let text = mixed_text(7, 16 * 1024, &[]);
            let leading = tokenizer.encode_prompt_leading(&text, true, 1024).unwrap();
            assert!(leading.complete, "{name}");
            assert_eq!(
                leading.tokens,
                tokenizer.encode_with_tokenizers(&text, true).unwrap()
            );
            continue;
        }
        assert!(tokenizer.leading_cuts, "{name}: leading cuts disabled");
        let specials = added_contents(tokenizer);
        let mut rng = Rng::new(0x1ead);
        for case in adversarial(&specials) {
            assert_leading_prefix(name, tokenizer, &case, &mut rng);
        }
        let special_refs: Vec<&str> = specials.iter().map(String::as_str).collect();
        let text = mixed_text(7, 512 * 1024, &special_refs);
        let (mut start, mut cuts) = (0, 0);
        while start < text.len() {
            let end = text.ceil_char_boundary((start + 1 + rng.below(32 * 1024)).min(text.len()));
            cuts += assert_leading_prefix(name, tokenizer, &text[start..end], &mut rng);
            start = end;
        }
        assert!(cuts > 100, "{name}: only {cuts} cuts taken");
    }
}

/// A conversation's turns through [`ModelTokenizer::encode_chat_resumable`], each taking over the
/// turn before it: every turn's tokens equal [`ModelTokenizer::encode_chat_with`]'s (and, for
/// the real tokenizers' first turns, `tokenizers`' own); most turns encode only their new text;
/// a prior of another conversation or of another `add_special_tokens` is never taken.
fn assert_resumed_turns_are_exact(name: &str, tokenizer: &ModelTokenizer, seed: u64) {
    let specials = added_contents(tokenizer);
    let special_refs: Vec<&str> = specials.iter().map(String::as_str).collect();
    let text = mixed_text(seed, 512 * 1024, &special_refs);
    let mut rng = Rng::new(seed);
    let mut cut_rng = Rng::new(seed ^ 0x1ead);
    let mut piece = |max: usize| {
        let start = text.floor_char_boundary(rng.below(text.len() - max - 8));
        let len = 1 + rng.below(max);
        text[start..text.floor_char_boundary(start + len)].to_owned()
    };
    // Turns whose rendered text starts with the previous turn's up to its resume point: a
    // template that moves the system prompt to the last user message (Mistral's) has none.
    let (mut extending, mut resumed) = (0, 0);
    // Leading parts whose chat was rendered only up to them.
    let mut rendered_in_part = 0;
    for conversation in 0..12 {
        let options = ChatOptions {
            add_special_tokens: conversation % 3 == 2,
            ..ChatOptions::default()
        };
        let mut messages = vec![
            serde_json::json!({"role": "system", "content": piece(400)}),
            serde_json::json!({"role": "user", "content": piece(6000)}),
        ];
        let mut prior: Option<(ResumePoint, Vec<u32>)> = None;
        let mut previous_rendered = String::new();
        for turn in 0..5 {
            let chat = serde_json::Value::Array(messages.clone());
            let expected = tokenizer.encode_chat_with(&chat, &options).unwrap();
            let rendered = tokenizer.render_chat_with(&chat, &options).unwrap();
            let extends = prior.as_ref().is_some_and(|(point, _)| {
                rendered
                    .as_bytes()
                    .starts_with(&previous_rendered.as_bytes()[..point.text_bytes])
            });
            let got = tokenizer
                .encode_chat_resumable(&chat, &options, prior.as_ref().map(|(p, t)| (p, &t[..])))
                .unwrap();
            assert_eq!(
                got.tokens, expected,
                "{name}: conversation {conversation} turn {turn} differs when resumed"
            );
            if turn == 0 && name != "tiny" {
                let hf = tokenizer
                    .encode_with_tokenizers(&rendered, options.add_special_tokens)
                    .unwrap();
                assert_eq!(got.tokens, hf, "{name}: conversation {conversation}");
            }
            // The leading part's resume point is where the rest of the same prompt takes over.
            let leading = tokenizer
                .encode_chat_leading(&chat, &options, 1 + cut_rng.below(4096))
                .unwrap();
            assert_eq!(
                leading.tokens,
                expected[..leading.tokens.len()],
                "{name}: conversation {conversation} turn {turn}: leading tokens"
            );
            if tokenizer.leading_cuts {
                let leading_point = leading.resume.expect("chats have resume points");
                if leading.rendered.as_ref().is_some_and(|r| !r.is_whole()) {
                    rendered_in_part += 1;
                    assert_eq!(leading.total_bytes, None, "{name}");
                } else {
                    assert_eq!(leading.total_bytes, Some(rendered.len()), "{name}");
                }
                let rest = tokenizer
                    .encode_chat_resumable(&chat, &options, Some((&leading_point, &leading.tokens)))
                    .unwrap();
                assert_eq!(
                    (rest.tokens.as_slice(), rest.prior_taken || leading.complete),
                    (expected.as_slice(), true),
                    "{name}: conversation {conversation} turn {turn} from its leading part"
                );
                // The rest from the chat the leading part rendered (not rendered again).
                assert_eq!(leading.rendered.is_some(), !leading.complete, "{name}");
                if let Some(rendered) = &leading.rendered {
                    let from_rendered = tokenizer
                        .encode_rendered_chat_resumable(
                            rendered,
                            Some((&leading_point, &leading.tokens)),
                        )
                        .unwrap();
                    assert_eq!(
                        from_rendered, rest,
                        "{name}: conversation {conversation} turn {turn} from its rendered chat"
                    );
                    // A longer leading part of the same rendered chat, taking over this one:
                    // the tokens a fresh render and encoding of that part give.
                    let longer = 4 * (1 + cut_rng.below(4096));
                    let grown = tokenizer
                        .encode_rendered_leading(
                            rendered,
                            longer,
                            Some((&leading_point, &leading.tokens)),
                        )
                        .unwrap();
                    let fresh = tokenizer
                        .encode_chat_leading(&chat, &options, longer)
                        .unwrap();
                    assert_eq!(
                        (
                            &grown.tokens,
                            grown.complete,
                            grown.resume,
                            grown.text_bytes
                        ),
                        (
                            &fresh.tokens,
                            fresh.complete,
                            fresh.resume,
                            fresh.text_bytes
                        ),
                        "{name}: conversation {conversation} turn {turn}: a leading part grown"
                    );
                    assert_eq!(grown.rendered.is_some(), !grown.complete, "{name}");
                }
            } else {
                assert_eq!(
                    (leading.tokens.as_slice(), leading.complete),
                    (expected.as_slice(), true),
                    "{name}: conversation {conversation} turn {turn}: leading tokens"
                );
            }
            assert!(
                extends || !got.prior_taken,
                "{name}: a prior taken over text that differs"
            );
            if extends {
                extending += 1;
            }
            if got.prior_taken {
                resumed += 1;
            }
            // Another conversation's prior is refused. This one's under the other
            // `add_special_tokens` may be taken only where the flag changes nothing (a template
            // that renders the special tokens itself). The answers are exact either way.
            if let Some((point, tokens)) = &prior {
                let other = serde_json::json!([
                    {"role": "system", "content": piece(400)},
                    {"role": "user", "content": piece(3000)},
                ]);
                let refused = tokenizer
                    .encode_chat_resumable(&other, &options, Some((point, tokens)))
                    .unwrap();
                assert!(
                    !refused.prior_taken,
                    "{name}: another conversation's prior taken"
                );
                assert_eq!(
                    refused.tokens,
                    tokenizer.encode_chat_with(&other, &options).unwrap(),
                    "{name}: another conversation's prior changed the tokens"
                );
                let flipped = ChatOptions {
                    add_special_tokens: !options.add_special_tokens,
                    ..options.clone()
                };
                let other_flag = tokenizer
                    .encode_chat_resumable(&chat, &flipped, Some((point, tokens)))
                    .unwrap();
                assert_eq!(
                    other_flag.tokens,
                    tokenizer.encode_chat_with(&chat, &flipped).unwrap(),
                    "{name}: a prior of the other add_special_tokens changed the tokens"
                );
            }
            prior = got.resume.map(|point| (point, got.tokens));
            previous_rendered = rendered;
            messages.push(serde_json::json!({"role": "assistant", "content": piece(800)}));
            messages.push(serde_json::json!({"role": "user", "content": piece(1500)}));
        }
    }
    assert!(
        !tokenizer.leading_cuts || rendered_in_part > 20,
        "{name}: only {rendered_in_part} of 60 leading parts rendered in part"
    );
    // Models without cuts (SentencePiece) have no resume points: every turn is encoded whole.
    assert!(
        resumed * 10 >= extending * 9,
        "{name}: only {resumed} of {extending} turns that extend the previous one resumed"
    );
}

/// Resumed conversations are exact on every real tokenizer and the tiny model.
#[test]
fn real_tokenizers_resumed_conversations_equal_whole_encodings() {
    let tiny = ModelTokenizer::from_dir(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/tiny-model"
    ))
    .unwrap();
    assert_resumed_turns_are_exact("tiny", &tiny, 0x7e5);
    for (name, tokenizer) in present("real_tokenizers_resumed_conversations_equal_whole_encodings")
    {
        if !tokenizer.has_chat_template() {
            eprintln!(
                "SKIP real_tokenizers_resumed_conversations_equal_whole_encodings for {name}: \
                 no chat template (gpt-oss's is in ../shared)"
            );
            continue;
        }
        assert_resumed_turns_are_exact(name, tokenizer, 0x7e5);
    }
}
