#!/usr/bin/env python3
"""Record real vLLM's prompt tokens for every request of the corpus, against a running server.

    python3 tests/vllm/goldens/record.py URL MODEL_NAME CORPUS.jsonl OUT.jsonl [BODIES.jsonl]

Each request goes to the engine's own render endpoint for its API - `/v1/chat/completions/render`,
`/v1/completions/render`, `/v1/responses/render` or `/v1/messages/render`, which run exactly the
preprocessing of the endpoint they extend (conversion to a chat, template, tokenization) and
return the prompt's token ids - with `"model": MODEL_NAME` added. Chat and completion requests
also go to `/tokenize`, whose token ids are
recorded when they differ (its request model lacks some of chat completions' normalisations).
BODIES (from `cargo run -p kvroute-ext-proc --example remote_bodies -- MODEL_NAME`) are the
`/tokenize` bodies kvroute's remote tokenizer sends for each request; each is sent too, and its
sha256 recorded ("remote_body_sha256"), with "remote_count" / "remote_sha256" /
"remote_status" only when vLLM's answer to it differs from the render endpoint's.

The first line of OUT is a header: {"header": true, "model", "recorded_at" (Unix seconds, the
clock templates' `strftime_now` read), "vllm"}. Then one line per request:
{"id", "status", "count", "sha256" (of the ids as comma-separated decimals), "tokens" (when at
most MAX_INLINE_TOKENS), "error" (vLLM's message, for a rejected request), "tokenize_count" /
"tokenize_sha256" (only when `/tokenize` disagrees)}. Standard library only.
"""
import hashlib
import json
import sys
import time
import urllib.error
import urllib.request

MAX_INLINE_TOKENS = 512
RENDER_PATHS = {
    "completions": "/v1/completions/render",
    "chat": "/v1/chat/completions/render",
    "responses": "/v1/responses/render",
    "messages": "/v1/messages/render",
}
TIMEOUT_SECONDS = 120


def post(url, body):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def digest(tokens):
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def error_message(answer):
    error = answer.get("error", answer)
    if isinstance(error, dict):
        return str(error.get("message", error))[:300]
    return str(error)[:300]


def main() -> int:
    if len(sys.argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    url, model, corpus, out_path = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3], sys.argv[4]
    bodies = {}
    if len(sys.argv) == 6:
        with open(sys.argv[5], encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                bodies[record["id"]] = record
    try:
        with urllib.request.urlopen(url + "/version", timeout=10) as response:
            version = json.loads(response.read()).get("version")
    except (urllib.error.URLError, ValueError):
        version = None
    lines = [json.dumps({"header": True, "model": model, "recorded_at": int(time.time()), "vllm": version})]
    accepted = 0
    with open(corpus, encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    for entry in entries:
        body = dict(entry["body"], model=model)
        path = RENDER_PATHS[entry["endpoint"]]
        status, answer = post(url + path, body)
        record = {"id": entry["id"], "status": status}
        if status == 200:
            generate = answer[0] if isinstance(answer, list) else answer
            tokens = generate["token_ids"]
            record.update(count=len(tokens), sha256=digest(tokens))
            if len(tokens) <= MAX_INLINE_TOKENS:
                record["tokens"] = tokens
            accepted += 1
            if entry["endpoint"] in ("chat", "completions"):
                t_status, t_answer = post(url + "/tokenize", body)
                if t_status != 200:
                    record["tokenize_status"] = t_status
                elif t_answer["tokens"] != tokens:
                    record.update(tokenize_count=len(t_answer["tokens"]), tokenize_sha256=digest(t_answer["tokens"]))
            remote = bodies.get(entry["id"], {})
            if remote.get("body") is not None:
                record["remote_body_sha256"] = remote["sha256"]
                r_status, r_answer = post(url + "/tokenize", remote["body"])
                if r_status != 200:
                    record["remote_status"] = r_status
                elif r_answer["tokens"] != tokens:
                    record.update(remote_count=len(r_answer["tokens"]), remote_sha256=digest(r_answer["tokens"]))
        else:
            record["error"] = error_message(answer)
        lines.append(json.dumps(record))
    with open(out_path, "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    print(f"{model}: {accepted}/{len(entries)} accepted; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
