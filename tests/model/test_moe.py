"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers.

Tiny random models built here give transformers' float32 greedy tokens over aiolm's paged
cache, several sequences in one batch and prompts prefilled in two chunks; the router
picks and weighs experts exactly as transformers' router does; the per-expert reference
sums what a plain loop sums; bad checkpoints are refused naming the tensor.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from aiolm.checkpoint.moe import MoEConfig
from aiolm.checkpoint.source import resolve_model
from aiolm.errors import ModelLoadError
from aiolm.model.layers.fused_moe import Router
from aiolm.model.registry import build_model
from aiolm.platforms.cpu import bfloat16_matmuls
from aiolm.quant.base import experts_reference
from moe_models import KINDS, moe_model
from paged import PagedHarness, hf_greedy

NEW = 12


@pytest.fixture(scope="module", params=KINDS)
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, moe_model(request.param, path), path


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11, 17)]


def test_config_reads_each_family(saved):
    kind, hf, path = saved
    cfg = resolve_model(path).config
    assert isinstance(cfg, MoEConfig) and cfg.architecture == kind
    c = hf.config
    assert cfg.top_k == c.num_experts_per_tok
    assert cfg.num_experts == (c.num_local_experts if kind == "mixtral" else c.num_experts)
    if kind == "qwen3_moe":
        assert cfg.sparse_layers == (True, False, True) and cfg.qk_norm and cfg.norm_topk_prob
    if kind == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size == 48 and cfg.attention_bias and not cfg.norm_topk_prob
    if kind == "mixtral":
        assert cfg.norm_topk_prob and cfg.moe_intermediate_size == c.intermediate_size


def test_greedy_tokens_match_transformers(saved):
    kind, hf, path = saved
    model = build_model(resolve_model(path), torch.float32)
    prompts = _prompts()
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    assert len({t for e in expected for t in e}) > 6  # the outputs are not one repeated token
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW) == expected
    assert PagedHarness(model, block_size=4).greedy(prompts, NEW, split=4) == expected  # chunked prefill
    counts = model.take_expert_counts()
    assert counts.shape[0] == sum(model.config.sparse_layers)
    assert torch.all(counts.sum(-1) == counts.sum(-1)[0]) and int(counts.sum(-1)[0]) % model.config.top_k == 0
    assert int(model.take_expert_counts().sum()) == 0  # read and restarted


@pytest.mark.skipif(not bfloat16_matmuls(), reason="this CPU has no bfloat16 matmuls: the model runs in float32")
def test_bfloat16_experts_give_the_float32_block_within_a_bfloat16_rounding(saved):
    """A sparse block built in bfloat16 (its experts packed for the fused op's bfloat16 paths:
    AMX tiles where the CPU has them) against the same block in float32, over a prompt's
    worth of tokens and a decode step's."""
    _, _, path = saved
    exact = build_model(resolve_model(path), torch.float32)
    model = build_model(resolve_model(path), torch.bfloat16)
    layer = model.config.sparse_layers.index(True)
    block, want_block = model.layers[layer].mlp, exact.layers[layer].mlp
    assert block.experts.cpu_experts.w13.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(3)
    for tokens in (70, 3):
        x = torch.randn(tokens, model.config.hidden_size, generator=g)
        got, want = block(x).float(), want_block(x)
        assert not torch.equal(got, want)  # it did round to bfloat16 ...
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))  # ... only that


@pytest.mark.parametrize("kind", KINDS)
def test_router_picks_and_weighs_as_transformers(kind):
    hf = moe_model(kind, num_hidden_layers=1, mlp_only_layers=[]) if kind == "qwen3_moe" else moe_model(kind)
    block = hf.model.layers[0].mlp
    hf_router = block.gate
    x = torch.randn(40, 64)
    _, want_w, want_ids = hf_router(x)
    cfg = resolve_config(hf)
    ours = Router(cfg.num_experts, 64, cfg.top_k, cfg.norm_topk_prob)
    ours.weight.data.copy_(hf_router.weight)
    w, ids = ours(x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=0, atol=0)


