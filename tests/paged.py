"""Test helper: drive a model over a paged KV cache with plain lists, no engine."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from aiolm.attention.metadata import AttentionMetadata
from aiolm.attention.torch_backend import kv_cache_shape


class PagedHarness:
    """Owns a KV cache and hands out blocks sequentially; enough to test model maths."""

    def __init__(
        self,
        model,
        num_blocks: int = 256,
        block_size: int = 16,
        dtype=torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        shape = kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.next_block = 1  # block 0 is the null block
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _ensure(self, seq: int, length: int) -> list[int]:
        blocks = self.blocks.setdefault(seq, [])
        while len(blocks) * self.block_size < length:
            blocks.append(self.next_block)
            self.next_block += 1
        return blocks

    def step(self, chunks: dict[int, list[int]], every: bool = False) -> dict[int, torch.Tensor]:
        """Run one flat batch: seq id -> new token ids. Returns seq id -> last-token logits
        (``every``: the logits after each new token, [tokens, vocab])."""
        ids, pos, meta = self._batch(chunks)
        hidden = self.model(ids, pos, self.caches, meta)
        if every:
            logits = self.model.compute_logits(hidden).float().cpu()
            starts = meta.query_start_loc.tolist()
            return {seq: logits[starts[i] : starts[i + 1]] for i, seq in enumerate(chunks)}
        last = meta.query_start_loc[1:] - 1
        logits = self.model.compute_logits(hidden[last]).float()
        return {seq: logits[i].cpu() for i, seq in enumerate(chunks)}

    def sampled_tokens(self, chunks: dict[int, list[int]], sampling=None) -> torch.Tensor | None:
        """A decode step (one new token a sequence) through the model's ``sampled_tokens``:
        each sequence's token (its argmax, or drawn with the SamplingMetadata ``sampling``),
        or None where the model does not take the step."""
        ids, pos, meta = self._batch(chunks)
        return self.model.sampled_tokens(ids, pos, self.caches, meta, sampling)

    def _batch(self, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The flat batch's token ids, positions and attention metadata, blocks given out."""
        ids, pos, qlens, slens, tables = [], [], [], [], []
        for seq, toks in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            ids += toks
            pos += list(range(start, end))
            qlens.append(len(toks))
            slens.append(end)
            tables.append(self._ensure(seq, end))
            self.lens[seq] = end
        meta = AttentionMetadata.build(qlens, slens, tables, self.block_size, self.device)
        return torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), meta

    def greedy(self, prompts: list[list[int]], max_new: int, split: int | None = None) -> list[list[int]]:
        """Greedy-decode all prompts together; ``split`` prefills in two passes."""
        outs: list[list[int]] = [[] for _ in prompts]
        if split:
            assert all(len(p) > split for p in prompts), "a prompt of `split` tokens would have no second pass"
            self.step({i: p[:split] for i, p in enumerate(prompts)})
            logits = self.step({i: p[split:] for i, p in enumerate(prompts)})
        else:
            logits = self.step({i: p for i, p in enumerate(prompts)})
        for _ in range(max_new):
            nxt = {i: [int(logits[i].argmax())] for i in logits}
            for i, t in nxt.items():
                outs[i].append(t[0])
            if len(outs[0]) == max_new:
                break
            logits = self.step(nxt)
        return outs


def check_sample_call(model, prompts: dict[int, list[int]], steps: int, params=None, **harness) -> None:
    """model.sampled_tokens (a decode step ending in one call) against forward, compute_logits
    and the sampler on a twin cache: the same int64 tokens step after step, and the same
    logits from the caches the two ways wrote. ``params``: per prompt, SamplingParams (a
    seeded one gets a generator of its seed on each side, the rest share one seeded default);
    None: every row greedy, through the call's argmax. ``harness``: PagedHarness's arguments."""
    from aiolm.kernels.sampling_ops import argmax_rows
    from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator

    def metadata():
        gens = [None if p.seed is None else make_generator(p.seed) for p in params]
        empty = [[] for _ in params]
        return SamplingMetadata.build(params, empty, empty, model.config.vocab_size, "cpu", gens, make_generator(0))

    ref, fused = PagedHarness(model, **harness), PagedHarness(model, **harness)
    ref_meta, fused_meta = (None, None) if params is None else (metadata(), metadata())
    logits = ref.step(prompts)
    fused.step(prompts)
    nxt = {i: [int(logits[i].argmax())] for i in prompts}
    off_argmax = 0
    for _ in range(steps):
        logits = ref.step(nxt)
        rows = torch.stack([logits[i] for i in nxt])
        want = (argmax_rows(rows) if ref_meta is None else Sampler()(rows, ref_meta).sampled).tolist()
        got = fused.sampled_tokens(nxt, fused_meta)
        assert got is not None, "the one call should take a decode step of this size"
        assert got.dtype == torch.int64 and got.tolist() == want
        off_argmax += sum(t != int(logits[i].argmax()) for i, t in zip(nxt, want))
        nxt = {i: [t] for i, t in zip(nxt, want)}
    if params is not None and any(not p.greedy for p in params):
        assert off_argmax, "the random rows should not all have taken their argmax"
    after_ref, after_fused = ref.step(nxt), fused.step(nxt)  # the caches the calls wrote agree
    for i in nxt:
        assert torch.equal(after_ref[i], after_fused[i])


def hf_greedy(model, prompt_ids: list[int], max_new: int, device: str = "cpu") -> list[int]:
    """A plain greedy loop with an explicit all-ones mask (pad id == eos id in SmolLM2);
    ``device``: where ``model`` is."""
    ids = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new):
            res = model(
                ids if past is None else ids[:, -1:],
                attention_mask=torch.ones_like(ids),
                past_key_values=past,
                use_cache=True,
            )
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def hf_from_gguf(path: Path):
    """transformers' own model read from a GGUF file, float32, in eval mode.

    transformers parses the file's metadata twice (for the config, then the weights) and
    builds the same tensor-name map once per module; both are pure functions of their
    arguments, so they are memoized for this one load. The model it builds is unchanged."""
    import gguf
    from transformers import AutoModelForCausalLM

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def quicksort(arr):",
    "Les élèves ont mangé des pommes 🍎 et parlé 日本語 avec",
    "List three colors:\n1.",
]


def parity_prompt_ids(tokenizer) -> list[list[int]]:
    """The parity prompts (English, code, accents, emoji, CJK, a list) and one chat turn, as ids."""
    chat = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are concise."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS + [chat]]
