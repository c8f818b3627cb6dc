#!/usr/bin/env python3
"""Generate the seeded corpus of request shapes whose prompt tokens are recorded from real vLLM.

    python3 tests/vllm/goldens/corpus.py OUT.jsonl

One JSON object per line: {"id", "endpoint": "chat" | "completions" | "responses" | "messages",
"body"}. The same corpus is
recorded for every model. Deterministic (random.Random(SEED)); standard library only.
"""
import json
import random
import sys

SEED = 14
WORDS = (
    "the of and to in is that for it as with was on be by this are or at from have an they which "
    "one you were all we can her has there been if more when will would who so no model cache "
    "prefix router replica token block engine request tool call weather search file code value"
).split()
UNICODE = [
    "caf\u00e9 na\u00efve \u00e9t\u00e9",
    "\u4e2d\u6587\u5b57\u7b26\u6d4b\u8bd5",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0643\u0645",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\U0001f600\U0001f44d\U0001f3fd emoji \U0001f680",
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439 \u043c\u0438\u0440",
    "e\u0301e\u0308 combining \u2167 \u00bd",
    "\u00a0nbsp\u00a0 \u2028line\u2029 \u3000wide",
]
CODE = [
    "def f(x):\n    return x * 2\n\nprint(f(21))\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}\n',
    "    indented\n\n\n    lines   with   spaces\t\ttabs\n",
]
SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>",
    "<|endoftext|> and <|eot_id|>",
    "<|start|>assistant<|channel|>final<|message|>x<|end|>",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<s> </s> <unk> <tool_call> </tool_call>",
]


def sentence(r, n=None):
    n = n or r.randint(3, 25)
    text = " ".join(r.choice(WORDS) for _ in range(n))
    return text[0].upper() + text[1:] + r.choice([".", "?", "!", ""])


def text(r):
    kind = r.random()
    if kind < 0.15:
        return r.choice(UNICODE) + " " + sentence(r)
    if kind < 0.25:
        return r.choice(CODE)
    if kind < 0.32:
        return r.choice(SPECIAL)
    if kind < 0.36:
        return r.choice(["", " ", "\n", "  leading and trailing  ", "\n\nnewlines\n\n"])
    return " ".join(sentence(r) for _ in range(r.randint(1, 4)))


def long_text(r, approx_tokens):
    parts, size = [], 0
    while size < approx_tokens:
        s = sentence(r, 40)
        if r.random() < 0.1:
            s += "\n\n" + r.choice(CODE) + r.choice(UNICODE)
        parts.append(s)
        size += len(s) // 4
    return " ".join(parts)


def schema(r, depth=0):
    props = {}
    for i in range(r.randint(1, 4)):
        name = r.choice(["location", "unit", "query", "limit", "path", "options", "ids", "flag"]) + (
            str(i) if r.random() < 0.3 else ""
        )
        kind = r.choice(["string", "integer", "number", "boolean", "array", "object", "enum"])
        if kind == "enum":
            props[name] = {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}
        elif kind == "array":
            props[name] = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
        elif kind == "object" and depth < 2:
            props[name] = schema(r, depth + 1)
        elif kind == "number":
            props[name] = {"type": "number", "minimum": 0.5, "maximum": 100.0, "default": 1e-05}
        else:
            props[name] = {"type": kind if kind != "object" else "string"}
        if r.random() < 0.5:
            props[name]["description"] = r.choice(
                ["The city, e.g. San Francisco", "Temp\u00e9rature \u00b0C \u2014 \u6e29\u5ea6", sentence(r), "Emoji \U0001f321"]
            )
    out = {"type": "object", "properties": props}
    if r.random() < 0.7:
        out["required"] = sorted(props)[: r.randint(0, len(props))]
    if r.random() < 0.3:
        out["additionalProperties"] = False
    return out


