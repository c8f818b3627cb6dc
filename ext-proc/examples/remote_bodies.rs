//! The `/tokenize` bodies kvroute's remote tokenizer sends for a corpus of requests.
//!
//! ```text
//! cargo run -p kvroute-ext-proc --example remote_bodies -- MODEL < corpus.jsonl > bodies.jsonl
//! ```
//!
//! Reads `{"id", "endpoint": "chat" | "completions" | "responses" | "messages", "body"}` lines
//! (the golden corpus; a Responses or Messages body gives the converted chat's), parses
//! each body as ext-proc does (with `"model": MODEL`) and writes `{"id", "body", "sha256"}`: the
//! body kvroute would POST to `/tokenize` (`null` when it would not call it) and the sha256 of
//! its JSON bytes. `tests/vllm/goldens/record.py` sends these to real vLLM.

use std::io::{BufRead, Write};

use kvroute_ext_proc::request::{Endpoint, parse};
use kvroute_ext_proc::tokenizer::{RemoteTokenizer, TokenizeInput};
use sha2::{Digest, Sha256};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args()
        .nth(1)
        .ok_or("usage: remote_bodies MODEL < corpus.jsonl")?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in std::io::stdin().lock().lines() {
        let entry: serde_json::Value = serde_json::from_str(&line?)?;
        let mut body = entry["body"].clone();
        body["model"] = model.as_str().into();
        let bytes = serde_json::to_vec(&body)?;
        let endpoint = match entry["endpoint"].as_str() {
            Some("chat") => Endpoint::ChatCompletions,
            Some("responses") => Endpoint::Responses,
            Some("messages") => Endpoint::Messages,
            _ => Endpoint::Completions,
        };
        let remote = parse(&bytes, endpoint)
            .ok()
            .and_then(|parsed| TokenizeInput::from_prompt(&parsed.prompt))
            .and_then(|input| RemoteTokenizer::request_body(&model, &input));
        let sha256 = remote
            .as_ref()
            .map(|b| serde_json::to_vec(b).map(|bytes| format!("{:x}", Sha256::digest(&bytes))))
            .transpose()?;
        let record = serde_json::json!({"id": entry["id"], "body": remote, "sha256": sha256});
        writeln!(out, "{record}")?;
    }
    Ok(())
}
