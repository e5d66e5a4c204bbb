"""The pooling APIs on real `aiolm serve --runner pooling` processes, against sentence-transformers.

One server per model, each shared by the module: a tiny random BERT embedder (mean pooling,
normalised) and a tiny BERT cross-encoder (one label), both saved as sentence-transformers
folders (tests/pooling_models.py). Embeddings go through the real `openai` client, the other
routes through httpx; every number is compared with what sentence-transformers or
transformers compute from the same folder in float32.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import struct
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import API_KEY, ServerProcess, free_port

from pooling_models import WORDS, bert_cross_encoder, bert_embedder

TIMEOUT = 60.0
SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Embeddings",
    "Paris is the capital of France, and its museums are among the largest in the world.",
    "hello world",
]
QUERY = "Where is the Eiffel tower?"
DOCS = [
    "The Eiffel tower is in Paris.",
    "Bananas are yellow.",
    "Paris is the capital of France and home to a famous iron tower.",
    "The stock market fell sharply today after the announcement.",
]
MATRYOSHKA = [16, 32]
WRONG = [[[]]]  # no pooling request field takes a list of lists of lists


def _pooling_server(tmp: Path, model: Path, *extra: str) -> ServerProcess:
    max_len = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "aiolm.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model),
        "--runner",
        "pooling",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_len),
        "--max-num-seqs",
        "16",
        "--max-waiting-requests",
        "64",
        "--num-threads",
        "1",
        "--shutdown-timeout",
        "5",
        *extra,
    ]
    return ServerProcess(cmd, port, tmp / "server.log")


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mean pooling, normalised, and matryoshka sizes 16 and 32 (vLLM's config key; the
    sentence-transformers reference ignores it)."""
    folder = Path(bert_embedder(tmp_path_factory.mktemp("bert-embedder"), pooling="mean", normalize=True))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": MATRYOSHKA}))
    return folder


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(bert_cross_encoder(tmp_path_factory.mktemp("bert-cross-encoder"), num_labels=1))


@pytest.fixture(scope="module")
def pooling_servers(tmp_path_factory: pytest.TempPathFactory, embedder_dir: Path, cross_dir: Path):
    """Both servers, started side by side (start-up is most of this module's time); each must
    exit 0 on SIGTERM."""
    emb = _pooling_server(tmp_path_factory.mktemp("embedder-server"), embedder_dir)
    cross = _pooling_server(tmp_path_factory.mktemp("cross-server"), cross_dir)
    # few seats and a short --request-timeout: a request of many inputs outlives it
    timed = _pooling_server(
        tmp_path_factory.mktemp("timed-server"), embedder_dir, "--request-timeout", "0.5", "--max-num-seqs", "2"
    )
    with contextlib.ExitStack() as stack:
        stack.callback(cross.kill)  # if the embedder never gets ready, the others go too
        stack.callback(timed.kill)
        stack.enter_context(emb.serving("embedder"))
        stack.enter_context(cross.serving("cross-encoder"))
        stack.enter_context(timed.serving("embedder with a request timeout"))
        yield emb, cross, timed


@pytest.fixture(scope="module")
def embedder(pooling_servers) -> ServerProcess:
    return pooling_servers[0]


@pytest.fixture(scope="module")
def cross(pooling_servers) -> ServerProcess:
    return pooling_servers[1]


@pytest.fixture(scope="module")
def client(embedder: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=embedder.base_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def st_embedder(embedder_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder_dir), device="cpu")


@pytest.fixture(scope="module")
def st_cross(cross_dir: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_dir), device="cpu")


def _vocab(model: Path) -> int:
    """The model's vocabulary: the rows of its embedding table."""
    return json.loads((model / "config.json").read_text())["vocab_size"]


def _cos(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=TIMEOUT)


