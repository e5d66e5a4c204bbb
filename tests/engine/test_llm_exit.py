"""A script holding an LLM ends promptly however it holds it, leaving no worker and no shared memory.

Each way a user might hold the engine runs as its own Python program (all at once, to save
time); the program prints its worker pids, and after it exits the test checks that they are
gone and that no ``/dev/shm/aiolm_<pid>_*`` segment of the program is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300

SETUP = """
import os
from aiolm import LLM, SamplingParams
ARGS = dict(max_model_len=256, kv_cache_memory=32 << 20, max_num_seqs=4, num_threads=1)
PARAMS = SamplingParams(max_tokens=3, temperature=0)
def report(llm):
    out = llm.generate(["The capital of France is"], PARAMS, use_tqdm=False)[0].outputs[0].text
    procs = getattr(llm.engine.executor, "procs", None)  # none in-process: the script's own pid
    print("TEXT", repr(out), "WORKERS", *([p.pid for p in procs] if procs else [os.getpid()]), flush=True)
"""

SCRIPTS = {
    # The README's shape: the engine in a module global, nothing closed.
    "global": "llm = LLM(**ARGS)\nreport(llm)\n",
    "local": "def main():\n    llm = LLM(**ARGS)\n    report(llm)\nmain()\n",
    "sys_exit": "import sys\nllm = LLM(**ARGS)\nreport(llm)\nsys.exit(3)\n",
    "exception": "llm = LLM(**ARGS)\nreport(llm)\nraise RuntimeError('user bug')\n",
    "with": "with LLM(**ARGS) as llm:\n    report(llm)\n",
    # in-process: its step thread's pool took no more work at exit (a traceback)
    "in_process": "llm = LLM(executor='local', **ARGS)\nreport(llm)\n",
}
EXIT_CODES = {"global": 0, "local": 0, "sys_exit": 3, "exception": 1, "with": 0, "in_process": 0}


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # exited, waiting for init to reap it


def test_scripts_holding_an_llm_exit_cleanly(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {}
    for name, body in SCRIPTS.items():
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(SETUP) + body)
        procs[name] = subprocess.Popen(
            [sys.executable, str(path)],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    results = {}
    try:
        for name, p in procs.items():
            try:
                out, err = p.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                pytest.fail(f"{name}: still running {TIMEOUT}s after start (hung at exit?)\n{err[-3000:]}")
            results[name] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    deadline = time.monotonic() + 10
    for name, (rc, out, err) in results.items():
        assert rc == EXIT_CODES[name], f"{name} exited with {rc}\n{out}\n{err[-3000:]}"
        line = next(ln for ln in out.splitlines() if ln.startswith("TEXT"))
        assert "Paris" in line, line
        workers = [int(w) for w in line.split("WORKERS")[1].split()]
        assert workers
        while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(w) for w in workers), f"{name}: worker processes {workers} outlived the script"
        pid = procs[name].pid
        left = [s for s in os.listdir("/dev/shm") if s.startswith(f"aiolm_{pid}_")]
        assert not left, f"{name}: shared memory left behind: {left}"
        if name == "exception":
            assert "RuntimeError: user bug" in err
        assert "Traceback" not in err or name == "exception", f"{name}: {err[-3000:]}"
