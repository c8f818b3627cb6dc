//! kvroute's in-process tokens against real SGLang's, on real models, for every request shape.
//!
//! `tests/fixtures/sglang-goldens/` holds, per model, the prompt token ids SGLang 0.5.23's own
//! HTTP server computed for each request of the vLLM goldens' corpus (or its 4xx/5xx), recorded
//! by `bash tests/sglang/goldens/run.sh`. Each request is parsed as ext-proc parses bodies and
//! tokenized by an [`InProcessTokenizer`] building prompts in SGLang's dialect (a pool whose
//! engine is `sglang`), and must give exactly SGLang's ids whenever SGLang accepted it. The
//! tokenizer folders come from `scripts/models.sh`; without them the test skips, saying so.

use std::path::PathBuf;
use std::sync::Arc;

use kvroute_tokenize::{Dialect, ModelTokenizer};
use tokio_util::task::TaskTracker;

use super::InProcessTokenizer;
use super::goldens_tests::{GOLDENS, Outcome, digest, kvroute_tokens, models_dir, read_jsonl};

const SGLANG_GOLDENS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/sglang-goldens"
);
/// Recorded models (each its tokenizer folder's name).
const MODELS: [&str; 2] = ["qwen3", "llama3_1"];

/// Requests SGLang refuses that kvroute tokenizes anyway (routed normally; the engine answers
/// the error). Every other refused request must fail in kvroute too (routed on load).
const TOKENIZED_THOUGH_REFUSED: [&str; 1] = [
    // Anthropic's `max_tokens` is required; kvroute does not repeat the request model's check.
    "messages-rejected-3",
];

#[tokio::test]
async fn sglang_goldens() {
    let Some(models) = models_dir().filter(|d| d.is_dir()) else {
        eprintln!(
            "SKIP sglang_goldens: no tokenizer folders; run `bash scripts/models.sh` (sets KVROUTE_MODELS)"
        );
        return;
    };
    let corpus = read_jsonl(&PathBuf::from(GOLDENS).join("corpus.jsonl"));
    let mut failures = Vec::new();
    let mut checked_models = 0;
    for name in MODELS {
        let dir = models.join(name);
        let goldens_path = PathBuf::from(SGLANG_GOLDENS).join(format!("{name}.jsonl"));
        if !dir.join("tokenizer.json").is_file() || !goldens_path.is_file() {
            eprintln!(
                "SKIP sglang_goldens/{name}: no {} or no goldens",
                dir.display()
            );
            continue;
        }
        let goldens = read_jsonl(&goldens_path);
        let header = &goldens[0];
        assert_eq!(header["header"], true, "{name}: first line is the header");
        assert_eq!(
            header["sglang"], "0.5.23",
            "{name}: the dialect reproduces 0.5.23"
        );
        let model = Arc::new(ModelTokenizer::from_dir(&dir).unwrap());
        if let Some(template) = model.chat_template() {
            template.fix_clock(header["recorded_at"].as_i64().unwrap());
        }
        let tokenizer = InProcessTokenizer::new(Arc::clone(&model), TaskTracker::new())
            .with_dialect(Dialect::Sglang);
        let (mut equal, mut accepted, mut refused, mut refused_tokenized) = (0, 0, 0, 0);
        let mut by_endpoint = std::collections::BTreeMap::<String, (usize, usize)>::new();
        for (entry, golden) in corpus.iter().zip(&goldens[1..]) {
            let id = entry["id"].as_str().unwrap();
            assert_eq!(golden["id"], id, "{name}: goldens follow the corpus");
            let outcome = kvroute_tokens(&tokenizer, entry, name).await;
            if golden["status"] != 200 {
                refused += 1;
                let tokenized = matches!(outcome, Outcome::Tokens(_));
                refused_tokenized += usize::from(tokenized);
                let listed = TOKENIZED_THOUGH_REFUSED.contains(&id);
                if tokenized != listed {
                    failures.push(format!(
                        "{name}/{id}: SGLang answers {}, kvroute {} (listed: {listed})",
                        golden["status"],
                        if tokenized {
                            "tokenized it"
                        } else {
                            "failed too"
                        }
                    ));
                }
                continue;
            }
            accepted += 1;
            let endpoint = entry["endpoint"].as_str().unwrap_or_default().to_owned();
            let counts = by_endpoint.entry(endpoint).or_default();
            counts.1 += 1;
            match outcome {
                Outcome::Tokens(tokens) if digest(&tokens) == golden["sha256"] => {
                    equal += 1;
                    counts.0 += 1;
                }
                Outcome::Tokens(tokens) => {
                    let expected: Vec<u32> = golden["tokens"]
                        .as_array()
                        .map(|t| t.iter().map(|t| t.as_u64().unwrap() as u32).collect())
                        .unwrap_or_default();
                    let at = expected
                        .iter()
                        .zip(&tokens)
                        .position(|(a, b)| a != b)
                        .unwrap_or(expected.len().min(tokens.len()));
                    let near = |ids: &[u32]| {
                        let ids =
                            &ids[at.saturating_sub(4).min(ids.len())..(at + 10).min(ids.len())];
                        model.decode(ids, false).unwrap_or_default()
                    };
                    failures.push(format!(
                        "{name}/{id}: {} tokens vs SGLang's {} (at {at}: kvroute {:?} vs SGLang {:?})",
                        tokens.len(),
                        golden["count"],
                        near(&tokens),
                        near(&expected)
                    ));
                }
                Outcome::ParseError(e) | Outcome::TokenizeError(e) => {
                    failures.push(format!("{name}/{id}: SGLang accepted, kvroute failed: {e}"));
                }
            }
        }
        let per_endpoint = by_endpoint
            .iter()
            .map(|(endpoint, (equal, all))| format!("{endpoint} {equal}/{all}"))
            .collect::<Vec<_>>()
            .join(", ");
        eprintln!(
            "sglang_goldens/{name}: {equal}/{accepted} accepted requests equal in process \
             ({per_endpoint}); {refused} refused by SGLang ({refused_tokenized} of them \
             tokenized by kvroute anyway)"
        );
        checked_models += 1;
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    if checked_models == 0 {
        eprintln!("SKIP sglang_goldens: no model checked");
    }
}
