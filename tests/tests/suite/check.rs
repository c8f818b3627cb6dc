//! `kvroute-check`, the operator's check: the built command's token ids and block keys for
//! completion and chat bodies equal what ext-proc's decision path and the block-keys crate
//! compute; a bad body or endpoint exits non-zero saying why; and with the real tokenizer
//! folders (`scripts/models.sh`), a recorded request gives vLLM's own tokens.
//!
//! The command is run from cargo's target directory: `cargo build -p kvroute-ext-proc --bins`
//! first (`scripts/test.sh` builds every binary).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use kvroute_block_keys::{ExtraKeysEra, HashAlgo, KeyScheme, LoraRef, VllmHasher};
use kvroute_ext_proc::tokenizer::{InProcessTokenizer, Tokenizer};
use kvroute_tests::harness::tiny_model_dir;
use kvroute_tests::stack::binary_dir;
use sha2::{Digest as _, Sha256};
use tokio_util::task::TaskTracker;

use super::common::decision_path_tokens;

const GOLDENS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/vllm-goldens");

fn check_binary() -> PathBuf {
    let path = binary_dir(None).join("kvroute-check");
    assert!(
        path.is_file(),
        "build it first: cargo build -p kvroute-ext-proc --bins ({path:?})"
    );
    path
}

/// Runs `kvroute-check` with `args`, `body` on stdin.
pub(super) fn run_check(args: &[&str], body: &str) -> Output {
    let mut child = Command::new(check_binary())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A refused command line exits before reading its body: the pipe may then be closed.
    let written = child.stdin.take().unwrap().write_all(body.as_bytes());
    if let Err(error) = written {
        assert_eq!(error.kind(), std::io::ErrorKind::BrokenPipe, "{error}");
    }
    child.wait_with_output().unwrap()
}

/// The report of a successful run.
pub(super) fn report(args: &[&str], body: &str) -> serde_json::Value {
    let output = run_check(args, body);
    assert!(
        output.status.success(),
        "kvroute-check {args:?} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn u32s(value: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

fn u64s(value: &serde_json::Value) -> Vec<u64> {
    serde_json::from_value(value.clone()).unwrap()
}

fn vllm_keys(
    tokens: &[u32],
    block_size: usize,
    algo: HashAlgo,
    version: &str,
    lora: Option<&LoraRef<'_>>,
    salt: Option<&str>,
) -> Vec<u64> {
    KeyScheme::VllmExact {
        hasher: VllmHasher::new(algo, Some("0")).unwrap(),
        era: ExtraKeysEra::for_vllm_version(version).unwrap(),
    }
    .prompt_keys(tokens, block_size, lora, salt)
    .unwrap()
}

fn tiny_tokenizer(tasks: &TaskTracker) -> Arc<dyn Tokenizer> {
    Arc::new(InProcessTokenizer::load(&tiny_model_dir(), tasks.clone()).unwrap())
}

#[tokio::test]
async fn check_prints_the_decision_paths_tokens_and_vllm_block_keys() {
    let tasks = TaskTracker::new();
    let tokenizer = tiny_tokenizer(&tasks);
    let dir = tiny_model_dir().display().to_string();
    let cases = [
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":"The cache holds every block of the prompt prefix, so a replica that saw it answers sooner."}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny","messages":[{"role":"system","content":"You route requests."},{"role":"user","content":"Which replica holds this conversation's prefix?"}]}"#,
        ),
    ];
    for (path, body) in cases {
        let report = report(
            &[
                path,
                "--model-dir",
                &dir,
                "--block-size",
                "4",
                "--seed",
                "0",
            ],
            body,
        );
        let ours = decision_path_tokens(&tokenizer, &tasks, body, path, path).await;
        let tokens = u32s(&report["token_ids"]);
        assert_eq!(tokens, &ours.tokens[..], "{path}: token ids");
        assert_eq!(report["token_count"], tokens.len(), "{path}");
        let keys = u64s(&report["block_keys"]);
        assert_eq!(
            keys,
            // The pool schema's defaults: vLLM 0.32's sha256 and extra keys.
            vllm_keys(&tokens, 4, HashAlgo::Sha256, "0.32.0", None, None),
            "{path}: block keys"
        );
        assert!(keys.len() >= 4, "{path}: too few blocks to mean much");
        assert_eq!(report["full_blocks"], tokens.len() / 4, "{path}");
        assert_eq!(report["block_size"], 4);
        assert_eq!(report["key_scheme"]["hash_algo"], "sha256");
        assert_eq!(report["key_scheme"]["seed"], "0");
        assert_eq!(report["tokenizer"]["mode"], "in_process", "{report}");
        assert_eq!(report["tokenizer"]["encoder"], "fast-byte-bpe", "{report}");
        assert_eq!(report["token_source"], "tokenizer");
    }
}

