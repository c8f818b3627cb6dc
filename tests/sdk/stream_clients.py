"""One streamed turn of a conversation through the official SDKs, as agent clients send it.

Reads a JSON request on stdin:
  {"api": "responses" | "messages", "base_url": "http://host:port", "model": str,
   "system": str, "messages": [{"role": "user" | "assistant", "content": str}, ...],
   "max_tokens": int}
and streams it with OpenAI's `client.responses.create(..., stream=True)` or Anthropic's
`client.messages.stream(...)`. Prints one JSON line: the event types in arrival order, the text
the deltas carried, and the usage the SDK reports at the end of the stream.

Exit status 3 when the SDKs are not importable (the caller decides whether that skips).
"""

import json
import sys

try:
    import anthropic
    import openai
except ImportError as e:
    print(f"the SDKs are not importable: {e}", file=sys.stderr)
    sys.exit(3)


def stream_responses(request):
    client = openai.OpenAI(base_url=request["base_url"] + "/v1", api_key="unused", max_retries=0)
    events, text, usage = [], [], None
    stream = client.responses.create(
        model=request["model"],
        instructions=request["system"],
        input=request["messages"],
        max_output_tokens=request["max_tokens"],
        stream=True,
    )
    for event in stream:
        events.append(event.type)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        elif event.type == "response.completed":
            usage = event.response.usage.model_dump()
    return events, "".join(text), usage


def stream_messages(request):
    client = anthropic.Anthropic(base_url=request["base_url"], api_key="unused", max_retries=0)
    events, text = [], []
    with client.messages.stream(
        model=request["model"],
        system=request["system"],
        messages=request["messages"],
        max_tokens=request["max_tokens"],
    ) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
        final = stream.get_final_message()
    return events, "".join(text), final.usage.model_dump()


def main():
    request = json.load(sys.stdin)
    run = {"responses": stream_responses, "messages": stream_messages}[request["api"]]
    events, text, usage = run(request)
    print(json.dumps({"events": events, "text": text, "usage": usage}))


if __name__ == "__main__":
    main()
