"""StreamingLLM's attention (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
2023): a window plus attention sinks whose positions are those within the cache, not in the text, so
that a conversation may outgrow the model's context and no query ever sees a distance it was not
trained on.

The cache holds keys before the rotary embedding (the model's layers leave q and k unrotated:
engine.model.llama.ModelPlan.rotary_in_attention); each step rotates the keys it gathers and its
queries. A query at text position p sees the sinks 0..S-1 and its window's keys f(p)..p, where
f(p) = max(S, p - W + 1); its cache holds them at 0..S-1 and S..S + p - f(p), so the query is at
p - shift(p), shift(p) = f(p) - S, never beyond S + W - 1 (the paper's example: cache [0, 1, 2, 3,
6, 7, 8] decoding token 9 places them at 0..7).

In a prompt chunk each query has its own cache, so its own shift. Rotary scores depend only on the
difference of the two positions, and the window's keys shift with their query, so the chunk's
queries and window keys are rotated once, in the frame of the chunk's first query (every distance
p - j is the text's). Only the sinks stay put: they are scored against each query rotated at its
own cache position. A query of 2 * head_dim holds both rotations, [q at p - shift(p) | q in the
chunk's frame], and a key [k at j | 0] for a sink and [0 | k in the frame] otherwise, so one product
scores each key in its own frame.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.attention.windowed import gather_held, visible_mask
from engine.kv_cache.codec import KVCodec
from engine.kv_cache.window import KVWindow

# x [n, heads, head_dim] rotated by the model's rotary embedding at `positions` [n], any integers
# (a prompt chunk's frame may pass the model's table): engine.model.rope.RotaryAtAnyPosition.
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def streaming_over_context(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_len: int, scale: float, codec: KVCodec, window: KVWindow,
                           rotate: Rotate) -> torch.Tensor:
    """One sequence's unrotated queries (the last len(q) of its `seq_len` positions) over the keys
    `window` shows each of them, at their cache positions: [len(q), num_heads, head_dim]."""
    query_len, num_heads, _ = q.shape
    first_query = seq_len - query_len
    keys, values, key_pos = gather_held(k_cache, v_cache, block_table, window, first_query, seq_len, codec, q.dtype)
    query_pos = torch.arange(first_query, seq_len, device=q.device)
    sink = key_pos < window.sink_tokens
    frame = window.shift(first_query)
    own = torch.tensor([window.shift(p) for p in range(first_query, seq_len)], device=q.device)
    queries = torch.cat((rotate(q, query_pos - own), rotate(q, query_pos - frame)), dim=-1)
    sink_keys = torch.where(sink[:, None, None], rotate(keys, key_pos), 0)
    window_keys = torch.where(sink[:, None, None], 0, rotate(keys, key_pos - frame))
    keys = torch.cat((sink_keys, window_keys), dim=-1).transpose(0, 1)[None]
    mask = visible_mask(window, key_pos, query_pos[:, None])
    out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys, values.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=num_heads != keys.shape[1])
    return out[0].transpose(0, 1).to(q.dtype)


class StreamingAttention:
    """The torch backend under StreamingLLM's window (see the module): each sequence in turn, decode
    rows too, over only the blocks it holds (engine.attention.windowed). Pages are written through
    `codec` unrotated; reading decodes them (int4's Hadamard rotation undone) before the rotary
    embedding is applied, so every KV format serves."""

    name = "torch"

    def __init__(self, codec: KVCodec, window: KVWindow, rotate: Rotate) -> None:
        if not window.cache_positions:
            raise ValueError("StreamingAttention: the window's positions must be the cache's")
        self.codec = codec
        self.window = window
        self.rotate = rotate

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """See `AttentionBackend.forward`; q and k come unrotated."""
        self.codec.write(k_cache, v_cache, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens_list):
            out[starts[i]: starts[i + 1]] = streaming_over_context(
                q[starts[i]: starts[i + 1]], k_cache, v_cache, meta.block_tables[i], seq_len, scale, self.codec,
                self.window, self.rotate)
        return out
