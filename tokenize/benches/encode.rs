//! Encoding ~1k- and ~32k-token prompts with the `tokenizers` crate and with the fast exact
//! encoder, on the project's tiny model and on each real tokenizer folder present
//! (`scripts/models.sh`: Qwen3, Llama 3.1, gpt-oss, Qwen2.5, DeepSeek-V3, Mistral NeMo, Llama 2,
//! Gemma 2, Gemma 3); both give identical ids (asserted).
//! Inputs: license texts from tests/fixtures/corpus (English prose) and seeded mixed text
//! (`kvroute_tokenize::testing::mixed_text`: code, JSON, CJK, Arabic, emoji, marks, …).
//! Throughput is in tokens, so criterion's time per iteration of a `1k_tokens` group is the cost
//! per ~1k tokens; the setup prints each model's load time and the memory it added.
#![expect(
    clippy::unwrap_used,
    reason = "benchmark setup: any failure should abort the run"
)]

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_tokenize::{FastBpe, FastEncoderKind, ModelTokenizer};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

/// `text` repeated as needed and cut to about `tokens` tokens (at a char boundary).
fn prompt(tokenizer: &ModelTokenizer, source: &str, tokens: usize) -> String {
    let mut text = String::new();
    while tokenizer.encode_prompt(&text, false).unwrap().len() < tokens {
        text.push_str(source);
    }
    let ratio = text.len() as f64 / tokenizer.encode_prompt(&text, false).unwrap().len() as f64;
    let mut end = ((tokens as f64 * ratio) as usize).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

fn license_corpus() -> String {
    let mut files: Vec<_> = std::fs::read_dir(format!("{FIXTURES}/corpus"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|file| std::fs::read_to_string(file).unwrap())
        .collect()
}

/// Resident memory of this process in bytes (Linux; 0 elsewhere).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Loads a model folder, printing the load time, the part the fast encoder's build takes and
/// the memory the load kept.
fn load(name: &str, dir: &PathBuf) -> ModelTokenizer {
    let before = rss_bytes();
    let started = Instant::now();
    let tokenizer = ModelTokenizer::from_dir(dir).unwrap();
    let total = started.elapsed();
    let after = rss_bytes();
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let started = Instant::now();
    let fast = FastBpe::from_tokenizer_json(&json).unwrap();
    let build = started.elapsed();
    drop(fast);
    eprintln!(
        "{name}: load {:.0} ms (fast encoder build {:.0} ms of it, plus the JSON parse), \
         RSS +{:.0} MiB; fast encoder: {:?}",
        total.as_secs_f64() * 1e3,
        build.as_secs_f64() * 1e3,
        after.saturating_sub(before) as f64 / (1 << 20) as f64,
        tokenizer.fast_encoder_kind().map(FastEncoderKind::name),
    );
    tokenizer
}

fn models() -> Vec<(String, PathBuf)> {
    let mut models = vec![(
        "tiny".to_owned(),
        PathBuf::from(format!("{FIXTURES}/tiny-model")),
    )];
    let dir = kvroute_tokenize::testing::real_models_dir();
    for name in kvroute_tokenize::testing::REAL_MODELS {
        match dir.as_ref().map(|d| d.join(name)) {
            Some(path) if path.join("tokenizer.json").is_file() => {
                models.push((name.to_owned(), path));
            }
            _ => eprintln!(
                "SKIP {name}: no tokenizer folder; run `bash scripts/models.sh` \
                 (sets KVROUTE_MODELS)"
            ),
        }
    }
    models
}

/// About `tokens`-token consecutive cuts of `text`, each encoded once in turn, so each
/// iteration sees text it has not just seen. On 4 MiB of mixed text (another seed) most pieces
/// miss the fast encoder's word cache, as a router's new prompts do, where the groups above
/// repeat one prompt and find every piece cached. On the license corpus (~180 KB, ~40 cuts)
/// the cache holds the corpus' words after the first pass: new English prompts over a vocabulary
/// the router has seen, the common case between a cold start and the fully cached one.
fn new_text_prompts(tokenizer: &ModelTokenizer, text: &str, tokens: usize) -> (Vec<String>, u64) {
    let sample = prompt(tokenizer, text, tokens);
    let cut_bytes = sample.len().max(1);
    let mut cuts = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + cut_bytes).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        cuts.push(text[start..end].to_owned());
        start = end;
    }
    let mut total = 0;
    for cut in &cuts {
        let ids = tokenizer.encode_prompt(cut, true).unwrap();
        assert_eq!(ids, tokenizer.encode_with_tokenizers(cut, true).unwrap());
        total += ids.len() as u64;
    }
    let mean_tokens = total / cuts.len() as u64;
    (cuts, mean_tokens)
}

fn bench_encode(c: &mut Criterion) {
    let license = license_corpus();
    let mixed = kvroute_tokenize::testing::mixed_text(7, 1 << 20, &[]);
    let new_mixed = kvroute_tokenize::testing::mixed_text(11, 4 << 20, &[]);
    for (model, dir) in models() {
        let tokenizer = load(&model, &dir);
        assert!(tokenizer.uses_fast_path(), "{model}");
        let inputs = [
            ("license_1k_tokens", &license, 1_000),
            ("mixed_1k_tokens", &mixed, 1_000),
            ("license_32k_tokens", &license, 32_000),
        ];
        for (name, source, tokens) in inputs {
            let text = prompt(&tokenizer, source, tokens);
            let ids = tokenizer.encode_prompt(&text, true).unwrap();
            assert_eq!(ids, tokenizer.encode_with_tokenizers(&text, true).unwrap());
            let mut group = c.benchmark_group(format!("encode_{model}_{name}"));
            group.throughput(Throughput::Elements(ids.len() as u64));
            group.bench_function("tokenizers", |b| {
                b.iter(|| tokenizer.encode_with_tokenizers(black_box(&text), true))
            });
            group.bench_function("fast", |b| {
                b.iter(|| tokenizer.encode_prompt(black_box(&text), true))
            });
            group.finish();
        }
        for (name, source) in [("mixed", &new_mixed), ("license", &license)] {
            let (cuts, mean_tokens) = new_text_prompts(&tokenizer, source, 1_000);
            let mut group = c.benchmark_group(format!("encode_{model}_{name}_1k_tokens_new_text"));
            group.throughput(Throughput::Elements(mean_tokens));
            let mut next = 0;
            group.bench_function("tokenizers", |b| {
                b.iter(|| {
                    next = (next + 1) % cuts.len();
                    tokenizer.encode_with_tokenizers(black_box(&cuts[next]), true)
                })
            });
            let mut next = 0;
            group.bench_function("fast", |b| {
                b.iter(|| {
                    next = (next + 1) % cuts.len();
                    tokenizer.encode_prompt(black_box(&cuts[next]), true)
                })
            });
            group.finish();
        }
    }
}

criterion_group!(benches, bench_encode);
criterion_main!(benches);
