"""`aiolm generate` and `aiolm chat` on the embedded model, as a user would run them."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import socket
import subprocess
import sys
import termios
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import ROOT

from procs import live_running

FLAGS = ["--max-model-len", "512", "--kv-cache-memory", str(64 << 20), "--num-threads", "1"]


def _aiolm(
    *args: str, stdin: str | bytes | None = None, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The command's run, its output as text; ``stdin`` as bytes may hold bytes that are not UTF-8."""
    out = subprocess.run(
        [sys.executable, "-m", "aiolm.cli", *args],
        cwd=ROOT,
        env={**os.environ, **env} if env else None,
        input=stdin.encode() if isinstance(stdin, str) else stdin,
        capture_output=True,
        timeout=timeout,
    )
    text = (out.stdout.decode(errors="replace"), out.stderr.decode(errors="replace"))
    return subprocess.CompletedProcess(out.args, out.returncode, *text)


def test_usage_without_command():
    out = _aiolm()
    assert out.returncode == 2 and "serve" in out.stderr and "chat" in out.stderr
    assert "no command given" in out.stderr
    unknown = _aiolm("sevre")
    assert unknown.returncode == 2 and "unknown command 'sevre'" in unknown.stderr
    usage = _aiolm("--help")  # asked for: on stdout, plain text (no reST markup)
    assert usage.returncode == 0 and usage.stderr == "" and "aiolm serve" in usage.stdout
    assert "``" not in usage.stdout
    serve_help = _aiolm("serve", "--help", env={"AIOLM_API_KEY": "s3cr3t-key"})
    assert serve_help.returncode == 0 and "--max-num-batched-tokens" in serve_help.stdout
    assert "s3cr3t-key" not in serve_help.stdout  # the key from the environment is never printed
    assert "--api-key" in serve_help.stdout and "--allowed-origins" in serve_help.stdout


# The commands below that load the model, each with its stdin. They are started together:
# each loads the model in its own processes, and one after another they would wait on each
# other's start-up.
MODEL_RUNS: dict[str, tuple[tuple[str, ...], str | bytes | None]] = {
    "generate": (("generate", "What is the capital of France?", "--chat", "--max-tokens", "8", *FLAGS), None),
    "chat-stdin": (
        ("chat", "--temperature", "0", "--max-tokens", "8", *FLAGS),
        "What is the capital of France?\n/reset\nWhat is the capital of France?\n",
    ),
    # A line that is not UTF-8, and one past the context: each said on stderr, and the chat goes
    # on (the first ended it with a traceback, the second with exit code 2)
    "chat-bad-lines": (
        ("chat", "--temperature", "0", "--max-tokens", "8", *FLAGS),
        b"caf\xe9 au lait\n" + b"word " * 600 + b"\nWhat is the capital of France?\n",
    ),
    # Sampled at the default temperature and top_p; seeded, so one unlucky draw cannot fail it.
    "chat-sampled": (
        ("chat", "--max-tokens", "24", "--sampling-seed", "0", *FLAGS),
        "What is the capital of France?\n",
    ),
}


@pytest.fixture(scope="module")
def model_runs() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(len(MODEL_RUNS)) as pool:
        runs = {name: pool.submit(_aiolm, *args, stdin=stdin) for name, (args, stdin) in MODEL_RUNS.items()}
        return {name: run.result() for name, run in runs.items()}


@pytest.mark.slow
def test_generate_prints_the_completion(model_runs):
    out = model_runs["generate"]
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.slow
def test_chat_reads_stdin_until_eof(model_runs):
    out = model_runs["chat-stdin"]
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[0] == lines[1] and "Paris" in lines[0]


@pytest.mark.slow
def test_chat_says_what_it_cannot_send_and_goes_on(model_runs):
    out = model_runs["chat-bad-lines"]
    assert out.returncode == 0, out.stderr
    assert "that line is not UTF-8 text (byte 0xe9 at character 3); not sent" in out.stderr
    assert "maximum context length is 512" in out.stderr and "Traceback" not in out.stderr
    assert "Paris" in out.stdout


