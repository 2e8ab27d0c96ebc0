"""What one forward pass tells the attention layers about the batch's KV layout."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Batch layout shared by every layer of one forward pass.

    Tokens of all sequences are packed into one flat dimension T. Sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`, which are the *last* query_len tokens of its
    context of `seq_lens[i]` tokens; the KV of the whole context lives in the blocks of
    `block_tables[i]` once this step's keys and values are written at `slot_mapping`.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, per new token
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_list: tuple[int, ...]  # host copies, so backends need no device sync
    seq_lens_list: tuple[int, ...]
    # Under a KV budget (engine.kv_cache.kv_budget), for engine.attention.scored: each sequence's
    # table indices of the blocks it holds (the others were freed and may hold anything), and the
    # first query position whose attention scores them. None without a budget.
    held_blocks: tuple[tuple[int, ...], ...] | None = None
    score_from: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.seq_lens_list)

    @property
    def max_query_len(self) -> int:
        """Longest query in the batch (1 for a pure decode batch)."""
        return max(self.query_lens_list)

    @property
    def max_seq_len(self) -> int:
        """Longest context in the batch."""
        return max(self.seq_lens_list)

    @cached_property
    def per_query_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables [T, max_blocks], seq_lens [T]) with one entry per query row, as if each row
        were a decode row of its own: row j of a sequence's n sees its context up to itself, the
        first seq_len - n + j + 1 tokens. Computed once per pass (every layer asks)."""
        if self.max_query_len == 1:
            return self.block_tables, self.seq_lens
        lens = [seq_len - n + j + 1 for n, seq_len in zip(self.query_lens_list, self.seq_lens_list, strict=True)
                for j in range(n)]
        owners = torch.repeat_interleave(torch.arange(self.num_seqs, device=self.block_tables.device),
                                          torch.tensor(self.query_lens_list, device=self.block_tables.device))
        return (self.block_tables[owners].contiguous(),
                torch.tensor(lens, dtype=self.seq_lens.dtype, device=self.seq_lens.device))


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends over each sequence's context.

    The cache holds pages in the format chosen at load (engine.kv_cache.codec); the backend was
    made with its codec, so it alone encodes and decodes them: callers pass the tensors through.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, *page shape]: [block_size, num_kv_heads, head_dim] for values
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attention output for every query token."""
        ...

