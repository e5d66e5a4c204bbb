"""Multi-LoRA serving on real `aiolm serve` processes, through the real `openai` client,
against transformers + PEFT.

A tiny random Llama (the embedded model's tokenizer) and adapters written by PEFT itself
(tests/lora_models.py). Three servers start side by side and are shared by the module:

- ``main``: ``--enable-lora``, adapters a1 (``name=path``) and a2 (the JSON form),
  ``--max-loras 2 --max-lora-rank 16 --allow-runtime-lora-updating``;
- ``locked``: ``--enable-lora`` with a1 but no run-time updating (the endpoints are 403);
- ``bare``: ``--allow-runtime-lora-updating`` without ``--enable-lora`` (no adapters at all).

Every generation is greedy with ``ignore_eos`` and compared by token id (``return_token_ids``)
with transformers + PEFT greedy on the same folders in float32. The tests run in file order
on one server: the unload test, which takes a2 away, comes after every test that uses a2.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ROOT, ServerProcess, free_port, serve_cmd

from lora_models import hf_lora_greedy, peft_adapter, tiny_base

TIMEOUT = 60.0  # any one request; a hang fails the test instead of the suite
PROMPTS = [[1, 400, 500, 600], [1, 20, 30, 7, 9]]
N = 8  # tokens compared with the reference
LONG = 300  # tokens of a stream that must still be running while an adapter is (un)loaded
GREEDY = {"ignore_eos": True, "return_token_ids": True}
SERVER_FLAGS = ("--dtype", "float32", "--shutdown-timeout", "5")


@dataclass
class Lab:
    """The folders, the reference tokens (by adapter name, None: the base) and the servers."""

    root: Path
    base: Path
    adapters: dict[str, Path]
    bad: dict[str, Path]
    refs: dict[str | None, list[list[int]]]
    main: ServerProcess
    locked: ServerProcess
    bare: ServerProcess


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    from aiolm.checkpoint.source import resolve_model

    root = tmp_path_factory.mktemp("lora")
    base = tiny_base("llama", root / "base", resolve_model(None).path)
    a1 = peft_adapter(base, root / "a1", rank=8, seed=11)
    a2 = peft_adapter(base, root / "a2", rank=16, seed=12, rslora=True)

    def server(name: str, *flags: str) -> ServerProcess:
        port = free_port()
        cmd = serve_cmd(port, "--model", str(base), *SERVER_FLAGS, *flags)
        return ServerProcess(cmd, port, tmp_path_factory.mktemp(name) / "server.log")

    a2_json = json.dumps({"name": "a2", "path": str(a2)})
    main = server(
        "main",
        "--enable-lora",
        "--lora-modules",
        f"a1={a1}",
        a2_json,
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--allow-runtime-lora-updating",
    )
    locked = server("locked", "--enable-lora", "--lora-modules", f"a1={a1}")
    bare = server("bare", "--allow-runtime-lora-updating")
    with contextlib.ExitStack() as stack:
        for srv in (main, locked, bare):  # whatever fails below, no server outlives the module
            stack.callback(srv.kill)
        # Built while the servers load.
        a3 = peft_adapter(base, root / "a3", rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=13)
        bad = {
            "rank32": peft_adapter(base, root / "rank32", rank=32, seed=14),
            "three_layers": peft_adapter(tiny_base("llama", root / "base3", root, num_hidden_layers=3), root / "l3"),
            "wide": peft_adapter(tiny_base("llama", root / "base96", root, hidden_size=96), root / "h96"),
            "saves_head": peft_adapter(base, root / "saves", targets=("q_proj",), modules_to_save=["lm_head"]),
            "no_config": root / "no_config",
        }
        shutil.copytree(a1, bad["no_config"])
        (bad["no_config"] / "adapter_config.json").unlink()
        bad["cut"] = shutil.copytree(a1, root / "cut")  # half its bytes: the header reads, the data is gone
        weights = bad["cut"] / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        bad["rank_said"] = shutil.copytree(a1, root / "rank_said")  # rank-8 tensors, a config saying 4
        cfg_file = bad["rank_said"] / "adapter_config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "r": 4}))
        # a1's tensors under a config that asks for what is not served, or is not well-formed
        for name, edit in CONFIG_EDITS.items():
            bad[name] = shutil.copytree(a1, root / name)
            cfg_file = bad[name] / "adapter_config.json"
            cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **edit}))
        adapters = {"a1": a1, "a2": a2, "a3": a3}
        refs = {None: hf_lora_greedy(base, None, PROMPTS, N)}
        refs.update({name: hf_lora_greedy(base, path, PROMPTS, N) for name, path in adapters.items()})
        assert len({json.dumps(r) for r in refs.values()}) == len(refs), "the adapters must change the tokens"
        stack.enter_context(main.serving("main lora server"))
        stack.enter_context(locked.serving("locked lora server"))
        stack.enter_context(bare.serving("server without --enable-lora"))
        yield Lab(root, base, adapters, bad, refs, main, locked, bare)


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(lab: Lab) -> openai.OpenAI:
    return _client(lab.main)


@pytest.fixture(scope="module")
def base_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _complete(client: openai.OpenAI, model: str, prompts: list[list[int]] = PROMPTS) -> tuple[str, list[list[int]]]:
    """The response's model and each prompt's greedy tokens."""
    resp = client.completions.create(model=model, prompt=prompts, max_tokens=N, temperature=0, extra_body=GREEDY)
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.finish_reason for c in choices] == ["length"] * len(prompts)
    return resp.model, [c.to_dict()["token_ids"] for c in choices]


def _post(srv: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=TIMEOUT)


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@dataclass
class Stream:
    """One streamed completion read by its own thread: its tokens, when each arrived, how it ended."""

    model: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    error: BaseException | None = None
    accepted: threading.Event = field(default_factory=threading.Event)  # the server has the request
    started: threading.Event = field(default_factory=threading.Event)  # a first token came
    thread: threading.Thread | None = None

    def run(self, client: openai.OpenAI) -> None:
        try:
            stream = client.completions.create(
                model=self.model,
                prompt=self.prompt,
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                extra_body=GREEDY,
            )
            self.accepted.set()  # the response began after the engine took the request
            with stream:
                for chunk in stream:
                    for c in chunk.to_dict()["choices"]:
                        if c.get("token_ids"):
                            self.tokens += c["token_ids"]
                            self.times.append(time.monotonic())
                            self.started.set()
                        self.finish = c.get("finish_reason") or self.finish
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            self.accepted.set()
            self.started.set()

    def start(self, client: openai.OpenAI) -> Stream:
        self.thread = threading.Thread(target=self.run, args=(client,), daemon=True)
        self.thread.start()
        return self

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), f"stream for {self.model} still running after {TIMEOUT}s"


def _lora_info(srv: ServerProcess) -> dict[str, str]:
    """The labels of /metrics' one lora_requests_info sample."""
    text = httpx.get(srv.base_url + "/metrics", timeout=TIMEOUT).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "aiolm:lora_requests_info"]
    (sample,) = family.samples
    assert abs(sample.value - time.time()) < 60, sample
    labels = dict(sample.labels)
    assert labels.pop("engine") == "0" and labels.pop("model_name")  # replicas' series apart
    return labels