def tool(r, name):
    function = {"name": name}
    if r.random() < 0.85:
        function["description"] = r.choice(
            ["Get the current weather.", "Search the web \u2014 r\u00e9sultats \u641c\u7d22", sentence(r), ""]
        )
    if r.random() < 0.9:
        function["parameters"] = schema(r)
    if r.random() < 0.15:
        function["strict"] = r.random() < 0.5
    out = {"type": "function", "function": function}
    if r.random() < 0.1:
        del out["type"]
    return out


def arguments(r):
    args = {r.choice(["location", "q", "n", "path"]): r.choice(["Paris", 3, 2.5, True, None, ["a", "b"], {"x": 1}])
            for _ in range(r.randint(0, 3))}
    style = r.random()
    if style < 0.4:
        return json.dumps(args)
    if style < 0.7:
        return json.dumps(args, separators=(",", ":"))
    if style < 0.8:
        return json.dumps(args, indent=2, ensure_ascii=False)
    return r.choice(["", "{}", "not json", "[1, 2]", "42", '{"b": 1, "a": 2}', '{"u": "caf\\u00e9 \u4e2d"}'])


def content(r, role="user"):
    kind = r.random()
    if kind < 0.6:
        return text(r)
    if kind < 0.75:
        return [{"type": "text", "text": text(r)}]
    if kind < 0.85:
        return [{"type": "text", "text": text(r)} for _ in range(r.randint(2, 4))]
    if kind < 0.9:
        return [{"type": "text", "text": text(r), "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": text(r)}]
    # Only an assistant's content may be null (vLLM rejects it elsewhere).
    return r.choice(["", None, []] if role == "assistant" else ["", []])


def conversation(r, tools):
    messages = []
    if r.random() < 0.6:
        messages.append({"role": "system", "content": content(r) if r.random() < 0.3 else text(r)})
    if r.random() < 0.15:
        messages.append({"role": "developer", "content": text(r)})
    calls = 0
    for turn in range(r.randint(1, 5)):
        user = {"role": "user", "content": content(r)}
        if r.random() < 0.1:
            user["name"] = r.choice(["alice", "bob_2"])
        messages.append(user)
        if r.random() < 0.08:
            messages.append({"role": "developer", "content": text(r)})
        if turn == 0 and r.random() < 0.3 and tools:
            pass
        if r.random() < 0.8 or turn < 1:
            assistant = {"role": "assistant", "content": content(r, "assistant") if r.random() < 0.8 else None}
            if tools and r.random() < 0.5:
                n = r.randint(1, 3)
                assistant["tool_calls"] = [
                    {
                        "id": f"call_{calls + i}",
                        "type": "function",
                        "function": {"name": r.choice(tools)["function"]["name"], "arguments": arguments(r)},
                    }
                    for i in range(n)
                ]
                if r.random() < 0.5:
                    assistant["content"] = None
                messages.append(assistant)
                for i in range(n):
                    result = {"role": "tool", "tool_call_id": f"call_{calls + i}", "content": text(r)}
                    if r.random() < 0.2:
                        result["content"] = [{"type": "text", "text": text(r)}, {"type": "text", "text": text(r)}]
                    messages.append(result)
                calls += n
                messages.append({"role": "assistant", "content": text(r)})
            else:
                if r.random() < 0.15:
                    assistant["reasoning"] = sentence(r)
                elif r.random() < 0.1:
                    assistant["reasoning_content"] = sentence(r)
                if r.random() < 0.05:
                    assistant["content"] = "<think>\n" + sentence(r) + "\n</think>\n\n" + text(r)
                messages.append(assistant)
    if messages[-1]["role"] == "assistant" and r.random() < 0.6:
        messages.append({"role": "user", "content": text(r)})
    return messages


