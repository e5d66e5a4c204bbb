"""Session fixtures shared by the suite: the real embedded model and its reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One thread: test processes share two cores with worker processes, and OpenMP
# spin-waiting makes oversubscribed torch threads many times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def real_source():
    from aiolm.checkpoint.source import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(real_source):
    return real_source.load_tokenizer()


@pytest.fixture(scope="session")
def real_model(real_source):
    from aiolm.model.registry import build_model

    return build_model(real_source, torch.float32)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own model read from the same GGUF file, float32."""
    from aiolm.checkpoint.source import embedded_model_path
    from paged import hf_from_gguf

    return hf_from_gguf(embedded_model_path())


from paged import hf_greedy  # noqa: E402,F401  (re-exported for older imports)

sys.path.insert(0, str(ROOT / "tests" / "server"))
from server_helpers import KEYED_SERVER_FLAGS, OPEN_SERVER_FLAGS, SharedServer  # noqa: E402


@pytest.fixture(scope="session")
def keyed_servers(tmp_path_factory: pytest.TempPathFactory):
    """The real server with an API key, shared by tests/server and tests/web (``server``)."""
    shared = SharedServer("keyed-server", tmp_path_factory, *KEYED_SERVER_FLAGS)
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def open_servers(tmp_path_factory: pytest.TempPathFactory):
    """The real server without a key, with the hermes tool parser: the README's, the chat
    page's and the tool tests' server."""
    shared = SharedServer("open-server", tmp_path_factory, *OPEN_SERVER_FLAGS)
    yield shared
    shared.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that stop a shared server run after every other test."""
    last = [item for item in items if item.get_closest_marker("stops_shared_server")]
    if last:
        items[:] = [item for item in items if item not in last] + last


@pytest.fixture(scope="session")
def reasoning_servers(tmp_path_factory: pytest.TempPathFactory):
    """A real server on the scripted thinking model (tests/scripted_model.py) with Qwen3's
    reasoning parser and the hermes tool parser: the reasoning tests' and the chat page's."""
    from scripted_model import scripted_model

    folder = scripted_model(tmp_path_factory.mktemp("scripted-model"))
    shared = SharedServer(
        "reasoning-server",
        tmp_path_factory,
        str(folder),
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        "2048",  # the model's own: Anthropic's thinking budgets are 1024 tokens or more
    )
    yield shared
    shared.close()