def _wait(events: list[threading.Event], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    for e in events:
        assert e.wait(max(0.0, deadline - time.monotonic())), f"no {what} within {TIMEOUT}s"


# -- the served models ------------------------------------------------------------------


def test_models_lists_the_adapters(lab: Lab, client: openai.OpenAI, base_name: str):
    cards = {m.id: m.to_dict() for m in client.models.list().data}
    assert {base_name, "a1", "a2"} <= set(cards)
    assert cards[base_name]["parent"] is None
    for name in ("a1", "a2"):
        assert cards[name]["parent"] == base_name
        assert cards[name]["root"] == str(lab.adapters[name])
    got = client.models.retrieve("a1").to_dict()
    assert got["id"] == "a1" and got["parent"] == base_name and got["root"] == str(lab.adapters["a1"])
    assert client.models.retrieve(base_name).to_dict()["parent"] is None
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "no-such-adapter")
    assert "'a1'" in str(e.value) and "'a2'" in str(e.value)  # the 404 lists what is served


def test_each_model_gives_its_peft_tokens(lab: Lab, client: openai.OpenAI, base_name: str):
    """The base and both adapters at once (one batch mixes the adapters), three times over."""
    names = [base_name, "a1", "a2"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda m: _complete(client, m), names))
    for name, (model, tokens) in zip(names, results):
        assert model == name
        assert tokens == lab.refs[None if name == base_name else name], name


