"""Prefill context parallelism: one long prompt's prefill split across ranks by sequence.

`--prefill-context-parallel-size N` starts N - 1 ranks beside the engine (engine.parallel.group),
each holding the whole model. A step that computes one whole prompt of at least
`--prefill-context-parallel-min-tokens` tokens with nothing cached (`split`) gives rank r the
contiguous slice of tokens [bounds[r], bounds[r + 1]): every product, norm and MLP of a token runs on
the rank holding it. A later slice's queries attend over more keys, so the slices are cut for equal
work, not equal tokens: tokens [0, x) cost c_p·x + c_a·x²/2 (c_p a token's products, c_a one
query-key pair's attention, per layer: `attention_ratio` = c_a / c_p), and rank r's slice ends
where that reaches (r + 1)/N of the whole (the first slices are the longer).

Attention is the one place tokens meet. Each layer, every rank's slice of K and V is all-gathered
(one collective of [slice, KV heads, 2 x head size], the padded slices of every rank), written into
each rank's cache, and each rank's queries attend over the prompt up to their own end. All-gather
rather than a ring: the pages must land in rank 0's cache anyway (that is where the request decodes
or whence they are exported, layer by layer, as any prefill's), and with grouped KV heads a layer's
K/V are a small part of its traffic; a ring would bound each rank's K/V memory to two slices, which
pays for contexts beyond one rank's memory, not here.

Only rank 0 keeps the pages: the other ranks write the prompt into blocks 0.. of their own cache as
scratch for the step, so a prompt with a cached prefix (whose pages only rank 0 holds), a chunk of a
longer prompt, or a step with other requests in it runs on rank 0 alone as usual. The last token's
final hidden state is broadcast from the rank holding it, and rank 0 samples.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.parallel.step_plan import SequencePlan
from engine.scheduler import SchedulerOutput


def split(out: SchedulerOutput, size: int, min_tokens: int, attention_ratio: float) -> list[int] | None:
    """The slices' bounds (size + 1 token indices, each slice of equal work: see the module) when
    this step is one whole prompt computed from its start (nothing cached, no drafts) of at least
    `min_tokens` tokens; None otherwise."""
    if size == 1 or len(out.chunks) != 1:
        return None
    chunk = out.chunks[0]
    whole = chunk.start == 0 and chunk.num_tokens == chunk.request.num_tokens and not chunk.draft_token_ids
    tokens = chunk.num_tokens
    if not whole or tokens < max(min_tokens, size):
        return None
    total = tokens + attention_ratio * tokens * tokens / 2

    def end(share: float) -> int:  # the x where x + ratio·x²/2 = share, in whole tokens
        target = share * total
        x = target if attention_ratio == 0 else (math.sqrt(1 + 2 * attention_ratio * target) - 1) / attention_ratio
        return round(x)

    bounds = [0, *(end(rank / size) for rank in range(1, size)), tokens]
    # Every rank keeps at least one token.
    for rank in range(1, size):
        bounds[rank] = min(max(bounds[rank], bounds[rank - 1] + 1), tokens - (size - rank))
    return bounds


def attention_ratio(config: ModelConfig) -> float:
    """One query-key pair's attention over one token's products, per layer, in multiply-adds (the
    experts a token runs, for a mixture of experts)."""
    attention = config.hidden_size * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    attention += config.num_heads * config.head_dim * config.hidden_size
    moe = config.moe
    mlp = 3 * config.hidden_size * (config.intermediate_size if moe is None else
                                    moe.top_k * moe.intermediate_size + moe.shared_intermediate_size)
    return 2 * config.num_heads * config.head_dim / (attention + mlp)


class ContextParallelAttention:
    """An attention backend's stand-in on every rank: during a split step (`begin` .. `end`) it joins
    the ranks' K/V before attending; otherwise it is the backend itself."""

    def __init__(self, inner: AttentionBackend, group: dist.ProcessGroup, rank: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.codec = inner.codec  # type: ignore[attr-defined]
        self.group = group
        self.rank = rank
        # During a split step: each rank's slice length, and the other ranks' tokens (their rows of
        # the gathered K/V, and their slots in this rank's cache), the same for every layer.
        self._lengths: list[int] | None = None
        self._others = torch.empty(0, dtype=torch.long)
        self._other_slots = torch.empty(0, dtype=torch.long)

    def begin(self, slots: torch.Tensor, bounds: list[int]) -> None:
        """The coming forward pass is this rank's slice of a split prompt whose tokens go to `slots`."""
        self._lengths = [end - start for start, end in itertools.pairwise(bounds)]
        start, end = bounds[self.rank], bounds[self.rank + 1]
        self._others = torch.cat([torch.arange(0, start), torch.arange(end, len(slots))]).to(slots.device)
        self._other_slots = slots[self._others]

    def end(self) -> None:
        self._lengths = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """See AttentionBackend.forward; in a split step the other ranks' K/V are written first."""
        if self._lengths is not None:
            keys, values = self._gather(k, v, self._lengths)
            if len(self._others):
                self.codec.write(k_cache, v_cache, self._other_slots, keys[self._others], values[self._others])
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale)

    def _gather(self, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's slice of K and V, in token order (slices padded to the longest for the gather)."""
        longest = max(lengths)
        mine = torch.cat((k, v), dim=-1)
        padded = torch.nn.functional.pad(mine, (0, 0, 0, 0, 0, longest - mine.shape[0])).contiguous()
        parts = [torch.empty_like(padded) for _ in lengths]
        self.group.allgather([parts], [padded]).wait()
        joined = torch.cat([part[:length] for part, length in zip(parts, lengths, strict=True)])
        return joined.split(k.shape[-1], dim=-1)


def wrap_attention(model: LlamaForCausalLM, group: dist.ProcessGroup, rank: int) -> ContextParallelAttention:
    """Put one ContextParallelAttention in front of every layer's backend; it is returned."""
    attention = ContextParallelAttention(model.layers[0].attention, group, rank)
    for layer in model.layers:
        layer.attention = attention
    return attention


def slice_meta(bounds: list[int], rank: int, slots: torch.Tensor, block_table: torch.Tensor) -> AttentionMetadata:
    """Rank `rank`'s slice as a chunk of its own: its queries are the last of a context ending at its
    slice's end, over the whole prompt's block table."""
    start, end = bounds[rank], bounds[rank + 1]
    device = slots.device
    return AttentionMetadata(
        slot_mapping=slots[start:end],
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        block_tables=block_table[None, :].to(device, torch.int32),
        query_lens_list=(end - start,),
        seq_lens_list=(end,),
    )


def run_slice(model: LlamaForCausalLM, attention: ContextParallelAttention, group: dist.ProcessGroup,
              rank: int, input_ids: torch.Tensor, bounds: list[int], slots: torch.Tensor, block_table: torch.Tensor,
              kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
              on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
    """Rank `rank`'s part of a split prompt (every rank calls it): its slice through the model, then
    the last token's final hidden state [1, hidden] from the last rank, returned on every rank."""
    start, end = bounds[rank], bounds[rank + 1]
    positions = torch.arange(start, end, device=input_ids.device)
    attention.begin(slots, bounds)
    try:
        hidden = model(input_ids[start:end], positions, kv_caches, slice_meta(bounds, rank, slots, block_table),
                       on_layer_done)
    finally:
        attention.end()
    size = len(bounds) - 1
    last = hidden[-1:].contiguous() if rank == size - 1 else torch.empty_like(hidden[:1])
    options = dist.BroadcastOptions()
    options.rootRank = size - 1
    group.broadcast([last], options).wait()
    return last


class ContextParallelPrefill:
    """Rank 0's side: which steps split (`split`), and running one (`run`) beside the other ranks."""

    def __init__(self, model: LlamaForCausalLM, group: dist.ProcessGroup, send: Callable[[SequencePlan], None],
                 size: int, min_tokens: int) -> None:
        """`send` hands the other ranks each split prompt (engine.parallel.group)."""
        self.model = model
        self.group = group
        self.attention = wrap_attention(model, group, 0)
        self._send = send
        self.size = size
        self.min_tokens = min_tokens
        self.attention_ratio = attention_ratio(model.config)

    def split(self, out: SchedulerOutput) -> list[int] | None:
        """The slices' bounds where this step splits, else None."""
        return split(out, self.size, self.min_tokens, self.attention_ratio)

    def run(self, input_ids: torch.Tensor, bounds: list[int], meta: AttentionMetadata,
            kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
            on_layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """The prompt (one chunk: `meta`'s) computed across the ranks, its pages in this rank's cache as
        each layer's are complete (`on_layer_done` then runs); the last token's final hidden state [1, H]."""
        self._send(SequencePlan(input_ids, bounds))
        return run_slice(self.model, self.attention, self.group, 0, input_ids, bounds, meta.slot_mapping,
                         meta.block_tables[0], kv_caches, on_layer_done)
