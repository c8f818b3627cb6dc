//! A profiling driver for the fast encoder on new text (no `tokenizers` in the loop, so a
//! profile shows only the encoder): `encode_new_text <tokenizer.json> [mixed|license] [seconds]`
//! encodes consecutive ~4 KiB cuts of 4 MiB of seeded mixed text (or the license corpus), each
//! once in turn, and prints the mean time per 1k tokens.
#![expect(
    clippy::unwrap_used,
    clippy::print_stdout,
    reason = "a developer tool: any failure should abort; it reports on stdout"
)]

use std::time::{Duration, Instant};

use kvroute_tokenize::FastBpe;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap();
    let corpus = args.next().unwrap_or_else(|| "mixed".to_owned());
    let seconds: f64 = args.next().map_or(5.0, |s| s.parse().unwrap());
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let bpe = FastBpe::from_tokenizer_json(&json).unwrap().unwrap();
    let text = match corpus.as_str() {
        "license" => {
            let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/corpus");
            let mut files: Vec<_> = std::fs::read_dir(dir)
                .unwrap()
                .map(|entry| entry.unwrap().path())
                .collect();
            files.sort();
            files
                .iter()
                .map(|file| std::fs::read_to_string(file).unwrap())
                .collect()
        }
        _ => kvroute_tokenize::testing::mixed_text(11, 4 << 20, &[]),
    };
    let mut cuts = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + 4096).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        cuts.push(&text[start..end]);
        start = end;
    }
    let (mut tokens, mut next) = (0usize, 0);
    let cpu_started = cpu_seconds();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs_f64(seconds) {
        for _ in 0..64 {
            tokens += std::hint::black_box(bpe.encode(cuts[next], true)).len();
            next = (next + 1) % cuts.len();
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_started;
    println!(
        "{corpus}: {:.1} µs CPU per 1k tokens, {:.1} µs wall ({tokens} tokens)",
        cpu * 1e9 / tokens as f64,
        elapsed * 1e9 / tokens as f64
    );
}

/// This process' user + system CPU time (Linux, 10 ms ticks; 0 elsewhere): on a shared machine
/// the time it ran, not the time it waited for a core.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}
