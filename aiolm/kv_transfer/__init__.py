"""The KV connector: KV cache blocks that come from, or go to, somewhere other than
this engine's block pool.

A connector has two halves, as in vLLM v1: a scheduler side (``base.ConnectorScheduler``,
pure Python, in the engine process) that decides which blocks move and says so in each
step's ``KVTransferOps``, and a worker side (``base.ConnectorWorker``, one per rank,
holding tensors) that moves them and reports what arrived. The OffloadingConnector
(``offload_*.py``) keeps blocks the prefix cache evicts in host memory and on disk and
brings them back on a later hit; the TcpConnector (``pd_*.py``, ``wire.py``) moves a
prompt's KV from a prefill instance to a decode instance.
"""

from aiolm.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["KVTransferConfig", "parse_kv_transfer_config"]
