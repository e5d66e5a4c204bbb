"""xgrammar behind small doors: each process's compiler, the compiler's error messages, the
worker's background compiles, and the tokenizer info they all start from.

A request's grammar is compiled twice. First, before the request is queued, the engine's
validator (``validator.py``) compiles it in full (not only parses it) in a compile process
of its own (``compile_worker.py``), so that whatever it accepts also compiles in the worker
and a compile that runs too long can be stopped. Then the worker compiles it again (compiled
grammars are not worth shipping, see ``spec.py``), in the background while other requests
step (``BackgroundCompiles``); the scheduler holds the request until then. xgrammar releases
the GIL while it compiles, so those threads do not stall the step's Python. xgrammar (and the
torch it imports) loads on first use only, and never in the engine process. JSON is
generated on one line with fixed separators (``any_whitespace=False``: ", " and ": ", as
``json.dumps`` writes them, and no other whitespace): a free-whitespace grammar lets a small
model fill its budget with newlines before the document ends.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiolm.structured.spec import SCHEMA_MAPS, StructuredOutputs

log = logging.getLogger(__name__)
BACKENDS = ("xgrammar", "none")
# json_object: any JSON object, laid out like the schema kinds (xgrammar's built-in JSON grammar
# allows free whitespace).
_ANY_OBJECT = '{"type": "object"}'
# xgrammar's own cache of compiled grammars, per process: bounded, since clients choose the grammars.
_CACHE_BYTES = 256 << 20


def xgrammar_module() -> Any:
    """xgrammar, imported on first use (it imports torch)."""
    import xgrammar

    return xgrammar


_WHAT = {
    "json": "invalid JSON schema",
    "regex": "invalid regex",
    "grammar": "invalid grammar",
    "json_object": "invalid JSON grammar",
}


def compile_error(spec: StructuredOutputs, vocab_size: int) -> str | None:
    """Compile ``spec`` (the result stays in the process's cache); None, or why it failed."""
    try:
        check_startable(Compiler.compile(spec, vocab_size))
    except Exception as e:
        return describe_error(spec, e)
    return None


# JSON schema keywords xgrammar (0.2.9) compiles but does not enforce: text breaking them was
# measured to be accepted (allOf of two or more schemas, too: it does not merge them). oneOf is
# taken as anyOf, the usual reading of a discriminated union, and is let through. Checked where
# a client gives a schema for its output (protocol.py); a tool's parameters are let through, as
# vLLM lets them (they are often written from code, and pydantic writes uniqueItems for a set).
_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else")
_UNENFORCED += ("dependentRequired", "dependentSchemas", "dependencies")
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
# what may stand beside a $ref (xgrammar follows the reference and drops any other keyword)
_REF_SIBLINGS = {"$ref", "$defs", "definitions", "$id", "$schema", "$comment", "title", "description"}
_REF_SIBLINGS |= {"default", "examples", "deprecated", "readOnly", "writeOnly"}


def _unenforced_here(node: dict[str, Any]) -> str | None:
    """What of ``node`` itself (not its subschemas) the grammar would not enforce."""
    for key in _UNENFORCED:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return f"'{key}'"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"'$ref' to {ref[:80]!r} (only references within the schema, '#...', are resolved)"
    if ref is not None and set(node) - _REF_SIBLINGS:
        return f"'$ref' beside {', '.join(sorted(set(node) - _REF_SIBLINGS))} (move them into the schema it names)"
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        return "'pattern' beside 'minLength' or 'maxLength' (the lengths are dropped; put them in the pattern)"
    multiple = node.get("multipleOf")
    if multiple is not None and not (node.get("type") == "integer" and isinstance(multiple, int)):
        return "'multipleOf' of a non-integer"
    required, listed = node.get("required"), node.get("properties")
    others = node.get("additionalProperties") not in (None, False) or "patternProperties" in node
    if isinstance(required, list) and not others:
        missing = [r for r in required if not isinstance(listed, dict) or r not in listed]
        if missing:
            return f"'required' {missing[0]!r}, which 'properties' does not list (it can never be generated)"
    return None


def _malformed_here(node: dict[str, Any]) -> str | None:
    """What makes this schema node no JSON schema at all (the keywords read below assume it)."""
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return "'required' must be a list of property names"
    typ = node.get("type")
    if typ is not None and not all(isinstance(t, str) for t in (typ if isinstance(typ, list) else [typ])):
        return "'type' must be a type name or a list of them"
    return None


def unenforced(schema: Any) -> str | None:
    """Why the JSON schema ``schema`` (parsed) cannot be enforced: its first keyword the grammar
    would not enforce, and where; None when there is none. Generated text could break such a
    keyword, and a constraint silently dropped is a field silently ignored."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:  # a stack, not recursion: a schema may nest deeper than Python recurses
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        where = f" (at {path})" if path else ""
        why = _malformed_here(node)
        if why is not None:
            return f"{why}{where}"
        why = _unenforced_here(node)
        if why is not None:
            return f"{why}{where} is not enforced by this server's grammar backend"
        at = f"{path}." if path else ""
        for key in _SUBSCHEMA:
            stack.append((node.get(key), f"{at}{key}"))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{at}{key}[{i}]") for i, sub in enumerate(node[key]))
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{at}{key}.{name}") for name, sub in node[key].items())
    return None


def check_startable(compiled: Any) -> None:
    """Raise unless some token of the vocabulary may start the text (or end it at once): a
    grammar whose language is empty, or whose first characters no token spells, leaves every
    token masked at the first step, where a draw would take one it forbids."""
    xgr = xgrammar_module()
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
    if not bool(mask.any()):
        raise ValueError("no text this model's tokens can spell matches it")


def describe_error(spec: StructuredOutputs, error: Exception) -> str:
    """What a client is told when ``spec`` does not compile."""
    if isinstance(error, ImportError):
        return f"structured outputs need the xgrammar package ({error})"
    # xgrammar raises RuntimeError / ValueError / its own types
    return f"{_WHAT.get(spec.kind, 'invalid grammar')}: {clean_message(str(error)) or type(error).__name__}"


# xgrammar's C++ errors start with its logger's prefix, "[12:34:56] /project/cpp/grammar_parser.cc:820: ",
# and failed internal checks add "Check failed: (error.empty()) is false: ". Neither helps a client.
_CPP_PREFIX = re.compile(
    r"^\[\d{2}:\d{2}:\d{2}\] \S+?\.(?:cc|cpp|cxx|h|hpp):\d+: (?:Check failed: .*? is false: )?", re.MULTILINE
)
_MAX_MESSAGE = 1000  # characters: some messages quote the whole grammar back


def clean_message(text: str) -> str:
    """xgrammar's message without its C++ timestamps, source paths and check expressions,
    cut to ``_MAX_MESSAGE`` characters."""
    text = _CPP_PREFIX.sub("", text).strip()
    if "Stack trace:" in text:  # debug builds append a native stack
        text = text[: text.index("Stack trace:")].rstrip()
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def compile_spec(compiler: Any, spec: StructuredOutputs) -> Any:
    """``spec`` compiled by the xgrammar GrammarCompiler ``compiler``; raises what xgrammar
    raises on bad text."""
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.text)
    raise ValueError(f"unknown kind {spec.kind!r}")


class Compiler:
    """One xgrammar GrammarCompiler per worker process, built on first use.

    The tokenizer comes through the loader registered by the model runner, called on
    first use, so a worker that never sees a grammar pays
    nothing. xgrammar's compiler caches compiled grammars by their text (up to
    ``_CACHE_BYTES``, least recently used first out).
    """

    _lock = threading.Lock()
    _loader: Callable[[], Any] | None = None
    _tokenizer_dir: Path | None = None
    _compiler: Any = None
    _vocab_size: int = 0

    @classmethod
    def configure(cls, tokenizer_loader: Callable[[], Any], tokenizer_dir: Path | None = None) -> None:
        """``tokenizer_dir``: the folder the tokenizer loads from; with it, the compiler's
        tokenizer info is kept in aiolm's cache (``tokenizer_info``)."""
        cls._loader = tokenizer_loader
        cls._tokenizer_dir = tokenizer_dir

    @classmethod
    def preload(cls, vocab_size: int) -> None:
        """Build the compiler in a thread now (the engine asks once grammars are in use), so
        the next grammar's compile finds it built; a build() meanwhile waits on the lock. Not a
        daemon (said outright: a thread started from a daemon thread, as the local executor's
        is, would inherit it): a daemon thread still inside xgrammar's native code when the
        interpreter exits is killed there and aborts the process (std::terminate); exit waits
        for the bounded build instead."""

        def run() -> None:
            try:
                cls._get(vocab_size)
            except Exception:  # xgrammar missing or the tokenizer unloadable: the first grammar says so
                log.warning("structured outputs: could not prepare the grammar compiler", exc_info=True)

        threading.Thread(target=run, name="aiolm-grammar-preload", daemon=False).start()

    @classmethod
    def compile(cls, spec: StructuredOutputs, vocab_size: int) -> Any:
        """The compiled grammar of ``spec``; raises what xgrammar raises on bad text."""
        return compile_spec(cls._get(vocab_size), spec)

    @classmethod
    def _get(cls, vocab_size: int) -> Any:
        with cls._lock:
            if cls._compiler is None or cls._vocab_size != vocab_size:
                if cls._loader is None:
                    raise RuntimeError("structured outputs: no tokenizer registered in this worker")
                xgr = xgrammar_module()
                info = tokenizer_info(cls._loader, vocab_size, cls._tokenizer_dir)
                cls._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_CACHE_BYTES)
                cls._vocab_size = vocab_size
            return cls._compiler


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


