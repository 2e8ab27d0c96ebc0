"""The moe suite's models: one named mixture-of-experts shape (and a dense model of the same active
parameters), random weights saved once with transformers into bench/.cache/, a GGUF copy of the MoE
model (harness.moe_gguf), the Q8_0 blocks of a GGUF file made in process, and each model built as
the engine builds it at a given set of formats, with one decode step timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from bench.common.paths import CACHE_DIR
from engine.attention.metadata import AttentionMetadata
from engine.config import CacheConfig, EngineConfig
from engine.engine_model import EngineModel, load_engine_model
from engine.model.gguf_blocks import as_quantized
from engine.model.loader import ModelFiles
from engine.parallel.layout import TensorParallelLayout

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class MoEShape:
    """A Mixtral-style decoder: `experts` SwiGLU experts of `expert_intermediate` features, `top_k` a token."""

    name: str
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def dense_intermediate(self) -> int:
        """The dense MLP with a token's active expert parameters: top_k experts side by side."""
        return self.top_k * self.expert_intermediate

    def describe(self) -> str:
        """The shape as the output states it."""
        return (f"{self.name}: hidden {self.hidden}, {self.layers} layers, {self.experts} experts top-{self.top_k}, "
                f"expert intermediate {self.expert_intermediate}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"vocab {self.vocab} (dense twin: intermediate {self.dense_intermediate})")


# CPU-sized but MoE-like: Qwen-MoE's expert width under a Mixtral router (8 experts, top-2).
NAMED = MoEShape("moe-h1024-l8-e8top2-i1408", 1024, 8, 8, 2, 1408, 16, 4, 32000)
# --quick: the same structure, every dimension a whole number of Q8_0 blocks and TP-2 granules.
QUICK = MoEShape("moe-quick-h128-l2-e8top2-i128", 128, 2, 8, 2, 128, 4, 2, 512)
MIXTRAL_8X7B = MoEShape("mixtral-8x7b", 4096, 32, 8, 2, 14336, 32, 8, 32000)
# What llama.cpp's converter leaves F32 in a quantized file: the router decides routing, norms are vectors.
_KEPT_FLOAT = ("mlp.gate.weight", "norm.weight")


def _hf_config(shape: MoEShape, moe: bool) -> PretrainedConfig:
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02)
    if moe:
        return MixtralConfig(**common, intermediate_size=shape.expert_intermediate, num_local_experts=shape.experts,
                             num_experts_per_tok=shape.top_k, sliding_window=None)
    return LlamaConfig(**common, intermediate_size=shape.dense_intermediate)


@dataclass(frozen=True)
class Checkpoints:
    moe: Path  # HF directory (MixtralForCausalLM)
    dense: Path  # HF directory (LlamaForCausalLM of the same active parameters)
    gguf: Path | None  # the MoE model as GGUF, Q8_0 experts and matrices (None: harness.moe_gguf is missing)


def ensure_checkpoints(shape: MoEShape, cache: Path = CACHE_DIR) -> Checkpoints:
    """The shape's checkpoints under `cache`/moe-<name>/, each made once (random, seeded)."""
    from transformers import AutoModelForCausalLM

    folder = cache / shape.name
    paths = Checkpoints(folder / "moe-hf", folder / "dense-hf", folder / "moe-q8_0.gguf")
    for path, moe in ((paths.moe, True), (paths.dense, False)):
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(_hf_config(shape, moe), dtype=torch.float32).save_pretrained(path)
    if paths.gguf is not None and not paths.gguf.exists():
        try:
            from harness.moe_gguf import write_moe_gguf
        except ImportError:
            return replace(paths, gguf=None)
        model = AutoModelForCausalLM.from_pretrained(paths.moe, dtype=torch.float32)
        partial = paths.gguf.with_suffix(".partial")
        write_moe_gguf(model, partial, expert_type="Q8_0", dense_type="Q8_0")
        partial.rename(paths.gguf)  # a file that exists is whole
    return paths


def q8_0_files(files: ModelFiles) -> ModelFiles:
    """`files` as a Q8_0 GGUF file would hold them: every matrix in llama.cpp's Q8_0 blocks (made by
    gguf.quants, as harness.moe_gguf writes them), the router and norms kept float."""
    weights = dict(files.weights)
    for name, weight in files.weights.items():
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not name.endswith(_KEPT_FLOAT):
            array = weight.float().numpy()
            blocks = quantize(array, GGMLQuantizationType.Q8_0)
            quantized = as_quantized(np.asarray(blocks), GGMLQuantizationType.Q8_0, tuple(array.shape))
            assert quantized is not None
            weights[name] = quantized
    return replace(files, weights=weights, kind="gguf", quantized_as="gguf")


def engine_model(files: ModelFiles, formats: dict[str, str], batch: int, context: int) -> EngineModel:
    """The model as an engine at `formats` (EngineConfig fields; {} the defaults) builds it from
    `files`, with a KV cache for `batch` sequences of `context` tokens and one more."""
    blocks = batch * _blocks_per_sequence(context)
    config = EngineConfig(model=files.source, cache=CacheConfig(num_blocks=blocks, memory_bytes=None), **formats)
    return load_engine_model(config, files, TensorParallelLayout(), None, torch.device("cpu"))


def _blocks_per_sequence(context: int, block_size: int = CacheConfig.block_size) -> int:
    return -(-(context + 1) // block_size)


def decode_meta(batch: int, context: int, block_size: int) -> AttentionMetadata:
    """One decode step of `batch` sequences that each hold `context` tokens: a new token at position
    `context` for each, sequence i in blocks [i * n, (i + 1) * n)."""
    per = _blocks_per_sequence(context, block_size)
    tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        block_tables=tables,
        query_lens_list=(1,) * batch,
        seq_lens_list=(context + 1,) * batch,
    )


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls after one untimed warm-up call, in ms."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def decode_step_ms(built: EngineModel, batch: int, context: int, repeats: int) -> float:
    """The median ms of the model's decode step (the forward of one token for each of `batch`
    sequences, then their logits) over its KV cache; each repeat rewrites the same slots, so every
    step sees the same context."""
    model, cache = built.model, built.cache
    meta = decode_meta(batch, context, cache.block_size)
    ids = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    positions = torch.full((batch,), context)
    return median_ms(lambda: model.compute_logits(model(ids, positions, cache.kv_caches, meta)), repeats)
