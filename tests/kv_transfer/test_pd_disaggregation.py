"""Prefill/decode disaggregation on one machine, all real processes: a prefill instance
(kv_producer) and a decode instance (kv_consumer), each `aiolm serve` with its own
worker, behind `aiolm proxy`, driven by the openai client.

The two instances share a machine, so the KV goes through shared memory (the handshake
says so; tests/kv_transfer/test_pd_tensor_parallel.py covers the socket path).
Greedy answers through the proxy equal the single instance's (the decode instance
answering the same requests alone, its prefix cache off so nothing is reused), for 20
requests, streamed and not, chat and completions; the decode instance computed only
each prompt's last token (its /metrics: the tokens it ran, and the ones it loaded).
Faults: a prefill instance killed while it sends, a transfer damaged in flight, and a
decode instance whose KV layout differs (refused at the handshake, naming the
difference) all end with the decode instance computing the prompt itself: the same
answer, nothing leaked, the decode instance still serving.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import ServerProcess, free_port, serve_cmd  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
TOPICS = [
    "the sea",
    "a city at night",
    "bread",
    "winter",
    "a library",
    "the moon",
    "rivers",
    "a market",
    "bees",
    "trains",
]


def producer_config(port: int) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": port})


CONSUMER = json.dumps(
    {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout": 20}}
)


def proxy_cmd(port: int, prefill: str, decode: str) -> list[str]:
    return [sys.executable, "-m", "aiolm.cli", "proxy", "--prefill", prefill, "--decode", decode, "--port", str(port)]


def metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"aiolm:{name}{{") or line.startswith(f"aiolm:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def ask(client: openai.OpenAI, i: int, stream: bool) -> tuple[list[str], int]:
    """Request ``i`` (even: chat, odd: completions); its text pieces and prompt tokens."""
    topic = TOPICS[i % len(TOPICS)]
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    if i % 2 == 0:
        messages = [{"role": "user", "content": f"Write two sentences about {topic}. Request {i}."}]
        out = client.chat.completions.create(model="m", messages=messages, stream=stream, **GREEDY, **usage)
        if not stream:
            return [out.choices[0].message.content or ""], out.usage.prompt_tokens
        pieces, prompt = [], 0
        for chunk in out:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                prompt = chunk.usage.prompt_tokens
        return ["".join(pieces)], prompt
    prompt_text = f"Request {i}. A short note on {topic}: " * 3
    out = client.completions.create(model="m", prompt=prompt_text, stream=stream, **GREEDY, **usage)
    if not stream:
        return [out.choices[0].text], out.usage.prompt_tokens
    pieces, prompt = [], 0
    for chunk in out:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
    return ["".join(pieces)], prompt


@pytest.fixture(scope="module")
def decode_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    port = free_port()
    server = ServerProcess(
        serve_cmd(port, "--kv-transfer-config", CONSUMER, "--no-enable-prefix-caching", "--served-model-name", "m"),
        port,
        tmp / "decode.log",
    )
    with server.serving("decode instance"):
        yield server


def producer(tmp: Path, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    port, kv_port = free_port(), free_port()
    cmd = serve_cmd(port, "--kv-transfer-config", producer_config(kv_port), "--served-model-name", "m", *extra)
    return ServerProcess(cmd, port, tmp / f"prefill-{port}.log", env)


def proxy(tmp: Path, prefill: ServerProcess, decode: ServerProcess) -> ServerProcess:
    port = free_port()
    return ServerProcess(proxy_cmd(port, prefill.base_url, decode.base_url), port, tmp / f"proxy-{port}.log")


@pytest.fixture(scope="module")
def pd(decode_server, tmp_path_factory):
    """The prefill instance and the proxy over both; the prefill instance reads the fault
    to inject into its next transfers from ``fault`` (empty: none). The last test kills it."""
    tmp = tmp_path_factory.mktemp("pd-front")
    fault = tmp / "fault"
    fault.write_text("")
    prefill = producer(tmp, env={"AIOLM_TEST_KV_SEND_FAULT": str(fault)})
    prefill.wait_ready()
    front = proxy(tmp, prefill, decode_server)
    try:
        with front.serving("proxy"):
            yield prefill, front, fault
    finally:
        prefill.kill()


def test_twenty_requests_through_the_proxy_answer_as_one_instance(decode_server, pd):
    prefill, front, _ = pd
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    ran0 = metric(decode_server.base_url, "iteration_tokens_total_sum")
    loaded0 = metric(decode_server.base_url, "external_prefix_cache_hits_total")
    split = [ask(client, i, stream=i % 4 >= 2) for i in range(20)]
    ran = metric(decode_server.base_url, "iteration_tokens_total_sum") - ran0
    loaded = metric(decode_server.base_url, "external_prefix_cache_hits_total") - loaded0
    sent = metric(prefill.base_url, "kv_connector_saved_blocks_total")
    direct = openai.OpenAI(base_url=decode_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    alone = [ask(direct, i, stream=i % 4 >= 2) for i in range(20)]
    assert [text for text, _ in split] == [text for text, _ in alone]
    prompts = [p for _, p in split]
    assert all(p > 16 for p in prompts)
    # The decode instance ran each prompt's last token and the 11 tokens after the first:
    # MAX_TOKENS tokens a request, no prompt; every other prompt token arrived from the prefill instance.
    assert ran == 20 * MAX_TOKENS
    assert loaded == sum(p - 1 for p in prompts)
    assert sent >= sum(-(-p // 16) for p in prompts)
    assert metric(decode_server.base_url, "kv_connector_failed_loads_total") == 0
    for _ in range(50):  # the last prompt's blocks are freed once the prefill instance's ranks report them sent
        if metric(prefill.base_url, "kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert metric(prefill.base_url, "kv_cache_usage_perc") == 0
    # A batch of prompts goes to the decode instance alone (a prefill answer names one
    # prompt's KV): the same answers, and no block left leased on the prefill instance.
    batch = [f"Request {i}. A short note on {TOPICS[i]}: " * 3 for i in (1, 3, 5)]
    via = client.completions.create(model="m", prompt=batch, **GREEDY)
    assert [c.text for c in via.choices] == [
        direct.completions.create(model="m", prompt=b, **GREEDY).choices[0].text for b in batch
    ]
    assert metric(prefill.base_url, "kv_cache_usage_perc") == 0


def test_a_client_that_leaves_the_proxy_is_left_by_it(decode_server, pd):
    """A client that gives up on an unstreamed answer: the decode instance aborts it (the
    proxy's call is cancelled with it) instead of generating for nobody."""
    _, front, _ = pd
    long = {"model": "m", "prompt": "Tell a long story.", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(front.base_url + "/v1/completions", json=long, timeout=3.0)
    deadline = time.monotonic() + 10  # 900 tokens take half a minute here
    while metric(decode_server.base_url, "num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(decode_server.base_url, "num_requests_running") == 0
    assert metric(decode_server.base_url, "kv_cache_usage_perc") == 0


def _live_segments() -> set[str]:
    """aiolm's shared-memory segments whose creator is alive (a killed instance's are swept
    by the next aiolm to start)."""
    out = set()
    for name in os.listdir("/dev/shm"):
        if name.startswith("aiolm_"):
            try:
                os.kill(int(name.split("_")[1]), 0)
            except (ProcessLookupError, ValueError):
                continue
            out.add(name)
    return out


def _worker_sockets(server: ServerProcess) -> int:
    """Open sockets of the server's worker process (its only child)."""
    pid = server.proc.pid
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sum(1 for fd in Path(f"/proc/{child}/fd").iterdir() if os.readlink(fd).startswith("socket:"))


def _one_request_with_a_fault(decode_server, front: ServerProcess, kill: ServerProcess | None = None):
    """One chat request through the proxy; its answer, the decode instance's failed loads
    over it and the seconds it took. With ``kill``, that instance is SIGKILLed 4 s in.
    Nothing may be left behind: no block, no shared-memory segment, no socket to a
    prefill instance."""
    segments = _live_segments()
    sockets = _worker_sockets(decode_server)
    failed0 = metric(decode_server.base_url, "kv_connector_failed_loads_total")
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    if kill is not None:
        threading.Timer(4.0, kill.kill).start()
    t0 = time.monotonic()
    text, _ = ask(client, 4, stream=False)
    took = time.monotonic() - t0
    failed = metric(decode_server.base_url, "kv_connector_failed_loads_total") - failed0
    assert metric(decode_server.base_url, "kv_cache_usage_perc") == 0
    assert metric(decode_server.base_url, "num_requests_running") == 0
    assert _live_segments() <= segments  # the consumer's transfer segment is gone too
    assert _worker_sockets(decode_server) <= sockets  # a broken connection is closed, not kept
    return text, failed, took


def _alone(decode_server) -> list[str]:
    direct = openai.OpenAI(base_url=decode_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    return ask(direct, 4, stream=False)[0]


def test_damaged_transfer_is_detected_and_recomputed(decode_server, pd):
    _, front, fault = pd
    fault.write_text("corrupt")
    try:
        text, failed, _ = _one_request_with_a_fault(decode_server, front)
    finally:
        fault.write_text("")
    assert text == _alone(decode_server)
    assert failed == 1
    assert "failed its checksum" in Path(decode_server.log_path).read_text()


def test_prefill_instance_killed_mid_transfer(decode_server, pd):
    """The producer stalls halfway through sending; it is SIGKILLed meanwhile. The decode
    instance's transfer breaks and it computes the prompt: the same answer. (It ends the
    module's prefill instance, so it runs after the other tests that use it.)"""
    prefill, front, fault = pd
    fault.write_text("stall:60")
    text, failed, took = _one_request_with_a_fault(decode_server, front, kill=prefill)
    assert text == _alone(decode_server)
    assert failed == 1 and took < 40


def test_mismatched_layout_is_refused_at_the_handshake(decode_server, tmp_path):
    """A prefill instance with 32-token blocks: the decode instance (16) is refused with a
    message naming the difference, and computes the prompt."""
    prefill = producer(tmp_path, "--block-size", "32")
    prefill.wait_ready()
    front = proxy(tmp_path, prefill, decode_server)
    try:
        with front.serving("proxy"):
            client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            text, _ = ask(client, 4, stream=False)
    finally:
        prefill.stop()
    assert text == _alone(decode_server)
    log = Path(decode_server.log_path).read_text()
    assert "KV layouts differ: block_size: producer 32, consumer 16" in log


def test_kv_transfer_params_need_the_matching_role(decode_server):
    """A field this instance cannot honour is a 400 naming it."""
    direct = openai.OpenAI(base_url=decode_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="do_remote_decode needs a kv_producer or kv_both"):
        direct.completions.create(
            model="m", prompt="hi", max_tokens=1, extra_body={"kv_transfer_params": {"do_remote_decode": True}}
        )
    with pytest.raises(openai.BadRequestError, match="'kv_transfer_params': 'remote_hots' is not supported"):
        direct.completions.create(
            model="m", prompt="hi", max_tokens=1, extra_body={"kv_transfer_params": {"remote_hots": "x"}}
        )
