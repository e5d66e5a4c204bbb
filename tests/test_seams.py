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
HARDWARE_IMPORTS = {
    "aiolm.kernels.cpu",
    "aiolm.kernels.cpu_ops",
    "aiolm.kernels.triton",
    "aiolm.platforms.cpu",
    "aiolm.platforms.cuda",
    "aiolm.quant.cpu_packed",
    "aiolm.quant.gguf_blocks",
    "aiolm.attention.cpu_backend",
    "aiolm.attention.triton_backend",
}
# What a layer or a family gets from its BuildContext, never from a process-wide source.
LAYER_FILES = sorted((ROOT / "aiolm" / "model" / "layers").rglob("*.py")) + [
    ROOT / "aiolm" / "model" / f for f in ("llama.py", "gemma3.py")
]
PROCESS_WIDE = {
    "aiolm.platforms",
    "aiolm.platforms.get_platform",
    "aiolm.platforms.current_platform",
    "aiolm.distributed.parallel_state",
}
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


@pytest.mark.parametrize("path", LAYER_FILES, ids=[str(p.relative_to(ROOT)) for p in LAYER_FILES])
def test_layers_take_what_they_run_on_from_their_build_context(path):
    found = _imports(ast.parse(path.read_text())) & PROCESS_WIDE
    assert not found, f"{path.name} imports {found}: a layer gets its platform's choices through BuildContext"


PLATFORM_FILES = sorted((ROOT / "aiolm" / "platforms").rglob("*.py"))


@pytest.mark.parametrize("path", PLATFORM_FILES, ids=[str(p.relative_to(ROOT)) for p in PLATFORM_FILES])
def test_platforms_import_no_model_code(path):
    """A platform answers questions about its hardware; the builder takes its answers to the model."""
    found = {m for m in _imports(ast.parse(path.read_text())) if m.startswith(("aiolm.model", "aiolm.worker"))}
    assert not found, f"{path.name} imports {found}"


def test_engine_process_imports_no_model_stack():
    probe = (
        "import sys, aiolm.engine.async_engine\n"
        "bad = ('aiolm.worker', 'aiolm.model', 'xgrammar', "
        "'aiolm.kernels', 'aiolm.attention', 'aiolm.platforms', 'aiolm.quant')\n"
        "print(sorted(m for m in sys.modules if m.startswith(bad)))\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[0] == "[]", out[0]
    assert out[1] == "False"  # not even torch: the engine process holds config, tokenizer, scheduler, actors
