"""Inter-process plumbing between the engine and its worker processes.

``ShmRing``: a one-writer, N-reader shared-memory ring (engine -> workers
broadcast, worker -> engine responses) with an asyncio-friendly reader.
``codec``: bytes for SchedulerOutput, ModelRunnerOutput and RPC calls.
``lifeline``: helpers that tie a worker's life to its parent's.
"""

from aiolm.ipc.codec import RpcCall, decode, decode_rpc, encode, encode_rpc
from aiolm.ipc.lifeline import exit_on_signals, parent_alive, set_parent_death_signal
from aiolm.ipc.shm_ring import PeerDied, RingClosed, RingHandle, ShmRing

__all__ = [
    "PeerDied",
    "RingClosed",
    "RingHandle",
    "RpcCall",
    "ShmRing",
    "decode",
    "decode_rpc",
    "encode",
    "encode_rpc",
    "exit_on_signals",
    "parent_alive",
    "set_parent_death_signal",
]
