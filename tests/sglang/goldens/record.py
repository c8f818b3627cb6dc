#!/usr/bin/env python3
"""Record real SGLang's prompt tokens for every request of the corpus, against a running server.

    python3 tests/sglang/goldens/record.py URL MODEL_NAME CORPUS.jsonl OUT.jsonl SERVER_LOG

The server (tests/sglang/goldens/run.sh) runs with `--log-requests --log-requests-level 3
--log-requests-format json`, writing SERVER_LOG. Requests are sent one at a time, each body
exactly as in the corpus plus `"model": MODEL_NAME`, to the endpoint SGLang serves for its API
(`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/messages`) - SGLang has no
render-only endpoints, so each accepted request also generates (LIMITS caps generation where a
body sets no limit; the header lists what was added). The prompt token ids
are what SGLang's own serving code computed:
- chat, responses, messages: the OpenAI / Anthropic serving layer templates and tokenizes the
  conversation itself and hands `input_ids` to the tokenizer manager, which logs the request
  it received (`request.received`, the full `input_ids` at log level 3): read from the log
  bytes the request added. Chat bodies also ask for `return_prompt_token_ids` (a read-only
  flag: the ids come back in `choices[0].prompt_token_ids`), and the two must agree.
- completions: the tokenizer manager tokenizes the text itself (the log shows only the text),
  so the body also asks for `return_token_ids`, which returns `choices[0].prompt_token_ids`.

The first line of OUT is a header: {"header": true, "model", "recorded_at" (Unix seconds, the
clock templates' `strftime_now` read), "sglang"}. Then one line per request, in the format of
tests/fixtures/vllm-goldens/: {"id", "status", "count", "sha256" (of the ids as comma-separated
decimals), "tokens" (when at most MAX_INLINE_TOKENS), "error" (SGLang's message, for a rejected
request)}, plus "usage_prompt_tokens" (the count the response reports) when it differs from
"count", and "source" ("log" / "response") for where the ids were read. Standard library only.
"""
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request

MAX_INLINE_TOKENS = 512
PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
# Flags that only ask for ids back; they do not change how a prompt is built.
RETURN_IDS = {"completions": {"return_token_ids": True}, "chat": {"return_prompt_token_ids": True}}
# Generation limits added where a body sets none (the tiny random model would otherwise generate
# up to the context length): they do not change how a prompt is built either. A Messages body
# without max_tokens is left alone - it is one of the corpus's rejected requests.
LIMITS = {"completions": ("max_tokens", 1), "chat": ("max_tokens", 1), "responses": ("max_output_tokens", 4)}
TIMEOUT_SECONDS = 600
LOG_WAIT_SECONDS = 10


def post(url, body):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": raw.decode(errors="replace")}


def digest(tokens):
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def error_message(answer):
    error = answer.get("error", answer.get("detail", answer)) if isinstance(answer, dict) else answer
    if isinstance(error, dict):
        return str(error.get("message", error))[:300]
    return str(error)[:300]


def received_requests(log_bytes):
    """The tokenizer manager's `request.received` records in a slice of the server log."""
    out = []
    # Split on newlines only: str.splitlines() would also split inside a record at U+2028.
    for line in log_bytes.decode(errors="replace").split("\n"):
        start = line.find('{"timestamp"')
        if start < 0 or '"event": "request.received"' not in line:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if record.get("event") == "request.received":
            out.append(record["obj"])
    return out


def main() -> int:
    if len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        return 2
    url, model, corpus, out_path, log_path = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    with urllib.request.urlopen(url + "/server_info", timeout=10) as response:
        info = json.loads(response.read())
    version = info.get("version")
    header = {
        "header": True,
        "model": model,
        "recorded_at": int(time.time()),
        "sglang": version,
        "added_to_bodies": {"return_ids": RETURN_IDS, "limits_when_absent": {k: {f: v} for k, (f, v) in LIMITS.items()}},
    }
    lines = [json.dumps(header)]
    with open(corpus, encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    accepted = 0
    for entry in entries:
        endpoint = entry["endpoint"]
        body = dict(entry["body"], model=model, **RETURN_IDS.get(endpoint, {}))
        if endpoint in LIMITS and LIMITS[endpoint][0] not in body:
            body[LIMITS[endpoint][0]] = LIMITS[endpoint][1]
        log_start = os.path.getsize(log_path)
        status, answer = post(url + PATHS[endpoint], body)
        record = {"id": entry["id"], "status": status}
        tokens, source = None, None
        if status == 200:
            if endpoint == "completions":
                tokens, source = answer["choices"][0]["prompt_token_ids"], "response"
            else:
                # The log record is written before the response is sent; wait for the bytes to
                # land in the file all the same (a poll with a deadline).
                deadline = time.monotonic() + LOG_WAIT_SECONDS
                while True:
                    with open(log_path, "rb") as f:
                        f.seek(log_start)
                        received = received_requests(f.read())
                    if received or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                if len(received) != 1 or received[0].get("input_ids") is None:
                    raise SystemExit(f"{entry['id']}: expected one logged request with input_ids, got {len(received)}")
                tokens, source = received[0]["input_ids"], "log"
                if endpoint == "chat":
                    returned = answer["choices"][0].get("prompt_token_ids")
                    if returned != tokens:
                        raise SystemExit(f"{entry['id']}: logged input_ids differ from prompt_token_ids")
            usage = answer.get("usage") or {}
            reported = usage.get("prompt_tokens", usage.get("input_tokens"))
            record.update(count=len(tokens), sha256=digest(tokens), source=source)
            if len(tokens) <= MAX_INLINE_TOKENS:
                record["tokens"] = tokens
            if reported is not None and reported != len(tokens):
                record["usage_prompt_tokens"] = reported
            accepted += 1
        else:
            record["error"] = error_message(answer)
        lines.append(json.dumps(record))
    with open(out_path, "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    print(f"{model}: {accepted}/{len(entries)} accepted; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
