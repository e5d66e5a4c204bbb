"""CUDA graphs for decode steps: which batch sizes are captured, how a step is padded, when not to.

A decode step launches a few hundred small kernels; on a GPU the launches, not the maths,
set its time. A CUDA graph records one step's launches for a fixed batch size and replays
them in one call. So:

- Sizes 1, 2, 4, 8, then every multiple of 8 up to ``max_cudagraph_size`` (or
  ``max_num_seqs`` when smaller, which then is captured too) are captured, largest first,
  into one memory pool: a smaller graph reuses the larger one's memory, since replays never
  overlap.
- A decode step of n rows replays the smallest captured size B >= n. Rows n..B-1 are
  padding: slot -1 (the KV-cache write skips it, so no real page is touched), seq_len 0
  (attention reads nothing), an all-null block table row, token 0 at position 0. Only the
  first n output rows are handed back, so padding never reaches the sampler.
- A step runs eagerly when it has any prefill token (a graph's shapes are fixed by the
  number of rows, and prefill chunks vary in length), when it has more rows than the
  largest size, or when ``enforce_eager`` is set.

Inputs enter a graph only through persistent buffers filled by ``copy_``; the attention
metadata of size B is built once over views of them. Its host lists (``query_lens_cpu``,
``seq_lens_cpu``) are frozen at capture, so they say the worst case: one query token and
``max_model_len`` keys per row. The attention backend must take slot -1 and seq_len 0 as
"nothing" (aiolm/attention/triton_backend.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aiolm.attention.metadata import AttentionMetadata

DEFAULT_MAX_CUDAGRAPH_SIZE = 256

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, max_cudagraph_size: int = DEFAULT_MAX_CUDAGRAPH_SIZE) -> list[int]:
    """Ascending batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to the limit, the limit included."""
    if max_num_seqs < 1 or max_cudagraph_size < 1:
        raise ValueError(
            f"max_num_seqs ({max_num_seqs}) and max_cudagraph_size ({max_cudagraph_size}) must be at least 1"
        )
    limit = min(max_num_seqs, max_cudagraph_size)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit + 1, 8))
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_rows``; None above the largest."""
    for s in sizes:
        if s >= num_rows:
            return s
    return None


@dataclass(frozen=True)
class GraphDecision:
    """How one step runs: replay the graph of ``size``, or eagerly (size None) for ``reason``."""

    size: int | None
    reason: str

    @property
    def eager(self) -> bool:
        return self.size is None


def plan_step(num_reqs: int, num_tokens: int, sizes: list[int], enforce_eager: bool = False) -> GraphDecision:
    """A step is a pure decode step when every request brings exactly one token."""
    if enforce_eager:
        return GraphDecision(None, "enforce_eager")
    if num_reqs == 0:
        return GraphDecision(None, "empty step")
    if num_tokens != num_reqs:
        return GraphDecision(None, "prefill tokens in the step")
    size = padded_size(num_reqs, sizes)
    if size is None:
        return GraphDecision(None, f"{num_reqs} rows, more than the largest graph ({sizes[-1]})")
    return GraphDecision(size, "decode")


class DecodeBuffers:
    """The persistent inputs of every captured size: int32 metadata, as the kernels want it."""

    def __init__(
        self, max_size: int, max_blocks_per_seq: int, block_size: int, max_model_len: int, device: torch.device | str
    ) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), -1, **i32)
        self.seq_lens = torch.zeros(max_size, **i32)
        self.query_start_loc = torch.arange(max_size + 1, **i32)  # one token per row, always
        self.block_table = torch.zeros(max_size, max_blocks_per_seq, **i32)
        self.block_size = block_size
        self.max_model_len = max_model_len

    def meta(self, size: int) -> AttentionMetadata:
        """Metadata of a ``size``-row step over views of the buffers (host lists: the worst case)."""
        return AttentionMetadata(
            num_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            block_size=self.block_size,
        )

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a decode step of n <= size rows in; rows n..size-1 become padding."""
        n = input_ids.shape[0]
        if n > size or meta.num_reqs != n or meta.num_tokens != n:
            raise ValueError(
                f"a decode step of {n} rows ({meta.num_reqs} requests, {meta.num_tokens} "
                f"tokens) does not fit a graph of {size}"
            )
        width = meta.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"block table of {width} pages, wider than the {self.block_table.shape[1]} captured")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # pages past a row's seq_len are never read, so stale ids beyond `width` are harmless
        self.block_table[:n, :width].copy_(meta.block_table)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].zero_()
        self.block_table[n:size].zero_()


class CudaGraphRunner:
    """Captures ``forward`` (input_ids, positions, metadata -> hidden rows) per size and
    replays it on padded decode steps.

    Without :meth:`capture` (on a CPU, or to debug a graph), :meth:`run` calls ``forward``
    on the same padded buffers eagerly, so the padding is exercised everywhere. The tensor
    :meth:`run` returns is a view of a persistent buffer: valid until the next run."""

    def __init__(
        self,
        forward: Forward,
        sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        device: torch.device | str,
    ) -> None:
        self.forward = forward
        self.sizes = sorted(sizes)
        self.device = torch.device(device)
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks_per_seq, block_size, max_model_len, device)
        self._metas = {s: self.buffers.meta(s) for s in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.output: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        return self.forward(b.input_ids[:size], b.positions[:size], self._metas[size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one pool. The buffers hold all-padding
        rows meanwhile (slot -1), so capturing writes nothing into the KV cache."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        b = self.buffers
        b.slot_mapping.fill_(-1)
        b.seq_lens.zero_()
        pool = None
        for size in reversed(self.sizes):
            out = self._forward(size)  # warm-up: compiles kernels and sets up library workspaces
            if self.output is None:
                self.output = torch.empty((self.sizes[-1], *out.shape[1:]), dtype=out.dtype, device=self.device)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.output[:size] = self._forward(size)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden rows of the n real rows only; ``size`` from :func:`plan_step`."""
        n = input_ids.shape[0]
        self.buffers.fill(size, input_ids, positions, meta)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        assert self.output is not None
        return self.output[:n]
