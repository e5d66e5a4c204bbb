"""The two halves of a KV connector and what the scheduler and model runner call.

Scheduler side (engine process, pure Python), called by aiolm/core/scheduler.py:

* ``num_external_blocks``: at admission, after the local prefix-cache hit, how many
  further blocks of the request can be loaded from outside (the last may be partly
  filled: its loaded part up to the prompt's second-to-last token is used).
* ``start_load``: the request got blocks for them; the connector asks its workers to
  fill them. The request then waits (WAITING_FOR_REMOTE_KVS), holding its blocks but
  outside the running batch, until ModelRunnerOutput.kv_loaded reports the load; other
  requests step meanwhile. Its blocks are never freed before that report, even when it
  is aborted (the scheduler keeps them on a lease), because a worker may still write them.
* ``on_evict``: the block pool is about to reuse a block that caches a prefix.
* ``loaded``: how a load ended (blocks past the first bad one are recomputed).
* ``take_ops``: the step's KVTransferOps for the workers.
* ``reset``: the workers were replaced; nothing they held survives.
* ``request_finished``, ``sent``, ``expired``, ``pending``: a request whose KV another
  instance will read keeps its blocks, leased, until they are sent or the lease ends.

Worker side (one per rank, holds tensors), called by aiolm/worker/model_runner.py:
``begin_step`` before the step's forward pass (saves, drops, starting loads, and
copying loads into their blocks), ``finished_loads`` and ``finished_sends`` for the
reply, and ``close``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiolm.core.request import Request
from aiolm.core.step import KVTransferOps, SchedulerOutput


@dataclass
class ConnectorStats:
    """Counted over the engine's life, in blocks but for the ``_tokens`` fields. As vLLM's
    external prefix-cache counters, the token fields leave out requests resumed after a
    preemption: their lookups are recomputation, not traffic."""

    saved_blocks: int = 0  # blocks kept past their request: evicted ones a tier took, or served to a consumer
    loaded_blocks: int = 0  # blocks that came back intact
    queried_tokens: int = 0  # prompt tokens past the local prefix cache that admitted requests asked about
    loaded_tokens: int = 0  # prompt tokens they hold that were not computed here
    failed_loads: int = 0  # loads cut short by a block missing or corrupt on some rank
    failed_blocks: int = 0  # blocks such loads did not bring (that block and those after it): recomputed
    dropped_blocks: int = 0  # pushed out of the last tier by its cap


class ConnectorScheduler(abc.ABC):
    def __init__(self) -> None:
        self.stats = ConnectorStats()
        self._ops = KVTransferOps()  # what the step being scheduled asks of the workers

    def take_ops(self) -> KVTransferOps | None:
        """What the workers do at the start of the step being built (None: nothing)."""
        ops = self._ops
        if not ops:
            return None
        self._ops = KVTransferOps()
        return ops

    @abc.abstractmethod
    def num_external_blocks(self, request: Request, start: int, limit: int) -> int:
        """How many of ``request.block_hashes[start:limit]``, from the first, can be loaded."""

    @abc.abstractmethod
    def start_load(self, load_id: int, request: Request, start: int, block_ids: Sequence[int]) -> None:
        """Fill ``block_ids`` with the request's blocks ``start, start + 1, ...``; the
        workers report it under ``load_id``."""

    @abc.abstractmethod
    def loaded(self, request: Request, start: int, asked: int, intact: int) -> None:
        """A load of ``asked`` blocks from ``start`` ended with ``intact`` good ones."""

    @abc.abstractmethod
    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool reuses ``block_id``, which caches ``block_hash``, in the step being scheduled."""

    @abc.abstractmethod
    def reset(self) -> None:
        """The workers were replaced: forget what only they held."""

    def request_finished(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        """A request finished holding ``block_ids``: None to free them as usual, or the
        ``kv_transfer_params`` of its answer, its blocks then leased until ``sent`` or
        ``expired`` names the transfer."""
        return None

    def sent(self, transfer_ids: Sequence[str]) -> list[str]:
        """Of the transfers the workers report sent, those whose leases end now."""
        return []

    def expired(self, now: float) -> list[str]:
        """Transfers whose leases ran out by ``now`` (``time.monotonic``)."""
        return []

    @property
    def pending(self) -> bool:
        """Whether the engine must keep stepping for the connector (a transfer in flight)."""
        return False

    def forget(self, request: Request) -> None:  # noqa: B027 (most connectors keep nothing per request)
        """The request is finished: drop what was kept about it."""

    def skip_load(self, request: Request) -> None:  # noqa: B027 (only a consumer of another instance acts)
        """The request was asked about and has nothing to load (``num_external_blocks`` 0)."""


class ConnectorWorker(abc.ABC):
    @abc.abstractmethod
    def begin_step(self, step: SchedulerOutput, idle: bool = False) -> None:
        """Before the step's forward: put the loads every rank has finished into their
        blocks (a load is reported only once it is there) and carry out ``step.kv_ops``.
        ``idle``: the step runs nothing, so it may wait a little for a transfer."""

    @abc.abstractmethod
    def finished_loads(self) -> dict[int, int]:
        """Loads copied into their blocks since the last call: load id -> intact blocks
        from the first."""

    def finished_sends(self) -> list[str]:
        """Transfers every rank has sent since the last call."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Finish pending writes and stop background threads."""
