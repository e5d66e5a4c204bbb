"""``--kv-transfer-config``: which connector, in which role, with what room.

Spelled as vLLM spells it, one JSON object::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"cpu_bytes": 1073741824,
                                   "disk_path": "/var/cache/aiolm-kv", "disk_bytes": 10737418240}}
    {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_ip": "10.0.0.5", "kv_port": 14579}

Every key is checked here, so a typo or a field this connector does not implement is an
error naming it, never a setting silently ignored. Pure Python: read by the engine
process, and pickled to the workers inside their RunnerConfig.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

CONNECTORS = ("OffloadingConnector", "TcpConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
_TOP_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_ip", "kv_port"}
_EXTRA_KEYS = {
    "OffloadingConnector": {"num_cpu_blocks", "cpu_bytes", "disk_path", "disk_bytes"},
    "TcpConnector": {"lease_seconds", "transfer_timeout", "shared_memory"},
}


@dataclass(frozen=True)
class KVTransferConfig:
    """A parsed ``--kv-transfer-config``.

    Offloading sizes: the host tier holds ``num_cpu_blocks`` blocks, or as many as fit in
    ``cpu_bytes`` (per rank); the disk tier, present when ``disk_path`` is given, holds at
    most ``disk_bytes`` of block files (per rank, file headers included).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    num_cpu_blocks: int | None = None
    cpu_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0
    # TcpConnector: where a producer's rank r serves its KV (kv_port + r), a name for the
    # instance, how long a finished prompt's blocks wait for their consumer, and how long a
    # consumer waits on a silent producer before it computes the prompt itself.
    engine_id: str = ""
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    lease_seconds: float = 120.0
    transfer_timeout: float = 30.0
    shared_memory: bool = True  # a consumer fetches through shared memory from a producer on its machine

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def cpu_blocks(self, block_bytes: int) -> int:
        """Blocks the host tier holds, given one block's bytes on a rank."""
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        return self.cpu_bytes // max(1, block_bytes)


def check_disk_path(path: str) -> None:
    """ValueError unless ``path`` is, or can be made, a directory this process writes in (the
    workers find out only once the model is loaded)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.disk_path: cannot use {path!r} as a directory "
            f"({e.strerror or e})"
        ) from None


def parse_kv_transfer_config(text: str | dict[str, Any] | None) -> KVTransferConfig | None:
    """The config a JSON string (or a dict, from Python) asks for; ValueError naming the
    key that is wrong."""
    if text is None or text == "":
        return None
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config: not valid JSON ({e.msg} at position {e.pos})") from None
    else:
        raw = text
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_config: must be a JSON object")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ValueError(
            f"kv_transfer_config: {', '.join(unknown)} not supported; supported keys: {', '.join(sorted(_TOP_KEYS))}"
        )
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector: {connector!r} is not supported; supported: {CONNECTORS}")
    role = raw.get("kv_role", "kv_both")
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config.kv_role: {role!r} is not one of {', '.join(ROLES)}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config: must be a JSON object")
    allowed = _EXTRA_KEYS[connector]
    unknown = sorted(set(extra) - allowed)
    if unknown:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config: {', '.join(unknown)} not supported by "
            f"{connector}; supported: {', '.join(sorted(allowed))}"
        )
    if connector == "TcpConnector":
        return _tcp_config(raw, role, extra)
    for key in ("kv_ip", "kv_port", "engine_id"):
        if key in raw:
            raise ValueError(f"kv_transfer_config: {key} not supported by {connector}")
    if role != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role: {connector} stores and loads, so its role is kv_both")
    for key in ("num_cpu_blocks", "cpu_bytes", "disk_bytes"):
        value = extra.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key}: must be an integer >= 0")
    disk_path = extra.get("disk_path")
    if disk_path is not None and (not isinstance(disk_path, str) or not disk_path):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.disk_path: must be a directory path")
    if disk_path is not None and not extra.get("disk_bytes"):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.disk_bytes: needed with disk_path (its cap)")
    if disk_path is None and "disk_bytes" in extra:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.disk_bytes: caps a disk tier; give disk_path")
    if "num_cpu_blocks" in extra and "cpu_bytes" in extra:
        raise ValueError("kv_transfer_config.kv_connector_extra_config: give num_cpu_blocks or cpu_bytes, not both")
    cfg = KVTransferConfig(
        kv_connector=connector,
        kv_role=role,
        num_cpu_blocks=extra.get("num_cpu_blocks"),
        cpu_bytes=extra.get("cpu_bytes", 0),
        disk_path=disk_path,
        disk_bytes=extra.get("disk_bytes", 0),
    )
    if not cfg.disk_path and not (cfg.num_cpu_blocks or cfg.cpu_bytes):
        raise ValueError(
            "kv_transfer_config.kv_connector_extra_config: OffloadingConnector needs room: "
            "num_cpu_blocks or cpu_bytes (host memory), and/or disk_path with disk_bytes"
        )
    return cfg


def _tcp_config(raw: dict[str, Any], role: str, extra: dict[str, Any]) -> KVTransferConfig:
    if role == "kv_consumer":  # it serves nothing: a producer's address comes with each request
        for key in ("kv_ip", "kv_port", "lease_seconds"):
            if key in raw or key in extra:
                raise ValueError(f"kv_transfer_config: {key} is a producer's; a kv_consumer serves no KV")
    ip = raw.get("kv_ip", "127.0.0.1")
    port = raw.get("kv_port", 14579)
    engine_id = raw.get("engine_id") or ""
    if not isinstance(ip, str) or not ip:
        raise ValueError("kv_transfer_config.kv_ip: must be a host name or address")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError("kv_transfer_config.kv_port: must be a port number (1-65535)")
    if not isinstance(engine_id, str):
        raise ValueError("kv_transfer_config.engine_id: must be a string")
    shared = extra.get("shared_memory", True)
    if not isinstance(shared, bool):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_memory: must be true or false")
    times = {}
    for key, default in (("lease_seconds", 120.0), ("transfer_timeout", 30.0)):
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config.{key}: must be a positive number of seconds"
            )
        times[key] = float(value)
    return KVTransferConfig(
        kv_connector="TcpConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_ip=ip,
        kv_port=port,
        lease_seconds=times["lease_seconds"],
        transfer_timeout=times["transfer_timeout"],
        shared_memory=shared,
    )
