"""An installed wheel carries the native sources (ext/cpu) and builds the same kernels from them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_carries_ext_and_finds_it_when_installed(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("aiolm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.name for p in (ROOT / "ext" / "cpu").iterdir())
    assert sorted(n.rsplit("/", 1)[1] for n in names if "/share/aiolm/ext/cpu/" in n) == sources
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip first uninstalls the aiolm of the environment running
    # this test (the checkout's editable install) before writing into the prefix.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--ignore-installed",
            "--prefix",
            str(prefix),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = next(prefix.glob("lib/python*/site-packages"))
    probe = (
        "from aiolm.kernels import cpu; import aiolm; "
        "print(aiolm.__file__); print(cpu.source_dir()); print(cpu.library_path().name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(site)},
        check=True,
    ).stdout.split()
    from aiolm.kernels import cpu

    assert out[0].startswith(str(site))  # the installed copy, not this checkout
    assert Path(out[1]) == prefix / "share" / "aiolm" / "ext" / "cpu"
    assert out[2] == cpu.library_path().name  # same sources, torch and CPU: the same build key
    # The running environment is untouched: its aiolm is still this checkout, as a fresh process sees it.
    home = subprocess.run(
        [sys.executable, "-c", "import aiolm; print(aiolm.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert Path(home) == ROOT / "aiolm" / "__init__.py"
