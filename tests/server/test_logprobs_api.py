"""vLLM's logprob extensions through a real server and the openai client: -1 (the whole
vocabulary) where --max-logprobs -1 allows it, ``logprobs: 0`` on completions, and
``logprob_token_ids`` (named tokens' logprobs in place of the top ones)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_helpers import ServerProcess, SharedServer, free_port, serve_cmd

VOCAB = 49152  # the embedded SmolLM2's
PROMPT = "The capital of France is"
NAMED = [12, 3000, 7, 314]


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    port = free_port()
    log = tmp_path_factory.mktemp("unbounded-logprobs") / "server.log"
    srv = ServerProcess(serve_cmd(port, "--max-logprobs", "-1"), port, log)
    with srv.serving("unbounded-logprobs server"):
        yield srv


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_minus_one_is_the_whole_vocabulary(unbounded):
    c = _client(unbounded)
    model = _model(c)
    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=-1,
    )
    (tok,) = chat.choices[0].logprobs.content
    assert len(tok.top_logprobs) == VOCAB
    assert abs(sum(math.exp(t.logprob) for t in tok.top_logprobs) - 1) < 1e-3
    assert tok.top_logprobs[0].logprob == tok.logprob  # greedy: the sampled token is the most likely
    few = c.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=3)
    every = c.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=-1)
    assert every.choices[0].text == few.choices[0].text
    assert every.choices[0].logprobs.token_logprobs == pytest.approx(few.choices[0].logprobs.token_logprobs, abs=1e-5)
    for whole, top3 in zip(every.choices[0].logprobs.top_logprobs, few.choices[0].logprobs.top_logprobs):
        assert len(whole) > 3 and all(whole[t] == pytest.approx(v, abs=1e-5) for t, v in top3.items())
    scored = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": -1}
    )
    plp = scored.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == VOCAB for e in plp[1:])
    # echoed prompt tokens carry the whole vocabulary too (-1 counted as less than any count:
    # they had one entry each), also beside a smaller prompt_logprobs
    for extra in ({}, {"prompt_logprobs": 2}):
        echoed = c.completions.create(
            model=model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=-1, extra_body=extra
        )
        tops = echoed.choices[0].logprobs.top_logprobs
        # (keyed by text, as OpenAI's are: tokens that decode alike share a key, as the generated one's)
        whole = len(tops[-1])
        assert tops[0] is None and whole > 40000 and all(len(t) == whole for t in tops[1:]), [
            len(t or ()) for t in tops
        ]


def test_logprobs_zero_is_the_sampled_token_alone(unbounded):
    """Completions' top logprobs always hold the sampled token, as OpenAI's and vLLM's do."""
    c = _client(unbounded)
    model = _model(c)
    zero = c.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    one = c.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    lp = zero.choices[0].logprobs
    assert len(lp.tokens) == 3
    assert lp.token_logprobs == pytest.approx(one.choices[0].logprobs.token_logprobs, abs=1e-5)
    # OpenAI's "up to logprobs + 1 elements": the sampled token's own, and with logprobs 0 that alone
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [top[t] for top, t in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    drawn = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=2.0, seed=3, logprobs=1)
    lp = drawn.choices[0].logprobs
    assert all(t in top and len(top) <= 2 for top, t in zip(lp.top_logprobs, lp.tokens))


def test_named_tokens_logprobs_in_place_of_the_top_ones(unbounded):
    c = _client(unbounded)
    model = _model(c)
    msgs = [{"role": "user", "content": "Hi"}]
    every = c.chat.completions.create(
        model=model, messages=msgs, max_tokens=3, temperature=0, logprobs=True, top_logprobs=-1
    )
    named = c.chat.completions.create(
        model=model, messages=msgs, max_tokens=3, temperature=0, logprobs=True, extra_body={"logprob_token_ids": NAMED}
    )
    assert named.choices[0].message.content == every.choices[0].message.content
    for got, whole in zip(named.choices[0].logprobs.content, every.choices[0].logprobs.content):
        assert got.token == whole.token and got.logprob == pytest.approx(whole.logprob, abs=1e-5)
        assert len(got.top_logprobs) == len(NAMED)
        by_text = {}
        for t in whole.top_logprobs:
            by_text.setdefault(t.token, t.logprob)
        for t in got.top_logprobs:
            assert t.logprob == pytest.approx(by_text[t.token], abs=1e-5)
    streamed = c.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"logprob_token_ids": NAMED},
    )
    tokens = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    flat = [x.logprob for t in tokens for x in t.top_logprobs]
    plain = [x.logprob for t in named.choices[0].logprobs.content for x in t.top_logprobs]
    assert flat == pytest.approx(plain, abs=1e-6) and len(tokens) == 3
    comp = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"logprob_token_ids": NAMED}
    )
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == 2 and all(len(d) <= len(NAMED) and d for d in lp.top_logprobs)


@pytest.mark.parametrize(
    "path,body,param,says",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs", "--max-logprobs -1"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "--max-logprobs -1"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -2}, "logprobs", ""),
        ("/v1/completions", {"prompt": PROMPT, "logprob_token_ids": [VOCAB]}, "logprob_token_ids", "vocabulary"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "logprob_token_ids": [5]}, "logprob_token_ids", ""),
        ("/v1/chat/completions", {"logprob_token_ids": [5]}, "logprob_token_ids", "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprob_token_ids": []}, "logprob_token_ids", ""),
    ],
)
def test_bad_logprob_requests_are_400s_naming_the_field(open_servers: SharedServer, path, body, param, says):
    srv = open_servers.get()  # --max-logprobs left at its default of 20
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(srv.base_url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