def _idle(srv: ServerProcess, timeout: float = 10.0) -> None:
    """No engine request and no HTTP request left in the server."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(srv.base_url + "/metrics", timeout=TIMEOUT).text
        live = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("aiolm:num_requests_running", "aiolm:num_requests_waiting"))
        ]
        load = httpx.get(srv.base_url + "/load", timeout=TIMEOUT).json()["server_load"]
        if len(live) == 2 and not any(live) and load == 0:
            # pooling requests generate nothing: no max_tokens is observed for them (vLLM's)
            (observed,) = [
                line for line in text.splitlines() if line.startswith("aiolm:request_params_max_tokens_count")
            ]
            assert float(observed.rsplit(" ", 1)[1]) == 0, observed
            return
        assert time.monotonic() < deadline, (live, load)
        time.sleep(0.1)


def _refused(r: httpx.Response, param: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err


# -- /v1/embeddings through the openai client --------------------------------------------------


def test_embeddings_equal_sentence_transformers(client, model, st_embedder):
    res = client.embeddings.create(model=model, input=SENTENCES, encoding_format="float")
    assert [d.index for d in res.data] == list(range(len(SENTENCES))) and res.model == model
    want = st_embedder.encode(SENTENCES, convert_to_numpy=True)
    for got, ref in zip(res.data, want):
        assert len(got.embedding) == len(ref)
        assert _cos(got.embedding, ref.tolist()) >= 0.99999
        assert abs(math.sqrt(sum(x * x for x in got.embedding)) - 1) < 1e-5  # the folder's Normalize module
    tokens = sum(len(st_embedder.tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert res.usage.prompt_tokens == res.usage.total_tokens == tokens


def test_base64_equals_float_and_a_mixed_batch_equals_one_by_one(client, model):
    floats = client.embeddings.create(model=model, input=SENTENCES, encoding_format="float").data
    want = [d.embedding for d in floats]
    # asked for explicitly, base64 comes back as sent: little-endian float32
    raw = client.embeddings.create(model=model, input=SENTENCES, encoding_format="base64").data
    decoded = [list(struct.unpack(f"<{len(w)}f", base64.b64decode(d.embedding))) for d, w in zip(raw, want)]
    assert decoded == want
    # without a format the client asks for base64 and decodes it itself
    assert [d.embedding for d in client.embeddings.create(model=model, input=SENTENCES).data] == want
    for s, batched in zip(SENTENCES, floats):
        alone = client.embeddings.create(model=model, input=s, encoding_format="float").data[0].embedding
        assert max(abs(x - y) for x, y in zip(alone, batched.embedding)) < 1e-5


def test_dimensions_cut_then_normalise(client, model, st_embedder):
    """OpenAI's ``dimensions``: the first N values, normalised after the cut (as
    sentence-transformers' ``truncate_dim`` then Normalize)."""
    res = client.embeddings.create(model=model, input=SENTENCES[:2], dimensions=16, encoding_format="float")
    want = st_embedder.encode(SENTENCES[:2], convert_to_numpy=True, output_value="token_embeddings")
    for got, tokens in zip(res.data, want):
        ref = tokens.mean(0)[:16].tolist()
        assert len(got.embedding) == 16 and _cos(got.embedding, ref) >= 0.99999
        assert abs(math.sqrt(sum(x * x for x in got.embedding)) - 1) < 1e-5
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="hello", dimensions=20)
    assert e.value.body["param"] == "dimensions"


def test_a_batch_larger_than_the_queue_is_served_whole(embedder, client, model, embedder_dir):
    """200 inputs on a server with 16 running seats and 64 waiting: a request's inputs enter
    the engine in a window, so it is served whole rather than refused as a full engine (429).
    One bad input among many is a 400 that leaves no engine request behind."""
    texts = [" ".join(WORDS[i % 40 : i % 40 + 1 + i % 23]) for i in range(200)]
    res = client.embeddings.create(model=model, input=texts, encoding_format="float")
    assert [d.index for d in res.data] == list(range(200))
    for i in (0, 77, 199):
        alone = client.embeddings.create(model=model, input=texts[i], encoding_format="float").data[0].embedding
        assert max(abs(x - y) for x, y in zip(alone, res.data[i].embedding)) < 1e-5
    _idle(embedder)
    vocab = _vocab(embedder_dir)
    _refused(_post(embedder, "/v1/embeddings", {"input": [[2, 7, 3]] * 150 + [[2, vocab, 3]]}), "input[150]")
    _idle(embedder)


