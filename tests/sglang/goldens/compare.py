#!/usr/bin/env python3
"""Compare SGLang's recorded prompt tokens with vLLM's for the same corpus, and tag each differing
request with the corpus features that SGLang 0.5.23 handles differently (see
tests/fixtures/sglang/README.md, "Chat tokens: SGLang vs vLLM", for the source lines).

    python3 tests/sglang/goldens/compare.py MODEL     # qwen3 | llama3_1

A tag says a request has the feature, not that the feature alone caused the difference;
"unexplained" lists differing requests with none of them. Standard library only.
"""
import collections
import json
import sys

model = sys.argv[1]
corpus = {json.loads(l)["id"]: json.loads(l) for l in open("tests/fixtures/vllm-goldens/corpus.jsonl")}
v = {json.loads(l).get("id"): json.loads(l) for l in open(f"tests/fixtures/vllm-goldens/{model}.jsonl")}
s = {json.loads(l).get("id"): json.loads(l) for l in open(f"tests/fixtures/sglang-goldens/{model}.jsonl")}
def text_parts(content):
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text")) if isinstance(content, list) else 0
def feats(e):
    b = e["body"]; f = set(); ep = e["endpoint"]
    msgs = b.get("messages") or (b.get("input") if isinstance(b.get("input"), list) else []) or []
    msgs = [m for m in msgs if isinstance(m, dict)]
    if b.get("tools") and b.get("tool_choice") != "none": f.add("tools_json")
    if b.get("tools") and b.get("tool_choice") == "none": f.add("tool_choice_none_drops_tools")
    if any(m.get("role") == "assistant" and m.get("reasoning") is not None for m in msgs): f.add("assistant_reasoning_field_not_passed")
    if msgs and msgs[-1].get("role") == "assistant" and ep != "chat": f.add("final_assistant_becomes_user")
    if any(text_parts(m.get("content")) >= 2 for m in msgs): f.add("text_parts_joined_with_space")
    if ep == "chat":
        if any(m.get("role") == "developer" for m in msgs): f.add("developer_role_passed_through")
        if b.get("documents"): f.add("documents_ignored")
        if b.get("add_generation_prompt") is False: f.add("add_generation_prompt_ignored")
        if b.get("add_special_tokens") is not None: f.add("add_special_tokens_ignored")
        last = msgs[-1] if msgs else {}
        if last.get("role") == "assistant" and isinstance(last.get("content"), str):
            f.add("continue_final_message" if b.get("continue_final_message") else "final_assistant_becomes_user")
    if ep == "completions" and b.get("add_special_tokens") is False:
        f.add("add_special_tokens_ignored")
    if ep == "messages" and b.get("system") is not None and isinstance(b.get("system"), list) and text_parts(b["system"]) >= 2: f.add("text_parts_joined_with_space")
    return f
diff = collections.Counter(); combos = collections.Counter(); unexplained = collections.defaultdict(list)
n = 0
for k, r in s.items():
    if k is None or r["status"] != 200 or v[k]["status"] != 200 or r["sha256"] == v[k]["sha256"]: continue
    n += 1
    e = corpus[k]; f = feats(e)
    for x in f: diff[(e["endpoint"], x)] += 1
    if not f: unexplained[e["endpoint"]].append(k)
status = collections.Counter(
    (corpus[k]["endpoint"], v[k]["status"], r["status"]) for k, r in s.items() if k is not None and r["status"] != v[k]["status"]
)
same = sum(1 for k, r in s.items() if k is not None and r["status"] == 200 == v[k]["status"] and r["sha256"] == v[k]["sha256"])
print("both 200 and identical:", same)
print("status differs (endpoint, vllm, sglang):", dict(status))
print("differing (both 200):", n)
for k, c in sorted(diff.items(), key=str): print(c, k)
for ep, ids in unexplained.items(): print("unexplained", ep, len(ids), ids[:12])
