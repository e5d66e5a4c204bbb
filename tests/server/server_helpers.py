"""Helpers and fixtures for the server tests (import the fixtures into a test module to use them):
a real server process, and a fake engine for fast ones.

Real servers run ``python -m aiolm.cli serve`` (or another ASGI server) on
127.0.0.1 with a free port, light engine flags, output in a log file; teardown
sends SIGTERM and the test asserts a clean exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LIGHT_ENGINE_FLAGS = [
    "--max-model-len",
    "1024",
    "--kv-cache-memory",
    str(256 << 20),
    "--max-num-seqs",
    "32",
    "--num-threads",
    "1",
]  # one torch thread: several times faster on shared cores
API_KEY = "test-key-123"
START_TIMEOUT = float(os.environ.get("AIOLM_TEST_SERVER_START_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server subprocess on a free local port; ``stop()`` returns its exit code."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
        )
        self.returncode: int | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM, then wait; kill (and fail) if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"server did not exit {timeout}s after SIGTERM:\n{self.log()}") from None
        self.returncode = self.proc.returncode
        self._log.close()
        return self.returncode

    @contextlib.contextmanager
    def serving(self, name: str = "server") -> Iterator[ServerProcess]:
        """Ready on entry; on exit SIGTERM, and the process must exit with 0."""
        try:
            self.wait_ready()
            yield self
        finally:
            code = self.stop()
            assert code == 0, f"{name} exited with {code} on SIGTERM:\n{self.log()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def serve_cmd(port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "aiolm.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *LIGHT_ENGINE_FLAGS,
        *extra,
    ]


class SharedServer:
    """One real `aiolm serve` with fixed flags for every test module that asks for it (model
    load is the expensive part of a server test), so tests must not rely on a fresh server's
    counters or caches. Started on first use, started again if a test stopped it; each one
    must exit 0 on SIGTERM."""

    def __init__(self, name: str, tmp_path_factory: pytest.TempPathFactory, *flags: str) -> None:
        self.name = name
        self._tmp = tmp_path_factory
        self._flags = flags
        self._srv: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self._srv is not None and self._srv.proc.poll() is not None:
            self.close()  # a test stopped it: its exit code is still checked
        if self._srv is None:
            port = free_port()
            srv = ServerProcess(serve_cmd(port, *self._flags), port, self._tmp.mktemp(self.name) / "server.log")
            srv.wait_ready()
            self._srv = srv
        return self._srv

    def close(self) -> None:
        srv, self._srv = self._srv, None
        if srv is not None:
            code = srv.stop()
            assert code == 0, f"{self.name} exited with {code} on SIGTERM:\n{srv.log()}"


# The flags of the two shared servers (session fixtures in tests/conftest.py).
KEYED_SERVER_FLAGS = (
    "--api-key",
    API_KEY,
    "--max-request-bytes",
    str(256 << 10),
    "--shutdown-timeout",
    "5",
    "--metrics-prefix",
    "vllm",
)
OPEN_SERVER_FLAGS = ("--tool-call-parser", "hermes", "--shutdown-timeout", "5")


# -- a fake engine: the AsyncEngine surface the server uses, no model --------------------


@dataclass
class _Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _Seq:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class _State:
    def __init__(self, req_id: str, prompt_ids: list[int], params: Any) -> None:
        self.req_id = req_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = [_Seq(i) for i in range(params.n)]
        self.aborted = asyncio.Event()


class FakeEngine:
    """Generates "abcdefghij..." one character per step, ``step_delay`` apart."""

    model_name = "fake-model"
    max_model_len = 256
    runner = "generate"  # it generates; the pooling routes refuse it
    pooling_config = None
    takes_images = False  # a text model: image parts are a 400
    eos_token_ids: tuple[int, ...] = ()  # no end token: streams end at max_tokens

    def lora(self, name: str) -> None:  # serves no LoRA adapters
        return None

    def list_loras(self) -> list[Any]:
        return []

    def __init__(self, step_delay: float = 0.0) -> None:
        self.step_delay = step_delay
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.live: dict[str, _State] = {}
        self.aborted: list[str] = []
        self.started = False
        self.dead: str | None = None
        self.scheduler = None
        self.death_callbacks: list[Any] = []
        from aiolm.metrics import EngineMetrics

        self.metrics = EngineMetrics(self)  # the real registry, reading this engine's gauges
        self.metrics.configure(self.model_name, self.max_model_len)

    # One token per character (ids = code points): enough for format tests.
    vocab_size = 0x110000
    generation_config: dict[str, Any] = {}
    sampling_defaults: dict[str, Any] = {}  # a test may set the model's recommendations

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def clip_prompt(self, text: str, keep_end: bool) -> str:
        return text

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    async def render_chat_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        return self.render_chat(messages, add_generation_prompt, **kw)

    def prompt_too_long(self, text: str) -> str | None:
        return None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def tokenizer_info(self) -> dict[str, Any]:
        return {
            "tokenizer_class": "FakeTokenizer",
            "vocab_size": self.vocab_size,
            "bos_token": None,
            "eos_token": None,
            "pad_token": None,
            "unk_token": None,
            "chat_template": None,
        }

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def is_healthy(self) -> bool:
        return self.started and self.dead is None

    def health(self) -> tuple[bool, str | None]:
        return self.is_healthy(), self.dead

    @property
    def dead_reason(self) -> str | None:
        return self.dead

    recovering: str | None = None
    stalled: str | None = None

    def kv_cache_usage(self) -> float:
        return 0.01 * len(self.live)

    def num_requests(self) -> tuple[int, int]:
        return len(self.live), 0

    async def add_request(
        self, prompt: Any, params: Any, request_id: str | None = None, priority: int = 0, timeout: float | None = None
    ) -> _State:
        from aiolm.engine.errors import EngineDeadError

        if self.dead:
            raise EngineDeadError(self.dead)
        st = _State(request_id or "r", list(prompt["prompt_token_ids"]), params)
        self.live[st.req_id] = st
        self.stats["prompt_tokens"] += len(st.prompt_ids)
        return st

    async def stream(self, st: _State):
        from aiolm.outputs import CompletionOutput, RequestOutput
        from aiolm.params import OutputKind

        p = st.params
        max_tokens = p.max_tokens or 8
        delta = p.output_kind is OutputKind.DELTA
        text = [""] * p.n
        lps: list[list[dict[int, _Logprob]]] = [[] for _ in range(p.n)]
        t0 = time.monotonic()
        finished = False
        try:
            for step in range(max_tokens):
                await asyncio.sleep(self.step_delay)
                outs = []
                for s in st.seqs:
                    if s.finish_reason is not None:
                        if not delta:
                            lp_all = lps[s.index] if p.logprobs is not None else None
                            outs.append(
                                CompletionOutput(
                                    s.index, text[s.index], list(s.token_ids), s.finish_reason, None, lp_all
                                )
                            )
                        continue
                    tid = ord("a") + (step + s.index) % 26
                    s.token_ids.append(tid)
                    self.stats["generation_tokens"] += 1
                    piece = chr(tid)
                    before = len(text[s.index])
                    text[s.index] += piece
                    reason = "length" if step == max_tokens - 1 else None
                    stop_hit = next((x for x in p.stop if x in text[s.index]), None)
                    if stop_hit:
                        text[s.index] = text[s.index][: text[s.index].index(stop_hit)]
                        reason = "stop"
                    s.finish_reason = reason
                    lps[s.index].append({tid: _Logprob(-0.5, 1, piece), ord("z"): _Logprob(-2.0, 2, "z")})
                    use_lp = p.logprobs is not None
                    if delta:
                        outs.append(
                            CompletionOutput(
                                s.index,
                                text[s.index][before:],
                                [tid],
                                reason,
                                None,
                                lps[s.index][-1:] if use_lp else None,
                            )
                        )
                    else:
                        outs.append(
                            CompletionOutput(
                                s.index,
                                text[s.index],
                                list(s.token_ids),
                                reason,
                                None,
                                list(lps[s.index]) if use_lp else None,
                            )
                        )
                finished = all(s.finish_reason for s in st.seqs)
                if p.output_kind is OutputKind.FINAL_ONLY and not finished:
                    continue
                yield RequestOutput(
                    st.req_id,
                    None,
                    st.prompt_ids,
                    outs,
                    finished,
                    metrics={"ttft": 0.001, "e2e": time.monotonic() - t0} if finished else {},
                )
                if finished:
                    return
        finally:
            self.live.pop(st.req_id, None)
            if not finished:
                self.aborted.append(st.req_id)

    async def abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.aborted.append(request_id)


# -- hypothesis strategies from the server's own /openapi.json ------------------------------


def json_values():
    """Any JSON value (small), for replacing fields with wrong types."""
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12)
    )
    return st.recursive(
        scalars,
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
        max_leaves=6,
    )


def from_schema(schema: dict | bool, max_text: int = 24, defs: dict | None = None):
    """A hypothesis strategy for the JSON Schema subset /openapi.json uses (``defs``: its
    components, which ``$ref`` names)."""
    from hypothesis import strategies as st

    def sub(s: dict | bool):
        return from_schema(s, max_text, defs)

    if isinstance(schema, bool):  # true: any value
        return json_values()
    if "$ref" in schema:
        assert defs is not None, schema
        return st.deferred(lambda: sub(defs[schema["$ref"].rsplit("/", 1)[1]]))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([sub(s) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    t = schema.get("type")
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        lo = schema.get("minimum", -(2**66))
        hi = schema.get("maximum", 2**66)
        return st.integers(lo, hi)
    if t == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(
            min_value=lo,
            max_value=schema.get("maximum"),
            allow_nan=False,
            allow_infinity=False,
            exclude_min="exclusiveMinimum" in schema,
        )
    if t == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", max_text), max_text))
    if t == "array":
        lo = schema.get("minItems", 0)
        return st.lists(sub(schema.get("items", {})), min_size=lo, max_size=max(lo, min(schema.get("maxItems", 3), 3)))
    if t == "object":
        props = schema.get("properties", {})
        if not props:
            extra = schema.get("additionalProperties", {})
            return st.dictionaries(
                st.text(max_size=6),
                sub(extra) if extra else json_values(),
                max_size=min(schema.get("maxProperties", 3), 3),
            )
        required = schema.get("required", [])
        optional = [k for k in props if k not in required]
        return st.fixed_dictionaries(
            {k: sub(props[k]) for k in required}, optional={k: sub(props[k]) for k in optional}
        )
    return json_values()