def test_streamed_chat_with_an_adapter(lab: Lab, client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="a2",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=N,
        temperature=0,
        stream=True,
        extra_body=GREEDY,
    )
    prompt_ids, tokens, models, finish = None, [], set(), None
    for chunk in stream:
        d = chunk.to_dict()
        models.add(d["model"])
        prompt_ids = d.get("prompt_token_ids") or prompt_ids
        for c in d["choices"]:
            tokens += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    assert models == {"a2"} and finish == "length" and prompt_ids
    assert tokens == hf_lora_greedy(lab.base, lab.adapters["a2"], [prompt_ids], N)[0]


# -- loading at run time --------------------------------------------------------------


def test_load_while_streams_run(lab: Lab, client: openai.OpenAI, base_name: str):
    streams = [Stream("a1", PROMPTS[0], LONG).start(client), Stream(base_name, PROMPTS[1], LONG).start(client)]
    _wait([s.started for s in streams], "first token")
    resp = _post(lab.main, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(lab.adapters["a3"])})
    loaded_at = time.monotonic()
    assert resp.status_code == 200 and "a3" in resp.text, resp.text
    assert _complete(client, "a3") == ("a3", lab.refs["a3"])  # served while the streams run
    for s in streams:
        s.join()
    for s, ref in zip(streams, (lab.refs["a1"][0], lab.refs[None][1])):
        assert s.error is None and s.finish == "length" and len(s.tokens) == LONG, (s.error, s.finish)
        assert s.tokens[:N] == ref
        assert s.times[-1] > loaded_at, "the stream ended before the load: make LONG longer"
    card = client.models.retrieve("a3").to_dict()
    assert card["parent"] == base_name and card["root"] == str(lab.adapters["a3"])
    # A served name is not loaded twice, nor is the base model's name taken
    err = _error(
        _post(lab.main, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(lab.adapters["a1"])}), 400
    )
    assert err["param"] == "lora_name" and "'a3'" in err["message"] and "already loaded" in err["message"]
    err = _error(
        _post(lab.main, "/v1/load_lora_adapter", {"lora_name": base_name, "lora_path": str(lab.adapters["a1"])}), 400
    )
    assert err["param"] == "lora_name" and "base model" in err["message"]
    assert _complete(client, "a3") == ("a3", lab.refs["a3"])  # the refused reload changed nothing
    # vLLM's load_inplace: the name serves the new folder from now on (false: refused as above)
    body = {"lora_name": "a3", "lora_path": str(lab.adapters["a1"]), "load_inplace": True}
    assert _post(lab.main, "/v1/load_lora_adapter", body).status_code == 200
    assert _complete(client, "a3") == ("a3", lab.refs["a1"])
    body["lora_path"] = str(lab.adapters["a3"])
    assert _post(lab.main, "/v1/load_lora_adapter", body).status_code == 200
    assert _complete(client, "a3") == ("a3", lab.refs["a3"])


# adapter_config.json fields over a1's, each refused (PEFT variants with a forward of their
# own were served as plain LoRA; malformed values were a 500)
CONFIG_EDITS: dict[str, dict[str, Any]] = {
    "alora": {"alora_invocation_tokens": [500, 600]},
    "lora_bias": {"lora_bias": True},
    "alpha_null": {"lora_alpha": None},
    "alpha_text": {"lora_alpha": "sixteen"},
    "pattern_regex": {"rank_pattern": {"(": 8}},
    "pattern_list": {"alpha_pattern": ["q_proj"]},
    "pissa": {"init_lora_weights": "pissa_niter_4"},
}

