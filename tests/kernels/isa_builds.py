"""Kernel sources built for other ISAs than the machine's, for the tests of their other paths.

The machine builds the kernels for its own CPU (-march=native), so a test run only reaches
the paths its CPU has. These builds take the same sources and flags with AVX-512 turned off
(the AVX2 paths) or with the baseline x86-64 (the scalar ones); a child process loads such
a library in place of the cache's and runs the named tests against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from aiolm.kernels import cpu as cpu_kernels

ISA_BUILDS = {"avx2": ["-mno-avx512f"], "baseline-x86-64": ["-march=x86-64"]}
# The GGUF block kernels' sources as one library an ISA, shared by every test that builds any
# of them (test_gguf_linear.py, test_gguf_experts.py, test_fused_moe_cpu.py): apart they
# compiled gguf_int8.cpp and fused_moe.cpp twice, on every cold run.
GGUF_SOURCES = ["gguf_linear.cpp", "gguf_int8.cpp", "fused_moe.cpp"]
_ROOT = Path(__file__).resolve().parents[2]
_CHILD = """
import json, sys, torch
plan = json.loads(sys.argv[1])
for lib in plan["libraries"]:
    torch.ops.load_library(lib)
from aiolm.kernels import cpu
cpu._state["ok"] = True  # the libraries just loaded stand in for the machine's own build
import pytest


class Tally:
    def __init__(self):
        self.passed, self.skipped, self.failed = 0, [], []

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed.append(f"{report.nodeid}: collection failed\\n{report.longreprtext[-2000:]}")

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(f"{report.nodeid} ({report.when})\\n{report.longreprtext[-2000:]}")
        elif report.skipped:
            self.skipped.append(report.nodeid)
        elif report.when == "call":
            self.passed += 1


results = {}
for name, suite in plan["suites"].items():
    tally = Tally()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *suite["files"], "-k", suite["select"]], plugins=[tally])
    results[name] = {"rc": int(rc), "passed": tally.passed, "skipped": tally.skipped, "failed": tally.failed}
with open(plan["out"], "w") as f:
    json.dump(results, f)
"""


def isa_flags(isa: str) -> list[str]:
    return [
        f
        for f in cpu_kernels._compile_flags()
        if not (f.startswith("-march") and ISA_BUILDS[isa][0].startswith("-march"))
    ] + ISA_BUILDS[isa]


def isa_library(name: str, sources: list[str], isa: str) -> Path:
    """``sources`` (files of ext/cpu) linked into one library built for ``isa``, cached in the
    aiolm cache folder like the kernels themselves: keyed by the sources and headers, the flags
    (torch's include paths among them) and the compiler."""
    h = hashlib.sha256()
    for p in sorted(cpu_kernels.source_dir().glob("*.[ch]*")):
        h.update(p.read_bytes())
    h.update(torch.__version__.encode())
    h.update("\0".join(isa_flags(isa) + sources).encode())
    h.update(subprocess.run(["c++", "--version"], capture_output=True, check=True).stdout)
    lib = cpu_kernels.cache_dir() / "isa-tests" / f"{name}_{isa}_{h.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build-") as tmp:
        objects = [Path(tmp) / f"{Path(s).stem}.o" for s in sources]

        def compile_one(src: str, obj: Path) -> None:
            subprocess.run(
                ["c++", *isa_flags(isa), "-w", "-c", str(cpu_kernels.source_dir() / src), "-o", str(obj)],
                check=True,
                timeout=600,
            )

        with ThreadPoolExecutor(2) as pool:  # two compilers at once
            list(pool.map(compile_one, sources, objects))
        out = Path(tmp) / lib.name
        subprocess.run(cpu_kernels._link_command(objects, out, "c++"), check=True, timeout=120)
        os.replace(out, lib)  # atomic: a concurrent run never loads a half-written library
    return lib


