"""The real model behind a real `aiolm serve` process, driven by the real `openai` client.

The server is the session's shared keyed one (model load is the expensive part), so
checks on counters and caches are relative; generation lengths are kept small because
this runs on a couple of shared CPU cores. It must exit 0 on SIGTERM (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_helpers import API_KEY, ROOT, from_schema, json_values

from metrics_contract import Scrape, check_contract

TIMEOUT = 180.0
PARIS_Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r"\{.*\}", "", key) if "_bucket" not in key else key] = float(value)
    return out


def _scrape(server) -> Scrape:
    r = httpx.get(server.base_url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text, "vllm")


def _wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        idle = (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_models_health_and_auth(server, client, model):
    assert model
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.base_url + "/version", timeout=10).json()["version"]
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"]
    # The log says where the API and the chat page are, with the real port.
    log = server.log_path.read_text(errors="replace")
    assert f"OpenAI-compatible API at {server.base_url}/v1 (health: {server.base_url}/health)" in log, log
    assert f"chat page at {server.base_url}/" in log


def test_vllm_named_metrics_agree_with_the_responses(server, client, model):
    """/metrics under --metrics-prefix vllm: every series vLLM's dashboards read, with values
    (taken as increases over a few requests) that agree with the responses' usage."""
    _wait_idle(server)
    before = _scrape(server)
    usages, max_tokens = [], [6, 9, 7, 5, 5]
    for mt in max_tokens[:2]:
        r = client.completions.create(
            model=model,
            prompt="The history of the printing press",
            max_tokens=mt,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        usages.append(r.usage)
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=max_tokens[2],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usages.append([c.usage for c in stream if c.usage is not None][-1])
    chat = [{"role": "user", "content": "Name three colours of the rainbow, please, in one short line."}]
    for mt in max_tokens[3:]:  # the same chat twice: the second finds its prompt's blocks cached
        r = client.chat.completions.create(
            model=model, messages=chat, max_tokens=mt, temperature=0, extra_body={"ignore_eos": True}
        )
        usages.append(r.usage)
    reqs = len(usages)
    prompt = sum(u.prompt_tokens for u in usages)
    gen = sum(u.completion_tokens for u in usages)
    assert gen == sum(max_tokens)
    after = _scrape(server)  # recorded when the engine finishes a request, before its response ends
    check_contract(after, model)

    def inc(sample: str, **labels: str) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    def hist(name: str) -> tuple[float, float]:
        (c1, s1), (c0, s0) = after.hist(name), before.hist(name)
        return c1 - c0, s1 - s0

    assert inc("prompt_tokens_total") == prompt and inc("generation_tokens_total") == gen
    assert inc("request_success_total", finished_reason="length") == reqs
    assert inc("request_success_total", finished_reason="abort") == 0 and inc("num_preemptions_total") == 0
    assert after.value("num_requests_running") == 0 and after.value("gpu_cache_usage_perc") == 0
    assert hist("request_prompt_tokens") == (reqs, prompt)
    assert hist("request_generation_tokens") == (reqs, gen)
    assert hist("request_params_max_tokens") == (reqs, sum(max_tokens))
    assert hist("request_params_n") == (reqs, reqs)

    # One inter-token latency per generated token after each request's first; their sum is
    # the time from first to last token, which is the decode time.
    itl = hist("inter_token_latency_seconds")
    assert itl[0] == gen - reqs and hist("time_per_output_token_seconds") == itl
    e2e, ttft = hist("e2e_request_latency_seconds"), hist("time_to_first_token_seconds")
    phase = {p: hist(f"request_{p}_time_seconds") for p in ("queue", "prefill", "decode", "inference")}
    assert all(count == reqs and total > 0 for count, total in [e2e, ttft, *phase.values()]), (e2e, phase)
    assert itl[1] == pytest.approx(phase["decode"][1], rel=1e-6)
    assert phase["queue"][1] + phase["prefill"][1] + phase["decode"][1] == pytest.approx(e2e[1], rel=1e-6)
    assert phase["prefill"][1] + phase["decode"][1] == pytest.approx(phase["inference"][1], rel=1e-6)
    assert ttft[1] == pytest.approx(phase["queue"][1] + phase["prefill"][1], rel=1e-6) and ttft[1] < e2e[1]

    # Each engine step's scheduled tokens: every prompt token not found in the prefix cache,
    # then one per generated token after the first.
    hits = inc("prefix_cache_hits_total")
    assert hits >= 16 and inc("prefix_cache_queries_total") >= prompt
    steps, tokens = hist("iteration_tokens_total")
    assert tokens == prompt - hits + gen - reqs and gen - reqs <= steps <= tokens


def test_chat_capital_of_france(client, model, server):
    r = client.chat.completions.create(
        model=model, messages=PARIS_Q, temperature=0, max_tokens=16, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    # usage is right: prompt tokens as /tokenize counts them, one logprob entry per generated token
    tok = httpx.post(
        server.base_url + "/tokenize",
        json={"messages": PARIS_Q},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()
    assert r.usage.prompt_tokens == tok["count"]
    assert r.usage.completion_tokens == len(choice.logprobs.content) >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-4


def test_chat_stream_matches_non_stream(client, model):
    kw = dict(model=model, messages=PARIS_Q, temperature=0, max_tokens=16)
    client.chat.completions.create(**kw)  # so both below find the prompt's blocks cached
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_async_n2_stream_and_usage(server, model):
    async def run():
        async with _aclient(server) as ac:
            full = await ac.completions.create(
                model=model, prompt="The sky is", max_tokens=6, n=2, temperature=0.9, seed=3
            )
            assert [c.index for c in full.choices] == [0, 1]
            assert 2 <= full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0

            stream = await ac.completions.create(
                model=model,
                prompt=["The sky is", "Grass is"],
                max_tokens=5,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=1,
                temperature=0,
            )
            texts: dict[int, str] = {}
            ntoks: dict[int, int] = {}
            usage = None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    ntoks[c.index] = ntoks.get(c.index, 0) + len(c.logprobs.tokens)
            assert sorted(texts) == [0, 1, 2, 3]
            assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: both samples agree
            assert usage is not None and usage.completion_tokens == sum(ntoks.values())
            return texts

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))


def test_n_streams_send_each_finish_reason_once(server, client, model):
    # Different lengths per choice (sampled, with a stop on "."), so some finish while others run.
    body = {
        "model": model,
        "prompt": "List some colours:",
        "max_tokens": 24,
        "n": 3,
        "stream": True,
        "temperature": 1.0,
        "seed": 5,
        "stop": ["."],
    }
    finishes: dict[int, int] = {}
    texts: dict[int, str] = {}
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=TIMEOUT,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            assert len(choices) == 1, f"one choice per chunk, got {choices}"
            c = choices[0]
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finishes[c["index"]] = finishes.get(c["index"], 0) + 1
            else:
                assert c["index"] not in finishes, f"choice {c['index']} sent after its finish_reason"
    assert finishes == {0: 1, 1: 1, 2: 1}
    chat = client.chat.completions.create(
        model=model, messages=PARIS_Q, max_tokens=12, n=2, stream=True, temperature=1.0, seed=7
    )
    per_index: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chat:
        assert len(chunk.choices) == 1
        c = chunk.choices[0]
        if c.finish_reason:
            per_index[c.index].append(c.finish_reason)
    assert all(len(v) == 1 for v in per_index.values()), per_index


def test_completion_echo_and_token_prompts(client, model, server):
    ids = httpx.post(
        server.base_url + "/tokenize",
        json={"prompt": "Hello there"},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0, echo=True)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_text.choices[0].text.startswith("Hello there")
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) == by_ids.usage.prompt_tokens