def resolve_config(hf) -> MoEConfig:
    from aiolm.checkpoint.families import read_config

    cfg = read_config(json.loads(hf.config.to_json_string()))
    assert isinstance(cfg, MoEConfig)
    return cfg


@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_experts_reference_sums_what_a_plain_loop_sums(top_k):
    g = torch.Generator().manual_seed(top_k)
    e, h, i, t = 8, 24, 16, 30
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    ids[: t // 2] = torch.where(ids[: t // 2] == 5, 0, ids[: t // 2])  # expert 5 gets fewer tokens
    ids[0, 0] = -1  # an expert on another rank adds nothing
    w = torch.rand(t, top_k, generator=g)
    want = torch.zeros(t, h)
    for tok in range(t):
        for j in range(top_k):
            ex = int(ids[tok, j])
            if ex >= 0:
                gate, up = (w13[ex] @ x[tok]).chunk(2)
                want[tok] += w[tok, j] * (w2[ex] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_reference(x, w13, w2, w, ids), want, rtol=1e-5, atol=1e-4)
    one = torch.full((t, 1), 3)  # every token to one expert; the others receive none
    single = experts_reference(x, w13, w2, torch.ones(t, 1), one)
    gate, up = (x @ w13[3].T).chunk(2, dim=-1)
    torch.testing.assert_close(single, (torch.nn.functional.silu(gate) * up) @ w2[3].T, rtol=1e-5, atol=1e-4)
    assert experts_reference(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, h)


def _rewrite(path, change) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_a_missing_or_misshapen_expert_tensor_is_refused_by_name(tmp_path):
    moe_model("qwen3_moe", tmp_path)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    good = load_file(tmp_path / "model.safetensors")[name]
    _rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=r"missing 1 expert weights.*layers\.2\.mlp\.experts\.5\.up_proj"):
        build_model(resolve_model(tmp_path), torch.float32)
    _rewrite(tmp_path, lambda t: t.update({name: good[:, :-1].contiguous()}))
    with pytest.raises(ModelLoadError, match=rf"{name}: shape \(32, 63\), expected \(32, 64\)"):
        build_model(resolve_model(tmp_path), torch.float32)


def test_mixtral_missing_expert_is_named_as_its_checkpoint_names_it(tmp_path):
    moe_model("mixtral", tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        build_model(resolve_model(tmp_path), torch.float32)


def test_expert_parallel_places_whole_experts_and_tensor_parallel_slices_them(tmp_path):
    """Rank 1 of 2: with expert parallelism it holds experts 3-5 whole, without it the second
    half of every expert's intermediate features (the ranks' outputs are summed by the
    all-reduce, here left out: one process)."""
    from aiolm.distributed.parallel_state import TPGroup, get_tp_group, set_tp_group
    from aiolm.platforms import get_platform

    hf = moe_model("qwen3_moe", tmp_path, num_experts=6, moe_intermediate_size=48)
    experts = hf.model.layers[0].mlp.experts  # transformers 5 keeps them fused: [E, 2I, H] and [E, H, I]
    before = get_tp_group()
    set_tp_group(TPGroup(rank=1, world_size=2, all_reduce_fn=lambda x: x, all_gather_fn=lambda x: x))
    try:
        torch_platform = get_platform("cpu", reference=True)  # dense expert weights, as loaded
        ep = build_model(resolve_model(tmp_path), expert_parallel=True, platform=torch_platform).layers[0].mlp.experts
        tp = build_model(resolve_model(tmp_path), platform=torch_platform).layers[0].mlp.experts
    finally:
        set_tp_group(before)
    assert (ep.local_experts, ep.expert_start) == (3, 3)
    torch.testing.assert_close(ep.w13, experts.gate_up_proj[3:], rtol=0, atol=0)
    torch.testing.assert_close(ep.w2, experts.down_proj[3:], rtol=0, atol=0)
    gate, up = experts.gate_up_proj.chunk(2, dim=1)
    assert (tp.local_experts, tp.expert_start) == (6, 0)
    torch.testing.assert_close(tp.w13, torch.cat([gate[:, 24:], up[:, 24:]], 1), rtol=0, atol=0)
    torch.testing.assert_close(tp.w2, experts.down_proj[:, :, 24:], rtol=0, atol=0)