/// `--config` + `--model`: the pool, its LoRA adapter and the body's `cache_salt` enter the keys
/// as ext-proc applies them (vLLM 0.31+ extra keys here).
#[tokio::test]
async fn check_with_a_config_applies_the_adapter_and_cache_salt() {
    let tasks = TaskTracker::new();
    let tokenizer = tiny_tokenizer(&tasks);
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("ext-proc.yaml");
    std::fs::write(
        &config,
        format!(
            "pools:\n\
             - name: tiny-pool\n  models: [tiny]\n  block_size: 8\n\
             \x20 adapters: [{{name: sql, path: /adapters/sql}}]\n\
             \x20 key_scheme: {{hash_algo: sha256_cbor, seed: \"0\", vllm_version: 0.32.0}}\n\
             \x20 tokenizer: {{model_dir: {}}}\n\
             replicas:\n- {{id: r0, pool: tiny-pool, address: \"127.0.0.1:9\"}}\n",
            tiny_model_dir().display()
        ),
    )
    .unwrap();
    let body = r#"{"model":"tiny","cache_salt":"tenant-7","messages":[{"role":"user","content":"Select every replica whose cache holds the first block of this prompt, then the next."}]}"#;
    let path = "/v1/chat/completions";
    let config = config.display().to_string();
    let report = report(&[path, "--config", &config, "--model", "sql"], body);
    assert_eq!(report["pool"], "tiny-pool");
    assert_eq!(report["model"], "sql");
    assert_eq!(report["adapter"]["path"], "/adapters/sql");
    assert_eq!(report["cache_salt"], "tenant-7");
    let ours = decision_path_tokens(&tokenizer, &tasks, body, path, path).await;
    let tokens = u32s(&report["token_ids"]);
    assert_eq!(tokens, &ours.tokens[..]);
    let lora = LoraRef {
        id: None,
        name: "sql",
        path: Some("/adapters/sql"),
    };
    let keys = u64s(&report["block_keys"]);
    assert_eq!(
        keys,
        vllm_keys(
            &tokens,
            8,
            HashAlgo::Sha256Cbor,
            "0.32.0",
            Some(&lora),
            Some("tenant-7")
        )
    );
    assert!(!keys.is_empty());
    // The extras change every key: without them the chain is another.
    assert_ne!(
        keys,
        vllm_keys(&tokens, 8, HashAlgo::Sha256Cbor, "0.32.0", None, None)
    );
}

#[test]
fn check_refuses_a_bad_body_or_endpoint_saying_why() {
    let dir = tiny_model_dir().display().to_string();
    let args = |path| vec![path, "--model-dir", dir.as_str()];

    let output = run_check(&args("/v1/completions"), r#"{"model":"tiny","prompt":"#);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("malformed request body"), "{stderr}");
    assert!(output.stdout.is_empty());

    let output = run_check(&args("/v1/chat/completions"), r#"{"model":"tiny"}"#);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("messages"), "{stderr}");

    let output = run_check(&args("/v1/embeddings"), r#"{"model":"tiny","input":"hi"}"#);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("does not tokenize this endpoint"),
        "{stderr}"
    );

    // A Responses request is tokenized as its chat; one kvroute cannot convert fails (exit 1).
    let output = run_check(&args("/v1/responses"), r#"{"model":"tiny","input":"hi"}"#);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["endpoint"], "responses");
    let output = run_check(
        &args("/v1/responses"),
        r#"{"model":"tiny","input":"hi","previous_response_id":"resp_1"}"#,
    );
    assert_eq!(output.status.code(), Some(1));

    // Neither --model-dir nor --config: bad usage.
    let output = run_check(&["/v1/completions"], "{}");
    assert_eq!(output.status.code(), Some(64));
}

fn models_dir() -> Option<PathBuf> {
    std::env::var_os("KVROUTE_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/kvroute/models")))
}

fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// One recorded Qwen3 chat request with tools: the command prints vLLM 0.32's own tokens.
#[test]
fn check_gives_vllms_tokens_for_a_recorded_request() {
    let Some(qwen3) = models_dir()
        .map(|d| d.join("qwen3"))
        .filter(|d| d.join("tokenizer.json").is_file())
    else {
        eprintln!(
            "SKIP check_gives_vllms_tokens_for_a_recorded_request: no Qwen3 tokenizer folder; \
             run `bash scripts/setup.sh` (sets KVROUTE_MODELS)"
        );
        return;
    };
    let corpus = read_jsonl(&Path::new(GOLDENS).join("corpus.jsonl"));
    let goldens = read_jsonl(&Path::new(GOLDENS).join("qwen3.jsonl"));
    let (request, golden) = corpus
        .iter()
        .filter(|r| r["endpoint"] == "chat" && r["body"].get("tools").is_some())
        .find_map(|r| {
            let golden = goldens
                .iter()
                .find(|g| g["id"] == r["id"] && g["status"] == 200)?;
            Some((r, golden))
        })
        .expect("a recorded chat request with tools that vLLM accepted");
    let mut body = request["body"].clone();
    body["model"] = "qwen3".into();
    let dir = qwen3.display().to_string();
    let report = report(
        &["/v1/chat/completions", "--model-dir", &dir, "--seed", "0"],
        &body.to_string(),
    );
    // Goldens keep long prompts as their length and the sha256 of the comma-joined ids.
    let tokens = u32s(&report["token_ids"]);
    let joined = tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let digest = format!("{:x}", Sha256::digest(joined.as_bytes()));
    let id = &request["id"];
    assert_eq!(golden["count"], tokens.len(), "{id}: token count");
    assert_eq!(
        golden["sha256"], digest,
        "{id}: kvroute-check's tokens differ from vLLM's"
    );
    if let Some(recorded) = golden.get("tokens") {
        assert_eq!(tokens, u32s(recorded), "{id}");
    }
    assert_eq!(report["full_blocks"], tokens.len() / 16);
}
