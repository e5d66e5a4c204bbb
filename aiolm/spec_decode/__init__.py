"""Speculative decoding: draft proposers and the acceptance bookkeeping.

Pure Python (no torch): the n-gram proposer runs in the engine process inside
``Scheduler.schedule`` on the request's own token list, so drafts cost no IPC
and no worker time; verification happens on the worker
(``aiolm/sample/rejection.py``).
"""

from aiolm.spec_decode.config import SpecConfig, supports_speculation
from aiolm.spec_decode.ngram import NgramProposer
from aiolm.spec_decode.stats import AcceptanceWindow, SpecDecodeStats

__all__ = ["AcceptanceWindow", "NgramProposer", "SpecConfig", "SpecDecodeStats", "supports_speculation"]
