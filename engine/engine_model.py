"""What one engine computes with, resolved and loaded: its formats, its model and its KV cache
tensors. A tensor-parallel engine's every rank loads one, each holding its shard (engine.parallel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from engine.attention.scored import ScoredAttention
from engine.attention.selector import select_attention_backend, windowed_attention
from engine.config import EngineConfig, ModelConfig
from engine.dtypes import TORCH_DTYPES
from engine.formats import EngineFormats, choose_dtype, resolve_formats
from engine.hardware import probe
from engine.kv_cache.cache_engine import CacheEngine, bytes_per_block
from engine.kv_cache.codec import KVFormat, kv_format
from engine.kv_cache.kv_budget import KVBudget, kv_budget
from engine.kv_cache.window import KVWindow, check_window_served, kv_window
from engine.model.int8_activations import PARTS
from engine.model.kernels import cpu_kernels
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import ModelFiles, build_model, load_model_files
from engine.model.quant_config import check_requested
from engine.model.quantized import Weight
from engine.model.rope import RotaryAtAnyPosition
from engine.model.weight_formats import choose_quantization
from engine.parallel.collectives import TensorParallelSharding
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.pipeline_layout import PipelineLayout
from engine.parallel.shard import shard_files, shard_tensor


@dataclass(frozen=True)
class EngineModel:
    """One rank's model and KV cache tensors, and what they were resolved to."""

    config: ModelConfig  # the whole model's
    source: str  # the checkpoint's path
    dtype: torch.dtype
    quantization: str  # the weight format served
    formats: EngineFormats
    kv_format: KVFormat
    model: LlamaForCausalLM
    cache: CacheEngine
    attention: str  # the attention backend's name
    window: KVWindow | None  # the sliding window attention runs with; None: full attention
    budget: KVBudget | None  # the KV budget requests are evicted under; None: none
    scored: ScoredAttention | None  # the attention that scores blocks under `budget`


def load_engine_model(config: EngineConfig, files: ModelFiles | None, layout: TensorParallelLayout,
                      group: object | None, device: torch.device,
                      stage: PipelineLayout | None = None) -> EngineModel:
    """Resolve `config`'s formats on `device`, load the model (or use already loaded `files`) and
    keep rank `layout.rank`'s shard, made whole with the other ranks of `group` (a process group;
    None at size 1), of pipeline stage `stage`'s layers (None: every layer). ValueError naming the
    field for a format the device has no kernel for, or a size the model cannot be split by."""
    stage = stage or PipelineLayout()
    hardware = probe(config.device)
    dtype_name = choose_dtype(config.dtype, hardware).dtype
    dtype = TORCH_DTYPES[dtype_name]
    kv = kv_format(config.kv_cache_dtype, dtype_name)
    # Before loading: a KV format the device's kernels cannot read fails at once.
    cpu_ops = cpu_kernels(config.device)
    attention = select_attention_backend(config.attention_backend, config.device, kv.codec,
                                         None if cpu_ops is None else cpu_ops.decode_attention,
                                         None if cpu_ops is None else cpu_ops.prefill_attention)
    if files is None:  # each rank reads only its shard: the whole model is never in one process
        keep = None if layout.size == stage.size == 1 else functools.partial(_keep, layout, stage)
        files = load_model_files(config.model, dtype, config.quantization, keep)
        shard = files if layout.size == 1 else replace(files, config=layout.shard_config(files.config))
    else:
        check_requested(config.quantization, files.stored_format, files.source)
        shard = shard_files(files, layout)
        shard = replace(shard, weights={name: weight for name, weight in shard.weights.items()
                                        if stage.keep(files.config, name, weight) is not None})
    layout.check(files.config)  # at size 1 no tensor was cut, yet an expert layout of a dense model is refused
    shard = replace(shard, config=stage.stage_config(shard.config))
    window = kv_window(config, files.config)
    check_window_served(config, files.config, window)
    if window is not None:
        attention = windowed_attention(attention, window, RotaryAtAnyPosition(files.config, device))
    budget = kv_budget(config, files.config)
    # Under a budget a step whose queries score blocks, or that reads a request whose blocks were
    # freed, takes the torch attention that gathers only held blocks (engine.attention.scored): the
    # CPU kernels' ops and Triton attend over whole contexts, and a freed block must never be read.
    # The other steps (a long prompt's chunks before its observation window) are the regular
    # backend's, which it wraps. No decode stack is built over it (DecodeStack.build sees no torch
    # backend), which costs nothing: every decode step scores, so none could run in it.
    scored = None if budget is None else ScoredAttention(kv.codec, attention)
    if scored is not None:
        attention = scored
    quantization = choose_quantization(config.quantization, files.quantized_as, config.device)
    formats = resolve_formats(config, hardware, quantization)
    block_size = config.cache.block_size
    # Every pipeline stage holds as many blocks as the stage of the most layers can.
    block_bytes = bytes_per_block(replace(shard.config, num_layers=stage.budget_layers(files.config)), block_size,
                                  kv)  # checks the format fits the model
    sharding = None if group is None else TensorParallelSharding(layout, files.config, group)
    model = build_model(shard, attention, device, quantization, formats.cpu_weights, dtype,
                        PARTS.get(formats.activation_quantization, 0), sharding)
    # --kv-cache-mib is each rank's budget: every rank holds the same number of blocks of its heads.
    num_blocks = config.cache.num_blocks or max(1, (config.cache.memory_bytes or 0) // block_bytes)
    cache = CacheEngine(shard.config, num_blocks, block_size, kv, device)
    return EngineModel(files.config, files.source, dtype, quantization, formats, kv, model, cache, attention.name,
                       window, budget, scored)


def _keep(layout: TensorParallelLayout, stage: PipelineLayout, config: ModelConfig, name: str,
          weight: Weight) -> Weight | None:
    """A rank's part of a tensor as it is read: only its pipeline stage's, and of that its shard."""
    if stage.keep(config, name, weight) is None:
        return None
    return weight if layout.size == 1 else shard_tensor(layout, config, name, weight)