def tokenizer_info(loader: Callable[[], Any], vocab_size: int, tokenizer_dir: Path | None) -> Any:
    """xgrammar's TokenizerInfo for the tokenizer ``loader`` gives, read from aiolm's cache
    when an earlier process built it for the same tokenizer files.

    Building it needs the Hugging Face tokenizer, whose load (transformers' imports and
    the tokenizer itself) is most of the seconds a worker spends preparing its compiler,
    on every start and every restart; the serialized info reads back in milliseconds.
    The cache key covers the files' paths, sizes and times, the vocabulary size and
    xgrammar's version; any failure to read or write the cache falls back to building.
    """
    from importlib.metadata import version

    from aiolm.checkpoint.gguf_cache import cache_root

    xgr = xgrammar_module()
    path = None
    if tokenizer_dir is not None:
        h = hashlib.sha256(f"{version('xgrammar')}|{vocab_size}|{tokenizer_dir.resolve()}".encode())
        for name in _TOKENIZER_FILES:
            f = tokenizer_dir / name
            if f.exists():
                st = f.stat()
                h.update(f"|{name}:{st.st_size}:{st.st_mtime_ns}".encode())
        path = cache_root() / "tokenizer-info" / f"{h.hexdigest()[:24]}.json"
        try:
            return xgr.TokenizerInfo.deserialize_json(path.read_text())
        except FileNotFoundError:
            pass
        except Exception:  # a damaged entry: build again and replace it
            log.warning("structured outputs: unreadable tokenizer info %s; rebuilding it", path, exc_info=True)
    info = xgr.TokenizerInfo.from_huggingface(loader(), vocab_size=vocab_size)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(info.serialize_json())
            os.replace(tmp, path)  # whole or absent, whoever races
        except OSError as e:
            log.info("structured outputs: tokenizer info not cached (%s)", e)
    return info