def test_prompt_logprobs_echo_and_token_ids(client, model, server):
    auth = {"authorization": f"Bearer {API_KEY}"}
    text = "The capital of France is"
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": text}, headers=auth, timeout=30).json()["tokens"]
    out = client.completions.create(
        model=model,
        prompt=text,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 1, "return_token_ids": True},
    )
    c = out.choices[0]
    assert c.prompt_token_ids == ids and len(c.token_ids) == 3
    plp = c.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    actual = [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    assert all(v <= 0 for v in actual) and all(1 <= len(e) <= 2 for e in plp[1:])
    lp = c.logprobs  # echo + logprobs: the echoed prompt carries the same numbers, then the output
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1 : len(ids)] == pytest.approx(actual, abs=1e-6)
    assert len(lp.tokens) == len(ids) + 3 and all(v is not None for v in lp.token_logprobs[1:])
    plain = client.completions.create(model=model, prompt=text, max_tokens=3, temperature=0)
    assert plain.choices[0].prompt_logprobs is None and plain.choices[0].token_ids is None
    assert plain.choices[0].text == c.text[len(text) :]
    # streamed echo + logprobs: the echo chunk has the prompt's logprobs too
    chunks = list(
        client.completions.create(
            model=model, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == text and first.logprobs.token_logprobs[1:] == pytest.approx(actual, abs=1e-6)
    # echo with max_tokens 0 scores the prompt alone (vLLM's echo without generation; it was a 400)
    scored = client.completions.create(
        model=model, prompt=text, max_tokens=0, echo=True, logprobs=2, extra_body={"return_token_ids": True}
    )
    only = scored.choices[0]
    assert (only.text, only.token_ids, only.finish_reason, scored.usage.completion_tokens) == (text, [], "length", 0)
    assert (
        only.logprobs.tokens == lp.tokens[: len(ids)] and only.logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    )
    streamed = list(
        client.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=2, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in streamed) == text
    assert [ch.choices[0].finish_reason for ch in streamed][-1] == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # without echo there is nothing to return
        client.completions.create(model=model, prompt=text, max_tokens=0)
    # chat: the rendered prompt's ids and logprobs at the top of the response
    msgs = [{"role": "user", "content": "Say hi."}]
    chat_ids = httpx.post(server.base_url + "/tokenize", json={"messages": msgs}, headers=auth, timeout=30).json()
    chat = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    assert chat.prompt_token_ids == chat_ids["tokens"] and len(chat.choices[0].token_ids) == 2
    assert len(chat.prompt_logprobs) == chat_ids["count"] and chat.prompt_logprobs[0] is None
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=text, max_tokens=1, extra_body=bad)
        assert e.value.body["param"] == "prompt_logprobs"


def test_allowed_token_ids_and_bad_words(client, model, server):
    auth = {"authorization": f"Bearer {API_KEY}"}
    allowed = httpx.post(
        server.base_url + "/tokenize",
        json={"prompt": " yes no maybe", "add_special_tokens": False},
        headers=auth,
        timeout=30,
    ).json()["tokens"]
    out = client.completions.create(
        model=model,
        prompt="Is the sky blue?",
        max_tokens=5,
        temperature=0.9,
        seed=3,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert out.choices[0].token_ids and set(out.choices[0].token_ids) <= set(allowed)
    kw = dict(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in client.completions.create(**kw).choices[0].text
    banned = client.completions.create(**kw, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned and banned
    # allowed tokens that are all banned leave a step nothing to draw (it drew token 0): a 400
    (paris,) = httpx.post(
        server.base_url + "/tokenize", json={"prompt": "Paris", "add_special_tokens": False}, headers=auth, timeout=30
    ).json()["tokens"]
    for extra in (
        {"allowed_token_ids": [paris], "bad_words": ["Paris"]},
        {"allowed_token_ids": [paris], "stop_token_ids": [paris], "min_tokens": 2},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**kw, "max_tokens": 4}, extra_body=extra)
        assert e.value.body["param"] == "allowed_token_ids" and "no token can be generated" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the engine checks them against the vocabulary
        client.completions.create(**kw, extra_body={"allowed_token_ids": [paris, 2**40]})
    assert e.value.body["param"] == "allowed_token_ids" and "outside the vocabulary" in e.value.body["message"]


def test_stop_sequences(client, model):
    kw = dict(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert len(free) > 6
    stop = free[4:7]
    cut = free[: free.index(stop)]
    stopped = client.completions.create(**kw, stop=[stop, "never-appears"]).choices[0]
    assert stopped.text == cut and stopped.finish_reason == "stop"
    chat = client.chat.completions.create(model=model, messages=PARIS_Q, temperature=0, max_tokens=16, stop=" Paris")
    assert "Paris" not in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"


def test_a_stop_string_made_by_the_last_token_allowed_is_a_stop(client, model):
    """Where max_tokens and a stop string end the text at the same token, the stop is what is
    reported (vLLM does so too): it was 'length' with the text cut at the stop."""
    kw = dict(model=model, prompt="The history of Rome", max_tokens=12, temperature=0)
    free = client.completions.create(**kw, logprobs=0).choices[0]
    tokens = free.logprobs.tokens
    assert free.finish_reason == "length" and len(tokens) == 12
    # the shortest tail of the text, whole tokens, that first occurs at its very end
    tails = ("".join(tokens[-k:]).lstrip() for k in range(1, 12))
    stop = next(t for t in tails if t.strip() and free.text.find(t) == len(free.text) - len(t))
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            reason = next(
                c.choices[0].model_extra.get("stop_reason") for c in chunks if c.choices and c.choices[0].finish_reason
            )
        else:
            ch = client.completions.create(**kw, stop=[stop]).choices[0]
            text, finish, reason = ch.text, [ch.finish_reason], ch.model_extra.get("stop_reason")
        assert text == free.text[: free.text.rindex(stop)] and finish == ["stop"] and reason == stop, (text, finish)


def test_continuous_usage_reports_cached_tokens_only_once_known(client, model):
    """A stream's chunks before the engine's first output cannot know the prefix-cache hit:
    they leave the details out (the role chunk said 0 cached, the next ones 32)."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Count from one to twenty, please. " * 4}])
    client.chat.completions.create(**kw, max_tokens=1, temperature=0)  # the prompt's blocks now cached
    chunks = list(
        client.chat.completions.create(
            **kw,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    final = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert final > 0
    for c in chunks:
        details = c.usage.prompt_tokens_details
        assert details is None or details.cached_tokens == final, [x.usage for x in chunks]


def test_cache_salt_keeps_tenants_prefix_blocks_apart(server, client, model):
    """vLLM's cache_salt on chat, completions and Responses: a prompt hits the prefix cache
    only for the salt that cached it, with the same answer either way; a bad salt is a 400."""
    prompt = "Salted prompt: list the planets of the solar system in order, with one fact each. " * 3
    msgs = [{"role": "user", "content": prompt}]

    def chat(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    first = chat("salt-one")
    runs = [first, chat("salt-one"), chat("salt-two"), chat(None)]
    assert [cached > 0 for cached, _ in runs[:3]] == [False, True, False], runs
    assert runs[3][0] < runs[1][0], runs  # unsalted: at most the template's opening other chats share
    assert len({text for _, text in runs}) == 1

    def completion(salt):
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert completion("salt-three") == 0 and completion("salt-three") > 0

    def responses(salt):
        body = {"model": model, "input": prompt, "max_output_tokens": 2, "temperature": 0, "cache_salt": salt}
        r = httpx.post(server.base_url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    assert responses("salt-four") == 0 and responses("salt-four") > 0
    for bad in ("", 12, "s" * 1025):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=1, extra_body={"cache_salt": bad})
        assert "cache_salt" in str(e.value), e.value


def test_truncate_prompt_tokens_keeps_the_end_or_the_start_of_a_prompt(server, client, model):
    """vLLM's truncate_prompt_tokens on completions and chat: the prompt runs as its last N
    tokens (or first, truncation_side 'right'), where a longer one would be a 400."""
    text = "Rome was founded on the Tiber; its history runs through kings, a republic and emperors. " * 3
    full = client.completions.create(
        model=model, prompt=text, max_tokens=1, extra_body={"return_token_ids": True}
    ).choices[0]
    full_ids = full.model_extra["prompt_token_ids"]
    assert len(full_ids) > 40

    def run(**extra):
        r = client.completions.create(
            model=model,
            prompt=text,
            max_tokens=4,
            temperature=0,
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 24, **extra},
        )
        return r.usage.prompt_tokens, r.choices[0].model_extra["prompt_token_ids"], r.choices[0].text

    for side, kept in ((None, full_ids[-24:]), ("left", full_ids[-24:]), ("right", full_ids[:24])):
        tokens, ids, answer = run(**({} if side is None else {"truncation_side": side}))
        given = client.completions.create(model=model, prompt=kept, max_tokens=4, temperature=0).choices[0].text
        assert (tokens, ids, answer) == (24, kept, given), side
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 16},
    )
    assert chat.usage.prompt_tokens == 16

    limit = httpx.get(server.base_url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    limit = limit["max_model_len"]
    long_text = text * (limit // 40)  # past the context: refused unless truncated
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=long_text, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # -1: the context less one, so 5 more do not fit
        client.completions.create(
            model=model, prompt=long_text, max_tokens=5, extra_body={"truncate_prompt_tokens": -1}
        )
    assert e.value.param == "max_tokens" and f"{limit - 1} in the input" in e.value.message
    r = client.completions.create(model=model, prompt=long_text, max_tokens=1, extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8
    for extra in (
        {"truncate_prompt_tokens": 0},
        {"truncate_prompt_tokens": limit},
        {"truncate_prompt_tokens": -2},
        {"truncation_side": "left"},
        {"truncate_prompt_tokens": 8, "truncation_side": "middle"},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=text, max_tokens=1, extra_body=extra)
        assert e.value.param in extra, (extra, e.value)


def test_seed_reproducible(client, model):
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Tell me a fun fact."}],
        temperature=0.8,
        max_tokens=8,
        seed=1234,
    )
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b and a


def test_logprobs_completions(client, model):
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) >= value - 1e-4  # greedy: the sampled token is the best


def test_request_errors(client, model, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=PARIS_Q, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hello " * 1100, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "maximum context length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hello", max_tokens=1024)
    assert e.value.body["param"] == "max_tokens" and "maximum context length" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=PARIS_Q)
    auth = {"authorization": f"Bearer {API_KEY}"}
    big = httpx.post(server.base_url + "/v1/completions", headers=auth, timeout=30, json={"prompt": "x" * (300 << 10)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server.base_url + path, headers=auth, timeout=10)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers={**auth, "content-type": "application/json"},
        content=b"{not json",
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for path, body, param in (
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    ):
        r = httpx.post(
            server.base_url + path, headers={**auth, "content-type": "application/json"}, content=body, timeout=10
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5, -1], max_tokens=2)
    assert e.value.body["param"] == "prompt[1]"
    r = httpx.get(server.base_url + "/health", headers={"x-request-id": "trace-42"}, timeout=10)
    assert r.headers["x-request-id"] == "trace-42"


def test_unknown_fields_are_refused_through_the_client(client, model):
    """The openai client's extra_body reaches the server; what it does not implement is a 400 naming it."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=PARIS_Q, max_tokens=2, extra_body={"vllm_xargs": {"a": 1}})
    assert e.value.body["param"] == "vllm_xargs" and e.value.body["code"] == "unrecognized_argument"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI refuses this too
        client.chat.completions.create(
            model=model, messages=PARIS_Q, max_tokens=2, stream_options={"include_usage": True}
        )
    assert e.value.body["param"] == "stream_options"
    out = client.chat.completions.create(
        model=model, messages=PARIS_Q, max_tokens=2, store=False, metadata={"k": "v"}, user="u", service_tier="auto"
    )
    assert out.choices[0].finish_reason == "length"  # the no-op fields are accepted


# -- /v1/responses, /tokenizer_info, /load, /tokenize's token_strs --------------------------


def _chat_greedy(client, model, messages, max_tokens):
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return out.choices[0], out.usage


def test_responses_give_chat_text_streamed_or_not(client, model):
    """Greedy: /v1/responses answers a conversation with the same text and token counts as chat,
    and its typed event stream reassembles to that text."""
    kw = dict(model=model, input="What is the capital of France?", max_output_tokens=24, temperature=0)
    r = client.responses.create(**kw)
    choice, usage = _chat_greedy(client, model, PARIS_Q, 24)
    assert choice.finish_reason == "stop" and "Paris" in choice.message.content
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == [] and part.text == choice.message.content
    assert r.output_text == choice.message.content
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.total_tokens,
    )

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ], kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 10
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")} | {events[2].item.id, events[-2].item.id}
    assert len(item_ids) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == r.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == "completed" and final.output_text == text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (r.usage.input_tokens, r.usage.output_tokens)


def test_responses_output_dumped_by_the_sdk_goes_back_as_input(client, model):
    """model_dump() writes every field the SDK knows, null where unset (a message item's
    phase): it was refused as unknown. text.format's fields beyond its type are a 400 for the
    text and json_object types, which take none (they were dropped)."""
    ask = [{"role": "user", "content": "Name a color."}]
    r = client.responses.create(model=model, input=ask, max_output_tokens=4, temperature=0)
    follow = [*ask, *(o.model_dump() for o in r.output), {"role": "user", "content": "Another."}]
    again = client.responses.create(model=model, input=follow, max_output_tokens=4, temperature=0)
    assert again.output_text
    for fmt, param in (
        ({"type": "json_object", "schema": {"type": "object"}}, "text.format.schema"),
        ({"type": "text", "strict": True}, "text.format.strict"),
        ({"type": "json_object", "name": "x"}, "text.format.name"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, input="hi", max_output_tokens=2, text={"format": fmt})
        assert e.value.body["param"] == param, e.value.body


def test_responses_items_instructions_and_incomplete(client, model):
    """Message items (string or text parts, earlier output_text included) and ``instructions``
    render as chat's system + messages; ``max_output_tokens`` cuts to ``incomplete``."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Blue.", "annotations": []}],
        },
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Count from one to twenty."},
    ]
    as_chat = [
        {"role": "system", "content": "You are a counting assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Count from one to twenty."},
    ]
    r = client.responses.create(
        model=model,
        input=items,
        instructions="You are a counting assistant.",
        max_output_tokens=4,
        temperature=0,
        store=False,
        metadata={"run": "t"},
        user="u",
    )
    choice, usage = _chat_greedy(client, model, as_chat, 4)
    assert choice.finish_reason == "length"
    assert r.output_text == choice.message.content and r.usage.input_tokens == usage.prompt_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 4
    assert r.metadata == {"run": "t"} and r.instructions == "You are a counting assistant."
    last = list(
        client.responses.create(
            model=model,
            input=items,
            instructions="You are a counting assistant.",
            max_output_tokens=4,
            temperature=0,
            stream=True,
        )
    )[-1]
    assert last.type == "response.incomplete" and last.response.output_text == r.output_text


def test_responses_json_schema_and_errors(client, model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "rank": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=model,
        input="Describe Paris as JSON.",
        max_output_tokens=48,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}},
    )
    doc = json.loads(r.output_text)
    assert set(doc) == {"city", "rank"} and isinstance(doc["city"], str) and 1 <= doc["rank"] <= 10
    assert r.output_text == json.dumps(doc, ensure_ascii=False)  # the layout README promises
    assert r.text.format.type == "json_schema"
    bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=model, input="x", text={"format": {"type": "json_schema", "name": "c", "schema": bad}}
        )
    assert e.value.body["param"] == "text.format" and "minimum" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "unrecognized_argument"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", extra_body={"top_k": 3})
    assert e.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hello " * 1100)
    assert e.value.body["param"] == "input" and "maximum context length" in e.value.body["message"]


def test_tokenize_token_strs_and_tokenizer_info(server):
    import jinja2

    auth = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=30) as c:
        plain = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert "token_strs" in plain and plain["token_strs"] is None  # vLLM's: null unless asked
        asked = c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert asked["tokens"] == plain["tokens"] and len(asked["token_strs"]) == len(plain["tokens"]) >= 2
        assert asked["token_strs"][-1].endswith("world")  # the tokenizer's piece, not decoded text
        assert httpx.get(server.base_url + "/tokenizer_info", timeout=10).status_code == 401
        info = c.get("/tokenizer_info").json()
        assert info["tokenizer_class"] and info["max_model_len"] == plain["max_model_len"]
        vocab = info["vocab_size"]
        assert c.post("/detokenize", json={"tokens": [vocab - 1]}).status_code == 200
        assert c.post("/detokenize", json={"tokens": [vocab]}).json()["error"]["param"] == "tokens[0]"
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # each one special token
            ids = c.post("/tokenize", json={"prompt": info[name], "add_special_tokens": False}).json()["tokens"]
            assert len(ids) == 1 and c.post("/detokenize", json={"tokens": ids}).json()["prompt"] == info[name]
        # the template served is the one the server renders chats with
        text = (
            jinja2.Environment()
            .from_string(info["chat_template"])
            .render(
                messages=PARIS_Q, add_generation_prompt=True, bos_token=info["bos_token"], eos_token=info["eos_token"]
            )
        )
        rendered = c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert rendered == c.post("/tokenize", json={"messages": PARIS_Q}).json()["tokens"]
        assert "name_or_path" not in info and not any(isinstance(v, str) and v.startswith("/") for v in info.values())


def _aborted(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if "request_success_total{" in line and 'finished_reason="abort"' in line
    )


def test_load_counts_live_requests_and_hanging_up_aborts_them(server, model):
    """Three streams (chat, completions, responses) are the server's load until their clients
    hang up mid-stream; then each is aborted, its KV blocks freed, and /load is 0 again."""
    auth = {"authorization": f"Bearer {API_KEY}"}
    story = "Write a very long story about dragons."
    bodies = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": story}], "max_tokens": 400, "ignore_eos": True, "stream": True},
        ),
        ("/v1/completions", {"prompt": story, "max_tokens": 400, "ignore_eos": True, "stream": True}),
        ("/v1/responses", {"input": story, "max_output_tokens": 400, "temperature": 0, "stream": True}),
    ]
    assert httpx.get(server.base_url + "/load", timeout=10).json() == {"server_load": 0}
    aborted = _aborted(server)
    readers = []  # a line iterator dropped unfinished closes its connection: hold them all
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=120) as c, contextlib.ExitStack() as open_:
        for path, body in bodies:
            r = open_.enter_context(c.stream("POST", path, json={**body, "model": model}))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            deltas = 0
            for line in itertools.islice(readers[-1], 200):  # a few tokens in: the request is live
                deltas += line.startswith("data: ") and ('"delta"' in line or '"text"' in line)
                if deltas >= 3:
                    break
            assert deltas >= 3, path
        assert httpx.get(server.base_url + "/load", timeout=10).json() == {"server_load": 3}
        readers.clear()
    # the three clients have hung up
    deadline = time.monotonic() + 30
    while httpx.get(server.base_url + "/load", timeout=10).json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.base_url + "/load", timeout=10).json() == {"server_load": 0}
    m = _wait_idle(server, 30.0)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert _aborted(server) == aborted + 3  # none ran to its end


@pytest.mark.slow
def test_disconnect_frees_the_request(server, model):
    auth = {"authorization": f"Bearer {API_KEY}"}
    body = {
        "model": model,
        "prompt": "Write a very long story about dragons.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 2:
                    break  # hang up mid-stream
        # non-streaming: the client gives up while the server still generates (1,000 tokens:
        # 400 took under the 3 s on a fast machine)
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1000}, timeout=3)
    m = _wait_idle(server, 10.0)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_32_concurrent_streams(server, model):
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await ac.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def run():
        async with _aclient(server) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(run(), 240))
    assert len(results) == 32
    assert all(text and 1 <= usage <= 16 for text, usage in results), results
    m = _wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    print(f"32 streams in {time.monotonic() - t0:.1f}s")


def test_example_client_runs(server):
    env = {**os.environ, "OPENAI_API_KEY": API_KEY}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_client.py"), server.base_url + "/v1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "completion 1:" in out.stdout


@pytest.mark.slow
def test_fuzz_against_openapi_schema(server, model):
    """Bodies from /openapi.json, some with wrong-typed or extra fields: never 5xx, never a hang."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spec = httpx.get(server.base_url + "/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    auth = {"authorization": f"Bearer {API_KEY}"}
    targets = {
        "/v1/chat/completions": "ChatCompletionRequest",
        "/v1/completions": "CompletionRequest",
        "/v1/responses": "ResponsesRequest",
        "/tokenize": "TokenizeRequest",
        "/detokenize": "DetokenizeRequest",
    }
    budget_s = float(os.environ.get("AIOLM_FUZZ_SECONDS", "60"))
    start = time.monotonic()
    counts = {"sent": 0, "2xx": 0, "4xx": 0}

    def cheap(body, path):
        """Keep generation short on CPU: small max_tokens/n, the served model name."""
        if isinstance(body, dict) and path == "/v1/responses":
            if not isinstance(body.get("max_output_tokens"), int) or isinstance(body["max_output_tokens"], bool):
                body["max_output_tokens"] = 2
            body["max_output_tokens"] = 1 + body["max_output_tokens"] % 3
        elif isinstance(body, dict) and path in ("/v1/chat/completions", "/v1/completions"):
            for k in ("max_tokens", "max_completion_tokens", "min_tokens"):
                if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > 3:
                    body[k] = 1 + body[k] % 3
            if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
                body["n"] = 2
            if isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool):
                body["best_of"] = body.get("n")
            if body.get("max_tokens") is None:  # absent or null: chat would run to max_model_len
                body["max_tokens"] = 2
        return body

    def mutate(draw_body):
        return st.one_of(
            draw_body,
            st.tuples(draw_body, st.text(max_size=8), json_values()).map(
                lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0]
            ),
            json_values(),
        )

    strategies = []
    for path, name in targets.items():
        body = from_schema(schemas[name], defs=schemas).map(
            lambda b: {**b, "model": model} if isinstance(b, dict) and "model" in b and b.get("model") else b
        )
        strategies.append(st.tuples(st.just(path), mutate(body).map(lambda b, p=path: cheap(b, p))))

    @settings(
        max_examples=int(os.environ.get("AIOLM_FUZZ_EXAMPLES", "250")),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(st.one_of(strategies))
    def check(case):
        if time.monotonic() - start > budget_s:
            return
        path, body = case
        counts["sent"] += 1
        r = httpx.post(server.base_url + path, headers=auth, timeout=60, content=json.dumps(body).encode())
        assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
        if r.status_code >= 400:
            counts["4xx"] += 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text
        else:
            counts["2xx"] += 1
            if isinstance(body, dict) and body.get("stream") is True and path == "/v1/responses":
                last = r.text.rstrip().rsplit("\n\n", 1)[-1]
                assert last.startswith(("event: response.completed", "event: response.incomplete")), r.text[-300:]
            elif isinstance(body, dict) and body.get("stream") is True:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]

    auth["content-type"] = "application/json"
    check()
    # raw garbage too
    for raw in (b"", b"null", b"[]", b'"x"', b"{" * 50, b"\x00\xff", b'{"prompt": NaN}', b'{"messages": [{}]}'):
        r = httpx.post(server.base_url + "/v1/chat/completions", headers=auth, content=raw, timeout=30)
        assert r.status_code == 400, (raw, r.text)
    assert counts["sent"] > 10 and counts["2xx"] > 0 and counts["4xx"] > 0, counts
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    m = _wait_idle(server, 15.0)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    print(f"fuzz: {counts} in {time.monotonic() - start:.0f}s")


@pytest.mark.stops_shared_server
def test_sigterm_lets_in_flight_requests_finish(server, model):
    """SIGTERM mid-stream (run last: the server is shared); the stream still ends properly and
    the server exits 0."""
    import threading

    auth = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "stream": True}
    events: list[str] = []
    codes: list[int] = []
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    threading.Thread(target=lambda: codes.append(server.stop())).start()
    assert events[-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
    assert finals[-1] == "length"
    deadline = time.monotonic() + 60
    while not codes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert codes == [0], server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=5)


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client, model):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: none on a new prompt; on the same
    prompt again its whole blocks but the last token's (recomputed to sample from)."""
    nonce = f"{time.time_ns()}"  # no earlier request shares this prompt's first block
    text = f"Note {nonce}: " + " ".join(f"word{i}" for i in range(60))
    first = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
    again = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    streamed = client.completions.create(
        model=model, prompt=text, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in streamed if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens

    messages = [{"role": "user", "content": text + " Chat."}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // 16 * 16
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = [c.usage for c in stream if c.usage is not None][-1]
    assert last.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens_details.cached_tokens


def test_invocations_serves_the_route_the_body_names(server, client, model):
    """SageMaker's /invocations (vLLM's routing): the body's fields pick the route, whose
    answer it gets unchanged; a body of no known task is a 400 listing them; POST /ping is
    the health check."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.base_url + "/invocations"
    chat_body = {"model": model, "messages": PARIS_Q, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url, json=chat_body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    direct = client.chat.completions.create(**chat_body)
    assert r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"]["content"] == direct.choices[0].message.content

    text_body = {"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    r = httpx.post(url, json=text_body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    assert r.json()["choices"][0]["text"] == client.completions.create(**text_body).choices[0].text

    with httpx.stream("POST", url, json={**chat_body, "stream": True}, headers=headers, timeout=TIMEOUT) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == direct.choices[0].message.content

    for body, words in (
        ({"model": model, "foo": 1}, ("'messages'", "'prompt'", "'input'")),
        ([1, 2], ("'messages'",)),
        ({"model": model, "input": "hi"}, ("--runner pooling",)),  # an embedding body, on a generation server
        ({"model": model, "messages": "not a list"}, ("messages",)),  # chat's own validation
    ):
        r = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 400, (body, r.text)
        assert all(w in r.json()["error"]["message"] for w in words), (body, r.text)
    r = httpx.post(server.base_url + "/ping", headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_return_tokens_as_token_ids_spells_logprob_tokens_by_id(client, model):
    """vLLM's return_tokens_as_token_ids: every logprob token reads 'token_id:<id>', the ids
    being the ones generated, with the same logprobs as the tokens' text would carry."""
    kw = dict(model=model, messages=PARIS_Q, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**kw)
    by_id = client.chat.completions.create(
        **kw, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}
    )
    ids = by_id.choices[0].token_ids
    content = by_id.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{i}" for i in ids]
    # the same values (to a prefix-cache hit's rounding: the second run reuses the first's KV)
    assert [c.logprob for c in content] == pytest.approx(
        [c.logprob for c in plain.choices[0].logprobs.content], abs=1e-3
    )
    for c, p in zip(content, plain.choices[0].logprobs.content):
        assert bytes(c.bytes).decode() == c.token
        assert all(re.fullmatch(r"token_id:\d+", t.token) for t in c.top_logprobs)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([t.logprob for t in p.top_logprobs], abs=1e-3)
    stream = client.chat.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
    streamed = [
        c.token
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert streamed == [c.token for c in content]

    text = client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    lp = text.choices[0].logprobs
    assert lp.tokens == [f"token_id:{i}" for i in text.choices[0].token_ids]
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] < len(text.choices[0].text)  # offsets count the text
    echoed = client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=2,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = echoed.choices[0]
    spelt = [f"token_id:{i}" for i in [*choice.prompt_token_ids, *choice.token_ids]]
    assert choice.logprobs.tokens == spelt and choice.text.startswith("The capital of France is")