def test_token_id_inputs_and_user(client, model, st_embedder):
    ids = [st_embedder.tokenizer(s)["input_ids"] for s in SENTENCES[:2]]
    by_text = client.embeddings.create(model=model, input=SENTENCES[:2], encoding_format="float").data
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float", user="u-1").data
    one = client.embeddings.create(model=model, input=ids[0], encoding_format="float").data
    for a, b in zip(by_text, by_ids):
        assert _cos(a.embedding, b.embedding) >= 0.99999
    assert _cos(one[0].embedding, by_text[0].embedding) >= 0.99999


def test_pooling_route_and_models(embedder, client, model):
    want = client.embeddings.create(model=model, input=SENTENCES[0], encoding_format="float").data[0].embedding
    r = _post(embedder, "/pooling", {"input": [SENTENCES[0]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    assert _cos(body["data"][0]["data"], want) >= 0.99999
    assert body["usage"]["prompt_tokens"] > 0
    cards = httpx.get(embedder.base_url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert len(cards) == 1 and cards[0]["id"] == body["model"]


def test_bi_encoder_score_and_rerank_are_cosines(embedder, st_embedder):
    vecs = st_embedder.encode([QUERY, *DOCS], convert_to_numpy=True).tolist()
    want = [_cos(vecs[0], v) for v in vecs[1:]]
    r = _post(embedder, "/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    assert [d["index"] for d in r.json()["data"]] == list(range(len(DOCS)))
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    r = _post(embedder, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r.json()["results"]] == best


def test_invocations_routes_embedding_score_and_rerank_bodies(embedder):
    """SageMaker's /invocations on a pooling server: each body gets its own route's answer."""
    for body, path in (
        ({"input": [SENTENCES[0], SENTENCES[1]]}, "/v1/embeddings"),
        ({"text_1": QUERY, "text_2": DOCS}, "/score"),
        ({"query": QUERY, "documents": DOCS, "top_n": 2}, "/rerank"),
    ):
        via, direct = _post(embedder, "/invocations", body), _post(embedder, path, body)
        assert via.status_code == direct.status_code == 200, via.text
        a, b = via.json(), direct.json()
        for key in ("id", "created"):
            a.pop(key, None), b.pop(key, None)
        assert a == b, path
    r = _post(embedder, "/invocations", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "generate" in r.json()["error"]["message"], r.text


# -- the cross-encoder: /score, /rerank, /classify ---------------------------------------------


def test_rerank_equals_cross_encoder_predict(cross, st_cross):
    want = st_cross.predict([(QUERY, d) for d in DOCS]).tolist()
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(cross, path, {"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        for x in results:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
            assert x["document"] == {"text": DOCS[x["index"]]}
        assert body["usage"]["total_tokens"] > 0 and body["id"].startswith("rerank-")
    r = _post(cross, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False})
    (top,) = r.json()["results"]
    assert top["index"] == max(range(len(DOCS)), key=lambda i: want[i]) and "document" not in top


def test_identical_documents_score_alike_in_any_batch(cross):
    """A pair's score does not depend on the batch it ran in: equal documents tie exactly and
    keep the request's order, and each equals its pair scored alone."""
    query = "where is paris"
    for doc, others in (("a", []), (query, []), (DOCS[0], [DOCS[1], DOCS[2]])):
        alone = _post(cross, "/score", {"text_1": query, "text_2": doc}).json()["data"][0]["score"]
        for n in (2, 3, 5):
            docs = [doc] * n + others
            r = _post(cross, "/rerank", {"query": query, "documents": docs, "return_documents": False})
            assert r.status_code == 200, r.text
            ties = [x for x in r.json()["results"] if docs[x["index"]] == doc]
            assert [x["index"] for x in ties] == list(range(n)), ties
            assert {x["relevance_score"] for x in ties} == {alone}, (ties, alone)


def test_score_pairs_equal_cross_encoder_predict(cross, st_cross):
    one_to_n = _post(cross, "/score", {"text_1": QUERY, "text_2": DOCS})
    n_to_n = _post(cross, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})
    one = _post(cross, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
    for r, pairs in (
        (one_to_n, [(QUERY, d) for d in DOCS]),
        (n_to_n, list(zip(DOCS[:2], DOCS[2:]))),
        (one, [(QUERY, DOCS[0])]),
    ):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and all(d["object"] == "score" for d in body["data"])
        got = [d["score"] for d in body["data"]]
        want = st_cross.predict(pairs).tolist()
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    _refused(_post(cross, "/score", {"text_1": DOCS[:3], "text_2": DOCS[:2]}), "text_1")


def test_classify_and_pooled_logits_equal_transformers(cross, cross_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cross_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(cross_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(**tok(s, return_tensors="pt")).logits[0].tolist() for s in SENTENCES[:3]]
    r = _post(cross, "/classify", {"input": SENTENCES[:3]})
    assert r.status_code == 200, r.text
    for d, want in zip(r.json()["data"], logits):
        assert d["num_classes"] == 1 and d["label"] == model.config.id2label[0]
        assert abs(d["probs"][0] - 1 / (1 + math.exp(-want[0]))) < 1e-5
    r = _post(cross, "/pooling", {"input": SENTENCES[:3]})  # a classifier's pooled output: its logits
    assert r.status_code == 200, r.text
    for d, want in zip(r.json()["data"], logits):
        assert len(d["data"]) == 1 and abs(d["data"][0] - want[0]) < 1e-4
    # a model without matryoshka sizes refuses `dimensions`
    _refused(_post(cross, "/pooling", {"input": "x", "dimensions": 4}), "dimensions")


# -- what is refused -----------------------------------------------------------------------------


def test_bad_embedding_inputs_are_400s_naming_the_field(embedder, embedder_dir):
    vocab = _vocab(embedder_dir)
    max_len = json.loads(httpx.get(embedder.base_url + "/v1/models", timeout=TIMEOUT).text)["data"][0]["max_model_len"]
    long_text = " ".join(["word"] * (max_len + 8))
    cases = [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [[]]}, "input[0]"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": [[1, 2], [3, vocab]]}, "input[1]"),
        ({"input": ["short", long_text]}, "input[1]"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "priority": 1}, "priority"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "not_a_field": 1}, "not_a_field"),
        ({"input": 5}, "input"),
    ]
    for body, param in cases:
        r = _post(embedder, "/v1/embeddings", body)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    # over the context length, truncation only when asked: the first N tokens are kept
    r = _post(embedder, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16, r.text
    r = _post(embedder, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == max_len, r.text
    _refused(_post(embedder, "/classify", {"input": "x"}), "model")
    _refused(_post(embedder, "/rerank", {"query": "q", "documents": []}), "documents")


def test_bad_cross_encoder_inputs_are_400s_naming_the_field(cross):
    """A pair's truncate_prompt_tokens is checked before the tokenizer sees it (a negative or
    huge one was a 500 there), logits are never normalised, and a pair too long for the
    context is refused before it is tokenized. The server serves on afterwards."""
    bodies = {
        "/score": {"text_1": QUERY, "text_2": DOCS[:2]},
        "/rerank": {"query": QUERY, "documents": DOCS[:2]},
        "/invocations": {"query": QUERY, "documents": DOCS[:2]},
    }
    for path, body in bodies.items():
        for value in (-3, 0, 2**64, 10**20, True, "5"):
            _refused(_post(cross, path, {**body, "truncate_prompt_tokens": value}), "truncate_prompt_tokens")
    err = _refused(_post(cross, "/pooling", {"input": "x", "normalize": True}), "normalize")
    assert "logits" in err["message"]
    long_doc = " ".join(["paris"] * 5000)
    err = _refused(_post(cross, "/rerank", {"query": QUERY, "documents": [DOCS[0], long_doc]}), "documents[1]")
    assert "characters" in err["message"]
    r = _post(cross, "/rerank", {"query": QUERY, "documents": [DOCS[0], long_doc], "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    r = _post(cross, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
    _idle(cross)


def _health_during(srv: ServerProcess, path: str, body: bytes) -> tuple[httpx.Response, float, float]:
    """(the response to ``body`` at ``path``, how long it took, /health's worst wait meanwhile)."""
    import asyncio

    async def run() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as c:
            worst, done = 0.0, asyncio.Event()

            async def probe() -> None:
                nonlocal worst
                for _ in range(2000):  # bounded: about 20 ms a round
                    if done.is_set():
                        return
                    t0 = time.monotonic()
                    assert (await c.get("/health")).status_code == 200
                    worst = max(worst, time.monotonic() - t0)
                    await asyncio.sleep(0.02)

            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
            took = time.monotonic() - t0
            done.set()
            await prober
            return r, took, worst

    return asyncio.run(run())


def _texts(n: int, words: int) -> list[str]:
    """``n`` texts of ``words`` words each (each too long for the test models once tokenized)."""
    pool = [WORDS[(i * 7) % len(WORDS)] for i in range(words)]
    return [" ".join(pool[i % 7 :] + pool[: i % 7]) for i in range(n)]


def test_many_pairs_are_tokenized_off_the_event_loop(cross):
    """2,000 pairs of a few thousand characters each take the tokenizer a second or more;
    /health, polled meanwhile, must not wait for them (it did, for the whole batch)."""
    docs = _texts(2000, 400)
    r, took, worst = _health_during(cross, "/rerank", json.dumps({"query": QUERY, "documents": docs}).encode())
    err = _refused(r, r.json()["error"]["param"])
    assert err["param"].startswith("documents[") and "tokens" in err["message"], err
    assert took > 0.5, f"the pairs tokenized in {took:.2f}s: too fast to show a stall"
    assert worst < took / 3, f"/health waited {worst:.2f}s while {len(docs)} pairs took {took:.2f}s"
    _idle(cross)


def test_many_embedding_inputs_are_tokenized_off_the_event_loop(embedder):
    """The same for 2,000 texts to embed, each short enough to be tokenized on the loop alone
    (it was, one after another: /health waited seconds)."""
    texts = _texts(2000, 300)
    r, took, worst = _health_during(embedder, "/v1/embeddings", json.dumps({"input": texts}).encode())
    err = _refused(r, r.json()["error"]["param"])
    assert err["param"].startswith("input[") and "tokens" in err["message"], err
    if took < 0.5:
        pytest.skip(f"the texts tokenized in {took:.2f}s: too fast to show a stall")
    assert worst < took / 3, f"/health waited {worst:.2f}s while {len(texts)} texts took {took:.2f}s"
    _idle(embedder)


def test_the_request_timeout_bounds_the_whole_request(pooling_servers):
    """--request-timeout is the request's, not each input's from when it gets a seat: 2,000
    inputs through 2 seats outlive it (they were a 200, seconds later)."""
    timed = pooling_servers[2]
    t0 = time.monotonic()
    r = _post(timed, "/v1/embeddings", {"input": _texts(2000, 60)})
    took = time.monotonic() - t0
    assert r.status_code == 408, (took, r.text[:100])
    assert took < 5, f"answered after {took:.1f} s"
    assert _post(timed, "/v1/embeddings", {"input": "the cat"}).status_code == 200
    _idle(timed)


def test_every_documented_field_is_read(embedder):
    """As test_server_endpoints.py does for the generation routes: each field /openapi.json
    lists for a pooling route, given a value of the wrong shape, is refused by name."""
    bases = {
        "/v1/embeddings": {"input": "x"},
        "/pooling": {"input": "x"},
        "/score": {"text_1": "a", "text_2": "b"},
        "/rerank": {"query": "q", "documents": ["d"]},
        "/classify": {"input": "x"},
    }
    doc = httpx.get(embedder.base_url + "/openapi.json", timeout=TIMEOUT).json()
    for path, base in bases.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
        assert set(base) <= set(props)
        for field in props:
            r = _post(embedder, path, {**base, field: WRONG})
            assert r.status_code == 400, (path, field, r.text)
            err = r.json()["error"]
            assert err["code"] != "unrecognized_argument" and err["param"].startswith(field), (path, field, err)


def test_each_runner_refuses_the_others_routes(embedder, server):
    """A pooling server refuses generation, a generation server pooling: 400s naming the model."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ):
        err = _refused(_post(embedder, path, body), "model")
        assert err["code"] == "wrong_runner" and "--runner pooling" in err["message"]
    gen = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
    name = gen.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        gen.embeddings.create(model=name, input="hi")
    assert e.value.body["param"] == "model" and name in e.value.body["message"]
    for path in ("/score", "/rerank", "/classify", "/pooling"):
        r = httpx.post(server.base_url + path, json={}, headers={"authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_runner", (path, r.text)
