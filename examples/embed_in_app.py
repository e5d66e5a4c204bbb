"""AsyncEngine embedded in your own asyncio program.

The engine's actors (input, core step loop, output processing) run as tasks on
*your* event loop, next to your own coroutines; the model runs in worker
processes, so the loop stays free while they compute. Here the "application"
is a heartbeat that measures how late the loop wakes it, plus a few users
asking questions at the same time: one streams a story token by token, one
chats, and one loses interest and walks away (leaving the ``async for`` aborts
the request and frees its KV cache at once).

    python examples/embed_in_app.py [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiolm import AsyncEngine, EngineArgs, OutputKind, SamplingParams


async def heartbeat(stop: asyncio.Event, lags: list[float], period: float = 0.005) -> None:
    """Your application's own work: it must keep running while the engine is busy."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(period)
        lags.append(loop.time() - t - period)


async def storyteller(engine: AsyncEngine, max_tokens: int) -> str:
    """Stream the new text of each step as it comes (delta mode)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=max_tokens,
                            output_kind=OutputKind.DELTA)
    pieces = []
    async for out in engine.generate("Once upon a time, in a quiet harbour town,", params):
        pieces.append(out.outputs[0].text)
        print(out.outputs[0].text, end="", flush=True)
    print()
    return "".join(pieces)


async def chatter(engine: AsyncEngine, max_tokens: int) -> str:
    """A chat request; each output holds everything so far (the default), keep the last."""
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    final = None
    async for out in engine.generate(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
        final = out
    assert final is not None
    return final.outputs[0].text


async def impatient(engine: AsyncEngine) -> int:
    """Reads three updates, then leaves: the request is aborted and its blocks freed."""
    seen = 0
    async for _ in engine.generate("Tell me everything about the history of Rome.",
                                   SamplingParams(temperature=0.0, max_tokens=1000)):
        seen += 1
        if seen == 3:
            break
    return seen


async def main(args: argparse.Namespace) -> None:
    engine_args = EngineArgs(max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                             max_num_seqs=16, num_threads=args.num_threads, executor=args.executor)
    t0 = time.perf_counter()
    async with AsyncEngine(engine_args) as engine:
        print(f"engine ready in {time.perf_counter() - t0:.1f}s, model {engine.model_name}")
        stop, lags = asyncio.Event(), []
        beat = asyncio.create_task(heartbeat(stop, lags))
        t1 = time.perf_counter()
        story, answer, seen = await asyncio.gather(
            storyteller(engine, args.max_tokens), chatter(engine, args.max_tokens), impatient(engine))
        elapsed = time.perf_counter() - t1
        stop.set()
        await beat
        # The impatient user's request is gone from the scheduler (give the abort a moment).
        for _ in range(100):
            if engine.num_requests() == (0, 0):
                break
            await asyncio.sleep(0.01)
        print(f"chat answer: {answer!r}")
        print(f"story: {len(story)} chars; impatient user left after {seen} updates")
        print(f"three users served in {elapsed:.2f}s; heartbeat ran {len(lags)} times, "
              f"worst lag {1e3 * max(lags, default=0.0):.1f} ms")
        print(f"healthy={engine.is_healthy()} requests={engine.num_requests()} "
              f"kv_cache_usage={engine.kv_cache_usage():.3f}")
        # The engine's Prometheus registry (serve it with prometheus_client.start_http_server(
        # port, registry=engine.metrics_registry)); here two of its series, read in process.
        reg, labels = engine.metrics_registry, {"model_name": engine.model_name, "engine": "0"}
        tokens = reg.get_sample_value("aiolm:generation_tokens_total", labels)
        gaps = reg.get_sample_value("aiolm:inter_token_latency_seconds_count", labels)
        itl = reg.get_sample_value("aiolm:inter_token_latency_seconds_sum", labels) / max(gaps, 1.0)
        print(f"metrics: {tokens:.0f} tokens generated, mean inter-token latency {1e3 * itl:.1f} ms")
    print("engine shut down")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--num-threads", type=int, default=0, help="torch threads per worker (0 = default)")
    p.add_argument("--executor", default="mp", choices=["mp", "local"])
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))
