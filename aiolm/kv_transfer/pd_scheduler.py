"""The TcpConnector's scheduler side: prefill/decode disaggregation between instances.

Producer (``kv_producer`` or ``kv_both``): a request with ``do_remote_decode`` runs as
usual (the proxy asks it for one token); when it finishes, its blocks are not freed but
leased under a transfer id, the workers are told to serve them, and the answer's
``kv_transfer_params`` say where they are. The lease ends when every rank reports the
blocks sent (ModelRunnerOutput.kv_sent) or after ``lease_seconds`` (a consumer that
never came).

Consumer (``kv_consumer`` or ``kv_both``): a request with ``do_remote_prefill`` loads its
prompt's blocks, all but the last token's position, past any local prefix hit, from the
producer's rank r into its own rank r; it waits for them outside the batch, then
computes only the last prompt token and decodes. A load that fails (the producer died,
a frame failed its checksum, the layouts differ) brings nothing and the request
computes its prompt itself; it is never tried again.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiolm.core.request import Request, RequestStatus
from aiolm.core.step import KVTransferOps
from aiolm.kv_transfer.base import ConnectorScheduler
from aiolm.kv_transfer.config import KVTransferConfig
from aiolm.kv_transfer.params import wants_remote_decode, wants_remote_prefill

log = logging.getLogger(__name__)

_SETTLED_KEPT = 4096  # transfer ids remembered as fetched or released (a request's come within its life)


class PDScheduler(ConnectorScheduler):
    def __init__(self, cfg: KVTransferConfig, tp_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_size = tp_size
        self.engine_id = cfg.engine_id or uuid.uuid4().hex[:12]
        self.sends: dict[str, float] = {}  # transfer id -> when its lease ends (time.monotonic)
        # transfers fetched or released, never tried again, the oldest forgotten first: a
        # failed fetch is not retried, and n > 1 siblings share their parent's transfer,
        # which its fetch or release has already ended
        self._settled: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- consumer ------------------------------------------------------------------

    def num_external_blocks(self, request: Request, start: int, limit: int) -> int:
        params = request.sampling_params.kv_transfer_params
        if not self.cfg.consumes or not wants_remote_prefill(params):
            return 0
        assert params is not None
        if params["remote_request_id"] in self._settled:
            return 0
        return max(0, min(limit, len(params["remote_block_ids"])) - start)

    def start_load(self, load_id: int, request: Request, start: int, block_ids: Sequence[int]) -> None:
        params = request.sampling_params.kv_transfer_params
        assert params is not None
        self._settle(params["remote_request_id"])
        ops = self._ops
        ops.load_ids.append(load_id)
        ops.load_req_ids.append(request.req_id)
        ops.load_hashes.append([])
        ops.load_block_ids.append(list(block_ids))
        ops.load_sources.append(f"{params['remote_host']}:{params['remote_port']}")
        ops.load_transfer_ids.append(params["remote_request_id"])
        ops.load_remote_block_ids.append(list(params["remote_block_ids"][start : start + len(block_ids)]))

    def loaded(self, request: Request, start: int, asked: int, intact: int) -> None:
        self.stats.loaded_blocks += intact
        if intact < asked:
            self.stats.failed_loads += 1
            self.stats.failed_blocks += asked - intact
            log.warning(
                "request %s: its KV did not arrive from the prefill instance; it computes its prompt", request.req_id
            )

    def skip_load(self, request: Request) -> None:
        """A local prefix hit holds all the producer kept: it is told so, and frees it now."""
        self._release(request)

    def forget(self, request: Request) -> None:
        self._release(request)  # it never fetched: aborted while waiting, or prompt logprobs

    def _release(self, request: Request) -> None:
        params = request.sampling_params.kv_transfer_params
        if not self.cfg.consumes or not wants_remote_prefill(params):
            return
        assert params is not None
        transfer_id = params["remote_request_id"]
        if transfer_id in self._settled:
            return
        self._settle(transfer_id)
        self._ops.release_sources.append(f"{params['remote_host']}:{params['remote_port']}")
        self._ops.release_transfer_ids.append(transfer_id)

    def _settle(self, transfer_id: str) -> None:
        self._settled[transfer_id] = None
        while len(self._settled) > _SETTLED_KEPT:
            self._settled.popitem(last=False)

    # -- producer ------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        params = request.sampling_params.kv_transfer_params
        if (
            not self.cfg.produces
            or not wants_remote_decode(params)
            or request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            or not block_ids
        ):
            return None
        transfer_id = f"{self.engine_id}-{uuid.uuid4().hex}"
        self.sends[transfer_id] = time.monotonic() + self.cfg.lease_seconds
        self._ops.serve_ids.append(transfer_id)
        self._ops.serve_block_ids.append(list(block_ids))
        self.stats.saved_blocks += len(block_ids)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.cfg.kv_ip,
            "remote_port": self.cfg.kv_port,
            "remote_block_ids": list(block_ids),
            "remote_request_id": transfer_id,
            "tp_size": self.tp_size,
        }

    def sent(self, transfer_ids: Sequence[str]) -> list[str]:
        """The transfers every rank has sent whose leases end now."""
        done = [t for t in transfer_ids if self.sends.pop(t, None) is not None]
        self._ops.unserve_ids.extend(done)
        return done

    def expired(self, now: float) -> list[str]:
        """Transfers no consumer fetched in time: the workers stop serving them, and their
        leases end now."""
        gone = [t for t, deadline in self.sends.items() if deadline <= now]
        for t in gone:
            del self.sends[t]
            log.warning("transfer %s: no decode instance fetched it within %.0f s", t, self.cfg.lease_seconds)
        self._ops.unserve_ids.extend(gone)
        return gone

    @property
    def pending(self) -> bool:
        # a release still to send keeps the engine stepping: an idle consumer held it for good
        return bool(self.sends) or bool(self._ops.release_transfer_ids)

    # -- common ---------------------------------------------------------------------

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        pass  # nothing is kept past the pool

    def reset(self) -> None:
        self.sends.clear()  # their blocks went with the old pool; the new workers serve nothing
        self._ops = KVTransferOps()
