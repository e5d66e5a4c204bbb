"""LoRA adapters end to end: the real engine against transformers + PEFT.

Tiny random Llama and Qwen3 bases with adapters written by PEFT itself (tests/lora_models.py):
every adapter's greedy tokens equal PEFT's, alone and in batches that mix adapters, with
fewer slots than adapters (requests wait for a slot, evicted adapters are read again), in
the prefix cache (no block is shared across adapters), over two tensor-parallel ranks, and
the errors a caller can meet. PEFT's tokens are each prompt run alone, so a request that
equals them in a mixed batch got what it gets alone.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aiolm import LLM, LoRARequest, ParamError, RequestError, RequestOutput, SamplingParams
from lora_models import ALL_TARGETS, hf_lora_greedy, peft_adapter, tiny_base

MAX_NEW = 8
PROMPTS = [[1, 400, 500, 600], [1, 20, 30, 7, 9, 1200], [1, 3000, 17, 256, 9000, 42, 11]]
# Sixty tokens: three full blocks of 16 the prefix cache can hold (the last token is always computed).
LONG = [1] + [100 + (37 * i) % 20000 for i in range(59)]
ALL_PROMPTS = [*PROMPTS, LONG]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    kv_cache_memory=8 << 20,
    max_num_seqs=32,
    max_num_batched_tokens=256,
    block_size=16,
    num_threads=1,
    enable_lora=True,
    max_lora_rank=16,
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# name -> PEFT settings; the first three are built for both bases, the others for Llama only.
ADAPTERS: dict[str, dict] = {
    "all8": dict(rank=8, targets=ALL_TARGETS, seed=11),
    "attn16": dict(rank=16, targets=ATTENTION, seed=12),
    "rs_mlp16": dict(rank=16, targets=MLP, rslora=True, seed=13),
    "extra8": dict(rank=8, targets=ALL_TARGETS, seed=14),
    # PEFT's patterns are regular expressions of a name's last parts: "a|b" is one group
    "mix12": dict(
        rank=12,
        targets=("q_proj", "v_proj", "down_proj"),
        alpha=24,
        seed=15,
        rank_pattern={"q_proj|down_proj": 8},
        alpha_pattern={"q_proj|v_proj": 40},
    ),
}
BOTH = ("all8", "attn16", "rs_mlp16")


@dataclass
class Kit:
    """A base model, its adapters (LoRARequests with ids 1, 2, ...) and PEFT's tokens for
    ALL_PROMPTS under each adapter (None: the base)."""

    base: Path
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    refs: dict[str | None, list[list[int]]] = field(default_factory=dict)

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.loras[name]

    def path(self, name: str | None) -> Path | None:
        return None if name is None else Path(self.loras[name].lora_path)


def build_kit(kind: str, root: Path, tokenizer_from: Path, names: tuple[str, ...]) -> Kit:
    kit = Kit(tiny_base(kind, root / "base", tokenizer_from))
    for i, name in enumerate(names, start=1):
        path = peft_adapter(kit.base, root / name, **ADAPTERS[name])
        kit.loras[name] = LoRARequest(name, i, str(path))
    for name in (None, *names):
        kit.refs[name] = hf_lora_greedy(kit.base, kit.path(name), ALL_PROMPTS, MAX_NEW)
    # Every adapter changes the tokens, each its own way: a mix-up between them would show.
    tokens = [str(t) for t in kit.refs.values()]
    assert len(set(tokens)) == len(tokens), "two adapters give the same tokens"
    return kit


@pytest.fixture(scope="module")
def llama(tmp_path_factory, real_source) -> Kit:
    return build_kit("llama", tmp_path_factory.mktemp("lora_llama"), real_source.path, tuple(ADAPTERS))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, real_source) -> Kit:
    return build_kit("qwen3", tmp_path_factory.mktemp("lora_qwen3"), real_source.path, BOTH)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def mixed(kit: Kit, names: list[str | None], prompts: list[list[int]]):
    """Every prompt under every adapter, interleaved: (prompts, loras, expected tokens)."""
    ps, loras, want = [], [], []
    for p in prompts:
        for name in names:
            ps.append({"prompt_token_ids": p})
            loras.append(kit.lora(name))
            want.append(kit.refs[name][ALL_PROMPTS.index(p)])
    return ps, loras, want


def generate(llm: LLM, kit: Kit, names: list[str | None], prompts: list[list[int]]) -> None:
    """One generate call over ``mixed``; every request must get PEFT's tokens."""
    ps, loras, want = mixed(kit, names, prompts)
    got = tokens(llm.generate(ps, GREEDY, use_tqdm=False, lora_request=loras))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} ({loras[i].lora_name if loras[i] else 'base'}): {g} != {w}"


def each_alone(llm: LLM, prompts: list[list[int]], lora: LoRARequest | None) -> list[RequestOutput]:
    """Each prompt as its own generate call, so the results are the prompt's alone."""
    return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=lora)[0] for p in prompts]


