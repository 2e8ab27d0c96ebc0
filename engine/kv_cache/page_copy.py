"""Copying rows and whole blocks in and out of a paged cache tensor, whatever its format: what the
cache engine and the KV codecs (engine.kv_cache.codec) both move pages with."""

from __future__ import annotations

import torch


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the given blocks out of a cache: [len(block_ids), block_size, num_kv_heads, head_dim].

    index_select on the flattened blocks, because on CPU it is faster than advanced indexing
    (docs/benchmarks.md, "Decisions settled by experiments").
    """
    flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1).long())
    return flat.view(block_ids.numel(), *cache.shape[1:])


def copy_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[index] = rows along dim 0 (rows in the cache's dtype and device).

    Bytes go as int32 words where their rows allow: torch's index_copy_ moves uint8 one element at
    a time, no faster an element than float32, so a quantized page would cost as much as an fp32
    one; as words it moves four bytes for the cost of one element.
    """
    rows = rows.contiguous()
    if cache.dtype == torch.uint8 and rows.shape[-1] % 4 == 0 and rows.storage_offset() % 4 == 0:
        cache, rows = cache.view(torch.int32), rows.view(torch.int32)
    cache.index_copy_(0, index, rows)
