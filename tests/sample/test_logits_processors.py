"""The logits-processor seam: a processor defined and registered here, outside the
sampler core, changes what the sampler and the model runner pick."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.params import ParamError, SamplingParams
from aiolm.sample import logits_processors
from aiolm.sample.logits_processors import BatchRows, LogitsProcessor
from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator
from aiolm.sample.tensors import long_tensor

sampler = Sampler()


def ban_token(token: int) -> type[LogitsProcessor]:
    """A processor class that forbids ``token`` in every row (inactive if outside the vocab)."""

    class BanToken(LogitsProcessor):
        name = "ban_token"

        @classmethod
        def build(cls, rows: BatchRows) -> BanToken | None:
            return cls() if 0 <= token < rows.vocab_size else None

        def apply(self, logits: torch.Tensor) -> None:
            logits[:, token] = float("-inf")

    return BanToken


class NoImmediateRepeat(LogitsProcessor):
    """Forbids each row's last output token, for rows with a positive presence penalty.

    Per-row state that follows :meth:`advance`: the row's last token, -1 for none.
    """

    name = "no_repeat"

    def __init__(self, rows: torch.Tensor, last: torch.Tensor, active: list[bool]) -> None:
        self.rows, self.last, self.active = rows, last, active

    @classmethod
    def build(cls, rows: BatchRows) -> NoImmediateRepeat | None:
        active = [p.presence_penalty > 0 for p in rows.params]
        if not any(active):
            return None
        last = [o[-1] if o and a else -1 for o, a in zip(rows.output_token_ids, active)]
        return cls(long_tensor(range(len(rows)), rows.device), long_tensor(last, rows.device), active)

    def advance(self, new_token_ids: Sequence[Sequence[int]]) -> None:
        for i, toks in enumerate(new_token_ids):
            if toks and self.active[i]:
                self.last[i] = toks[-1]

    def apply(self, logits: torch.Tensor) -> None:
        has = self.last >= 0
        logits[self.rows[has], self.last[has]] = float("-inf")


def meta(params, outputs=None, vocab=8, registry=None, seed=0):
    n = len(params)
    return SamplingMetadata.build(
        params,
        outputs or [[] for _ in range(n)],
        [[] for _ in range(n)],
        vocab,
        "cpu",
        default_generator=make_generator(seed),
        registry=registry,
    )


def test_registered_processor_bans_a_token_for_greedy_and_random_rows(monkeypatch):
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]]).expand(3000, -1).contiguous()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 1500
    before = sampler(logits, meta(params, vocab=4))
    assert before.sampled[0::2].unique().tolist() == [2]  # control: token 2 is the argmax
    assert 2 in before.sampled[1::2].tolist()

    monkeypatch.setattr(logits_processors, "REGISTRY", [*logits_processors.REGISTRY, ban_token(2)])
    m = meta(params, vocab=4)
    assert m.ban_token is not None and m.penalties is None  # active by name; inactive ones None
    after = sampler(logits, m).sampled
    assert after[0::2].unique().tolist() == [3]  # greedy: the next best
    assert set(after[1::2].unique().tolist()) == {0, 1, 3}  # random: never the banned token
    # A processor that no row uses is left out of the batch entirely.
    assert meta(params, vocab=2).processors == []


def test_registry_order_is_application_order():
    """A bias added after the ban cannot bring the banned token back; before it, it cannot either."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    p = [SamplingParams(temperature=0.0, logit_bias={2: 100.0})]
    reg = logits_processors.REGISTRY
    for order in ([*reg, ban_token(2)], [ban_token(2), *reg]):
        m = meta(p, vocab=4, registry=order)
        assert [type(x).__name__ for x in m.processors] == [
            c.__name__ for c in order if c.__name__ in ("BanToken", "LogitBias")
        ]
        assert sampler(logits, m).sampled.item() == 3


def test_processor_state_follows_advance_and_rebuild():
    logits = torch.tensor([[0.0, 3.0, 5.0, 4.0]]).expand(2, -1).contiguous()
    params = [SamplingParams(temperature=0.0, presence_penalty=0.01), SamplingParams(temperature=0.0)]
    reg = [*logits_processors.REGISTRY, NoImmediateRepeat]
    m = meta(params, vocab=4, registry=reg)
    assert isinstance(m.no_repeat, NoImmediateRepeat)
    picks = []
    for _ in range(4):
        tok = sampler(logits, m).sampled.tolist()
        picks.append(tok)
        m.advance([[t] for t in tok])
    # Row 0 alternates between its top two (the presence penalty of 0.01 never reorders them);
    # row 1 does not use the processor and keeps the argmax.
    assert picks == [[2, 2], [3, 2], [2, 2], [3, 2]]
    # Rebuilt with the rows swapped (the persistent batch moved them): state comes from history.
    m2 = meta(params[::-1], outputs=[[2], [3, 2]], vocab=4, registry=reg)
    assert sampler(logits, m2).sampled.tolist() == [2, 3]


