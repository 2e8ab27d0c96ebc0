"""How much memory an engine will hold, told from its files' headers before any weight is read.

A hot swap in one worker process (services.decode.model_swap) loads a new version beside the one
serving, so it must know whether both fit before it starts. An engine holds its weights in the
format it serves them in and its KV cache; the rest (kernels, tokenizer, activations) is small
beside them and is covered by measuring the process as it is, not predicted:

- weights: each tensor's elements at the served format's size: the checkpoint's own bytes where the
  integer groups are served as stored ("gguf", "gptq", "awq"), one byte an element for "int8", the
  dtype's size for float weights ("none"). The headers (GGUF's tensor table, safetensors' JSON)
  give the counts without reading the data (a safetensors checkpoint's own bytes are its files');
- the KV cache: its memory budget, or its explicit block count times a block's bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod

import torch
from safetensors import safe_open

from engine.config import EngineConfig
from engine.formats import choose_dtype
from engine.hardware import probe
from engine.kv_cache.cache_engine import bytes_per_block
from engine.kv_cache.codec import kv_format
from engine.model.gguf_file import gguf_reader
from engine.model.gguf_loader import gguf_model_config
from engine.model.hf_loader import config_from_hf, safetensors_files
from engine.model.paths import default_model_path
from engine.model.quant_config import read_checkpoint_quantization
from engine.model.weight_formats import OWN_GROUPS, choose_quantization


@dataclass(frozen=True)
class Footprint:
    """An engine's predicted weights and KV cache, in bytes."""

    weight_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        """Both together."""
        return self.weight_bytes + self.kv_cache_bytes


@dataclass(frozen=True)
class _Tensors:
    elements: int  # every tensor's elements
    stored_bytes: int  # as the checkpoint holds them (a safetensors file's header included)


def predict_footprint(config: EngineConfig) -> Footprint:
    """The weights and KV cache an Engine for `config` will hold (one rank's share under tensor
    parallelism is about 1/N of the weights; this is the whole). ValueError naming the field, as
    the engine would, for a format the checkpoint or device cannot take; OSError for unreadable files."""
    path = config.model or default_model_path()
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
            raw = json.load(file)
        model = config_from_hf(raw)
        quantization = read_checkpoint_quantization(raw, path)
        stored_as = None if quantization is None else quantization.method
        tensors = _safetensors_tensors(path)
    else:
        reader = gguf_reader(path)
        model = gguf_model_config(reader, path)
        stored_as = "gguf"
        tensors = _Tensors(sum(int(t.n_elements) for t in reader.tensors), sum(int(t.n_bytes) for t in reader.tensors))
    served = choose_quantization(config.quantization, stored_as, config.device)
    dtype = choose_dtype(config.dtype, probe(config.device)).dtype
    if served in OWN_GROUPS:
        weight_bytes = tensors.stored_bytes
    elif served == "int8":
        weight_bytes = tensors.elements
    else:
        weight_bytes = tensors.elements * getattr(torch, dtype).itemsize
    cache = config.cache
    if cache.num_blocks is not None:
        kv_bytes = cache.num_blocks * bytes_per_block(model, cache.block_size, kv_format(config.kv_cache_dtype, dtype))
    else:
        kv_bytes = cache.memory_bytes or 0
    return Footprint(weight_bytes, kv_bytes)


def _safetensors_tensors(path: str) -> _Tensors:
    """Every tensor's elements (from the safetensors headers) and the bytes the files hold."""
    elements = stored = 0
    for shard in safetensors_files(path):
        with safe_open(shard, framework="pt") as file:
            elements += sum(prod(file.get_slice(name).get_shape()) for name in file.keys())  # noqa: SIM118
        stored += os.path.getsize(shard)
    return _Tensors(elements, stored)


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