# (folder in lab.bad, or a body; words the message must hold), each a 400
BAD_LOADS: dict[str, tuple[str | dict[str, Any], tuple[str, ...]]] = {
    "an activated LoRA": ("alora", ("alora_invocation_tokens", "not served")),
    "LoRA biases": ("lora_bias", ("lora_bias", "not served")),
    "lora_alpha null": ("alpha_null", ("lora_alpha must be a number", "None")),
    "lora_alpha a word": ("alpha_text", ("lora_alpha must be a number", "sixteen")),
    "a pattern that is no regular expression": ("pattern_regex", ("rank_pattern key '('",)),
    "patterns not a mapping": ("pattern_list", ("alpha_pattern must map",)),
    # PEFT rewrites the base weights as it loads these: served as plain LoRA, they gave another model
    "a PiSSA adapter": ("pissa", ("init_lora_weights", "pissa_niter_4", "change the base weights")),
    "missing folder": ("missing", ("{path}", "no such folder")),
    "no adapter_config.json": ("no_config", ("{path}", "adapter_config.json")),
    "rank above --max-lora-rank": ("rank32", ("rank 32", "--max-lora-rank 16")),
    "a layer the model lacks": ("three_layers", ("model.layers.2.", "not a layer of this model")),
    "another base's shapes": ("wide", ("features", "96", "another base model")),
    "modules_to_save": ("saves_head", ("modules_to_save", "lm_head")),
    "a file cut short": ("cut", ("cut short",)),  # it loaded, then failed in a step: every worker died
    "a rank the config does not say": ("rank_said", ("rank 8", "says 4")),
    "a name with a control character": ({"lora_name": "a\u0000b", "lora_path": "A1"}, ("lora_name",)),
    "a name padded with spaces": ({"lora_name": " a ", "lora_path": "A1"}, ("lora_name",)),
    "no lora_path": ({"lora_name": "x"}, ("lora_path",)),
    "no lora_name": ({"lora_path": "/tmp"}, ("lora_name",)),
    "unknown field": ({"lora_name": "x", "lora_path": "A1", "bogus": 1}, ("bogus",)),
    "empty name": ({"lora_name": "", "lora_path": "A1"}, ("lora_name",)),
    "not an object": ([], ()),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_load_refuses(lab: Lab, client: openai.OpenAI, case: str):
    spec, words = BAD_LOADS[case]
    if isinstance(spec, str):
        path = lab.bad.get(spec, lab.root / spec)
        body: Any = {"lora_name": "x", "lora_path": str(path)}
    else:
        body = json.loads(json.dumps(spec).replace('"A1"', json.dumps(str(lab.adapters["a1"]))))
    message = _error(_post(lab.main, "/v1/load_lora_adapter", body), 400)["message"]
    for word in words:
        assert word.replace("{path}", str(body.get("lora_path"))) in message, message
    assert "x" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(client, "x")


def test_loads_at_once_each_get_an_id(lab: Lab, client: openai.OpenAI):
    """Six loads sent together: every one is served (each got the same fresh id, and all but
    one were refused as another adapter's id)."""
    names = [f"together{i}" for i in range(6)]
    with ThreadPoolExecutor(len(names)) as pool:
        bodies = [{"lora_name": n, "lora_path": str(lab.adapters["a1"])} for n in names]
        codes = list(pool.map(lambda b: _post(lab.main, "/v1/load_lora_adapter", b), bodies))
    assert [r.status_code for r in codes] == [200] * len(names), [r.text for r in codes]
    assert _complete(client, names[-1]) == (names[-1], lab.refs["a1"])
    for n in names:
        assert _post(lab.main, "/v1/unload_lora_adapter", {"lora_name": n}).status_code == 200


def test_an_adapter_whose_folder_went_fails_its_requests_only(lab: Lab, client: openai.OpenAI, base_name: str):
    """Loaded, then its folder removed before its first use: the worker cannot read it. Its
    requests are an error naming why (they were a 200 with an empty text and finish_reason
    'error'), streamed or not; the server and the other models serve on."""
    gone = shutil.copytree(lab.adapters["a1"], lab.root / "gone")
    assert _post(lab.main, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(gone)}).status_code == 200
    shutil.rmtree(gone)
    try:
        for path, body in (
            ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
        ):
            err = _error(_post(lab.main, path, {**body, "model": "gone"}), 500)
            assert "no such folder" in err["message"], err
        with httpx.stream(
            "POST",
            lab.main.base_url + "/v1/completions",
            json={"model": "gone", "prompt": PROMPTS[0], "max_tokens": 4, "stream": True},
            timeout=TIMEOUT,
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "no such folder" in events[-1]["error"]["message"], events
        assert _complete(client, "a1") == ("a1", lab.refs["a1"])
        assert _complete(client, base_name) == (base_name, lab.refs[None])
    finally:
        _post(lab.main, "/v1/unload_lora_adapter", {"lora_name": "gone"})


def test_responses_use_the_adapter_named(lab: Lab, client: openai.OpenAI, base_name: str):
    """/v1/responses runs the adapter its model names, as chat does (it ran the base model)."""
    ask = [{"role": "user", "content": "hello there"}]
    for model in ("a1", base_name):
        r = client.responses.create(model=model, input=ask, max_output_tokens=N, temperature=0)
        chat = client.chat.completions.create(model=model, messages=ask, max_tokens=N, temperature=0)
        assert r.model == model and r.output_text == chat.choices[0].message.content, (model, r.output_text)
    base = client.responses.create(model=base_name, input=ask, max_output_tokens=N, temperature=0)
    assert (
        base.output_text
        != client.responses.create(model="a1", input=ask, max_output_tokens=N, temperature=0).output_text
    )


def test_unload_refuses(lab: Lab):
    err = _error(_post(lab.main, "/v1/unload_lora_adapter", {"lora_name": "a1", "lora_int_id": 999}), 400)
    assert err["param"] == "lora_int_id" and "999" in err["message"]
    err = _error(_post(lab.main, "/v1/unload_lora_adapter", {"lora_int_id": 1}), 400)
    assert "lora_name" in err["message"]
    err = _error(_post(lab.main, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}), 404)
    assert "never-loaded" in err["message"]


