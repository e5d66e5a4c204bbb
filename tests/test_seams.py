"""The seams of the design, checked: model code never asks what hardware it runs on, and
the engine process carries no model stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = sorted((ROOT / "aiolm" / "model").rglob("*.py"))

# Names whose use in model code would mean choosing by hardware.
HARDWARE_IMPORTS = {"aiolm.kernels.cpu", "aiolm.platforms.cpu", "aiolm.platforms.cuda",
                    "aiolm.platforms.cpu_linear", "aiolm.platforms.gguf_blocks", "aiolm.attention.cpu_backend",
                    "aiolm.attention.triton_backend"}
HARDWARE_WORDS = ("torch.ops.aiolm", "torch.cuda", "device.type", "cpu_kernels", "has_avx512", "is_available")


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", MODEL_FILES, ids=[str(p.relative_to(ROOT)) for p in MODEL_FILES])
def test_model_code_does_not_branch_on_hardware(path):
    source = path.read_text()
    tree = ast.parse(source)
    assert not _imports(tree) & HARDWARE_IMPORTS, f"{path.name} imports {_imports(tree) & HARDWARE_IMPORTS}"
    code = ast.unparse(tree)  # comments and docstrings do not count, code does
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            assert not strings & {"cpu", "cuda"}, f"{path.name}: compares against a device name: {ast.unparse(node)}"
    for word in HARDWARE_WORDS:
        assert word not in code, f"{path.name} mentions {word}"


def test_engine_process_imports_no_model_stack():
    probe = ("import sys, aiolm.engine.async_engine\n"
             "bad = ('aiolm.worker', 'aiolm.model.layers', 'aiolm.model.llama', 'aiolm.model.registry', "
             "'aiolm.kernels', 'aiolm.attention', 'aiolm.platforms')\n"
             "print(sorted(m for m in sys.modules if m.startswith(bad)))\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split("\n")
    assert out[0] == "[]", out[0]
    assert out[1] == "False"  # not even torch: the engine process holds config, tokenizer, scheduler, actors
