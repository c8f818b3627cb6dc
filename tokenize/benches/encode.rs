//! Encoding ~1k- and ~32k-token prompts (license texts from tests/fixtures/corpus) with the
//! `tokenizers` crate and with the fast byte-level BPE path; both give identical ids.
#![expect(
    clippy::unwrap_used,
    reason = "benchmark setup: any failure should abort the run"
)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_tokenize::ModelTokenizer;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

/// The corpus text, repeated as needed, cut to about `tokens` tokens (at a char boundary).
fn prompt(tokenizer: &ModelTokenizer, tokens: usize) -> String {
    let mut files: Vec<_> = std::fs::read_dir(format!("{FIXTURES}/corpus"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    let corpus: String = files
        .iter()
        .map(|file| std::fs::read_to_string(file).unwrap())
        .collect();
    let mut text = String::new();
    while tokenizer.encode_prompt(&text, false).unwrap().len() < tokens {
        text.push_str(&corpus);
    }
    let ratio = text.len() as f64 / tokenizer.encode_prompt(&text, false).unwrap().len() as f64;
    let mut end = ((tokens as f64 * ratio) as usize).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

fn bench_encode(c: &mut Criterion) {
    let tokenizer = ModelTokenizer::from_dir(format!("{FIXTURES}/tiny-model")).unwrap();
    assert!(tokenizer.uses_fast_path());
    for (name, tokens) in [("1k_tokens", 1_000), ("32k_tokens", 32_000)] {
        let text = prompt(&tokenizer, tokens);
        let ids = tokenizer.encode_prompt(&text, true).unwrap();
        assert_eq!(ids, tokenizer.encode_with_tokenizers(&text, true).unwrap());
        let mut group = c.benchmark_group(format!("encode_{name}"));
        group.throughput(Throughput::Elements(ids.len() as u64));
        group.bench_function("tokenizers", |b| {
            b.iter(|| tokenizer.encode_with_tokenizers(black_box(&text), true))
        });
        group.bench_function("fast", |b| {
            b.iter(|| tokenizer.encode_prompt(black_box(&text), true))
        });
        group.finish();
    }
}

criterion_group!(benches, bench_encode);
criterion_main!(benches);
