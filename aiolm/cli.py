"""The ``aiolm`` command: serve the OpenAI-compatible API, or generate / chat in the
terminal (``USAGE`` is what ``aiolm --help`` prints). Engine flags come from EngineArgs,
the same definition the Python API uses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import functools
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiolm.config import CliParser, EngineArgs, int_in

USAGE = """\
aiolm: an LLM inference and serving engine

  aiolm serve [MODEL] [--host H --port P --api-key K ...]   serve the OpenAI-compatible API
  aiolm generate "Once upon a time" --max-tokens 64         continue a prompt, print it
  aiolm chat                                                 chat in the terminal; Ctrl-D quits
  aiolm bench {throughput,latency,serve} ...                 measure
  aiolm proxy --prefill URL... --decode URL...               one address over prefill and decode instances

MODEL is a Hugging Face model folder or a .gguf file (default: the embedded
SmolLM2-135M-Instruct). `aiolm COMMAND --help` lists a command's flags."""


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_on_uvloop(coro: Any) -> Any:
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
    from aiolm.server import slow_clients
    from aiolm.server.settings import build_parser, parse_serve_args, seconds

    parser = build_parser()
    slow_clients.add_args(parser, seconds, int_in(1))  # options of this server, not of the ASGI app
    engine_args, settings, ns = parse_serve_args(argv, parser)
    _check_model_path(parser, engine_args.model)
    _check_device(parser, engine_args)
    _setup_logging(ns.log_level)
    # Bound before the engine stack is even imported: a busy port fails at once.
    sock = _listen_socket(parser, ns.host, ns.port)
    try:
        _check_model(parser, engine_args)
    except SystemExit:
        sock.close()
        raise
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from aiolm.engine.data_parallel import create_engine
    from aiolm.server.app import build_app

    app = build_app(create_engine(engine_args), settings)
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    max_connections = slow_clients.connections_allowed(ns.max_connections)
    http = slow_clients.guarded(AutoHTTPProtocol, ns.header_timeout, max_connections)
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        loop=loop,
        http=http,
        lifespan="on",
        access_log=False,
        log_level=ns.log_level,
        # past our own drain (GracefulServer.shutdown), which ends what is left with an error event
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)) + _CANCEL_MARGIN_S,
        log_config=None,
    )
    ctx = app.state.ctx
    drain = functools.partial(ctx.drain, settings.shutdown_timeout)
    server = _server_class(_serving_lines(ns.host, ns.port, settings.web_ui), drain, ctx.stop_starting)(config)
    server.run(sockets=[sock])
    return 0 if server.started and app.state.ctx.engine_died is None else 1


def _check_model_path(parser: argparse.ArgumentParser, model: str | None) -> None:
    if model is not None and not os.path.exists(os.path.expanduser(model)):
        parser.error(
            f"model {model!r}: no such file or directory (give a Hugging Face model folder or a "
            f".gguf file; no model hub is contacted)"
        )


def _check_model(parser: argparse.ArgumentParser, args: EngineArgs) -> None:
    """Read the model's config and check the flags that depend on it (an unknown
    architecture, a tensor-parallel size that does not split it): one line, exit 2."""
    from aiolm.engine.async_engine import check_model_args

    try:
        check_model_args(args)
    except ValueError as e:  # ModelLoadError is one
        parser.error(str(e))


def _check_device(parser: argparse.ArgumentParser, args: EngineArgs) -> None:
    if args.device != "cpu":
        try:
            args.resolved_device()
        except ValueError as e:
            parser.error(str(e))


