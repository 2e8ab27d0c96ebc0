"""KV pages between the ranks of a tensor-parallel engine and the form they leave and enter it in.

Each rank's cache holds the KV heads its layout gives it (engine.parallel.layout); pages that leave
the engine (to a decode worker) or enter it (from a prefill worker) carry the whole model's KV heads
in order, whatever either side's tensor-parallel size. So a prefill engine's rank 0 gathers every
rank's heads of the exported blocks (one gather per layer), and a decode engine's rank 0 scatters
each rank the heads it owns (one scatter per layer): rank 0 relays, and the two sides' layouts never
need to match. With replicated KV heads the gather keeps each head once (from the first rank holding
it) and the scatter sends each replica its copy.

Pages are [n, block_size, heads, row] (a quantized row carries its scale: engine.kv_cache.codec), so
splitting and joining along the head dimension keeps every scale with its head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.parallel.layout import TensorParallelLayout

_HEADS = 2  # the head dimension of a [n, block_size, heads, row] page


def kv_head_ranges(config: ModelConfig, size: int) -> list[range]:
    """The KV heads each rank of a `size`-rank engine of `config`'s model holds, in rank order."""
    return [TensorParallelLayout(size, rank).kv_heads(config) for rank in range(size)]


class RankKVHeads:
    """One rank's side of moving pages between its cache's heads and the whole model's."""

    def __init__(self, config: ModelConfig, size: int, group: dist.ProcessGroup) -> None:
        self.heads = kv_head_ranges(config, size)
        self.group = group
        # The rank each head is taken from when joining: the first that holds it.
        taken: set[int] = set()
        self._joined: list[int] = []
        for rank, heads in enumerate(self.heads):
            if heads.start not in taken:
                taken.update(heads)
                self._joined.append(rank)

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: this rank's pages joined with every other rank's (which call `send`) into pages
        of all KV heads."""
        mine = torch.stack([k, v])
        parts = [torch.empty_like(mine) for _ in self.heads]
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather([parts], [mine], options).wait()
        whole = torch.cat([parts[rank] for rank in self._joined], dim=_HEADS + 1)
        return whole[0], whole[1]

    def send(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Ranks 1..: hand this rank's pages to rank 0's `gather`."""
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather([], [torch.stack([k, v])], options).wait()

    def scatter(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: give every other rank (which calls `receive`) its heads of pages of all KV heads;
        return this rank's."""
        whole = torch.stack([k, v])
        parts = [whole.narrow(_HEADS + 1, heads.start, len(heads)).contiguous() for heads in self.heads]
        mine = torch.empty_like(parts[0])
        options = dist.ScatterOptions()
        options.rootRank = 0
        self.group.scatter([mine], [parts], options).wait()
        return mine[0], mine[1]

    def receive(self, page_shape: torch.Size, blocks: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Ranks 1..: this rank's heads of `blocks` pages from rank 0's `scatter` (`page_shape`: one
        page of this rank's cache)."""
        mine = torch.empty(2, blocks, *page_shape, dtype=dtype, device=device)
        options = dist.ScatterOptions()
        options.rootRank = 0
        self.group.scatter([mine], [], options).wait()
        return mine[0], mine[1]