# -- tokens equal PEFT's -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_each_adapter_gives_peft_tokens(kind, request):
    kit: Kit = request.getfixturevalue(kind)
    with LLM(model=str(kit.base), executor="local", max_loras=1, **ENGINE) as llm:
        for name in (None, *BOTH):  # all seven targets; attention only at rank 16; rsLoRA on the MLP
            ps = [{"prompt_token_ids": p} for p in ALL_PROMPTS]
            got = tokens(llm.generate(ps, GREEDY, use_tqdm=False, lora_request=kit.lora(name)))
            assert got == kit.refs[name], name


def test_a_batch_mixing_four_adapters_and_the_base(llama):
    """Worker processes; fifteen requests submitted together, each getting its tokens alone."""
    with LLM(model=str(llama.base), executor="mp", max_loras=4, **ENGINE) as llm:
        generate(llm, llama, [None, "all8", "attn16", "rs_mlp16", "mix12"], PROMPTS)
    assert all(p.poll() is not None for p in llm.engine.executor.procs)


def test_more_adapters_than_slots_reads_evicted_ones_again(llama):
    with LLM(model=str(llama.base), executor="local", max_loras=2, max_cpu_loras=2, **ENGINE) as llm:
        manager = llm.engine.executor.runner.lora
        rounds = [
            ["all8", "attn16", None],
            ["rs_mlp16", "extra8"],
            ["mix12", "all8"],  # all8 left the slots and the host cache two rounds ago
            ["attn16", "rs_mlp16", None],
            ["extra8", "mix12"],
        ]
        for names in rounds:
            generate(llm, llama, names, PROMPTS[:2])
        # No round's adapters were held by the round before: each use read the folder again.
        assert manager.loads == 10


def test_preempted_requests_resume_with_their_adapter(llama):
    """A KV cache of a few blocks: requests of three adapters and the base are preempted and
    recomputed, each again with its own adapter."""
    prompts = [[1] + [100 + (37 * i + k) % 20000 for i in range(40)] for k in range(3)]
    names: list[str | None] = [None, "all8", "attn16", "rs_mlp16"]
    n = 24
    want = {name: hf_lora_greedy(llama.base, llama.path(name), prompts, n) for name in names}
    args = {**ENGINE, "kv_cache_memory": 200 << 10}  # room for about two dozen blocks of 16
    with LLM(model=str(llama.base), executor="local", max_loras=2, **args) as llm:
        ps = [{"prompt_token_ids": p} for p in prompts for _ in names]
        loras = [llama.lora(name) for _ in prompts for name in names]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        got = tokens(llm.generate(ps, params, use_tqdm=False, lora_request=loras))
        assert llm.engine.scheduler.num_preemptions > 0
    assert got == [want[name][k] for k in range(len(prompts)) for name in names]


# -- one slot: waiting, prefix cache, errors -------------------------------------------------


@pytest.fixture(scope="module")
def one_slot(llama):
    """One adapter slot, one adapter in host memory: a second adapter always evicts the first."""
    with LLM(model=str(llama.base), executor="local", max_loras=1, max_cpu_loras=1, **ENGINE) as llm:
        yield llm


def test_one_slot_serves_three_adapters_submitted_together(llama, one_slot):
    manager = one_slot.engine.executor.runner.lora
    names = ["all8", "attn16", "mix12"]
    in_slot = sum(llama.loras[n].lora_int_id in manager.slot_ids for n in names)
    loads = manager.loads
    generate(one_slot, llama, [*names, None], PROMPTS[:2])
    # The requests of one adapter ran together while the others waited: each adapter was read
    # once, not once per switch back and forth (and never two at once: one slot would raise).
    assert manager.loads - loads == len(names) - in_slot


def test_prefix_cache_is_never_shared_across_adapters(llama, one_slot):
    a, b = llama.loras["extra8"], llama.loras["rs_mlp16"]
    first, again = each_alone(one_slot, [LONG, LONG], a)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    assert tokens([first, again]) == [llama.refs["extra8"][-1]] * 2
    (other,) = each_alone(one_slot, [LONG], b)
    assert other.num_cached_tokens == 0
    assert tokens([other]) == [llama.refs["rs_mlp16"][-1]]
    (base,) = each_alone(one_slot, [LONG], None)
    assert base.num_cached_tokens == 0 and tokens([base]) == [llama.refs[None][-1]]


