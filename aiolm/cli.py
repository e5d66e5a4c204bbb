"""``aiolm``: serve the OpenAI-compatible API, or generate / chat in the terminal.

    aiolm serve [MODEL] [--host H --port P --api-key K ...engine flags]
    aiolm generate "Once upon a time" --max-tokens 64
    aiolm chat                      # interactive; reads stdin, streams replies; Ctrl-D quits

Engine flags come from EngineArgs, the same definition the Python API uses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import sys
from typing import Any, Iterator

from aiolm.config import EngineArgs


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _run(coro: Any) -> Any:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if hasattr(uvloop, "run"):
        return uvloop.run(coro)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(coro)


# -- serve ---------------------------------------------------------------------------


def serve(argv: list[str]) -> int:
    import uvicorn

    from aiolm.engine.async_engine import AsyncEngine
    from aiolm.server.app import build_app
    from aiolm.server.settings import build_parser, parse_serve_args

    engine_args, settings, ns = parse_serve_args(argv, build_parser())
    _setup_logging(ns.log_level)
    app = build_app(AsyncEngine(engine_args), settings)
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    config = uvicorn.Config(app, host=ns.host, port=ns.port, loop=loop, lifespan="on", access_log=False,
                            log_level=ns.log_level, timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)),
                            log_config=None)
    server = _server_class()(config)
    server.run()
    return 0 if server.started and app.state.ctx.engine_died is None else 1


def _server_class() -> Any:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, which
        kills the process by signal; a clean drain should exit 0, so drop it."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    captured = getattr(self, "_captured_signals", None)
                    if isinstance(captured, list):
                        captured.clear()

    return GracefulServer


# -- generate / chat -----------------------------------------------------------------


def _gen_parser(prog: str, with_prompt: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    if with_prompt:
        p.add_argument("prompt", help="the text to continue ('-' reads it from stdin)")
        p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    else:
        p.add_argument("--system", default=None, help="a system message to start the conversation")
    EngineArgs.add_cli_args(p)
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0 if with_prompt else 0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    p.add_argument("--log-level", default="warning")
    return p


def _engine_and_params(ns: argparse.Namespace) -> tuple[Any, Any]:
    from aiolm.engine.async_engine import AsyncEngine
    from aiolm.params import OutputKind, SamplingParams

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            seed=ns.sampling_seed, output_kind=OutputKind.DELTA)
    return AsyncEngine(EngineArgs.from_namespace(ns)), params


async def _stream_to(out: Any, engine: Any, prompt: Any, params: Any) -> str:
    text = []
    async for o in engine.generate(prompt, params):
        piece = o.outputs[0].text
        if piece:
            text.append(piece)
            out.write(piece)
            out.flush()
    return "".join(text)


def generate(argv: list[str]) -> int:
    ns = _gen_parser("aiolm generate", True).parse_args(argv)
    _setup_logging(ns.log_level)
    prompt = sys.stdin.read() if ns.prompt == "-" else ns.prompt
    engine, params = _engine_and_params(ns)

    async def main() -> None:
        async with engine:
            p: Any = [{"role": "user", "content": prompt}] if ns.chat else prompt
            await _stream_to(sys.stdout, engine, p, params)
            sys.stdout.write("\n")

    _run(main())
    return 0


def chat(argv: list[str]) -> int:
    ns = _gen_parser("aiolm chat", False).parse_args(argv)
    _setup_logging(ns.log_level)
    engine, params = _engine_and_params(ns)
    interactive = sys.stdin.isatty()

    async def main() -> None:
        history: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []
        async with engine:
            if interactive:
                print(f"chatting with {engine.model_name}; /reset clears the history, Ctrl-D quits", file=sys.stderr)
            while True:
                if interactive:
                    sys.stdout.write("> ")
                    sys.stdout.flush()
                line = await asyncio.to_thread(sys.stdin.readline)
                if not line:  # EOF
                    break
                line = line.strip()
                if not line:
                    continue
                if line in ("/exit", "/quit"):
                    break
                if line == "/reset":
                    del history[int(bool(ns.system)):]
                    continue
                history.append({"role": "user", "content": line})
                answer = await _stream_to(sys.stdout, engine, history, params)
                sys.stdout.write("\n")
                sys.stdout.flush()
                history.append({"role": "assistant", "content": answer})
        if interactive:
            sys.stdout.write("\n")

    _run(main())
    return 0


def bench(argv: list[str]) -> int:
    """aiolm bench {throughput,latency,serve} ... (see docs/benchmarks.md)."""
    from aiolm.bench.cli import standalone

    return standalone(argv)


COMMANDS = {"serve": serve, "generate": generate, "chat": chat, "bench": bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        print("\ncommands: " + ", ".join(COMMANDS) + "  (aiolm COMMAND --help)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
