"""Prefill/decode disaggregation against one colocated instance: the token stream of short
chats while a burst of long prompts arrives.

    python benchmarks/bench_pd.py [--rounds 2] [--long-tokens 4000] [--json]

Load, the same for both setups: ``--chats`` clients each stream short chat answers
(``--chat-tokens`` tokens, one request after another), and after ``--burst-at`` seconds
``--burst`` completions with ``--long-tokens``-token prompts arrive at once. Measured at
the clients: the gaps between streamed tokens of the short chats from the burst's arrival
until its last request is answered (ITL), their p50 / p99, the median time to first token
of the chats that started meanwhile, and the burst's time to finish.

* colocated: one `aiolm serve` (``--threads`` torch threads in its worker);
* disaggregated: a kv_producer and a kv_consumer `aiolm serve` (``--threads`` / 2 each)
  behind `aiolm proxy`; the chats go through the proxy too.

Every server is the embedded model in float32 with the default --max-step-ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from server_helpers import ServerProcess, free_port  # noqa: E402

SERVE = [sys.executable, "-m", "aiolm.cli", "serve", "--served-model-name", "m", "--max-model-len", "8192"]


def serve(port: int, threads: int, log: Path, *extra: str) -> ServerProcess:
    cmd = [*SERVE, "--port", str(port), "--num-threads", str(threads), "--kv-cache-memory", str(1 << 30), *extra]
    return ServerProcess(cmd, port, log)


async def chat_stream(client: httpx.AsyncClient, url: str, i: int, tokens: int, stamps: list[float]) -> None:
    """Stream one chat answer; ``stamps`` gets the client's clock at each token, after the
    request's send time first (so stamps[1] - stamps[0] is its time to first token)."""
    stamps.append(time.perf_counter())
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Tell me a short story about a cat, number {i}."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):  # a token (not the role chunk, not the end)
                stamps.append(time.perf_counter())


async def long_request(client: httpx.AsyncClient, url: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    body = {"model": "m", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    resp = await client.post(url + "/v1/completions", json=body)
    resp.raise_for_status()
    return time.perf_counter() - t0


async def load(url: str, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(a.long_tokens)] for _ in range(a.burst)]
    streams: list[list[float]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:

        async def chatter(c: int) -> None:
            n = 0
            while not stop.is_set():
                stamps: list[float] = []
                streams.append(stamps)
                await chat_stream(client, url, c * 1000 + n, a.chat_tokens, stamps)
                n += 1

        chats = [asyncio.ensure_future(chatter(c)) for c in range(a.chats)]
        await asyncio.sleep(a.burst_at)
        t_burst = time.perf_counter()
        burst = await asyncio.gather(*(long_request(client, url, p) for p in prompts))
        t_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*chats)
    gaps = [
        b - prev
        for stamps in streams
        for prev, b in zip(stamps[1:], stamps[2:])
        if t_burst <= b <= t_end  # gaps that end while the burst is being served
    ]
    gaps.sort()
    ttfts = [s[1] - s[0] for s in streams if len(s) > 1 and t_burst <= s[1] <= t_end]
    return {
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 1),
        "itl_p99_ms": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
        "itl_max_ms": round(1e3 * gaps[-1], 1),
        "gaps": len(gaps),
        "chat_ttft_median_s": round(statistics.median(ttfts), 2) if ttfts else None,
        "burst_s": round(t_end - t_burst, 2),
        "burst_request_s": [round(x, 2) for x in burst],
    }


def run_mode(mode: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    procs: list[ServerProcess] = []
    try:
        if mode == "colocated":
            server = serve(free_port(), a.threads, tmp / "colocated.log")
            procs.append(server)
            server.wait_ready()
            url = server.base_url
        else:
            kv_port = free_port()
            producer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port})
            consumer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_consumer"})
            half = max(1, a.threads // 2)
            pre = serve(free_port(), half, tmp / "prefill.log", "--kv-transfer-config", producer)
            dec = serve(free_port(), half, tmp / "decode.log", "--kv-transfer-config", consumer)
            procs += [pre, dec]
            pre.wait_ready()
            dec.wait_ready()
            port = free_port()
            cmd = [sys.executable, "-m", "aiolm.cli", "proxy", "--prefill", pre.base_url, "--decode", dec.base_url]
            proxy = ServerProcess([*cmd, "--port", str(port)], port, tmp / "proxy.log")
            procs.append(proxy)
            proxy.wait_ready()
            url = proxy.base_url
        res = asyncio.run(load(url, a))
        for server in procs[:2]:  # the instances (not the proxy)
            text = httpx.get(server.base_url + "/metrics").text
            for line in text.splitlines():
                if line.startswith("aiolm:num_preemptions_total{"):
                    res.setdefault("preemptions", []).append(float(line.rsplit(" ", 1)[1]))
        return res
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--burst", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=4000)
    p.add_argument("--burst-at", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the colocated worker (split in two)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="aiolm-pd-bench-"))
    results: dict[str, list[dict[str, Any]]] = {"colocated": [], "disaggregated": []}
    for r in range(a.rounds):
        for mode in ("colocated", "disaggregated") if r % 2 == 0 else ("disaggregated", "colocated"):
            res = run_mode(mode, a, tmp)
            results[mode].append(res)
            print(f"round {r} {mode}: {res}", flush=True)
    medians = {
        mode: {k: statistics.median(x[k] for x in runs) for k in ("itl_p50_ms", "itl_p99_ms", "burst_s")}
        for mode, runs in results.items()
    }
    print("medians:", medians)
    if a.json:
        print(json.dumps({"args": vars(a), "runs": results, "medians": medians}))


if __name__ == "__main__":
    main()
