"""vLLM's ``use_beam_search`` through a real server and the real ``openai`` client on the
embedded model: the choices are the n best beams, best first, the same as
``LLM.beam_search`` gives offline; fields a beam search cannot honour are a 400 naming
them; nothing is left in the KV cache afterwards."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_helpers import LIGHT_ENGINE_FLAGS, ServerProcess, SharedServer

from aiolm import LLM, BeamSearchParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
BEAM = {"use_beam_search": True}
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def server(open_servers: SharedServer) -> ServerProcess:
    return open_servers.get()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def offline(tokenizer):
    """LLM.beam_search on the same model and engine flags as the server."""
    flags = dict(zip(LIGHT_ENGINE_FLAGS[::2], LIGHT_ENGINE_FLAGS[1::2]))
    with LLM(
        max_model_len=int(flags["--max-model-len"]),
        kv_cache_memory=int(flags["--kv-cache-memory"]),
        max_num_seqs=int(flags["--max-num-seqs"]),
        num_threads=1,
    ) as llm:
        yield llm


def kv_usage(server: ServerProcess) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("aiolm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"))
    )


def settle(server: ServerProcess) -> float:
    for _ in range(100):
        usage = kv_usage(server)
        if usage == 0:
            return usage
        time.sleep(0.05)
    return kv_usage(server)


def test_completions_are_the_best_beams(client, server, offline, tokenizer):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=0, extra_body={**BEAM, "return_token_ids": True}
    )
    (want,) = offline.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6))
    got = [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]  # type: ignore[attr-defined]
    assert len({tuple(g) for g in got}) == 3
    assert got[0] == want.sequences[0].token_ids
    assert got == [s.token_ids for s in want.sequences]
    assert [c.text for c in r.choices] == [s.text for s in want.sequences]
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == sum(map(len, got))
    assert settle(server) == 0


def test_chat_and_streams(client, server, offline, tokenizer):
    body = dict(model=MODEL, messages=MESSAGES, n=2, max_tokens=8, temperature=0)
    r = client.chat.completions.create(**body, extra_body={**BEAM, "length_penalty": 0.5, "early_stopping": True})
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    (want,) = offline.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.5))
    assert [c.message.content for c in r.choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in want.sequences]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in want.sequences)
    # Streamed: the role chunks, then each beam whole with its finish reason, then usage.
    chunks = list(
        client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_body={**BEAM, "length_penalty": 0.5}
        )
    )
    text = {0: "", 1: ""}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [text[0], text[1]] == [s.text for s in want.sequences]
    assert finish == {0: r.choices[0].finish_reason, 1: r.choices[1].finish_reason}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # completions, streamed, two prompts: choices prompt-major
    stream = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Dogs are"], n=2, max_tokens=4, temperature=0, stream=True, extra_body=BEAM
    )
    got: dict[int, str] = {}
    for ch in stream:
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + c.text
    (dogs,) = offline.beam_search("Dogs are", BeamSearchParams(beam_width=2, max_tokens=4))
    assert [got[2], got[3]] == [s.text for s in dogs.sequences]
    assert settle(server) == 0


@pytest.mark.parametrize(
    "route,extra,field",
    [
        ("completions", {"logprobs": 2}, "logprobs"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("completions", {"best_of": 2}, "best_of"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
        ("chat", {"top_p": 0.5}, "top_p"),
        ("completions", {"presence_penalty": 1.0}, "presence_penalty"),
        ("chat", {"stop": ["x"]}, "stop"),
        ("completions", {"n": 11}, "n"),  # 2 * 11 logprobs > --max-logprobs 20
        ("chat", {"length_penalty": "long"}, "length_penalty"),
        ("completions", {"early_stopping": "sometimes"}, "early_stopping"),
        ("completions", {"stop_token_ids": [49152]}, "stop_token_ids"),  # past the vocabulary
        ("chat", {"stop_token_ids": [2**70]}, "stop_token_ids"),
    ],
)
def test_bad_combinations_name_the_field(server, route, extra, field):
    body = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    r = httpx.post(
        f"{server.base_url}/v1/{'completions' if route == 'completions' else 'chat/completions'}",
        json={**body, "max_tokens": 2, "n": 2, **BEAM, **extra},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field.split(".")[0] in err["message"]
    if field == "n":
        assert "--max-logprobs" in err["message"] and "20" in err["message"]


@pytest.mark.parametrize("penalty", [500.0, 1e308, -1000.0])
def test_an_extreme_length_penalty_ranks_without_failing(server, penalty):
    """length ** length_penalty overflows (or underflows to 0) there: it was a 500."""
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "n": 2, "length_penalty": penalty, **BEAM},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert settle(server) == 0


def test_a_client_gone_mid_search_leaves_nothing(server):
    body = {"prompt": PROMPT, "max_tokens": 200, "n": 4, "ignore_eos": True, **BEAM}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.0)
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        time.sleep(0.5)  # no chunk comes before the search ends: leave in the middle
    assert settle(server) == 0
    time.sleep(0.3)  # a search still running would fill the cache again by now
    assert kv_usage(server) == 0
    load = httpx.get(server.base_url + "/load", timeout=10).json()
    assert load["server_load"] == 0
