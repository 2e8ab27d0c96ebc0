"""The KV connector's export: which KV pages each layer of a step wrote for a request, handed to where they go.

A request added with a `KVExport` gets its pages pushed layer by layer while later layers compute:
as soon as a layer has written the step's KV, the engine gathers the blocks of each such request that
the receiver does not hold yet and hands them to the request's sink. Only the engine knows the
blocks; the sink sees destination indices (0 is the first block the receiver lacks).

Under a sliding window (engine.kv_cache.window) a chunk's blocks are gathered in the step that
wrote them, before the window frees them. A model's own window hides a head of the prompt from the
receiver's first query: the receiver counts it as held (`receiver_cached_tokens`), so only the
window's blocks ship. With sinks what is hidden is not a head, and every block ships; the receiver
frees the hidden ones once the pages are in.

Under a KV budget (engine.kv_cache.kv_budget) the receiver reserves only the blocks the prompt
keeps, k of its n, in table order: the kept block at table index i lands in the receiver's j-th
block when it is the j-th kept one. Which older blocks survive is known only once the prompt's
last chunk has scored them, after its last layer (scores sum over layers); but the blocks of the
recent window (`KVBudget.surely_kept_from`; every block, for a prompt within the budget) survive
whatever the scores, and they are the last of the kept ones, so block i of them goes to i - (n - k).
So a budgeted export pushes those layer by layer as they are computed, like any export, and holds
the older blocks; once the step that computed the prompt's end has scored them, the engine picks
the kept ones exactly as the receiver's eviction would, and hands the sink their indices and scores
(`KVSink.kept`) and then every layer's pages of the held kept ones (destinations 0, 1, ...) at once.
Those, at most the budget less its recent window, are the transfer that compute does not hide;
holding everything until scored would expose the whole budget's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class LayerPages:
    """One layer's K and V for the receiver's blocks [first_block, first_block + len(k)), each
    [n, *page shape] as the cache stores them: a quantized cache's rows carry their scales
    (engine.kv_cache.codec), so the scales go wherever the pages go."""

    layer: int
    first_block: int
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together (scales included)."""
        return self.k.nbytes + self.v.nbytes


class KVSink(Protocol):
    """Where one request's pages go. Called on the engine thread, inside the step, so it must be
    quick and must not raise (a transfer's failure is its own request's, never the step's)."""

    def layer_done(self, layer: int, pages: LayerPages | None) -> None:
        """A layer of a step that computed part of the request is done; `pages` are the blocks it
        wrote that the receiver needs (None when it wrote only blocks the receiver holds)."""
        ...

    def kept(self, kept: KeptBlocks) -> None:
        """Under a budget, once the prompt is computed and before its pages: the blocks it keeps
        (their table indices, in the order their pages follow) and their scores."""
        ...


@dataclass(frozen=True)
class KVExport:
    """Push a request's pages to `sink`, except the blocks of the receiver's own prefix-cache hit
    (its first `receiver_cached_tokens` tokens); under the receiver's `budget`, only the blocks the
    prompt keeps: its recent window's as computed, the older ones once it is scored."""

    sink: KVSink
    receiver_cached_tokens: int = 0
    budget: KVBudget | None = None
    # The fingerprint of the LoRA adapter the receiver runs the request under (b"": the base): the
    # engine computes the prompt only under the same (engine.lora.identity).
    adapter_fingerprint: bytes = b""


@dataclass
class _Progress:
    export: KVExport
    skip: int  # block i goes to the receiver's index i - skip (the receiver holds or drops the first skip)
    first: int  # the first block pushed as computed (under a budget, those before it wait: take_budgeted)
    next_block: int  # first block never sent


@dataclass(frozen=True)
class ExportRange:
    """The blocks [first, end) of a request (this engine's block indices) a step's layers export."""

    request_id: str
    first: int
    end: int


class KVExports:
    """The requests whose pages go out as they are computed, and what each has sent so far."""

    def __init__(self, block_size: int, num_layers: int) -> None:
        self._block_size = block_size
        self._last_layer = num_layers - 1
        self._progress: dict[str, _Progress] = {}

    def __bool__(self) -> bool:
        return bool(self._progress)

    def add(self, request_id: str, export: KVExport, num_tokens: int) -> None:
        """Start exporting the pages of a request of `num_tokens` known tokens (before its first step)."""
        skip = first = export.receiver_cached_tokens // self._block_size
        if export.budget is not None:
            num_blocks = blocks_for(num_tokens, self._block_size)
            skip = num_blocks - export.budget.kept_count(num_blocks, num_tokens)
            first = export.budget.surely_kept_from(num_tokens)
        self._progress[request_id] = _Progress(export, skip, first, first)

    def drop(self, request_id: str) -> None:
        """Stop exporting: no page of the request reaches its sink after this."""
        self._progress.pop(request_id, None)

    def take_budgeted(self, request_ids: Sequence[str]) -> list[tuple[str, KVSink, KVBudget, int]]:
        """Of the requests whose prompt a step just computed, those exported under a budget: their
        sink, budget, and the first block pushed as computed (the kept ones before it go now). No
        later step exports them."""
        taken = []
        for request_id in request_ids:
            progress = self._progress.get(request_id)
            if progress is not None and progress.export.budget is not None:
                taken.append((request_id, progress.export.sink, progress.export.budget, progress.first))
                del self._progress[request_id]
        return taken

    def ranges(self, chunks: Sequence[ScheduledChunk]) -> list[ExportRange]:
        """The blocks each exported request of a step gets after every layer (empty when the step
        writes only blocks its receiver holds); the same for every layer of the step."""
        ranges = []
        for chunk in chunks:
            progress = self._progress.get(chunk.request.request_id)
            if progress is not None:
                ranges.append(ExportRange(chunk.request.request_id, *self._pages_written(chunk, progress)))
        return ranges

    def layer_done(self, layer: int, ranges: Sequence[ExportRange],
                   pages: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Hand each of a step's exported requests the pages `layer` wrote for it: `pages` are the K
        and V of every range's blocks, in the ranges' order (None when no range has a block)."""
        offset = 0
        for export in ranges:
            progress = self._progress[export.request_id]
            count = max(0, export.end - export.first)
            layer_pages = None
            if count and pages is not None:
                k, v = (part.narrow(0, offset, count) for part in pages)
                layer_pages = LayerPages(layer, export.first - progress.skip, k, v)
            offset += count
            progress.export.sink.layer_done(layer, layer_pages)
            if layer == self._last_layer:
                progress.next_block = max(progress.next_block, export.end)

    def _pages_written(self, chunk: ScheduledChunk, progress: _Progress) -> tuple[int, int]:
        # The chunk wrote tokens [start, start + num_tokens). Its first block may be one an earlier
        # chunk left partly filled (sent again, now fuller); blocks before it that were never sent
        # are this engine's own prefix-cache hits, which no chunk computes.
        first = max(progress.first, min(progress.next_block, chunk.start // self._block_size))
        end = blocks_for(chunk.start + chunk.num_tokens, self._block_size)
        return first, end
