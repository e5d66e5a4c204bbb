"""Big grammars: the compile time limit, cancellation, no head-of-line blocking, no leftovers.

A real `aiolm serve` with `--structured-outputs-compile-timeout 3` on the embedded model, real
compile processes (``aiolm/structured/validator.py``), observed through the server's log and
/proc; the lifeline test hosts a Validator in a process of its own and SIGKILLs it. JSON
schemas of many optional integer properties are the big grammars: their compile time grows
steeply with the count (docs/reliability.md has the figures), so 2,000 properties never
finish within these tests and 5,000 could take far longer.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ROOT, ServerProcess, free_port, serve_cmd

from procs import live_running

pytest.importorskip("xgrammar")
LIMIT_S = 3
READY = re.compile(r"grammar compile process (\d+) ready")
STOPPED = re.compile(r"grammar compile process (\d+) stopped: (.*)")


def big_schema(n: int, tag: str = "p") -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "integer"} for i in range(n)}}


def compile_pids(parent: int | None = None) -> set[int]:
    """Live (not zombie) compile processes, of ``parent`` if given."""
    return set(live_running(b"aiolm.structured.compile_worker", parent))


def wait_until(what, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(message)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(
        serve_cmd(port, "--structured-outputs-compile-timeout", str(LIMIT_S), "--shutdown-timeout", "5"),
        port,
        tmp_path_factory.mktemp("limited") / "server.log",
    )
    srv.wait_ready()
    yield srv
    if srv.proc.poll() is None:
        code = srv.stop()
        assert code == 0, srv.log()


def full_log(srv: ServerProcess) -> str:
    return srv.log_path.read_text(errors="replace")


def post(client: httpx.AsyncClient, extra: dict, max_tokens: int = 2):
    return client.post(
        "/v1/completions", json={"prompt": "Is it so?", "max_tokens": max_tokens, "temperature": 0, **extra}
    )


@pytest.fixture(scope="module")
def warm(limited):
    """A structured request started the pool; wait until its three processes are ready."""
    r = httpx.post(
        limited.base_url + "/v1/completions",
        timeout=300,
        json={"prompt": "Is it so?", "max_tokens": 2, "structured_outputs": {"regex": "[a-z]+"}},
    )
    assert r.status_code == 200, r.text
    wait_until(
        lambda: len(READY.findall(full_log(limited))) >= 3,
        180,
        f"the compile processes did not all start:\n{limited.log()}",
    )
    return limited


def test_a_big_schema_is_refused_within_the_limit_while_a_choice_answers(warm):
    async def run():
        async with httpx.AsyncClient(base_url=warm.base_url, timeout=120) as c:
            t0 = time.monotonic()
            big = asyncio.ensure_future(post(c, {"structured_outputs": {"json": big_schema(5000)}}))
            await asyncio.sleep(0.3)  # the big compile has started
            t1 = time.monotonic()
            choice = await post(c, {"structured_outputs": {"choice": ["yes", "no"]}})
            choice_s = time.monotonic() - t1
            refused = await big
            big_s = time.monotonic() - t0
            t2 = time.monotonic()
            again = await post(c, {"structured_outputs": {"json": big_schema(5000)}})
            return choice, choice_s, refused, big_s, again, time.monotonic() - t2

    choice, choice_s, refused, big_s, again, again_s = asyncio.run(run())
    text = choice.json()["choices"][0]["text"] if choice.status_code == 200 else ""
    assert text and ("yes".startswith(text) or "no".startswith(text)), choice.text  # 2 tokens of a choice
    assert choice_s < 1.0, f"the choice request took {choice_s:.2f} s beside a big compile"
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == "structured_outputs.json", err
    assert f"longer than {LIMIT_S} s to compile" in err["message"], err
    assert "--structured-outputs-compile-timeout" in err["message"], err
    assert LIMIT_S <= big_s < LIMIT_S + 2.0, f"refused after {big_s:.2f} s"
    # The refusal is remembered: the same grammar is refused at once, without a compile.
    assert again.status_code == 400 and again.json()["error"] == err, again.text
    assert again_s < 0.5, f"the second refusal took {again_s:.2f} s"
    assert "ran past the 3 s limit" in full_log(warm)


def test_a_client_leaving_stops_its_compile(warm):
    before = compile_pids(warm.proc.pid)
    log_start = len(full_log(warm))

    async def run():
        async with httpx.AsyncClient(base_url=warm.base_url, timeout=120) as c:
            task = asyncio.ensure_future(post(c, {"structured_outputs": {"json": big_schema(2000, "gone")}}))
            await asyncio.sleep(1.5)  # past the first second: a big compile, stopped as soon as nobody waits
            task.cancel()  # the connection closes
            with pytest.raises(asyncio.CancelledError):
                await task

    t0 = time.monotonic()
    asyncio.run(run())
    found = wait_until(
        lambda: STOPPED.findall(full_log(warm)[log_start:]), 5, f"no compile process was stopped:\n{warm.log()}"
    )
    stopped_s = time.monotonic() - t0
    ((pid, why),) = found
    assert why == "every request waiting for its grammar has gone", found
    assert stopped_s < LIMIT_S, f"stopped only after {stopped_s:.2f} s"
    assert int(pid) in before
    wait_until(lambda: int(pid) not in compile_pids(), 5, f"process {pid} is still there")
    # ...and it is replaced
    wait_until(
        lambda: len(compile_pids(warm.proc.pid) - before) == 1,
        60,
        f"no new compile process: before {before}, now {compile_pids(warm.proc.pid)}",
    )
    # the access log: the client closed the request. Its line is written as the handler unwinds,
    # which may come after the replacement process has started
    wait_until(lambda: '"status": 499' in full_log(warm)[log_start:], 5, f"no 499 in the access log:\n{warm.log()}")


def test_compiler_messages_carry_no_cpp_paths_or_timestamps(warm):
    cases = [
        ({"structured_outputs": {"regex": "(ab"}}, "The parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, 'Rule "nothing_here" is not defined'),
        ({"structured_outputs": {"json": {"type": "no-such-type"}}}, 'Unsupported type "no-such-type"'),
    ]
    for extra, words in cases:
        r = httpx.post(warm.base_url + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert words in message, message
        assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+|/cpp/", message), message


def test_the_server_process_never_loads_xgrammar(warm):
    maps = Path(f"/proc/{warm.proc.pid}/maps").read_text()
    assert "xgrammar" not in maps


_HOST = textwrap.dedent("""
    import asyncio, json, sys
    from aiolm.checkpoint.source import resolve_model
    from aiolm.structured.spec import StructuredOutputs
    from aiolm.structured.validator import Validator

    async def main():
        src = resolve_model(None)
        v = Validator("xgrammar", compile_timeout=600)
        v.configure(src.path, src.config.vocab_size)
        await v.check(StructuredOutputs("regex", "[a-z]+"))
        big = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(2000)}}
        task = asyncio.ensure_future(v.check(StructuredOutputs("json", json.dumps(big))))
        while not any(p.job is not None for p in v.pool.procs):
            await asyncio.sleep(0.05)
        print(" ".join(str(p.pid) for p in v.pool.procs), flush=True)
        await task

    asyncio.run(main())