def chat(r):
    body = {}
    tools = []
    if r.random() < 0.4:
        names = ["get_weather", "search_web", "read_file", "run_code", "m\u00e9t\u00e9o"]
        r.shuffle(names)
        tools = [tool(r, names[i]) for i in range(r.randint(1, 4))]
        body["tools"] = tools
        choice = r.random()
        if choice < 0.3:
            body["tool_choice"] = "auto"
        elif choice < 0.4:
            body["tool_choice"] = "none"
    body["messages"] = conversation(r, tools)
    if r.random() < 0.2:
        kwargs = r.choice([{"enable_thinking": False}, {"enable_thinking": True}, {"custom_flag": 1}, {"enable_thinking": None}])
        body["chat_template_kwargs"] = kwargs
    if r.random() < 0.1:
        body["reasoning_effort"] = r.choice(["low", "medium", "high", "none"])
    roll = r.random()
    if roll < 0.08:
        if body["messages"][-1]["role"] != "assistant":
            body["messages"].append({"role": "assistant", "content": r.choice(["The answer is", "Sure, here", text(r) or "x"])})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    elif roll < 0.14:
        body["add_generation_prompt"] = False

    if r.random() < 0.08:
        body["add_special_tokens"] = r.random() < 0.7
    if r.random() < 0.04:
        body["documents"] = [{"title": "Doc " + str(i), "text": sentence(r)} for i in range(r.randint(1, 2))]
    return body


def completion(r, i):
    body = {"prompt": text(r) or "x"}
    if r.random() < 0.4:
        body["add_special_tokens"] = r.random() < 0.5
    return body


def responses_tool(r, name):
    """A Responses API function tool: the flat form (no nested "function")."""
    out = {"type": "function", "name": name}
    if r.random() < 0.85:
        out["description"] = r.choice(["Get the current weather.", "Search \u2014 r\u00e9sultats", sentence(r)])
    if r.random() < 0.9:
        out["parameters"] = schema(r)
    if r.random() < 0.2:
        out["strict"] = r.random() < 0.5
    return out


def responses_input(r, tools):
    """Responses input items: messages (string or input_text parts), assistant output messages,
    reasoning items, function calls and their outputs, as a client replays a conversation."""
    items = []
    calls = 0
    for turn in range(r.randint(1, 4)):
        if r.random() < 0.5:
            items.append({"role": "user", "content": text(r)})
        else:
            parts = [{"type": "input_text", "text": text(r)} for _ in range(r.randint(1, 3))]
            items.append({"type": "message", "role": "user", "content": parts})
        if r.random() < 0.1:
            items.append({"role": r.choice(["developer", "system"]), "content": text(r)})
        if turn == 3 or r.random() < 0.25:
            continue
        if r.random() < 0.3:
            items.append({"type": "reasoning", "id": f"rs_{turn}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": sentence(r)}]})
        if tools and r.random() < 0.5:
            n = r.randint(1, 2)
            for i in range(n):
                items.append({"type": "function_call", "call_id": f"call_{calls + i}", "id": f"fc_{calls + i}",
                              "name": r.choice(tools)["name"], "arguments": arguments(r)})
            for i in range(n):
                items.append({"type": "function_call_output", "call_id": f"call_{calls + i}", "output": text(r)})
            calls += n
        if r.random() < 0.5:
            items.append({"type": "message", "role": "assistant", "id": f"msg_{turn}", "status": "completed",
                          "content": [{"type": "output_text", "text": text(r), "annotations": []}]})
        else:
            items.append({"role": "assistant", "content": text(r)})
    return items


def responses(r):
    tools = [responses_tool(r, n) for n in ("get_weather", "search_web", "read_file")[: r.randint(0, 3)]]
    body = {"input": text(r) if r.random() < 0.15 else responses_input(r, tools), "max_output_tokens": 4}
    if r.random() < 0.6:
        body["instructions"] = text(r)
    if tools:
        body["tools"] = tools
        if r.random() < 0.3:
            body["tool_choice"] = r.choice(["auto", "required", "none"])
    if r.random() < 0.15:
        body["reasoning"] = {"effort": r.choice(["low", "medium", "high"])}
    if r.random() < 0.1:
        body["chat_template_kwargs"] = {"enable_thinking": r.random() < 0.5}
    return body


