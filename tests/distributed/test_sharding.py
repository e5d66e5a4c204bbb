"""Sharded loading (a rank reads only its slices), split rules, and pinning ranks to cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiolm.distributed.cpu_bind import parse_cpu_bind, split_cpus
from aiolm.distributed.parallel_state import TPGroup, set_tp_group
from aiolm.distributed.sharding import kv_head_for_rank, split_error
from aiolm.model.llama import LlamaForCausalLM
from aiolm.model.loader import iter_weights
from aiolm.model.registry import build_context, build_from_config
from aiolm.platforms import get_platform

ROOT = Path(__file__).resolve().parents[2]


def test_split_rules_name_the_head_counts_and_the_sizes_that_work():
    msg = split_error(2, 9, 3, 1536)  # SmolLM2-135M
    assert msg is not None and "9 attention heads" in msg and "3 KV heads" in msg
    assert "sizes that work: 1, 3)" in msg
    assert split_error(3, 9, 3, 1536) is None
    assert split_error(4, 8, 2, 64) is None  # KV heads replicated twice
    assert "KV heads" in (split_error(4, 8, 3, 64) or "")
    assert "intermediate size 30" in (split_error(4, 8, 8, 30) or "")
    assert [list(kv_head_for_rank(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_head_for_rank(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]


def _load_rank(source, rank: int, world: int) -> tuple[LlamaForCausalLM, int]:
    """Rank ``rank``'s model, loaded as the worker loads it; and the bytes it read."""
    set_tp_group(TPGroup(rank, world))  # loading runs no collective
    try:
        model = build_from_config(source.config, build_context(get_platform("torch")))
        seen = []

        def weights():
            for name, w in iter_weights(source, lazy=True):
                seen.append(w)
                yield name, w

        model.load_weights(weights())
        return model, sum(w.bytes_read for w in seen)
    finally:
        set_tp_group(TPGroup())


def test_a_rank_reads_only_its_slices_of_smollm2(real_source):
    full = dict(iter_weights(real_source))
    total = sum(t.numel() * t.element_size() for t in full.values())
    model, read = _load_rank(real_source, 1, 3)
    # Everything but the norms (a few KB) is split in three.
    assert total / 3 <= read < total / 3 * 1.01, (read, total)
    d = real_source.config.head_dim
    attn = model.layers[4].self_attn
    q = full["model.layers.4.self_attn.q_proj.weight"]
    k = full["model.layers.4.self_attn.k_proj.weight"]
    v = full["model.layers.4.self_attn.v_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q[3 * d : 6 * d], k[d : 2 * d], v[d : 2 * d]]))
    o = full["model.layers.4.self_attn.o_proj.weight"]
    assert torch.equal(attn.o_proj.weight, o[:, 3 * d : 6 * d])
    emb = full["model.embed_tokens.weight"]
    per = emb.shape[0] // 3
    assert torch.equal(model.embed_tokens.weight, emb[per : 2 * per])


def test_a_kv_head_shared_by_ranks_is_replicated(tmp_path):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from aiolm.checkpoint.source import resolve_model

    torch.manual_seed(0)
    HFLlama(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path)
    src = resolve_model(tmp_path)
    full = dict(iter_weights(src))
    k, v = full["model.layers.0.self_attn.k_proj.weight"], full["model.layers.0.self_attn.v_proj.weight"]
    for rank in range(2):
        model, _ = _load_rank(src, rank, 2)
        qkv = model.layers[0].self_attn.qkv_proj.weight
        assert model.layers[0].self_attn.num_kv_heads == 1
        assert torch.equal(qkv[16:], torch.cat([k, v]))  # 2 of 4 query heads, then the one KV head


def test_cpu_lists_split_and_parse():
    assert split_cpus([0, 1], 2) in ([[0], [1]], None)  # None only if both are one core's threads
    assert split_cpus([0, 1], 3) is None
    cpus = sorted(os.sched_getaffinity(0))
    first, last = cpus[0], cpus[-1]
    assert parse_cpu_bind(f"{first}-{first},{last};{last}", 2) == [[first, last], [last]]
    assert parse_cpu_bind("auto", 2) is None
    with pytest.raises(ValueError, match="2 cpu lists for 3 ranks"):
        parse_cpu_bind("0;1", 3)
    with pytest.raises(ValueError, match="not a cpu list"):
        parse_cpu_bind("0;x", 2)
    with pytest.raises(ValueError, match="names no cpu"):
        parse_cpu_bind(f"{last}-{first};{first}", 2) if last > first else parse_cpu_bind("1-0", 1)
    # a cpu the process may not run on failed in the worker as "OSError: [Errno 22] Invalid argument"
    with pytest.raises(ValueError, match=f"cpu {last + 500} is not one this process may run on"):
        parse_cpu_bind(f"{first};{last + 500}", 2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cpus")
def test_bind_rank_pins_disjoint_cores_and_sizes_threads():
    code = (
        "import json, os, torch; from aiolm.distributed.cpu_bind import bind_rank; "
        "import sys; r = int(sys.argv[1]); got = bind_rank(r, 2, 'auto'); "
        "print(json.dumps([got, sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))"
    )
    outs = []
    for rank in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code, str(rank)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
        ).stdout
        outs.append(json.loads(out))
    blocks = split_cpus(sorted(os.sched_getaffinity(0)), 2)
    if blocks is None:
        assert all(o[0] is None and o[2] == 1 for o in outs)
        return
    for rank, (got, affinity, threads) in enumerate(outs):
        assert got == affinity == blocks[rank] and threads >= 1
    assert not set(outs[0][1]) & set(outs[1][1])
