"""The engine's grammar check: each distinct grammar is compiled once, in a compile process that
can be killed (``compile_pool.py``), before its first request is queued.

A request awaits its own check only; the event loop and other requests run on. Requests with
the same grammar share one compile, and the check of a request that leaves (a client
disconnects, a task is cancelled) stops waiting at once; the pool stops the compile when the
last one has left. Verdicts (None, or the message for the client, a time-limit refusal
included) are cached by a digest of the grammar, never by its text: ``_CACHE_ENTRIES`` of them,
least recently used first out. Cache hits never touch the pool. A grammar's text is encoded to
UTF-8 once, for its digest and for the pipe to the compile process (raw, never JSON-escaped),
in a thread when it is longer than ``_HASH_ON_LOOP_BYTES``. The engine process never imports
xgrammar, nor the torch it imports.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from aiolm.params import ParamError
from aiolm.structured.backend import BACKENDS
from aiolm.structured.compile_pool import PROCESSES, CompileJob, CompilePool
from aiolm.structured.spec import StructuredOutputs

_CACHE_ENTRIES = 256  # distinct grammars whose verdict is remembered
_HASH_ON_LOOP_BYTES = 64 << 10  # longer grammar texts are encoded and hashed in a thread


class Validator:
    """Refuses a request whose grammar does not compile, or not within ``compile_timeout``
    seconds, with ParamError('structured_outputs', message)."""

    def __init__(self, backend: str = "xgrammar", compile_timeout: float = 30.0, processes: int = PROCESSES) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend: {backend!r}; supported: {', '.join(BACKENDS)}")
        if not compile_timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 seconds, got {compile_timeout!r}")
        self.backend = backend
        self.compile_timeout = compile_timeout
        self.processes = processes
        self.tokenizer_dir: Path | None = None  # set by configure() once the engine knows its model
        self.vocab_size = 0
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._jobs: dict[bytes, CompileJob] = {}
        self.pool: CompilePool | None = None  # started with the first grammar not in the cache
        # called when the pool starts: the engine has its workers build their compilers meanwhile
        self.on_first_grammar: Callable[[], None] | None = None

    def configure(self, tokenizer_dir: Path, vocab_size: int) -> None:
        """Compile against the tokenizer in this folder (the engine's, the one the workers load)."""
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size

    async def check(self, spec: StructuredOutputs | None) -> None:
        """Raise ParamError('structured_outputs', message) if the grammar is refused."""
        if spec is None:
            return
        if self.backend == "none":
            raise ParamError(
                "structured_outputs",
                "structured outputs are disabled on this server (--structured-outputs-backend none)",
            )
        key, text = await _encode(spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        else:
            error = await self._compile(spec, key, text)
        if error is not None:
            raise ParamError("structured_outputs", error)

    async def _compile(self, spec: StructuredOutputs, key: bytes, text: bytes) -> str | None:
        job = self._jobs.get(key)
        if job is None:  # concurrent requests with the same grammar share one compile
            if self.pool is None:
                if self.tokenizer_dir is None:
                    raise RuntimeError("Validator.configure() was not called")
                self.pool = CompilePool(
                    self.tokenizer_dir, self.vocab_size, self.compile_timeout, self.processes, self._settled
                )
                if self.on_first_grammar is not None:
                    self.on_first_grammar()
            job = self._jobs[key] = CompileJob(spec, key, text, asyncio.get_running_loop().create_future())
            self.pool.submit(job)
        job.waiters += 1
        try:
            return await asyncio.shield(job.future)
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.future.done() and self.pool is not None:
                self.pool.release(job)

    def _settled(self, job: CompileJob, error: str | None, remember: bool) -> None:
        """The pool's word on ``job``, before its future is resolved or cancelled."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if remember:
            self._verdicts[job.key] = error
            while len(self._verdicts) > _CACHE_ENTRIES:
                self._verdicts.popitem(last=False)

    async def close(self) -> None:
        """Stop every compile process and reap it; pending checks fail with EngineDeadError."""
        if self.pool is not None:
            await self.pool.close()


async def _encode(spec: StructuredOutputs) -> tuple[bytes, bytes]:
    """(the grammar's cache key, its text in UTF-8); a long text is encoded and hashed in a thread."""

    def encode() -> tuple[bytes, bytes]:
        text = spec.text.encode()
        h = hashlib.sha256(f"{spec.kind}\0{spec.strict}\0".encode())
        h.update(text)
        return h.digest(), text

    if len(spec.text) <= _HASH_ON_LOOP_BYTES:
        return encode()
    return await asyncio.to_thread(encode)
