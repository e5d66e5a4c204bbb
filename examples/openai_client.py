"""Talk to a running `aiolm serve` with the official `openai` client.

    aiolm serve --port 8000 &
    python examples/openai_client.py http://127.0.0.1:8000/v1

The base URL comes from argv[1], else $OPENAI_BASE_URL, else
http://127.0.0.1:8000/v1; the key from $OPENAI_API_KEY (any string when the
server runs without --api-key).
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI


def main() -> int:
    base_url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)

    model = client.models.list().data[0].id
    print(f"model: {model}")

    # A plain chat completion.
    reply = client.chat.completions.create(
        model=model, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    print("chat:", reply.choices[0].message.content)
    print("usage:", reply.usage.prompt_tokens, "prompt +", reply.usage.completion_tokens, "completion tokens")

    # The same, streamed token by token.
    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Name three colors."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n  ({chunk.usage.completion_tokens} tokens)")

    # A raw completion with two samples.
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, n=2,
                                    temperature=0.8, seed=7)
    for choice in out.choices:
        print(f"completion {choice.index}:", repr(choice.text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
