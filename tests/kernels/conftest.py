"""The other-ISA runs (isa_builds.py), shared by the kernels' tests that ask for them."""

from __future__ import annotations

import isa_builds
import pytest


@pytest.fixture(scope="session")
def isa_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> isa_builds.IsaRuns:
    """Plans one child process an ISA for every other-ISA test this session collected."""
    wanted: set[tuple[str, str]] = set()
    for item in request.session.items:
        if "isa_runs" not in getattr(item, "fixturenames", ()):
            continue
        name = isa_builds.suite_of(item.path.name)
        if name is None:
            continue
        callspec = getattr(item, "callspec", None)
        isa = callspec.params.get("isa") if callspec is not None else None
        wanted.update((name, i) for i in ([isa] if isa else isa_builds.SUITES[name].isas))
    return isa_builds.IsaRuns(wanted, tmp_path_factory.mktemp("isa-runs"))