def _listen_socket(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """Bind the listening socket before anything slow starts; uvicorn serves on it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        parser.error(f"cannot listen on {host}:{port}: {e.strerror or e}")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        reason = "the port is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        parser.error(f"cannot listen on {host}:{port}: {reason}")
    return sock


def _serving_lines(host: str, port: int, web_ui: bool) -> list[str]:
    """What the log says once the server answers: where the API, the chat page and the health
    probe are (uvicorn says nothing of it when handed a bound socket)."""
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    lines = [f"OpenAI-compatible API at {base}/v1 (health: {base}/health)"]
    if web_ui:
        lines.append(f"chat page at {base}/")
    if host in ("0.0.0.0", "::"):
        lines.append(f"listening on every interface ({host}); from this machine: http://127.0.0.1:{port}/v1")
    return lines


_CANCEL_MARGIN_S = 5  # uvicorn cancels the connections this long after the drain's deadline


def _server_class(
    serving_lines: list[str],
    drain: Callable[[], Awaitable[None]] | None = None,
    stop_starting: Callable[[], None] | None = None,
) -> Any:
    import uvicorn

    log = logging.getLogger("aiolm.server")

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, which
        kills the process by signal; a clean drain should exit 0, so drop it. Once started,
        it logs where it serves. ``drain`` starts with the shutdown, beside uvicorn's wait for
        the connections: the requests still running at its deadline are aborted and their
        streams end with an error event, before uvicorn would cancel them mid-response."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            draining = asyncio.ensure_future(drain()) if drain is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if draining is not None:
                    if self.force_exit:  # a second Ctrl+C: no waiting for the drain's deadline
                        draining.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await draining

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            # SIGTERM or Ctrl+C while the app starts (the model loads: seconds; minutes on a
            # first start that builds kernels) gives the start up now; uvicorn alone would
            # finish it first. The app then shuts down what started, and the process exits 0.
            async def start() -> SystemExit | None:
                try:
                    await super(GracefulServer, self).startup(sockets)
                except SystemExit as e:  # uvicorn's exit on a failed start: raised here, not in a task
                    return e
                return None

            starting = asyncio.ensure_future(start())
            stopped = False
            while not starting.done():
                await asyncio.wait({starting}, timeout=0.1)
                if self.should_exit and not stopped and stop_starting is not None:
                    stopped = True
                    stop_starting()
            failed = starting.result()
            if failed is not None:
                raise failed
            if self.started and not self.should_exit:
                for line in serving_lines:
                    log.info("%s", line)

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
    p = CliParser(prog=prog)
    if with_prompt:
        p.add_argument("prompt", help="the text to continue ('-' reads it from stdin)")
        p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
        temperature_help = "sampling temperature (default 0: greedy)"
    else:
        p.add_argument("--system", default=None, help="a system message to start the conversation")
        temperature_help = (
            f"sampling temperature (default: the model's generation config, else {CHAT_DEFAULTS['temperature']})"
        )
    EngineArgs.add_cli_args(p)
    p.add_argument("--max-tokens", type=int_in(1), default=256, help="most tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0 if with_prompt else None, help=temperature_help)
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling mass (default 1 for generate; chat: the model's generation config, "
        f"else {CHAT_DEFAULTS['top_p']})",
    )
    p.add_argument(
        "--sampling-seed", type=int_in(-(2**63), 2**63 - 1), default=None, help="seed of this request's sampling"
    )
    p.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,
        choices=("critical", "error", "warning", "info", "debug"),
        help="%(choices)s",
    )
    return p


# What `aiolm chat` samples with when the model's generation config says nothing.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9}


def _sampling(ns: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    """SamplingParams from the flags, falling back to ``defaults``; raises ParamError."""
    from aiolm.params import OutputKind, SamplingParams

    temperature = ns.temperature if ns.temperature is not None else defaults.get("temperature", 1.0)
    top_p = ns.top_p if ns.top_p is not None else defaults.get("top_p", 1.0)
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=ns.sampling_seed,
        output_kind=OutputKind.DELTA,
    )


def _engine(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> Any:
    """The engine for ``ns``, with every flag checked before anything loads."""
    from aiolm.engine.data_parallel import create_engine
    from aiolm.params import ParamError

    _check_model_path(parser, ns.model)
    try:
        _sampling(ns, CHAT_DEFAULTS)  # the request flags, checked now rather than after the model loaded
        args = EngineArgs.from_namespace(ns)
        _check_device(parser, args)
        _check_model(parser, args)
        return create_engine(args)
    except ParamError as e:
        flag = "sampling_seed" if e.param == "seed" else e.param  # the request's seed, not the engine's
        parser.error(f"--{flag.replace('_', '-')}: {e.message}")
    except (TypeError, ValueError) as e:
        parser.error(str(e))


async def _stream_to(out: Any, engine: Any, prompt: Any, params: Any) -> str:
    text = []
    async for o in engine.generate(prompt, params):
        piece = o.outputs[0].text
        if piece:
            text.append(piece)
            out.write(piece)
            out.flush()
    return "".join(text)


async def _start(engine: Any) -> None:
    """Start the engine, saying on stderr how long loading took (every call loads the model)."""
    t0 = time.monotonic()
    await engine.start()
    print(
        f"loaded {engine.model_name} in {time.monotonic() - t0:.1f}s "
        f"(each command loads the model; `aiolm serve` keeps it loaded)",
        file=sys.stderr,
    )


def generate(argv: list[str]) -> int:
    parser = _gen_parser("aiolm generate", True)
    ns = parser.parse_args(argv)
    _setup_logging(ns.log_level)
    prompt = sys.stdin.read() if ns.prompt == "-" else ns.prompt
    if not prompt:
        parser.error("the prompt is empty")
    bad = _not_utf8(prompt)
    if bad is not None:
        parser.error(f"the prompt{' (stdin)' if ns.prompt == '-' else ''} {bad}")
    engine = _engine(parser, ns)
    params = _sampling(ns, {})

    async def main() -> None:
        await _start(engine)
        try:
            p: Any = [{"role": "user", "content": prompt}] if ns.chat else prompt
            await _stream_to(sys.stdout, engine, p, params)
            sys.stdout.write("\n")
        finally:
            await engine.shutdown()

    _run_request(parser, main())
    return 0


def _run_request(parser: argparse.ArgumentParser, coro: Any) -> None:
    """Run ``coro``; a request the model refuses (a chat prompt for a model without a chat
    template, a prompt over max_model_len) is one line and exit code 2, like a bad flag."""
    from aiolm.params import ParamError

    try:
        run_on_uvloop(coro)
    except ParamError as e:
        parser.error(e.message)


def _not_utf8(text: str) -> str | None:
    """Why ``text`` is not UTF-8 text, or None. stdin and argv are decoded with
    surrogateescape: a byte that is not UTF-8 arrives as a lone surrogate, which the
    tokenizer cannot take (it failed with a traceback)."""
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            return f"is not UTF-8 text (byte 0x{ord(ch) - 0xDC00:02x} at character {i})"
        if "\ud800" <= ch <= "\udfff":
            return f"is not UTF-8 text (a lone surrogate at character {i})"
    return None


class _StdinLines:
    """stdin lines, read by a daemon thread: a blocked read never holds up Ctrl-C or exit."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = loop
        threading.Thread(target=self._pump, name="aiolm-stdin", daemon=True).start()

    def _pump(self) -> None:
        try:
            for line in iter(sys.stdin.readline, ""):
                self._loop.call_soon_threadsafe(self._queue.put_nowait, line)
        finally:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    async def get(self) -> str | None:
        return await self._queue.get()


def chat(argv: list[str]) -> int:
    from aiolm.params import ParamError

    parser = _gen_parser("aiolm chat", False)
    ns = parser.parse_args(argv)
    _setup_logging(ns.log_level)
    engine = _engine(parser, ns)
    interactive = sys.stdin.isatty()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        history: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []
        await _start(engine)
        model = engine.sampling_defaults  # the model's recommendations, unless --generation-config vllm
        params = _sampling(ns, {k: model.get(k, v) for k, v in CHAT_DEFAULTS.items()})
        answering: list[asyncio.Task[str]] = []
        leave = asyncio.Event()

        def on_interrupt() -> None:
            # Ctrl-C stops the answer being written; at the prompt it leaves.
            if answering and not answering[0].done():
                answering[0].cancel()
            else:
                leave.set()

        loop.add_signal_handler(signal.SIGINT, on_interrupt)
        lines = _StdinLines(loop)
        try:
            if interactive:
                print(
                    f"chatting with {engine.model_name} (temperature {params.temperature}, top_p {params.top_p}); "
                    "/reset clears the history, Ctrl-C stops an answer, Ctrl-D quits",
                    file=sys.stderr,
                )
            while not leave.is_set():
                if interactive:
                    sys.stdout.write("> ")
                    sys.stdout.flush()
                line = await _first(lines.get(), leave)
                if line is None:  # EOF or Ctrl-C at the prompt
                    break
                line = line.strip()
                if not line:
                    continue
                if line in ("/exit", "/quit"):
                    break
                if line == "/reset":
                    del history[int(bool(ns.system)) :]
                    continue
                bad = _not_utf8(line)
                if bad is not None:
                    print(f"aiolm chat: that line {bad}; not sent", file=sys.stderr)
                    continue
                history.append({"role": "user", "content": line})
                pieces: list[str] = []
                task = asyncio.ensure_future(_stream_to(_Tee(sys.stdout, pieces), engine, list(history), params))
                answering[:] = [task]
                try:
                    await task
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise
                    sys.stdout.write(" [stopped]")
                except ParamError as e:
                    if e.param != "prompt":  # the model cannot chat at all (no chat template): exit 2
                        raise
                    history.pop()  # the line, or the conversation with it, does not fit: say so, go on
                    print(f"aiolm chat: {e.message}; not sent (/reset starts the conversation again)", file=sys.stderr)
                    continue
                sys.stdout.write("\n")
                sys.stdout.flush()
                history.append({"role": "assistant", "content": "".join(pieces)})
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            await engine.shutdown()
        if interactive:
            sys.stdout.write("\n")

    _run_request(parser, main())
    return 0


class _Tee:
    """A stream that also keeps what was written (the answer so far, when it is stopped)."""

    def __init__(self, out: Any, pieces: list[str]) -> None:
        self.out, self.pieces = out, pieces

    def write(self, text: str) -> None:
        self.pieces.append(text)
        self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


async def _first(line: Any, leave: asyncio.Event) -> str | None:
    """The next stdin line, or None once ``leave`` is set."""
    get = asyncio.ensure_future(line)
    stop = asyncio.ensure_future(leave.wait())
    done, pending = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return get.result() if get in done else None


def bench(argv: list[str]) -> int:
    """aiolm bench {throughput,latency,serve} ... (see docs/benchmarks.md)."""
    from aiolm.bench.cli import standalone

    return standalone(argv)


def proxy(argv: list[str]) -> int:
    """aiolm proxy --prefill URL... --decode URL... (aiolm/server/proxy.py)."""
    import uvicorn

    from aiolm.server.proxy import build_proxy_app, parse_args

    ns = parse_args(argv)
    _setup_logging("info")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    sock = _listen_socket(CliParser(prog="aiolm proxy"), ns.host, ns.port)
    app = build_proxy_app(ns.prefill, ns.decode, ns.timeout)
    config = uvicorn.Config(app, lifespan="on", access_log=False, log_level="warning", log_config=None)
    base = f"http://{ns.host}:{ns.port}"
    server = _server_class([f"proxy at {base}/v1: prefill {ns.prefill}, decode {ns.decode}"])(config)
    server.run(sockets=[sock])
    return 0 if server.started else 1


COMMANDS = {"serve": serve, "generate": generate, "chat": chat, "bench": bench, "proxy": proxy}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{USAGE}\n\naiolm: error: {what}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
