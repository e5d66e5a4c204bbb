"""The examples run as their own programs, as a user would run them (both at once, to save time)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600
SERVER_URL = "http://127.0.0.1:8000"  # what README snippets that need `aiolm serve` connect to (/v1 or not)


def test_examples_run_standalone():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = ["--max-tokens", "8", "--num-threads", "1"]
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / name), *common],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("embed_in_app.py", "offline_batch.py")
    }
    results = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=TIMEOUT)
            results[name] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, (rc, out, err) in results.items():
        assert rc == 0, f"{name} exited with {rc}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"

    _, out, _ = results["embed_in_app.py"]
    assert "Paris" in out.split("chat answer:")[1]
    assert "impatient user left after 3 updates" in out
    assert "healthy=True requests=(0, 0) kv_cache_usage=0.000" in out
    assert re.search(r"metrics: [1-9]\d* tokens generated, mean inter-token latency \d+\.\d ms", out)
    assert out.rstrip().endswith("engine shut down")

    _, out, err = results["offline_batch.py"]
    assert "'The capital of France is' -> ' Paris" in out
    assert "6 prompts, " in out
    assert out.count("chat ") == 3
    assert out.rstrip().endswith("done")
    assert "Generating" in err  # the progress bar


def test_readme_python_snippets_run_as_written():
    """Each ```python block of the README, verbatim, as its own program: it prints and exits."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2
    blocks = [b for b in blocks if SERVER_URL not in b]  # those run against a server, below
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for code in blocks
    ]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for code, p, (out, err) in zip(blocks, procs, results):
        assert p.returncode == 0, f"{code}\nexited with {p.returncode}\n{out}\n{err[-3000:]}"
        assert "Paris" in out, f"{code}\n{out}"
    streamed = next(out for code, (out, _) in zip(blocks, results) if "AsyncEngine" in code)
    assert len(streamed.strip().splitlines()) == 1  # deltas printed back to back: the answer once


def test_readme_client_snippets_run_against_a_server(open_servers):
    """README blocks that talk to `aiolm serve`, verbatim but for the port: the shared server
    without a key (tests/conftest.py) on a free one."""
    import ast
    import re

    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if SERVER_URL in b]
    assert blocks, "the README's structured outputs example"
    port = open_servers.get().port
    for code in blocks:
        code = code.replace(SERVER_URL, f"http://127.0.0.1:{port}")
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=TIMEOUT)
        assert p.returncode == 0, f"{code}\n{p.stdout}\n{p.stderr[-3000:]}"
        lines = p.stdout.strip().splitlines()
        if "json_schema" in code:  # the structured outputs example: a document, then a choice
            doc = ast.literal_eval(lines[0])  # print() of the parsed dict
            assert set(doc) == {"city", "population"} and isinstance(doc["population"], int)
            assert lines[1] in ("yes", "no")
    # The README's curl stream, verbatim but for the port (its comment lines are shell comments).
    curl = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "curl -N" in b)
    p = subprocess.run(
        ["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
        text=True,
        capture_output=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, p.stderr
    events = [ln[len("data: ") :] for ln in p.stdout.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", p.stdout
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text and chunks[-1]["usage"]["completion_tokens"] > 0, p.stdout
