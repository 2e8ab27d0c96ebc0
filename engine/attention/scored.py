"""Torch attention over the blocks a request holds under a KV budget (engine.kv_cache.kv_budget),
with each held block's attention mass as a by-product: what the budget ranks blocks by.

Like engine.attention.windowed, each sequence gathers only the blocks it holds (a freed block may
be reused by any request and hold anything, NaN included) and cuts off the rows past its context
in its last block, which it always holds. Unlike a window, the held blocks are any set, so they
come from the metadata (AttentionMetadata.held_blocks). Keys keep their positions: a query sees
every held key at or before its own position.

The mass of a key is the probability the softmax gives it, summed over the query heads and the
queries from `score_from` on, and over the layers of a step (one backend serves every layer).

A step that needs neither (no query scores, no block was freed: a long prompt's chunks before its
observation window) is the engine's regular attention's, which this backend holds (the runner
decides: engine.runner.ModelRunner._prepare); it writes the same pages and computes the same
outputs up to rounding, through the CPU kernels' ops or Triton and their flash paths, where this
one's masked SDPA computes every pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.attention.reference import DensePrefill, TorchPagedAttention, causal_over_context
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.codec import KVCodec


def _gather(cache: torch.Tensor, blocks: torch.Tensor, rows: int, codec: KVCodec, dtype: torch.dtype) -> torch.Tensor:
    """The first `rows` rows of `blocks` read through `codec`: [rows, num_kv_heads, head_dim]."""
    pages = codec.read(cache, blocks, dtype)
    return pages.reshape(-1, *pages.shape[2:])[:rows]


def scored_over_held(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     held: tuple[int, ...], seq_len: int, score_from: int, scale: float,
                     codec: KVCodec, dense_prefill: DensePrefill | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's queries (the last len(q) of its `seq_len` positions) over its `held` blocks
    (table indices, ascending, the last holding position seq_len - 1): the output
    [len(q), num_heads, head_dim] and each held block's mass [len(held)] (fp32). `dense_prefill`:
    the regular backend's bf16 prompt op (engine.attention.reference.causal_over_context)."""
    query_len, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    if held[-1] != blocks_for(seq_len, block_size) - 1:
        raise ValueError(f"held_blocks: the last block of a context of {seq_len} tokens must be held, got {held}")
    index = torch.tensor(held, device=q.device)
    rows = len(held) * block_size - (blocks_for(seq_len, block_size) * block_size - seq_len)
    keys = _gather(k_cache, block_table[index], rows, codec, q.dtype)
    values = _gather(v_cache, block_table[index], rows, codec, q.dtype)
    key_pos = (index[:, None] * block_size + torch.arange(block_size, device=q.device)).reshape(-1)[:rows]
    query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    visible = key_pos[None, :] <= query_pos[:, None]
    first = min(query_len, max(0, score_from - (seq_len - query_len)))  # the first scoring query row
    mass = torch.zeros(len(held) * block_size, dtype=torch.float32, device=q.device)
    out = None
    if first < query_len:
        num_kv_heads = keys.shape[1]
        # Query head h reads KV head h // groups: [kv heads, groups * n, head_dim] against each KV head's keys.
        scored_q = q[first:].transpose(0, 1).float().reshape(num_kv_heads, -1, head_dim)
        logits = (scored_q @ keys.float().permute(1, 2, 0)) * scale  # [kv heads, groups * n, rows]
        hidden = ~visible[first:].repeat(num_heads // num_kv_heads, 1)
        probs = logits.masked_fill(hidden, float("-inf")).softmax(-1)
        mass[:rows] = probs.sum((0, 1))
        if first == 0:  # every query scores (a decode row): the probabilities give the output too
            out = (probs @ values.float().transpose(0, 1)).reshape(num_heads, query_len, head_dim).transpose(0, 1)
    if out is None and len(held) == held[-1] + 1:
        # Every block held (a prompt before any eviction): the regular backend's causal attention,
        # whose flash passes (or the bf16 prefill op) skip the masked pairs that the mask below makes
        # SDPA compute: a 1,024-token prompt is one step at the default chunk size, and scores
        # (`python -m bench kv_eviction --parts ttft`).
        out = causal_over_context(q, k_cache, v_cache, block_table, seq_len, scale, codec, dense_prefill)
    if out is None:
        queries = q.transpose(0, 1)[None].to(keys.dtype)
        out = F.scaled_dot_product_attention(queries, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                             attn_mask=visible, scale=scale,
                                             enable_gqa=num_heads != keys.shape[1])[0].transpose(0, 1)
    return out.to(q.dtype), mass.view(len(held), block_size).sum(1)


class ScoredAttention:
    """The attention under a KV budget: for a step whose metadata names held blocks, writes pages
    through `codec`, attends each sequence over its held blocks, and keeps the step's mass per held
    block until `take_scores`; any other step is `regular`'s (the backend the engine has without a
    budget, over the same `codec`)."""

    def __init__(self, codec: KVCodec, regular: AttentionBackend) -> None:
        self.codec = codec
        self.regular = regular
        self.name = f"{regular.name} (scoring steps: torch)"
        # A scoring step's prompt rows that hold every block attend as the torch backend's would.
        self._dense_prefill = regular.dense_prefill if isinstance(regular, TorchPagedAttention) else None
        self._meta: AttentionMetadata | None = None  # the step whose layers `_mass` sums
        self._mass: list[torch.Tensor] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """See `AttentionBackend.forward`; `meta` without held_blocks goes to the regular backend."""
        if meta.held_blocks is None or meta.score_from is None:
            return self.regular.forward(q, k, v, k_cache, v_cache, meta, scale)
        self.codec.write(k_cache, v_cache, meta.slot_mapping, k, v)
        if meta is not self._meta:  # a new step's first layer
            self._meta = meta
            self._mass = [torch.zeros(len(held), dtype=torch.float32, device=q.device) for held in meta.held_blocks]
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens_list):
            rows = slice(starts[i], starts[i + 1])
            out[rows], mass = scored_over_held(q[rows], k_cache, v_cache, meta.block_tables[i], meta.held_blocks[i],
                                               seq_len, meta.score_from[i], scale, self.codec, self._dense_prefill)
            self._mass[i] += mass
        return out

    def take_scores(self) -> list[torch.Tensor]:
        """The last step's mass per held block of each sequence (summed over its layers), once."""
        mass, self._mass, self._meta = self._mass, [], None
        return mass
