"""Builds and loads aiolm's C++ CPU kernels (``torch.ops.aiolm.*``) on first use.

The sources live in the project's ``ext/cpu`` (wheels carry them as data files) and are
compiled once per machine into the aiolm cache folder, keyed by the source, torch's version and the CPU's flags, so
it is tuned for the host (-march=native) without a build step at install time.
Only a C++ compiler is needed (no ninja, no pybind11). When no compiler is
found or the build fails, ``load()`` returns False with the reason logged and
callers fall back to plain torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def source_dir() -> Path:
    """The kernels' sources: ``ext/cpu`` of a source checkout (editable installs), else the
    copy a wheel installs as data files under ``share/aiolm/ext/cpu``."""
    checkout = Path(__file__).resolve().parents[2] / "ext" / "cpu"
    if checkout.is_dir():
        return checkout
    for f in importlib.metadata.files("aiolm") or []:
        if f.name == "vec.h" and "ext" in f.parts:
            return Path(str(f.locate())).resolve().parent
    raise RuntimeError("aiolm's kernel sources (ext/cpu) are not installed")


_CSRC = source_dir()
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    base = os.environ.get("AIOLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "aiolm")
    return Path(base) / "kernels"


def _cpuinfo(key: str) -> str:
    """/proc/cpuinfo's first line for ``key`` (flags, vendor_id), or "" where it has none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpuinfo("flags")


def is_amd() -> bool:
    """Whether AMD made this CPU: a few kernel choices were measured to go opposite ways on
    AMD's and Intel's cores (ext/cpu/cpu_vendor.h is the kernels' side of it)."""
    return "AuthenticAMD" in _cpuinfo("vendor_id")


def has_avx512() -> bool:
    """Whether the kernels are built with AVX-512 here (-march=native), which moves the
    batch sizes at which one kernel beats another."""
    return " avx512f" in _cpu_flags()


def has_avx512_vnni() -> bool:
    """Whether the int8 kernels get their VNNI path here (ext/cpu/gguf_int8.cpp), whose
    4-bit kernel outruns the float matmuls at every step size."""
    flags = _cpu_flags() + " "
    return all(f" {f} " in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512_vnni"))


def has_amx() -> bool:
    """Whether oneDNN's bfloat16 matmuls run on AMX tiles here, which overtake the int8
    kernels beyond 32 rows (aiolm/quant/gguf_blocks.py)."""
    return " amx_bf16" in _cpu_flags()


def _compile_flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [
        "-O3",
        "-march=native",
        "-std=c++17",
        "-fPIC",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        f"-I{sysconfig.get_paths()['include']}",
    ]


def _link_command(objects: list[Path], out: Path, compiler: str) -> list[str]:
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [
        compiler,
        "-shared",
        "-fopenmp",
        *map(str, objects),
        "-o",
        str(out),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{torch_lib}",
    ]


def library_path() -> Path:
    h = hashlib.sha256()
    for p in sorted(_CSRC.glob("*.[ch]*")):  # sources and the headers they include
        h.update(p.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return cache_dir() / f"aiolm_cpu_{h.hexdigest()[:16]}.so"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return compiler


def _build(target: Path) -> None:
    """Compile each source on its own (in parallel, one progress line each), then link."""
    compiler = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        flags = _compile_flags()
        done = [0]

        def compile_one(src: Path) -> Path:
            obj = Path(tmp) / (src.stem + ".o")
            t0 = time.monotonic()
            proc = subprocess.run([compiler, *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {src.name} failed:\n{proc.stderr[-4000:]}")
            with _lock_progress:
                done[0] += 1
                log.info("built kernel %d of %d: %s (%.0fs)", done[0], len(_SOURCES), src.name, time.monotonic() - t0)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:
            objects = list(pool.map(compile_one, _SOURCES))
        library = Path(tmp) / target.name
        proc = subprocess.run(_link_command(objects, library, compiler), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"linking the CPU kernels failed:\n{proc.stderr[-4000:]}")
        os.replace(library, target)  # atomic: concurrent builders never load a half-written library


_lock_progress = threading.Lock()


def ready(t: torch.Tensor, bf16_too: bool = False) -> bool:
    """True if the fused float32 CPU kernels can take ``t`` (cheap enough to call per op);
    ``bf16_too`` for the kernels that also take bfloat16."""
    if t.dtype != torch.float32 and not (bf16_too and t.dtype == torch.bfloat16) or t.device.type != "cpu":
        return False
    ok = _state.get("ok")
    return bool(ok) if ok is not None else load()


def load() -> bool:
    """Make ``torch.ops.aiolm.*`` available; False (logged) if they can't be."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("AIOLM_DISABLE_CPU_KERNELS") == "1":
            _state["ok"] = False
            return False
        try:
            path = library_path()
            if not path.exists():
                log.info("building aiolm CPU kernels (%d sources) into %s, once per machine", len(_SOURCES), path)
                _build(path)
            torch.ops.load_library(str(path))
            _state["ok"] = True
        except Exception as e:  # no compiler, a failed build: plain torch still works
            log.warning("aiolm CPU kernels unavailable, using plain torch instead: %s", e)
            _state["ok"] = False
        return bool(_state["ok"])