async def _each(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list:
    """Each request's final output, or the exception its stream raised."""

    async def one(p: list[int], lora: LoRARequest | None):
        final = None
        try:
            async for out in llm.engine.generate({"prompt_token_ids": p}, GREEDY, lora_request=lora):
                final = out
        except RequestError as e:
            return e
        return final

    return await asyncio.wait_for(asyncio.gather(*(one(p, lora) for p, lora in zip(prompts, loras))), 60)


def fail_a_removed_adapter(kit: Kit, llm: LLM, folder: Path, lora_id: int) -> tuple:
    """A copy of extra8 accepted and run, evicted from the worker's slot and host cache, its
    folder deleted, then run again beside a base request: (its result, the base's)."""
    shutil.copytree(kit.loras["extra8"].lora_path, folder)
    doomed = LoRARequest(folder.name, lora_id, str(folder))
    # Accepted (the engine checks an adapter once) and run: the copy's tokens are extra8's.
    assert tokens(each_alone(llm, PROMPTS[:1], doomed)) == [kit.refs["extra8"][0]]
    each_alone(llm, PROMPTS[:1], kit.loras["all8"])  # one slot, one host copy: evicts it
    manager = llm.engine.executor.runner.lora
    assert lora_id not in manager.slot_ids and lora_id not in manager.host
    shutil.rmtree(folder)
    failed, base = llm._run(_each(llm, PROMPTS[:2], [doomed, None]))
    return failed, base


def test_an_adapter_whose_folder_went_away_fails_its_request_only(llama, one_slot, tmp_path):
    failed, base = fail_a_removed_adapter(llama, one_slot, tmp_path / "doomed", 99)
    if not isinstance(failed, RequestError):
        assert failed.finished and failed.outputs[0].finish_reason == "error"
        assert failed.outputs[0].token_ids == []  # what it sampled without its adapter is dropped
    # The base request in the same step is untouched, and the engine goes on serving adapters.
    assert tokens([base]) == [llama.refs[None][1]]
    generate(one_slot, llama, ["all8", "attn16", None], PROMPTS[:2])


def test_the_failed_request_carries_the_workers_message(llama, one_slot, tmp_path):
    failed, _ = fail_a_removed_adapter(llama, one_slot, tmp_path / "gone", 98)
    message = str(failed) if isinstance(failed, RequestError) else (failed.error or "")
    assert "'gone'" in message and "cannot be loaded" in message, message


def test_an_adapter_above_max_lora_rank_is_refused(llama, one_slot, tmp_path):
    big = peft_adapter(llama.base, tmp_path / "rank32", rank=32, targets=("q_proj", "v_proj"))
    with pytest.raises(ParamError) as e:
        one_slot.generate(
            {"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 77, str(big))
        )
    assert e.value.param == "lora_path" and "rank 32" in e.value.message and "16" in e.value.message


def test_a_missing_adapter_folder_is_refused(llama, one_slot, tmp_path):
    with pytest.raises(ParamError) as e:
        one_slot.generate(
            {"prompt_token_ids": PROMPTS[0]},
            GREEDY,
            use_tqdm=False,
            lora_request=LoRARequest("ghost", 78, str(tmp_path / "nowhere")),
        )
    assert e.value.param == "lora_path" and "no such folder" in e.value.message
    with pytest.raises(ParamError) as e:  # Path.expanduser raised a RuntimeError: a 500 on the server
        one_slot.generate(
            {"prompt_token_ids": PROMPTS[0]},
            GREEDY,
            use_tqdm=False,
            lora_request=LoRARequest("ghost", 79, "~no_such_user_here/adapter"),
        )
    assert e.value.param == "lora_path" and "no such folder" in e.value.message
    # Refused before it was queued: the engine still serves.
    assert tokens(each_alone(one_slot, PROMPTS[:1], None)) == [llama.refs[None][0]]


def test_an_id_names_one_adapter_for_good(llama, one_slot):
    """The workers key their caches by id, so an id taken by one adapter refuses another."""
    taken = llama.loras["all8"]
    elsewhere = LoRARequest("all8", taken.lora_int_id, llama.loras["attn16"].lora_path)
    with pytest.raises(ParamError) as e:
        one_slot.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=elsewhere)
    assert e.value.param == "lora_int_id"
    assert tokens(each_alone(one_slot, PROMPTS[:1], taken)) == [llama.refs["all8"][0]]


def test_a_lora_request_without_enable_lora_is_refused(llama):
    args = {**ENGINE, "enable_lora": False}
    with LLM(model=str(llama.base), executor="local", **args) as llm:
        with pytest.raises(ParamError) as e:
            llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=llama.loras["all8"])
        assert e.value.param == "lora_request" and "enable-lora" in e.value.message
        assert tokens(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)) == [llama.refs[None][0]]


# -- tensor parallel -------------------------------------------------------------------------


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_one_rank_tokens(llama):
    """Each rank holds its share of every A (row-parallel layers) or B (column-parallel ones);
    PEFT's tokens are also what one rank gives (test_each_adapter_gives_peft_tokens)."""
    with LLM(model=str(llama.base), executor="mp", tensor_parallel_size=2, max_loras=2, **ENGINE) as llm:
        assert len(llm.engine.executor.procs) == 2
        generate(llm, llama, ["all8", None, "mix12"], PROMPTS)
