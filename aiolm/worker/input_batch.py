"""The persistent batch: requests keep their rows across steps.

Each step the worker applies the scheduler's diff (drop finished, add new, append
tokens and blocks to running rows) instead of rebuilding the batch, then builds the
flat inputs of the step with vectorised numpy over preallocated buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aiolm.core.step import SchedulerOutput
from aiolm.params import SamplingParams


@dataclass
class StepInputs:
    """Flat tensors for one forward pass plus which rows sample a token."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, W] (rows in scheduled order)
    query_lens: list[int]
    seq_lens_list: list[int]
    req_ids: list[str]  # scheduled requests, in flat-batch order
    rows: np.ndarray  # their rows in the persistent batch
    sample_mask: list[bool]  # True where the step ends the request's known tokens
    # Speculative steps only: per scheduled request, how many of its last positions are
    # drafts (their logits verify them); None when no request has drafts.
    num_drafts: list[int] | None = None


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self.num_rows = 0  # rows [0, num_rows) are in use, no holes after condense()

    def __len__(self) -> int:
        return len(self.row_of)

    # -- applying the diff ---------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self._remove(rid)
        for new in out.scheduled_new_reqs:
            self._remove(new.req_id)  # a resumed request is rebuilt from scratch
            self._add(
                new.req_id,
                new.prompt_token_ids,
                new.output_token_ids,
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
            )
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            row = self.row_of[rid]
            toks = c.new_token_ids[i]
            if toks:
                n = int(self.num_tokens[row])
                self.token_ids[row, n : n + len(toks)] = toks
                self.num_tokens[row] = n + len(toks)
            blocks = c.new_block_ids[i]
            if blocks:
                nb = int(self.num_blocks[row])
                self.block_table[row, nb : nb + len(blocks)] = blocks
                self.num_blocks[row] = nb + len(blocks)
            self.num_computed[row] = c.num_computed_tokens[i]
        self.condense()
        # Drafts go right after the known tokens without being counted as tokens, after
        # condense (which moves only counted tokens); next step's accepted tokens overwrite them.
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            row = self.row_of[rid]
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(drafts)] = drafts

    def _add(
        self,
        rid: str,
        prompt: list[int],
        output: list[int],
        params: SamplingParams,
        blocks: list[int],
        num_computed: int,
    ) -> None:
        row = self.req_ids.index(None) if self.num_rows > len(self.row_of) else self.num_rows
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch full ({self.max_num_reqs} rows)")
        n_p, n_o = len(prompt), len(output)
        self.token_ids[row, :n_p] = prompt
        if n_o:
            self.token_ids[row, n_p : n_p + n_o] = output
        self.num_prompt[row] = n_p
        self.num_tokens[row] = n_p + n_o
        self.num_computed[row] = num_computed
        self.block_table[row, : len(blocks)] = blocks
        self.num_blocks[row] = len(blocks)
        self.req_ids[row] = rid
        self.params[row] = params
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            if n_o and not (params.greedy or params.top_k == 1):
                # Resumed after preemption: replay the one draw per sampled token the
                # sampler already made, so the seeded sequence continues unchanged.
                for _ in range(n_o):
                    torch.rand(1, dtype=torch.float64, generator=gen, device=self.device)
        self.generators[row] = gen
        self.row_of[rid] = row
        self.num_rows = max(self.num_rows, row + 1)

    def _remove(self, rid: str) -> None:
        row = self.row_of.pop(rid, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.params[row] = None
        self.generators[row] = None

    def condense(self) -> None:
        """Move the last rows into holes so rows [0, len) are exactly the live requests."""
        live = len(self.row_of)
        hole = 0
        last = self.num_rows - 1
        while True:
            while hole < live and self.req_ids[hole] is not None:
                hole += 1
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            if hole >= live or last < live:
                break
            self._move(last, hole)
        self.num_rows = live

    def _move(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for arr in (self.num_tokens, self.num_prompt, self.num_computed, self.num_blocks):
            arr[dst] = arr[src]
        rid = self.req_ids[src]
        assert rid is not None
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.params[dst], self.params[src] = self.params[src], None
        self.generators[dst], self.generators[src] = self.generators[src], None
        self.row_of[rid] = dst

    # -- building the step ---------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, device: torch.device) -> StepInputs:
        sched = out.num_scheduled_tokens
        rows = np.array(sorted(self.row_of[r] for r in sched), dtype=np.int64)
        req_ids = [self.req_ids[r] for r in rows]
        q = np.array([sched[r] for r in req_ids], dtype=np.int64)  # type: ignore[index]
        start = self.num_computed[rows]
        seq = start + q
        total = int(q.sum())
        # position of every token: concatenated aranges start[i] .. seq[i]-1
        offsets = np.repeat(np.cumsum(q) - q, q)
        pos = np.repeat(start, q) + (np.arange(total) - offsets)
        row_rep = np.repeat(rows, q)
        ids = self.token_ids[row_rep, pos]
        blk = self.block_table[row_rep, pos // self.block_size]
        slots = blk * self.block_size + pos % self.block_size
        width = max(1, int(((seq.max() if len(seq) else 1) + self.block_size - 1) // self.block_size))
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        sample = (seq >= self.num_tokens[rows]).tolist()
        spec = out.scheduled_spec_decode_tokens
        num_drafts = [len(spec.get(r, ())) for r in req_ids] if spec else None  # type: ignore[arg-type]

        pin = device.type == "cuda"  # page-locked staging: the copy to the GPU does not block the host

        def t(a: np.ndarray) -> torch.Tensor:
            host = torch.from_numpy(np.ascontiguousarray(a))
            return (host.pin_memory() if pin else host).to(device, non_blocking=True)

        return StepInputs(
            input_ids=t(ids),
            positions=t(pos),
            slot_mapping=t(slots),
            query_start_loc=t(qsl),
            seq_lens=t(seq),
            block_table=t(self.block_table[rows, :width]),
            query_lens=q.tolist(),
            seq_lens_list=seq.tolist(),
            req_ids=req_ids,  # type: ignore[arg-type]
            rows=rows,
            sample_mask=sample,
            num_drafts=num_drafts,
        )

    def append_sampled(self, rows: list[int], tokens: list[int]) -> None:
        """Overlap scheduling: the engine schedules the next step before it has these
        tokens, so the worker appends what it sampled and the next step reads them from here.
        A row already at ``max_model_len`` is ending (the context is full): nothing to store."""
        r = np.asarray(rows, dtype=np.int64)
        n = self.num_tokens[r]
        room = n < self.max_model_len
        toks = np.asarray(tokens, dtype=np.int64)
        if not room.all():
            r, n, toks = r[room], n[room], toks[room]
        self.token_ids[r, n] = toks
        self.num_tokens[r] = n + 1

    def output_tokens(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt[row] : self.num_tokens[row]]

    def prompt_tokens(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_prompt[row]]