def anthropic_tool(r, name):
    out = {"name": name, "input_schema": schema(r)}
    if r.random() < 0.85:
        out["description"] = r.choice(["Get the current weather.", "Search \u2014 r\u00e9sultats", sentence(r)])
    return out


def anthropic_blocks(r):
    return [{"type": "text", "text": text(r)} for _ in range(r.randint(1, 3))]


def anthropic_messages(r, tools):
    messages = []
    calls = 0
    for turn in range(r.randint(1, 4)):
        messages.append({"role": "user", "content": text(r) if r.random() < 0.5 else anthropic_blocks(r)})
        if r.random() < 0.2:
            continue
        blocks = []
        if r.random() < 0.25:
            blocks.append({"type": "thinking", "thinking": sentence(r), "signature": "sig"})
        if r.random() < 0.7:
            blocks.extend(anthropic_blocks(r))
        ids = []
        if tools and r.random() < 0.5:
            for _ in range(r.randint(1, 2)):
                ids.append(f"toolu_{calls}")
                args = {r.choice(["location", "q", "n"]): r.choice(["Paris", 3, True, ["a"], {"x": 1}])}
                blocks.append({"type": "tool_use", "id": f"toolu_{calls}", "name": r.choice(tools)["name"], "input": args})
                calls += 1
        if not blocks:
            blocks = [{"type": "text", "text": text(r)}]
        messages.append({"role": "assistant", "content": blocks if r.random() < 0.8 or ids else text(r)})
        if ids:
            results = []
            for call in ids:
                result = {"type": "tool_result", "tool_use_id": call}
                result["content"] = text(r) if r.random() < 0.6 else anthropic_blocks(r)
                results.append(result)
            if r.random() < 0.3:
                results.append({"type": "text", "text": text(r)})
            messages.append({"role": "user", "content": results})
            messages.append({"role": "assistant", "content": text(r)})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": text(r)})
    return messages


