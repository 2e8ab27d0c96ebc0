"""What a Hugging Face checkpoint's `quantization_config` says, and whether `--quantization` fits it.

vLLM reads the method from config.json's `quantization_config` (older AutoGPTQ exports keep it in
a `quantize_config.json` beside it); so does this engine, so `--quantization auto` serves a GPTQ or
AWQ directory in its own format, and an explicit flag that contradicts the checkpoint is refused
at start-up, before any tensor is read.

Only the fields that change how the tensors decode are read; anything that would make them decode
differently from what engine.model.gptq_awq implements is refused, naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

QuantMethod = Literal["gptq", "awq"]
# What a checkpoint holds: a GGUF file's blocks, plain float tensors, or one of the packed formats.
StoredFormat = Literal["gguf", "float", "gptq", "awq"]

_LEGACY_CONFIG_FILE = "quantize_config.json"
_GPTQ_BITS = (4, 8)
_AWQ_BITS = (4,)
# GPTQ's first checkpoint format stores each zero point minus one; "gptq_v2" stores it as is.
_GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
_DESCRIBED = {
    "gguf": "a GGUF file",
    "float": "an unquantized (float) checkpoint",
    "gptq": "a GPTQ checkpoint",
    "awq": "an AWQ checkpoint",
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a GPTQ or AWQ checkpoint's packed tensors decode.

    w = scale * (q - zero) per group of `group_size` input features (-1: one group per row), where
    the stored zero point plus `zero_offset` is `zero`. `desc_act`: GPTQ's act-order, whose `g_idx`
    may put input features in any group. `sym`: every zero is 2**(bits - 1).
    """

    method: QuantMethod
    bits: int
    group_size: int
    zero_offset: int
    desc_act: bool = False
    sym: bool = False


def read_checkpoint_quantization(raw: dict[str, Any], directory: str) -> CheckpointQuantization | None:
    """The quantization of an HF directory from its config.json dict (or its quantize_config.json);
    None for a float checkpoint. ValueError naming the field for a method or variant not served."""
    fields = raw.get("quantization_config")
    if fields is None:
        legacy = os.path.join(directory, _LEGACY_CONFIG_FILE)
        if not os.path.exists(legacy):
            return None
        with open(legacy, encoding="utf-8") as file:
            # AutoGPTQ's own file; its early versions do not name the method.
            fields = {"quant_method": "gptq", **json.load(file)}
    method = str(fields.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(fields)
    if method == "awq":
        return _awq(fields)
    raise ValueError(f"quantization_config.quant_method: {method or None!r} is not supported (supported: gptq, awq)")


def check_requested(requested: str, stored: StoredFormat, source: str) -> None:
    """Refuse a `--quantization` that contradicts what the checkpoint holds (gptq and awq on
    anything but a checkpoint of that method; anything but auto or its own method on one)."""
    packed = stored in ("gptq", "awq")
    if requested in ("gptq", "awq") and requested != stored:
        raise ValueError(f"quantization: {requested!r} does not fit {source}: it is {_DESCRIBED[stored]} "
                         f"(--quantization {requested} needs an HF checkpoint whose quantization_config has "
                         f"quant_method {requested!r})")
    if packed and requested not in ("auto", stored):
        raise ValueError(f"quantization: {requested!r} does not fit {source}: it is {_DESCRIBED[stored]} "
                         f"(serve it with --quantization auto or {stored})")


def _gptq(fields: dict[str, Any]) -> CheckpointQuantization:
    if fields.get("is_marlin_format"):
        raise ValueError("quantization_config.is_marlin_format: Marlin-packed GPTQ is not supported")
    checkpoint_format = str(fields.get("checkpoint_format", fields.get("format", "gptq"))).lower()
    if checkpoint_format not in _GPTQ_ZERO_OFFSETS:
        raise ValueError(f"quantization_config.checkpoint_format: {checkpoint_format!r} is not supported "
                         f"(supported: {', '.join(_GPTQ_ZERO_OFFSETS)})")
    pack_dtype = str(fields.get("pack_dtype", "int32"))
    if pack_dtype != "int32":
        raise ValueError(f"quantization_config.pack_dtype: {pack_dtype!r} is not supported (only int32)")
    dynamic = fields.get("dynamic") or {}
    if any(not str(rule).startswith("-:") for rule in dynamic):
        # Negative rules only leave modules unquantized, which the tensors themselves show.
        raise ValueError("quantization_config.dynamic: per-module bits or group sizes are not supported")
    return CheckpointQuantization(
        method="gptq",
        bits=_bits(fields, "bits", _GPTQ_BITS, "gptq"),
        group_size=_group_size(fields, "group_size"),
        zero_offset=_GPTQ_ZERO_OFFSETS[checkpoint_format],
        desc_act=bool(fields.get("desc_act", False)),
        sym=bool(fields.get("sym", True)),
    )


def _awq(fields: dict[str, Any]) -> CheckpointQuantization:
    version = str(fields.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version: {version!r} is not supported (only AutoAWQ's 'gemm' "
                         "packing)")
    if not fields.get("zero_point", True):
        raise ValueError("quantization_config.zero_point: false is not supported (AWQ GEMM checkpoints carry "
                         "zero points)")
    bits_key = "bits" if "bits" in fields else "w_bit"
    return CheckpointQuantization(
        method="awq",
        bits=_bits(fields, bits_key, _AWQ_BITS, "awq"),
        group_size=_group_size(fields, "group_size" if "group_size" in fields else "q_group_size"),
        zero_offset=0,
    )


def _bits(fields: dict[str, Any], key: str, supported: tuple[int, ...], method: str) -> int:
    bits = fields.get(key)
    if bits not in supported:
        raise ValueError(f"quantization_config.{key}: {bits!r} is not supported for {method} "
                         f"(supported: {', '.join(map(str, supported))})")
    return int(bits)


def _group_size(fields: dict[str, Any], key: str) -> int:
    group_size = fields.get(key, -1)
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"quantization_config.{key}: {group_size!r} is not a group size (a positive "
                         "number of input features, or -1 for one group per row)")
    return group_size