def test_allowed_token_ids_restricts_only_the_rows_that_ask():
    torch.manual_seed(3)
    vocab = 50
    logits = torch.randn(4, vocab) * 3
    allowed = [7, 11, 45, 99]  # 99 is outside the vocabulary: ignored
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
    ]
    out = sampler(logits, meta(params, vocab=vocab)).sampled.tolist()
    assert out[0] == max((7, 11, 45), key=lambda t: logits[0, t].item())
    assert out[1] == logits[1].argmax().item() and out[3] == logits[3].argmax().item()
    draws = sample_rows(logits[2], SamplingParams(allowed_token_ids=allowed), 3000, vocab)
    assert set(draws.unique().tolist()) == {7, 11, 45}
    # Every row constrained takes the in-place path; the same picks.
    assert sampler(logits[:1], meta(params[:1], vocab=vocab)).sampled.tolist() == out[:1]
    # No in-vocabulary id at all: the row is left unconstrained rather than left with nothing.
    p = SamplingParams(temperature=0.0, allowed_token_ids=[vocab, vocab + 1])
    assert meta([p], vocab=vocab).allowed_token_ids is None


def test_allowed_token_ids_are_validated():
    for bad in ([], [-1], ["a"], [1.5], 3):
        with pytest.raises(ParamError) as e:
            SamplingParams(allowed_token_ids=bad)
        assert e.value.param == "allowed_token_ids"


def test_bad_words_forbid_completing_a_sequence_through_advance_and_rebuild():
    logits = torch.tensor([[0.0, 3.0, 4.0, 1.0, 0.0, 5.0]]).expand(2, -1).contiguous()
    words = [[5], [3, 2], [1, 1, 2], [9, 1]]  # [9, 1]: 9 is outside the vocabulary, never matches
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=words), SamplingParams(temperature=0.0)]
    m = meta(params, outputs=[[3], [3]], vocab=6)
    picks = []
    for forced in ([1], [2], [3], [1]):  # what each row "generated" after the pick
        picks.append(sampler(logits, m).sampled.tolist())
        m.advance([forced, forced])
    # 5 is always banned; 2 after a 3, and after 1, 1; row 1 keeps the argmax.
    assert picks == [[1, 5], [2, 5], [2, 5], [1, 5]]
    # Rebuilt from history: the output ends with 1, 1, so 2 is banned.
    assert sampler(logits, meta(params, outputs=[[0, 1, 1], []], vocab=6)).sampled.tolist() == [1, 5]
    draws = sample_rows(logits[0], SamplingParams(bad_words_token_ids=[[5], [2]]), 3000, 6)
    assert 5 not in draws.tolist() and 2 not in draws.tolist() and 1 in draws.tolist()
    with pytest.raises(ParamError) as e:
        SamplingParams(bad_words_token_ids=[[1], []])
    assert e.value.param == "bad_words_token_ids"


def sample_rows(row: torch.Tensor, params: SamplingParams, n: int, vocab: int) -> torch.Tensor:
    logits = row.unsqueeze(0).expand(n, -1).contiguous()
    return sampler(logits, meta([params] * n, vocab=vocab)).sampled


@pytest.mark.slow
def test_registered_processor_changes_the_model_runners_tokens(monkeypatch, real_source):
    """The real model in a real ModelRunner: banning the token greedy decoding picks first
    changes the output, and the banned token never appears."""
    from aiolm.worker.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(
        RunnerConfig(
            dtype="float32", max_num_seqs=2, max_model_len=64, block_size=16, kv_cache_memory=16 << 20, num_threads=1
        )
    )
    prompt = list(range(100, 110))

    def generate(rid: str) -> list[int]:
        sched = Scheduler(
            SchedulerConfig(
                num_blocks=runner.num_blocks,
                block_size=16,
                max_num_seqs=2,
                max_num_batched_tokens=64,
                max_model_len=64,
                hash_seed=0,
            )
        )
        sched.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
        tokens: list[int] = []
        for _ in range(20):
            if not sched.has_unfinished_requests():
                break
            so = sched.schedule()
            for out in sched.update_from_output(so, runner.execute(so)):
                tokens.extend(out.new_token_ids)
        assert len(tokens) == 6
        return tokens

    plain = generate("a")
    monkeypatch.setattr(logits_processors, "REGISTRY", [*logits_processors.REGISTRY, ban_token(plain[0])])
    banned = generate("b")
    assert banned[0] != plain[0] and plain[0] not in banned
