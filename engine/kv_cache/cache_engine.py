"""The paged KV cache tensors, and moving whole blocks in and out of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.kv_cache.page_copy import copy_rows, gather_blocks

if TYPE_CHECKING:
    from engine.kv_cache.codec import KVFormat


def bytes_per_block(model: ModelConfig, block_size: int, kv_format: KVFormat) -> int:
    """Memory one block takes across all layers, K and V (a quantized format's scales included)."""
    return 2 * model.num_layers * kv_format.page_bytes(block_size, model.num_kv_heads, model.head_dim)


def check_pages(k: torch.Tensor, v: torch.Tensor, blocks: int, page_shape: tuple[int, ...],
                cache_dtype: torch.dtype) -> None:
    """ValueError unless `k` and `v` are `blocks` pages of `page_shape` a cache of `cache_dtype` takes."""
    if tuple(k.shape) != (blocks, *page_shape) or v.shape != k.shape:
        raise ValueError(f"kv blocks: expected [{blocks}, {', '.join(map(str, page_shape))}], "
                         f"got k {list(k.shape)} and v {list(v.shape)}")
    if cache_dtype == torch.uint8 and not k.dtype == v.dtype == torch.uint8:
        # Values converted to uint8 would pass for codes: a quantized cache takes its own pages only.
        raise ValueError(f"kv blocks: this cache holds uint8 pages (codes and scales), got {k.dtype} and {v.dtype}")


class CacheEngine:
    """Per-layer K and V tensors of shape [num_blocks, *page shape]: [num_blocks, block_size,
    num_kv_heads, head_dim] for values, head_dim + 4 bytes per row for a quantized format
    (engine.kv_cache.codec). Blocks move in and out as pages of that format, scales included."""

    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, kv_format: KVFormat, device: torch.device
    ) -> None:
        shape = (num_blocks, *kv_format.page_shape(block_size, model.num_kv_heads, model.head_dim))
        dtype = kv_format.storage_dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]

    @property
    def num_layers(self) -> int:
        """Number of decoder layers with a cache."""
        return len(self.kv_caches)

    def gather_blocks(self, layer: int, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A contiguous copy of some blocks of one layer: two [n, *page shape] tensors."""
        k_cache, v_cache = self.kv_caches[layer]
        index = torch.tensor(list(block_ids), device=k_cache.device, dtype=torch.long)
        return gather_blocks(k_cache, index), gather_blocks(v_cache, index)

    def scatter_blocks(self, layer: int, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write received blocks of one layer into the given block ids."""
        k_cache, v_cache = self.kv_caches[layer]
        check_pages(k, v, len(block_ids), tuple(k_cache.shape[1:]), k_cache.dtype)
        index = torch.tensor(list(block_ids), device=k_cache.device, dtype=torch.long)
        copy_rows(k_cache, index, k.to(device=k_cache.device, dtype=k_cache.dtype))
        copy_rows(v_cache, index, v.to(device=v_cache.device, dtype=v_cache.dtype))
