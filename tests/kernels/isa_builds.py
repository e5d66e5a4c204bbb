"""Kernel sources built for other ISAs than the machine's, for the tests of their other paths.

The machine builds the kernels for its own CPU (-march=native), so a test run only reaches
the paths its CPU has. These builds take the same sources and flags with AVX-512 turned off
(the AVX2 paths) or with the baseline x86-64 (the scalar ones); a child process loads such
a library in place of the cache's and runs the named tests against it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
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
import sys, torch
torch.ops.load_library(sys.argv[1])
from aiolm.kernels import cpu
cpu._state["ok"] = True  # the library just loaded stands in for the machine's own build
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[3:], "-k", sys.argv[2]]))
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


def isa_libraries(name: str, sources: list[str]) -> dict[str, Path]:
    """Every ISA's build at once (up to four compilers on a cold cache)."""
    with ThreadPoolExecutor(len(ISA_BUILDS)) as pool:
        return dict(zip(ISA_BUILDS, pool.map(lambda isa: isa_library(name, sources, isa), ISA_BUILDS)))


def check_build_flags(isa: str) -> None:
    """The build really lacks AVX-512 (and, on the baseline, AVX2)."""
    macros = subprocess.run(
        ["c++", *isa_flags(isa), "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True, check=True
    ).stdout
    assert ("__AVX512F__" in macros) is False and ("__AVX2__" in macros) == (isa == "avx2")


def run_tests_with(lib: Path, test_files: list[str], select: str) -> None:
    """Runs the tests of ``test_files`` that ``select`` (a -k expression) names, in a child
    process with ``lib`` loaded; they must all pass and none may skip."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(lib), select, *test_files],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