# -- unloading with requests in flight (last on the main server: it takes a2 away) ------


def test_unload_with_requests_waiting(lab: Lab, client: openai.OpenAI, base_name: str):
    """Two long streams hold both adapter slots (a1 and h, a second name for a3's folder), so
    six a2 requests wait; a2 is unloaded then. The six still finish with a2's tokens (a
    request keeps the adapter it was accepted with), new a2 requests are 404s, and a2 loaded
    again from a1's folder is a1 (a fresh id, never the old adapter's cache)."""
    resp = _post(lab.main, "/v1/load_lora_adapter", {"lora_name": "h", "lora_path": str(lab.adapters["a3"])})
    assert resp.status_code == 200, resp.text
    holders = [Stream("a1", PROMPTS[0], LONG).start(client), Stream("h", PROMPTS[1], LONG).start(client)]
    _wait([s.started for s in holders], "first token")
    waiting = [Stream("a2", PROMPTS[i % 2], N).start(client) for i in range(6)]
    _wait([s.accepted for s in waiting], "accepted a2 request")
    # vLLM's lora_requests_info names the adapters of the running and the waiting requests
    assert _lora_info(lab.main) == {"max_lora": "2", "running_lora_adapters": "a1,h", "waiting_lora_adapters": "a2"}
    resp = _post(lab.main, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    unloaded_at = time.monotonic()
    assert resp.status_code == 200 and "a2" in resp.text, resp.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("a2")
    assert "a2" not in {m.id for m in client.models.list().data}
    err = _error(_post(lab.main, "/v1/unload_lora_adapter", {"lora_name": "a2"}), 404)
    assert "a2" in err["message"]
    resp = _post(lab.main, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(lab.adapters["a1"])})
    assert resp.status_code == 200, resp.text
    assert _complete(client, "a2") == ("a2", lab.refs["a1"])
    for s in holders + waiting:
        s.join()
    for s in holders:
        assert s.error is None and s.finish == "length" and len(s.tokens) == LONG, (s.model, s.error, s.finish)
    assert holders[0].tokens[:N] == lab.refs["a1"][0] and holders[1].tokens[:N] == lab.refs["a3"][1]
    for i, s in enumerate(waiting):
        assert s.error is None and s.finish == "length", (i, s.error, s.finish)
        assert s.tokens == lab.refs["a2"][i % 2], i
    # --max-loras 2: no a2 token came while a1 and h held the slots, i.e. before the unload
    assert min(s.times[0] for s in waiting) > unloaded_at
    assert httpx.get(lab.main.base_url + "/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(lab.main.base_url + "/metrics", timeout=TIMEOUT).status_code == 200
    assert _complete(client, base_name) == (base_name, lab.refs[None])
    assert _complete(client, "a1") == ("a1", lab.refs["a1"])


# -- servers that do not load adapters at run time -------------------------------------


def test_without_runtime_updating(lab: Lab):
    """--enable-lora alone: the --lora-modules adapters are served, the endpoints are 403s."""
    client = _client(lab.locked)
    assert _complete(client, "a1") == ("a1", lab.refs["a1"])
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(lab.adapters["a3"])}),
        ("/v1/unload_lora_adapter", {"lora_name": "a1"}),
    ):
        err = _error(_post(lab.locked, path, body), 403)
        assert "--allow-runtime-lora-updating" in err["message"], err
    assert "a3" not in {m.id for m in client.models.list().data}
    assert _complete(client, "a1") == ("a1", lab.refs["a1"])  # the refused unload changed nothing