def check_build_flags(isa: str) -> None:
    """The build really lacks AVX-512 (and, on the baseline, AVX2)."""
    macros = subprocess.run(
        ["c++", *isa_flags(isa), "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True, check=True
    ).stdout
    assert ("__AVX512F__" in macros) is False and ("__AVX2__" in macros) == (isa == "avx2")


@dataclass(frozen=True)
class Suite:
    """A kernel's tests run against its other-ISA builds: ``files`` (of tests/kernels, the
    first one holding the test that asks for the run) and the tests of them ``select`` (a -k
    expression) names, with ``library`` (built from ``sources``) loaded."""

    library: str
    sources: tuple[str, ...]
    files: tuple[str, ...]
    select: str
    isas: tuple[str, ...] = tuple(ISA_BUILDS)
    avx2_needs_avx512: bool = False  # its avx2 test skips where the machine's own build is the AVX2 one


SUITES = {
    "paged_attention": Suite(
        "paged_attention",
        ("paged_attention.cpp",),
        ("test_paged_attention.py",),
        "sliding_window or mixed_batches or wider_than or never_read or finite",
    ),
    "gguf_linear": Suite(
        "gguf",
        tuple(GGUF_SOURCES),
        ("test_gguf_linear.py", "test_gguf_kquants.py"),
        "matches_dequantized_matmul or float_kernel_matches or leading_dims or codes_compute or batch_it_is_in",
    ),
    "gguf_experts": Suite(
        "gguf",
        tuple(GGUF_SOURCES),
        ("test_gguf_experts.py",),
        "per_expert_loop and (Q4_K-Q4_K-Q6_K or Q4_K-Q4_K-Q5_0 or Q4_1) and not 13",
        avx2_needs_avx512=True,
    ),
    "fused_moe": Suite(
        "gguf",
        tuple(GGUF_SOURCES),
        ("test_fused_moe_cpu.py",),
        "matches_per_expert_loop and 13",
        isas=("baseline-x86-64",),
    ),
    "panel": Suite(
        "panel",
        ("panel_gemm.cpp", "fused_ops.cpp"),
        ("test_panel_gemm.py", "test_fused_ops.py"),
        "matches_float64 or bias_and_gelu or negative_tail or add_layer_norm",
    ),
    "encoder_attention": Suite(
        "encoder_attention",
        ("encoder_attention.cpp",),
        ("test_cpu_encoder_attention.py",),
        "matches_float64 or rejects",
    ),
    "lora": Suite(
        "lora",
        ("lora.cpp",),
        ("test_cpu_lora.py",),
        "matches_a_per_row_loop or static_slot or unused_slots",
    ),
}


def suite_of(test_file: str) -> str | None:
    """The suite whose run the tests of ``test_file`` (a file name) ask for."""
    return next((name for name, s in SUITES.items() if s.files[0] == test_file), None)


class IsaRuns:
    """One child process an ISA, with every library of that ISA loaded, runs every suite the
    session asks for (``wanted``: (suite, isa) pairs) one after another: a child apiece spent
    seconds each importing torch, aiolm and the suite's conftest. Each suite's result is its
    own; the first test of an ISA to ask starts its run, the others read it."""

    def __init__(self, wanted: set[tuple[str, str]], tmp: Path) -> None:
        self.wanted, self.tmp = wanted, tmp
        self.runs: dict[str, tuple[dict, str]] = {}

    def check(self, name: str, isa: str) -> None:
        """``name``'s tests against its ``isa`` build: they must all pass and none may skip."""
        if isa not in self.runs:
            self.runs[isa] = self._run(isa, {n for n, i in self.wanted if i == isa} | {name})
        if name not in self.runs[isa][0]:  # not planned for this ISA's run (not collected): its own
            self.runs[isa] = ({**self.runs[isa][0], **self._run(isa, {name})[0]}, self.runs[isa][1])
        results, tail = self.runs[isa]
        r = results[name]
        assert r["rc"] == 0 and not r["failed"], "\n\n".join(r["failed"]) + "\n" + tail
        assert r["passed"] > 0 and not r["skipped"], (r, tail)

    def _run(self, isa: str, names: set[str]) -> tuple[dict, str]:
        suites = {n: SUITES[n] for n in sorted(names)}
        if isa == "avx2" and not cpu_kernels.has_avx512():
            suites = {n: s for n, s in suites.items() if not s.avx2_needs_avx512}
        libraries = {(s.library, s.sources) for s in suites.values()}
        with ThreadPoolExecutor(len(libraries)) as pool:
            libs = list(pool.map(lambda ls: isa_library(ls[0], list(ls[1]), isa), sorted(libraries)))
        here = Path(__file__).resolve().parent
        out = self.tmp / f"isa-{isa}-{len(self.runs)}-{'-'.join(suites)}.json"
        plan = {
            "libraries": [str(lib) for lib in libs],
            "suites": {n: {"files": [str(here / f) for f in s.files], "select": s.select} for n, s in suites.items()},
            "out": str(out),
        }
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(plan)],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            timeout=900 * len(suites),
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.returncode == 0 and out.exists(), tail
        return json.loads(out.read_text()), tail
