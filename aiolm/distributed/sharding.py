"""Can a model be split over N tensor-parallel ranks, and which KV head does a rank hold.

Each rank takes num_heads / N query heads and the MLP's intermediate_size / N
columns. KV heads are split the same way while there are at least N of them;
with fewer, each KV head is replicated on N / num_kv_heads consecutive ranks,
which must be a whole number so that a rank's query heads all share its one KV
head. The engine checks this before starting any worker, so the error names the
head counts and the sizes that would work.
"""

from __future__ import annotations

from typing import Any


def _problems(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[str]:
    problems = []
    if num_heads % tp:
        problems.append(f"its {num_heads} attention heads are not divisible by {tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        problems.append(f"its {num_kv_heads} KV heads neither divide into {tp} ranks nor replicate evenly over them")
    if intermediate_size % tp:
        problems.append(f"its MLP intermediate size {intermediate_size} is not divisible by {tp}")
    return problems


def split_error(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> str | None:
    """Why ``tp`` ranks cannot split this model, or None if they can."""
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    problems = _problems(tp, num_heads, num_kv_heads, intermediate_size)
    if not problems:
        return None
    ok = [n for n in range(1, num_heads + 1) if not _problems(n, num_heads, num_kv_heads, intermediate_size)]
    return (
        f"tensor_parallel_size {tp} cannot split this model: {'; '.join(problems)} "
        f"(sizes that work: {', '.join(map(str, ok))})"
    )


def experts_split_error(tp: int, cfg: Any, expert_parallel: bool) -> str | None:
    """Why ``tp`` ranks cannot split the layers of experts of ``cfg`` (a MoEConfig): with
    expert parallelism each rank takes E / N whole experts, without it 1/N of every expert's
    intermediate features. None if they can."""
    shared = cfg.shared_expert_intermediate_size
    if shared % tp:
        return (
            f"tensor_parallel_size {tp} cannot split this model: its shared expert size {shared} "
            f"is not divisible by {tp}"
        )
    if expert_parallel:
        if cfg.num_experts % tp:
            ok = [n for n in range(1, cfg.num_experts + 1) if cfg.num_experts % n == 0]
            return (
                f"--enable-expert-parallel with tensor_parallel_size {tp}: its {cfg.num_experts} experts "
                f"cannot be split evenly over {tp} ranks (rank counts that divide them: {', '.join(map(str, ok))})"
            )
        return None
    if cfg.moe_intermediate_size % tp:
        return (
            f"tensor_parallel_size {tp} cannot split this model: its expert intermediate size "
            f"{cfg.moe_intermediate_size} is not divisible by {tp} (--enable-expert-parallel places whole "
            f"experts instead)"
        )
    return None


def kv_head_for_rank(rank: int, tp: int, num_kv_heads: int) -> range:
    """The KV heads rank ``rank`` holds (several when split, one when replicated)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)
