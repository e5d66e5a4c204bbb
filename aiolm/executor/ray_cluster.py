"""Joining a Ray cluster, or starting a local one, once per process.

``--ray-address`` (or ``RAY_ADDRESS``) joins an existing cluster (``ray start --head``
on one machine, ``ray start --address=...`` on the others). Without either, a private
local cluster starts with this process (``address="local"``, so a cluster someone
else started on the machine is never joined by accident): explicit CPU count, a small
object store (the executor sends only small messages through Ray), no dashboard, and
no memory monitor killing workers.
Ray stops a cluster it started when this process exits; ``shutdown()`` stops it earlier.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

# Bytes of the local cluster's object store: steps travel inline in task arguments
# (Ray inlines arguments under 100 KiB), so little is ever stored there.
OBJECT_STORE_ENV = "AIOLM_RAY_OBJECT_STORE_BYTES"
DEFAULT_OBJECT_STORE = 200 << 20
NUM_CPUS_ENV = "AIOLM_RAY_NUM_CPUS"

_lock = threading.Lock()
_release: threading.Event | None = None  # set by shutdown(): the keeper thread may end


def connect(address: str | None, min_cpus: int) -> None:
    """Make sure this process is connected to a Ray cluster (blocking: run it off the loop).

    ``min_cpus``: the CPUs the local cluster must offer (one per rank and replica), even
    where the machine has fewer cores; Ray's CPU counts are placement units, not cores.
    """
    import ray

    with _lock:
        if ray.is_initialized():
            return
        address = address or os.environ.get("RAY_ADDRESS") or None
        if address:
            log.info("joining the Ray cluster at %s", address)
            _init_in_keeper(dict(address=address, log_to_driver=True))
            return
        # Ray's memory monitor kills workers once the machine is 95% full, whoever fills it;
        # an engine's ranks size their KV cache up front, and losing one to another
        # program's growth would only cost a restart. A user's setting wins.
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        num_cpus = max(os.cpu_count() or 1, min_cpus, int(os.environ.get(NUM_CPUS_ENV, "0") or 0))
        store = int(os.environ.get(OBJECT_STORE_ENV, DEFAULT_OBJECT_STORE))
        log.info("starting a local Ray cluster: %d CPUs, %d MiB object store", num_cpus, store >> 20)
        _init_in_keeper(
            dict(
                address="local",
                num_cpus=num_cpus,
                object_store_memory=store,
                include_dashboard=False,
                log_to_driver=True,
            )
        )


def _init_in_keeper(kwargs: dict) -> None:
    """``ray.init`` on a thread that lives until ``shutdown()``.

    Ray starts its GCS and raylet with PR_SET_PDEATHSIG, which Linux ties to the
    starting *thread*: started from a pool thread (``asyncio.to_thread``) they would be
    killed as soon as that pool shuts down, and the driver would exit a minute later.
    """
    import ray

    global _release
    release = threading.Event()
    failed: list[BaseException] = []
    ready = threading.Event()

    def keep() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as e:  # handed to the caller below
            failed.append(e)
            return
        finally:
            ready.set()
        release.wait()

    threading.Thread(target=keep, name="aiolm-ray-keeper", daemon=True).start()
    ready.wait()
    if failed:
        raise failed[0]
    _release = release


def shutdown() -> None:
    """Disconnect (and stop the local cluster if this process started it)."""
    import ray

    global _release
    with _lock:
        if ray.is_initialized():
            ray.shutdown()
        if _release is not None:
            _release.set()
            _release = None
