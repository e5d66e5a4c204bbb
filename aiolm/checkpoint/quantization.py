"""What a Hugging Face folder's ``quantization_config`` says its weights are, read without torch.

The formats vLLM users download, each reduced to the few facts the loader needs:

- GPTQ (``quant_method: gptq``): 4-bit codes packed 8 to an int32 along the input features
  (``qweight`` [K/8, N]), zero points packed along the outputs (``qzeros`` [G, N/8]; stored
  minus 1 unless ``checkpoint_format`` is ``gptq_v2``), ``scales`` [G, N], and ``g_idx`` [K]
  naming each input feature's group (``desc_act`` orders the groups by activation).
- AWQ (``quant_method: awq``, GEMM layout): codes packed along the outputs in the order
  0 2 4 6 1 3 5 7 (``qweight`` [K, N/8]), zero points the same way (``qzeros`` [G, N/8]),
  ``scales`` [G, N].
- compressed-tensors ``pack-quantized`` (W4A16): ``weight_packed`` [N, K/8] of codes offset
  by 8, ``weight_scale`` [N, G], ``weight_zero_point`` [N/8, G] when asymmetric, and
  ``weight_g_idx`` [K] with activation order; ``float-quantized`` (W8A8-fp8): ``weight`` in
  float8 e4m3 with ``weight_scale`` per tensor or per output channel.
- fp8 (``quant_method: fp8``): ``weight`` in float8 e4m3 with ``weight_scale_inv`` per
  128 x 128 block (``weight_block_size``) or ``weight_scale`` per tensor.

Anything else is a ModelLoadError naming it, at the time the folder is read: a format read
as if it were dense would load noise. Each 4-bit weight is w = scale[g] * (q - zero[g]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiolm.errors import ModelLoadError

INT4_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's linear weights are stored (module docstring)."""

    method: str  # gptq | awq | compressed-tensors | fp8
    bits: int  # 4 (int codes) or 8 (fp8)
    group_size: int  # input features a scale covers; -1: all of them (per output channel)
    symmetric: bool = True  # no zero points stored (compressed-tensors; GPTQ and AWQ always store them)
    act_order: bool = False  # groups in activation order: g_idx is read, not assumed
    zero_offset: int = 0  # added to a stored zero point (GPTQ v1 stores it minus 1)
    block_size: tuple[int, int] | None = None  # fp8: the [out, in] tile a weight_scale_inv covers

    @property
    def int4(self) -> bool:
        return self.bits == 4


def read_quantization(cfg: dict[str, Any], source: str = "config.json") -> WeightQuant | None:
    """The weights' format from config.json's ``quantization_config``; None for a dense model."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(qc, source)
    if method == "awq":
        return _awq(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "fp8":
        return _fp8(qc, source)
    raise ModelLoadError(
        f"{source}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
        "aiolm reads gptq, awq, compressed-tensors (pack-quantized, float-quantized) and fp8"
    )


def _bits4(bits: Any, where: str) -> None:
    if bits != 4:
        raise ModelLoadError(f"{where}: {bits}-bit weights are not supported; 4-bit only")


def _group(size: Any, where: str) -> int:
    if size is None or size == -1:
        return -1
    if not isinstance(size, int) or size < 32 or size % 32:
        raise ModelLoadError(f"{where}: group_size {size!r} is not supported; -1 or a multiple of 32")
    return size


def _gptq(qc: dict[str, Any], source: str) -> WeightQuant:
    where = f"{source}: quantization_config (gptq)"
    _bits4(qc.get("bits"), where)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: checkpoint_format {fmt!r} is not supported; gptq or gptq_v2")
    if qc.get("is_marlin_format"):
        raise ModelLoadError(f"{where}: is_marlin_format (Marlin's packing) is not supported; gptq or gptq_v2")
    return WeightQuant(
        "gptq",
        4,
        _group(qc.get("group_size", 128), where),
        act_order=bool(qc.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _awq(qc: dict[str, Any], source: str) -> WeightQuant:
    where = f"{source}: quantization_config (awq)"
    _bits4(qc.get("bits", qc.get("w_bit")), where)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{where}: version {version!r} is not supported; the GEMM layout only")
    if not qc.get("zero_point", True):
        raise ModelLoadError(f"{where}: zero_point false is not supported")
    return WeightQuant("awq", 4, _group(qc.get("group_size", qc.get("q_group_size", 128)), where))


def _compressed_tensors(qc: dict[str, Any], source: str) -> WeightQuant:
    where = f"{source}: quantization_config (compressed-tensors)"
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{where}: no config_groups")
    schemes = {_ct_scheme(g, qc.get("format"), f"{where}: config_groups.{k}") for k, g in groups.items()}
    if len(schemes) > 1:
        raise ModelLoadError(f"{where}: config_groups with different schemes are not supported")
    sparsity = qc.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        raise ModelLoadError(
            f"{where}: sparsity_config format {sparsity.get('format')!r} is not supported; dense (or none)"
        )
    return schemes.pop()


def _ct_scheme(group: Any, top_format: Any, where: str) -> WeightQuant:
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ModelLoadError(f"{where}: no weights scheme")
    w = group["weights"]
    fmt = group.get("format") or top_format
    if fmt == "pack-quantized":
        if w.get("type", "int") != "int":
            raise ModelLoadError(f"{where}: pack-quantized weights of type {w.get('type')!r}; int expected")
        _bits4(w.get("num_bits"), where)
        if group.get("input_activations") is not None:
            raise ModelLoadError(f"{where}: quantized input activations with 4-bit weights are not supported")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ModelLoadError(f"{where}: weight strategy {strategy!r} is not supported; group or channel")
        actorder = w.get("actorder")
        # compressed-tensors' aliases: true and "dynamic" are "group", "static" is "weight"
        if actorder not in (None, False, True, "group", "dynamic", "weight", "static"):
            raise ModelLoadError(f"{where}: actorder {actorder!r} is not supported")
        return WeightQuant(
            "compressed-tensors",
            4,
            _group(w.get("group_size"), where) if strategy == "group" else -1,
            symmetric=bool(w.get("symmetric", True)),
            # "weight" reorders at quantization time only: no g_idx
            act_order=actorder in (True, "group", "dynamic"),
        )
    if fmt == "float-quantized":
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelLoadError(f"{where}: float-quantized weights must be 8-bit float (fp8 e4m3)")
        if w.get("strategy") not in ("tensor", "channel"):
            strategy = w.get("strategy")
            raise ModelLoadError(f"{where}: fp8 weight strategy {strategy!r} is not supported; tensor or channel")
        if not w.get("symmetric", True):
            raise ModelLoadError(f"{where}: asymmetric fp8 weights (with zero points) are not supported")
        return WeightQuant("compressed-tensors", 8, -1)
    raise ModelLoadError(
        f"{where}: format {fmt!r} is not supported; pack-quantized (int4 weights) or float-quantized (fp8)"
    )


def _fp8(qc: dict[str, Any], source: str) -> WeightQuant:
    where = f"{source}: quantization_config (fp8)"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"{where}: fmt {fmt!r} is not supported; e4m3")
    block = qc.get("weight_block_size")
    if block is not None and (
        not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ModelLoadError(f"{where}: weight_block_size must be two positive integers, got {block!r}")
    return WeightQuant("fp8", 8, -1, block_size=(block[0], block[1]) if block else None)