""")


def test_compile_processes_die_with_a_killed_engine_process():
    """SIGKILL the process that holds the pool while one of its processes compiles: none is left."""
    host = subprocess.Popen([sys.executable, "-c", _HOST], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = host.stdout.readline()  # once a compile runs
        pids = {int(p) for p in line.split()}
        assert pids and pids <= compile_pids(host.pid), (line, compile_pids(host.pid))
        time.sleep(0.5)
        host.kill()
        host.wait(10)
        wait_until(lambda: not (pids & compile_pids()), 5, f"compile processes outlived their engine: {pids}")
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)


def test_shutdown_leaves_no_compile_process(warm):
    """Last in the module: SIGTERM while a big grammar compiles; the server exits 0, and takes its
    compile processes with it."""
    r = None

    async def run():
        nonlocal r
        async with httpx.AsyncClient(base_url=warm.base_url, timeout=60) as c:
            task = asyncio.ensure_future(post(c, {"structured_outputs": {"json": big_schema(2000, "bye")}}))
            await asyncio.sleep(0.5)
            pids = compile_pids(warm.proc.pid)
            warm.proc.send_signal(signal.SIGTERM)
            try:
                r = await task
            except httpx.HTTPError:
                pass
            return pids

    pids = asyncio.run(run())
    assert pids
    assert warm.stop() == 0, warm.log()
    if r is not None:
        assert r.status_code in (400, 503), r.text
    assert not (pids & compile_pids()), f"compile processes outlived the server: {pids & compile_pids()}"


def test_the_compile_timeout_flag():
    from aiolm.config import EngineArgs
    from aiolm.server.settings import parse_serve_args

    assert parse_serve_args([])[0].structured_outputs_compile_timeout == 30.0
    args = parse_serve_args(["--structured-outputs-compile-timeout", "2.5"])[0]
    assert args.structured_outputs_compile_timeout == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse_serve_args(["--structured-outputs-compile-timeout", bad])
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout"):
        EngineArgs(structured_outputs_compile_timeout=0)