def test_without_enable_lora(lab: Lab):
    client = _client(lab.bare)
    base_name = client.models.list().data[0].id
    assert [m.id for m in client.models.list().data] == [base_name]
    err = _error(
        _post(lab.bare, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(lab.adapters["a1"])}), 400
    )
    assert "--enable-lora" in err["message"], err
    _error(_post(lab.bare, "/v1/unload_lora_adapter", {"lora_name": "a1"}), 404)
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a1")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("a1")
    assert _complete(client, base_name) == (base_name, lab.refs[None])
    assert "lora_requests_info" not in httpx.get(lab.bare.base_url + "/metrics", timeout=TIMEOUT).text


# -- start-up errors: one line, exit 2, nothing served ----------------------------------


def test_startup_errors(lab: Lab):
    a1 = str(lab.adapters["a1"])
    runs = {
        "missing folder": (("--enable-lora", "--lora-modules", "bad=/nonexistent/adapter"), ("/nonexistent/adapter",)),
        "no --enable-lora": (("--lora-modules", f"x={a1}"), ("--enable-lora",)),
        "rank": (("--enable-lora", "--lora-modules", f"r={lab.bad['rank32']}"), ("rank 32", "--max-lora-rank 16")),
        "a layer the model lacks": (
            ("--enable-lora", "--lora-modules", f"t={lab.bad['three_layers']}"),
            ("model.layers.2.", "not a layer of this model"),
        ),
        "another base's shapes": (
            ("--enable-lora", "--lora-modules", f"w={lab.bad['wide']}"),
            ("96", "another base model"),
        ),
        "same name twice": (("--enable-lora", "--lora-modules", f"a={a1}", f"a={a1}"), ("twice",)),
        "not name=path": (("--enable-lora", "--lora-modules", a1), ("name=path",)),
    }
    procs = {}
    for name, (flags, _) in runs.items():
        procs[name] = subprocess.Popen(
            [*serve_cmd(free_port(), "--model", str(lab.base), *SERVER_FLAGS), *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    t0 = time.monotonic()
    try:
        outs = {name: p.communicate(timeout=TIMEOUT) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for name, (_, words) in runs.items():
        out, err = outs[name]
        assert procs[name].returncode == 2, (name, procs[name].returncode, err[-2000:])
        for word in words:
            assert word in err, (name, err[-2000:])
        assert "OpenAI-compatible API" not in out + err, name
    assert time.monotonic() - t0 < TIMEOUT


def test_an_adapter_without_lora_alpha_has_peft_s_default(lab: Lab, tmp_path: Path):
    """PEFT's LoraConfig defaults lora_alpha to 8 (it was taken as the rank: a rank-16 adapter
    ran at twice PEFT's scale)."""
    from peft import PeftConfig

    from aiolm.checkpoint.families import read_config
    from aiolm.lora.adapter import read_adapter

    folder = shutil.copytree(lab.adapters["a2"], tmp_path / "no_alpha")  # rank 16, rsLoRA
    cfg = json.loads((folder / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    peft_cfg = PeftConfig.from_pretrained(str(folder))
    want = peft_cfg.lora_alpha / peft_cfg.r**0.5
    info = read_adapter(folder, read_config(json.loads((lab.base / "config.json").read_text())), 16)
    assert want == 2.0 and {m.scaling for m in info.modules.values()} == {want}
