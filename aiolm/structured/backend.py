"""xgrammar behind two small doors: the engine's validator and the worker's compiler.

xgrammar (and the torch it imports) loads on first use only, so an engine that
never sees a structured request stays torch-free. JSON is generated compact
(``any_whitespace=False``): a free-whitespace grammar lets a small model fill
its budget with newlines before the document ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from aiolm.params import ParamError
from aiolm.structured.spec import StructuredOutputs

BACKENDS = ("xgrammar", "none")
# json_object: any JSON object, compact like the schema kinds (xgrammar's built-in JSON grammar
# allows free whitespace).
_ANY_OBJECT = '{"type": "object"}'
_CACHE_ENTRIES = 256  # distinct grammars remembered per process


def xgrammar_module() -> Any:
    """xgrammar, imported on first use (it imports torch)."""
    import xgrammar

    return xgrammar


def _grammar(spec: StructuredOutputs) -> Any:
    """The grammar of ``spec`` (xgrammar.Grammar); raises what xgrammar raises on bad text."""
    xgr = xgrammar_module()
    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.text)
    raise ParamError("structured_outputs", f"unknown kind {spec.kind!r}")


_WHAT = {"json": "invalid JSON schema", "regex": "invalid regex", "grammar": "invalid grammar",
         "json_object": "invalid JSON grammar"}


class Validator:
    """Engine side: checks a request's grammar once per distinct text, in a thread pool.

    A request awaits its own check only; the event loop and other requests run on.
    The verdict (None or the compiler's message) is cached by the grammar's text.
    """

    def __init__(self, backend: str = "xgrammar", max_threads: int = 2) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend: {backend!r}; supported: {', '.join(BACKENDS)}")
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="aiolm-grammar") if backend != "none" else None
        self._verdicts: OrderedDict[tuple, asyncio.Future[str | None]] = OrderedDict()

    async def check(self, spec: StructuredOutputs | None) -> None:
        """Raise ParamError('structured_outputs', message) if the grammar is refused."""
        if spec is None:
            return
        if self._pool is None:
            raise ParamError("structured_outputs", "structured outputs are disabled on this server "
                                                   "(--structured-outputs-backend none)")
        key = spec.key()
        fut = self._verdicts.get(key)
        if fut is None:  # concurrent requests with the same grammar share one check
            fut = asyncio.get_running_loop().run_in_executor(self._pool, _verdict, spec)
            self._verdicts[key] = fut
            while len(self._verdicts) > _CACHE_ENTRIES:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(key)
        error = await asyncio.shield(fut)
        if error is not None:
            raise ParamError("structured_outputs", error)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _verdict(spec: StructuredOutputs) -> str | None:
    try:
        _grammar(spec)
    except ParamError as e:
        return e.message
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
        return f"{_WHAT.get(spec.kind, 'invalid grammar')}: {str(e).strip() or type(e).__name__}"
    return None


class WorkerCompiler:
    """Worker side: one xgrammar GrammarCompiler per process, built on first use.

    The tokenizer is loaded lazily through the loader the model runner registers,
    so a worker that never sees a grammar pays nothing. xgrammar's compiler
    caches compiled grammars by their text.
    """

    _lock = threading.Lock()
    _loader: Callable[[], Any] | None = None
    _compiler: Any = None
    _vocab_size: int = 0

    @classmethod
    def configure(cls, tokenizer_loader: Callable[[], Any]) -> None:
        cls._loader = tokenizer_loader

    @classmethod
    def compile(cls, spec: StructuredOutputs, vocab_size: int) -> Any:
        compiler = cls._get(vocab_size)
        xgr = xgrammar_module()
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(spec.text))

    @classmethod
    def _get(cls, vocab_size: int) -> Any:
        with cls._lock:
            if cls._compiler is None or cls._vocab_size != vocab_size:
                if cls._loader is None:
                    raise RuntimeError("structured outputs: no tokenizer registered in this worker")
                xgr = xgrammar_module()
                info = xgr.TokenizerInfo.from_huggingface(cls._loader(), vocab_size=vocab_size)
                cls._compiler = xgr.GrammarCompiler(info, max_threads=1)
                cls._vocab_size = vocab_size
            return cls._compiler