def test_a_prompt_that_is_not_utf8_is_one_line():
    out = _aiolm("generate", "-", stdin=b"caf\xe9\n", timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "the prompt (stdin) is not UTF-8 text (byte 0xe9 at character 3)" in out.stderr


BAD_ARGS = [
    (["serve", "--port", "70000"], "--port: 70000 is out of range"),
    (["serve", "--port", "0"], "--port: 0 is out of range"),
    (["serve", "--max-model-len", "0"], "max_model_len must be >= 2"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["serve", "--dtype", "float8"], "dtype: 'float8' is not supported"),
    (["serve", "/no/such/model.gguf"], "no such file or directory"),
    (["serve", "--device", "cuda"], "sees no CUDA device"),
    (["serve", "--attention-backend", "flash"], "attention_backend: 'flash' is not supported"),
    (["serve", "--media-fetch-timeout", "-1"], "media_fetch_timeout must be a positive number"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens: 0 is out of range"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["chat", "--top-p", "2"], "--top-p"),
    (["serve", "--model", "/a", "/b"], "the model is given twice"),
    (["serve", "--num-speculative-tokens", "3"], "num_speculative_tokens needs --speculative"),
    (["serve", "--seed", str(2**64)], "seed must be < 2**63"),
    (["generate", "hi", "--sampling-seed", str(2**64)], "--sampling-seed"),  # it said --seed, the engine's
    (["generate", "hi", "--log-level", "chatty"], "--log-level"),
    (["serve", "--cpu-bind", "100000"], "cpu 100000 is not one this process may run on"),
    # the benchmarks' own flags (tracebacks, or a run of 0 tok/s)
    (["bench", "throughput", "--prompt-len", "16-8"], "--prompt-len: '16-8'"),
    (["bench", "latency", "--batch-size", "0"], "--batch-size: 0 is out of range"),
    (["bench", "serve", "--dataset", "/no/such.jsonl"], "--dataset: '/no/such.jsonl': no such file"),
    (["bench", "serve", "--seed", "-1"], "--seed: -1 is out of range"),  # numpy's traceback
    (["serve", "--step-timeout", "nan"], "step_timeout must be >= 0, got nan"),  # it turned the watchdog off
    (["serve", "--max-step-ms", "nan"], "max_step_ms must be >= 0, got nan"),
    (["serve", "--allowed-origins", '["a.com", 1]'], "is not a JSON list of origins"),
    (["bench", "serve", "--slo-ttft-ms", "nan"], "--slo-ttft-ms: 'nan' must be > 0"),
    (["bench", "throughput", "--bench-seed", "-1"], "--bench-seed: -1 is out of range"),
    (["bench", "throughput", "--dtype", "foo"], "dtype: 'foo' is not supported"),  # the engine's tracebacks
    (["bench", "latency", "--model", "/no/such/model"], "/no/such/model: no such file or directory"),
    # a name that is no URL was taken, and every request failed with a 502
    (["proxy", "--prefill", "foo", "--decode", "http://127.0.0.1:2"], "--prefill: 'foo' is not a base URL"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--timeout", "-5"], "--timeout"),
]


@pytest.mark.parametrize("args,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_fail_at_once_in_one_line(args, message):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    out = _aiolm(*args, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "loaded" not in out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_model_dependent_arguments_fail_in_one_line(command, tmp_path):
    """Flags that only the model's config can judge (a tensor-parallel size that does not
    split it, an architecture aiolm lacks) are still one line and exit code 2."""
    port = ["--port", str(_free_port())] if command == "serve" else []
    prompt = ["hi"] if command == "generate" else []
    out = _aiolm(command, *prompt, "--tensor-parallel-size", "2", *port, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "tensor_parallel_size 2 cannot split" in out.stderr, out.stderr
    assert "sizes that work: 1, 3" in out.stderr
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    out = _aiolm(command, *prompt, "--model", str(tmp_path), *port, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "unknown architecture ['FooForCausalLM']" in out.stderr, out.stderr
    assert "supported: BertForSequenceClassification, BertModel, Gemma3ForCausalLM" in out.stderr


def test_an_engine_that_cannot_start_says_why_in_one_line():
    """A start the workers refuse (too little KV cache for one sequence) is the reason in
    one line and exit 3, not Starlette's traceback of the lifespan; past the model's
    positions --max-model-len is refused before anything starts."""
    port = str(_free_port())
    out = _aiolm("serve", "--kv-cache-memory", "1000000", "--port", port, "--num-threads", "1", timeout=120)
    assert out.returncode == 3, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 2 and "the engine did not start: worker 0 failed to start" in errors[0], out.stderr
    assert "raise kv_cache_memory or lower max_model_len" in errors[0] and "Traceback" not in out.stderr
    out = _aiolm("serve", "--max-model-len", "9000", "--port", port, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--max-model-len 9000 is more than the 8192 positions this model has" in out.stderr


@pytest.mark.slow
def test_a_request_the_model_refuses_is_one_line(tmp_path):
    """--chat for a model without a chat template: exit code 2 and the reason in one line
    (after the line saying the model loaded), no traceback."""
    from aiolm.checkpoint.source import resolve_model

    for f in resolve_model(None).path.iterdir():  # the embedded model, less its chat template
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (tmp_path / f.name).write_text(json.dumps(cfg))
        elif f.name != "chat_template.jinja":
            (tmp_path / f.name).symlink_to(f)
    out = _aiolm("generate", "hi", "--chat", "--model", str(tmp_path), *FLAGS)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1] == "aiolm generate: error: this model has no chat template; use a plain prompt"
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_busy_port_is_reported_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _aiolm("serve", "--port", str(port), timeout=60)
    assert out.returncode == 2 and "already in use" in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.slow
def test_chat_default_sampling_answers_and_says_the_load_time(model_runs):
    out = model_runs["chat-sampled"]
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "loaded SmolLM2-135M-Instruct" in out.stderr and "Traceback" not in out.stderr


class _Terminal:
    """A program on a pseudo-terminal, so Ctrl-C is a real SIGINT to its process group."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.screen = ""

    def read_until(self, text: str, timeout: float, start: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while text not in self.screen[start:]:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                raise AssertionError(f"{text!r} did not appear; screen:\n{self.screen[-3000:]}")
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    self.screen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the program closed the terminal
                    pass
        return self.screen.index(text, start) + len(text)

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


@pytest.mark.slow
def test_chat_ctrl_c_stops_the_answer_then_leaves():
    term = _Terminal([sys.executable, "-m", "aiolm.cli", "chat", "--temperature", "0", "--max-tokens", "400", *FLAGS])
    try:
        at = term.read_until("> ", 240)
        term.send("Write a very long story about a dragon.\n")
        at = term.read_until("dragon", 120, at)  # the echo of the question
        term.read_until(" ", 120, at + 1)  # the answer has started streaming
        term.send("\x03")
        at = term.read_until("[stopped]", 30, at)
        at = term.read_until("> ", 30, at)
        term.send("What is the capital of France?\n")
        at = term.read_until("Paris", 120, at)
        at = term.read_until("> ", 120, at)
        term.send("\x03")  # Ctrl-C at the prompt leaves
        assert term.proc.wait(60) == 0
        try:
            while select.select([term.master], [], [], 0.2)[0]:
                term.screen += os.read(term.master, 4096).decode(errors="replace")
        except OSError:
            pass
        assert "Traceback" not in term.screen, term.screen[-3000:]
    finally:
        term.close()


@pytest.mark.slow
def test_sigterm_while_the_model_loads_stops_at_once(tmp_path):
    """uvicorn finishes an app's start before it acts on a signal: a server told to stop while
    its model loaded kept loading (minutes, on a first start that builds kernels). It now gives
    the start up, shuts down what started, and exits 0 with nothing left behind."""
    import signal

    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aiolm.cli", "serve", "--port", str(_free_port()), *FLAGS],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while b"Waiting for application startup" not in log.read_bytes():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.02)
        time.sleep(0.3)  # the engine's start is under way: its workers are loading the model
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert code == 0 and "stopped while the engine started" in text, text
    assert took < 10 and "Traceback" not in text, (took, text)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{proc.pid}_")]
    assert live_running(b"--parent-pid\0%d\0" % proc.pid) == []  # its workers, orphaned or not
