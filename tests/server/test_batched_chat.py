"""vLLM's batched chat: ``messages`` as a list of conversations, each run as its own prompt
(as a completions batch is), its choices numbered after the ones before it. A real server
on the embedded model (the shared one without a key) and the openai client."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from server_helpers import ServerProcess, SharedServer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Count to three."}],
]


@pytest.fixture(scope="module")
def server(open_servers: SharedServer) -> ServerProcess:
    return open_servers.get()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _post(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def test_each_conversation_answers_as_it_would_alone(server, client):
    model = client.models.list().data[0].id
    alone = [
        client.chat.completions.create(model=model, messages=conv, max_tokens=8, temperature=0, n=2)
        for conv in CONVERSATIONS
    ]
    kw = dict(model=model, messages=CONVERSATIONS, max_tokens=8, temperature=0, n=2)
    batch = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    assert [c.index for c in batch.choices] == list(range(6))
    for k, single in enumerate(alone):
        for i, choice in enumerate(single.choices):
            got = batch.choices[k * 2 + i]
            assert got.message.content == choice.message.content
            assert got.finish_reason == choice.finish_reason
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert [len(ids) for ids in batch.model_extra["prompt_token_ids"]] == [a.usage.prompt_tokens for a in alone]

    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert streamed == {c.index: c.message.content for c in batch.choices}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [[]]}, "messages[0]"),
        ({"messages": [CONVERSATIONS[0], [{"role": "user"}]]}, "messages[1][0].content"),
        ({"messages": CONVERSATIONS, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": "hi " * 1100}]]}, "messages[1]"),
        ({"messages": [CONVERSATIONS[0]] * 40, "n": 2}, "n"),  # 80 sequences: past --max-seqs-per-request
    ],
)
def test_a_bad_conversation_is_a_400_naming_it(server, client, body, param):
    r = _post(server, {"model": client.models.list().data[0].id, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
