"""A grammar-compile process: ``python -m aiolm.structured.compile_worker``, one grammar at a time.

The engine's validator (``validator.py``) keeps a few of these so that a grammar's first
compile runs outside the engine process, where it can be stopped: xgrammar compiles in C++
that Python cannot interrupt, so the only way to end a compile that runs too long, or whose
clients have all left, is to kill its process.

The pipe protocol (stdin: requests, stdout: replies). Each message is a frame: a 4-byte
big-endian length, then that many bytes, of UTF-8 JSON unless said otherwise.

    reply, once, when the compiler is ready:  {"ready": true}
                  or when it cannot be built:  {"ready": false, "error": "..."}   (then it exits)
    request, two frames:                      {"kind": ..., "strict": ...}, then the grammar
                                              text's UTF-8 bytes, raw (the fields of
                                              ``StructuredOutputs``; JSON-escaping a text of
                                              megabytes would cost the engine's event loop)
    reply to each request:                     {"error": null}  or  {"error": "invalid regex: ..."}

End of stdin means stop. Anything else the process or its libraries print goes to stderr:
file descriptor 1 is pointed at stderr once the protocol has its own copy of it.

Lifeline: the engine may die by SIGKILL while a compile runs for minutes, when nothing reads
stdin. The process asks Linux for SIGKILL when its parent dies (the parent spawns these from
its event-loop thread, which lives as long as the engine, so the thread trap described in
``aiolm/ipc/lifeline.py`` does not apply), and a daemon thread also polls ``parent_alive``
(xgrammar releases the GIL while it compiles, so the thread runs), for other systems.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from aiolm.ipc.lifeline import parent_alive, set_parent_death_signal

log = logging.getLogger("aiolm.compile_worker")
HEADER_BYTES = 4
PARENT_POLL_S = 0.5


def encode_frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def _read_frame(stream: IO[bytes]) -> bytes | None:
    """The next frame's bytes, or None at end of input."""
    header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return None
    size = int.from_bytes(header, "big")
    body = stream.read(size)
    return body if len(body) == size else None


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aiolm.structured.compile_worker")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--tokenizer-dir", type=Path, required=True, help="the folder the model's tokenizer loads from")
    p.add_argument("--vocab-size", type=int, required=True)
    return p.parse_args(argv)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if not parent_alive(parent_pid):
            os._exit(0)  # a compile may be running in C++: nothing to unwind, nothing to clean


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    set_parent_death_signal(signal.SIGKILL)
    if not parent_alive(args.parent_pid):  # it died before the signal was armed
        return 0
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), name="aiolm-lifeline", daemon=True).start()
    # The engine stops these itself; Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = os.environ.get("AIOLM_LOG_LEVEL", "WARNING").upper()  # "info" crashed the process
    logging.basicConfig(
        level=level if isinstance(logging.getLevelName(level), int) else "WARNING",
        format="%(asctime)s compile-worker %(levelname)s %(message)s",
    )
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries must not reach the protocol
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    try:
        compiler = _build_compiler(args.tokenizer_dir, args.vocab_size)
    except Exception as e:  # xgrammar missing, the tokenizer unreadable: the engine says why to clients
        replies.write(
            encode_frame({"ready": False, "error": f"cannot prepare the grammar compiler: {type(e).__name__}: {e}"})
        )
        return 1
    replies.write(encode_frame({"ready": True}))
    from aiolm.structured.backend import check_startable, compile_spec, describe_error
    from aiolm.structured.spec import StructuredOutputs

    while (head := _read_frame(requests)) is not None and (text := _read_frame(requests)) is not None:
        msg = json.loads(head)
        spec = StructuredOutputs(str(msg["kind"]), text.decode(), bool(msg["strict"]))
        try:
            check_startable(compile_spec(compiler, spec))
            error = None
        except Exception as e:
            error = describe_error(spec, e)
        replies.write(encode_frame({"error": error}))
    return 0


def _build_compiler(tokenizer_dir: Path, vocab_size: int) -> Any:
    """An xgrammar compiler on one thread and without a cache: this process only answers
    whether a grammar compiles, and the engine remembers the answers."""
    from aiolm.structured.backend import tokenizer_info, xgrammar_module

    def load_tokenizer() -> Any:  # only when aiolm's cache has no tokenizer info for these files
        from aiolm.checkpoint.source import load_tokenizer as load

        return load(tokenizer_dir)

    info = tokenizer_info(load_tokenizer, vocab_size, tokenizer_dir)
    return xgrammar_module().GrammarCompiler(info, max_threads=1, cache_enabled=False)


if __name__ == "__main__":
    sys.exit(main())