class BackgroundCompiles:
    """Worker side: compiles the grammars the scheduler announces (``SchedulerOutput.grammars``)
    on a small thread pool while steps run, and reports which requests' grammars are done.

    The compiled grammar stays in the process's compiler cache, where the grammar logits
    processor finds it when the request's first sampling row is built. Requests sharing a
    grammar share one compile.
    """

    def __init__(self, vocab_size: int, max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self._max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first grammar
        self._pending: dict[str, Future[str | None]] = {}  # req_id -> its grammar's compile
        self._by_key: dict[tuple, Future[str | None]] = {}  # compiles in flight, by grammar

    def submit(self, grammars: dict[str, StructuredOutputs]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_threads, thread_name_prefix="aiolm-grammar")
        for req_id, spec in grammars.items():
            key = spec.key()
            fut = self._by_key.get(key)
            if fut is None:
                fut = self._by_key[key] = self._pool.submit(compile_error, spec, self.vocab_size)
            self._pending[req_id] = fut

    def collect(self, wait: float = 0.0) -> tuple[list[str], dict[str, str]]:
        """(requests whose grammar compiled, {request: error}) since the last call. With
        ``wait``, first wait up to that long for some compile to finish if none has."""
        if not self._pending:
            return [], {}
        if wait > 0 and not any(f.done() for f in self._by_key.values()):
            futures.wait(self._by_key.values(), timeout=wait, return_when=futures.FIRST_COMPLETED)
        ready: list[str] = []
        errors: dict[str, str] = {}
        for req_id, fut in list(self._pending.items()):
            if fut.done():
                del self._pending[req_id]
                error = fut.result()
                if error is None:
                    ready.append(req_id)
                else:
                    errors[req_id] = error
        for key, fut in list(self._by_key.items()):
            if fut.done():
                del self._by_key[key]
        return ready, errors

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
