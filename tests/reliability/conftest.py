"""The reliability suite: real servers on 127.0.0.1, real worker processes, real faults.

Shared helpers live in ``reliability_helpers.py``; the server helpers of
tests/server are reused from there.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "server", HERE.parent / "engine"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
