"""Torch attention under a sliding window (engine.kv_cache.window), for the torch backend.

The blocks a window hides are freed and may be reused by any request, holding anything (NaN
included), so masking them after reading is not enough: 0 * NaN is NaN. Each sequence therefore
gathers only the blocks it still holds: its sinks' and those from its first query's window on. The
rows of those blocks that a query must not see are this request's own (finite) keys, masked; the
rows past the context in its last block are cut off, never read into the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.codec import KVCodec
from engine.kv_cache.window import KVWindow


def held_positions(window: KVWindow, block_size: int, first_query: int, seq_len: int) -> list[range]:
    """The token ranges, whole blocks but the last, that queries from `first_query` on to `seq_len`
    may read: the sinks and the blocks from the first query's window on (merged when they meet)."""
    sinks = window.sink_tokens // block_size * block_size
    start = window.first_needed(first_query) // block_size * block_size
    if start <= sinks:
        return [range(0, seq_len)]
    return ([range(0, sinks)] if sinks else []) + [range(start, seq_len)]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, ranges: list[range], codec: KVCodec,
            dtype: torch.dtype) -> torch.Tensor:
    """The rows of `ranges` (block-aligned starts) read through `codec`: [n, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    parts = []
    for span in ranges:
        first, end = span.start // block_size, blocks_for(span.stop, block_size)
        rows = codec.read(cache, block_table[first:end], dtype)
        parts.append(rows.reshape(-1, *rows.shape[2:])[: len(span)])
    return torch.cat(parts)


def gather_held(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, window: KVWindow,
                first_query: int, seq_len: int, codec: KVCodec,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values [n, num_kv_heads, head_dim] that queries from `first_query` on may read,
    and their positions [n]."""
    ranges = held_positions(window, k_cache.shape[1], first_query, seq_len)
    keys = _gather(k_cache, block_table, ranges, codec, dtype)
    values = _gather(v_cache, block_table, ranges, codec, dtype)
    return keys, values, torch.cat([torch.arange(span.start, span.stop, device=keys.device) for span in ranges])


def visible_mask(window: KVWindow, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """`window.visible` over tensors: [len(query_pos), len(key_pos)] for query_pos [n, 1]."""
    return (key_pos <= query_pos) & ((key_pos > query_pos - window.size) | (key_pos < window.sink_tokens))


def windowed_over_context(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_len: int, scale: float, codec: KVCodec, window: KVWindow) -> torch.Tensor:
    """One sequence's queries (the last len(q) of its `seq_len` positions) over the keys `window`
    shows each of them: [len(q), num_heads, head_dim]."""
    query_len, num_heads, _ = q.shape
    keys, values, key_pos = gather_held(k_cache, v_cache, block_table, window, seq_len - query_len, seq_len, codec,
                                        q.dtype)
    mask = visible_mask(window, key_pos, torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(keys.dtype), keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=num_heads != keys.shape[1])
    return out[0].transpose(0, 1).to(q.dtype)


def windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, codec: KVCodec, window: KVWindow) -> torch.Tensor:
    """Every sequence of the batch in turn (decode rows too: each gathers its own held blocks)."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_list):
        out[starts[i]: starts[i + 1]] = windowed_over_context(
            q[starts[i]: starts[i + 1]], k_cache, v_cache, meta.block_tables[i], seq_len, scale, codec, window)
    return out