def messages(r):
    tools = [anthropic_tool(r, n) for n in ("get_weather", "search_web")[: r.randint(0, 2)]]
    body = {"max_tokens": 4, "messages": anthropic_messages(r, tools)}
    roll = r.random()
    if roll < 0.35:
        body["system"] = text(r)
    elif roll < 0.7:
        body["system"] = anthropic_blocks(r)
    if tools:
        body["tools"] = tools
        if r.random() < 0.3:
            body["tool_choice"] = r.choice([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": tools[0]["name"]}])
    if r.random() < 0.15:
        body["thinking"] = r.choice([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}])
    return body


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    r = random.Random(SEED)
    entries = []
    for i in range(60):
        entries.append({"id": f"completion-{i:03}", "endpoint": "completions", "body": completion(r, i)})
    for i, tokens in enumerate([8_000, 16_000, 32_000]):
        body = {"prompt": long_text(r, tokens), "add_special_tokens": i != 1}
        entries.append({"id": f"completion-long-{tokens}", "endpoint": "completions", "body": body})
    for i in range(300):
        entries.append({"id": f"chat-{i:03}", "endpoint": "chat", "body": chat(r)})
    # Requests vLLM rejects (400), to show what kvroute does with them.
    user = {"role": "user", "content": "hi"}
    rejected = [
        {"messages": [user, {"role": "assistant", "content": "x"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [user], "tools": []},
        {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        {"messages": [user], "chat_template": "{{ messages[0].content }}"},
        {"messages": [user], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
    ]
    for i, body in enumerate(rejected):
        entries.append({"id": f"chat-rejected-{i}", "endpoint": "chat", "body": body})
    # Edge cases of the kwargs merge and of tool choice.
    tools = [tool(r, "get_weather"), tool(r, "search_web")]
    edges = [
        {"messages": [user], "chat_template_kwargs": {"tokenize": True}, "add_special_tokens": True},
        {"messages": [user], "chat_template_kwargs": {"tokenize": False}, "add_special_tokens": True},
        {"messages": [user], "tools": tools, "tool_choice": "required"},
        {"messages": [user], "tools": tools, "tool_choice": {"type": "function", "function": {"name": "search_web"}}},
        {"messages": [user], "tools": tools, "tool_choice": "none"},
        {"messages": [user], "tools": tools, "chat_template_kwargs": {"tools": None}},
        {"messages": [user], "tools": tools, "chat_template_kwargs": {"tools": [tools[1]]}},
        {"messages": [user], "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [user], "reasoning_effort": "none"},
        {"messages": [user], "chat_template_kwargs": {"reasoning_effort": "low", "add_generation_prompt": False}},
        {"messages": [user], "chat_template_kwargs": {"documents": [{"title": "t", "text": "d"}]}},
        {"messages": [user], "documents": [{"title": "a", "text": "b"}], "chat_template_kwargs": {"documents": [{"title": "t", "text": "d"}]}},
        {"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": "Part one"}, {"type": "text", "text": "part two "}]}], "continue_final_message": True, "add_generation_prompt": False},
        {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nReal system"}, user]},
        {"messages": [{"role": "developer", "content": "d1"}, {"role": "system", "content": "s"}, user, {"role": "developer", "content": ""}]},
        {"messages": [user, {"role": "assistant", "content": "a", "reasoning": "r1", "reasoning_content": "r2"}, user]},
        {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1.0, \"a\": 1e2, \"u\": \"\\u00e9\"}"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "refusal", "refusal": "b"}, {"type": "thinking", "thinking": "c"}]}]},
        {"messages": [{"role": "custom_role", "content": "x", "name": "n"}, user]},
    ]
    for i, body in enumerate(edges):
        entries.append({"id": f"chat-edge-{i:02}", "endpoint": "chat", "body": body})
    body = {"messages": [{"role": "system", "content": long_text(r, 9_000)}, {"role": "user", "content": text(r)}]}
    entries.append({"id": "chat-long-9000", "endpoint": "chat", "body": body})
    # The Responses and Anthropic Messages APIs, from their own stream so the requests above keep
    # their shapes.
    r = random.Random(SEED + 1)
    for i in range(40):
        entries.append({"id": f"responses-{i:03}", "endpoint": "responses", "body": responses(r)})
    for i in range(40):
        entries.append({"id": f"messages-{i:03}", "endpoint": "messages", "body": messages(r)})
    api_edges = [
        ("responses", {"input": [{"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "id": "m", "status": "incomplete",
             "content": [{"type": "output_text", "text": "Once upon", "annotations": []}]}]}),
        ("responses", {"input": [{"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "s"}]},
            {"role": "user", "content": "hi"}]}),
        ("responses", {"input": "hi", "instructions": ""}),
        ("messages", {"max_tokens": 4, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"},
            {"type": "text", "text": "Real system"}], "messages": [{"role": "user", "content": "hi"}]}),
        ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": "a"}]},
            {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]}),
        ("messages", {"max_tokens": 4, "system": "s", "messages": [{"role": "user", "content": "a"},
            {"role": "system", "content": "inline"}, {"role": "user", "content": "b"}]}),
        ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "low"}}),
    ]
    for i, (endpoint, body) in enumerate(api_edges):
        entries.append({"id": f"{endpoint}-edge-{i:02}", "endpoint": endpoint, "body": body})
    # Requests vLLM rejects (400), to show what kvroute does with them.
    api_rejected = [
        ("responses", {"input": "hi", "previous_response_id": "resp_123"}),
        ("responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}),
        ("responses", {"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "e"},
            {"role": "user", "content": "hi"}]}),
        ("messages", {"messages": [{"role": "user", "content": "hi"}]}),
        ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "unknown_block", "x": 1}]}]}),
    ]
    for i, (endpoint, body) in enumerate(api_rejected):
        entries.append({"id": f"{endpoint}-rejected-{i}", "endpoint": endpoint, "body": body})
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        for entry in entries:
            out.write(json.dumps(entry, ensure_ascii=False) + "\n")
    print(f"wrote {len(entries)} requests to {sys.argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
