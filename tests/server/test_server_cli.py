"""`aiolm generate` and `aiolm chat` on the embedded model, as a user would run them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server_helpers import ROOT

FLAGS = ["--max-model-len", "512", "--kv-cache-memory", str(64 << 20), "--num-threads", "1"]


def _aiolm(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiolm.cli", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_usage_without_command():
    out = _aiolm()
    assert out.returncode == 2 and "serve" in out.stderr and "chat" in out.stderr
    assert _aiolm("--help").returncode == 0
    serve_help = _aiolm("serve", "--help")
    assert serve_help.returncode == 0 and "--max-num-batched-tokens" in serve_help.stdout
    assert "--api-key" in serve_help.stdout and "--allowed-origins" in serve_help.stdout


@pytest.mark.slow
def test_generate_prints_the_completion():
    out = _aiolm("generate", "What is the capital of France?", "--chat", "--max-tokens", "8", *FLAGS)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.slow
def test_chat_reads_stdin_until_eof():
    out = _aiolm("chat", "--temperature", "0", "--max-tokens", "8", *FLAGS,
                 stdin="What is the capital of France?\n/reset\nWhat is the capital of France?\n")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[0] == lines[1] and "Paris" in lines[0]
