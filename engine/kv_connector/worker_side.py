"""The worker side of the KV connector: pages out of the cache as each layer writes them (export)
and into reserved blocks as they arrive (import), at tensor-parallel size > 1 relayed through rank 0
(engine.parallel.kv_heads): each rank holds some KV heads, rank 0 joins them on the way out and
splits them on the way in. Whether a write may happen at all is the scheduler side's to say
(engine.kv_connector.connector)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from engine.kv_cache.cache_engine import CacheEngine, check_pages
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.kv_connector.export import KVExport, KVExports, LayerPages
from engine.parallel.group import TensorParallelGroup
from engine.parallel.pipeline import PipelineStages
from engine.parallel.step_plan import PagesPlan
from engine.scheduler import ScheduledChunk

LayerHook = Callable[[int], None]


class KVConnectorWorker:
    """Moves one engine's pages: its exported requests, and imports into its cache."""

    def __init__(self, cache: CacheEngine, page_shape: tuple[int, ...], block_size: int, num_layers: int,
                 parallel: TensorParallelGroup | None, ranks_busy: contextlib.AbstractContextManager,
                 stages: PipelineStages | None = None) -> None:
        """`page_shape`: a page of all the model's KV heads; `parallel`: a tensor-parallel engine's
        group; `ranks_busy`: held while rank 0 has the other ranks run something (a step, or a move
        of pages from another thread), so never two at once; `stages`: a pipeline-parallel engine's,
        through which the pages of the layers other stages hold come and go."""
        self._cache = cache
        self._page_shape = page_shape
        self._parallel = parallel
        self._stages = stages
        self._ranks_busy = ranks_busy
        self._num_layers = num_layers
        self._exports = KVExports(block_size, num_layers)

    # ---- export ---------------------------------------------------------------------------------
    def add_export(self, request_id: str, export: KVExport, num_tokens: int) -> None:
        """Push the pages of a request of `num_tokens` known tokens to its sink, layer by layer,
        from its first step on."""
        self._exports.add(request_id, export, num_tokens)

    def drop_export(self, request_id: str) -> None:
        """No page of the request reaches its sink after this."""
        self._exports.drop(request_id)

    def step_exports(self, chunks: Sequence[ScheduledChunk],
                     block_table: Callable[[str], list[int]]) -> tuple[LayerHook | None, list[int]]:
        """For a step about to run: the hook that hands each exported request the pages a layer wrote
        (None when no request is exported), and the blocks it gathers, which the other ranks of a
        tensor-parallel engine gather beside it."""
        if not self._exports:
            return None, []
        ranges = self._exports.ranges(chunks)
        exported = [block for r in ranges for block in block_table(r.request_id)[r.first:r.end]]

        def on_layer_done(layer: int) -> None:
            pages = self._whole_pages(layer, exported) if exported else None
            self._exports.layer_done(layer, ranges, pages)

        return on_layer_done, exported

    def ship_kept(self, sampled: Sequence[str],
                  kept_of: Callable[[str, KVBudget], tuple[KeptBlocks, list[int]]]) -> None:
        """After a step's update: each request exported under a budget whose prompt the step
        computed (it sampled) hands its sink the blocks `kept_of` picks (and their ids here), then
        every layer's pages of those not pushed as computed: the receiver's first blocks
        (engine.kv_connector.export)."""
        for request_id, sink, budget, pushed_from in self._exports.take_budgeted(sampled):
            kept, block_ids = kept_of(request_id, budget)
            sink.kept(kept)
            held = block_ids[:sum(1 for index in kept.indices if index < pushed_from)]
            if not held:
                continue
            for layer in range(self._num_layers):
                k, v = self._whole_pages(layer, held)
                sink.layer_done(layer, LayerPages(layer, 0, k, v))

    def _whole_pages(self, layer: int, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Some blocks' pages of one layer, of all KV heads: at tensor-parallel size > 1 joined from
        every rank, which gather the blocks the step's plan named after each layer."""
        if self._stages is not None and layer not in self._stages.local_layers:
            return self._stages.receive_pages(layer, len(block_ids), self._cache.kv_caches[0][0].device)
        k, v = self._cache.gather_blocks(layer, block_ids)
        if self._parallel is None:
            return k, v
        return self._parallel.kv_heads.gather(k, v)

    # ---- import ---------------------------------------------------------------------------------
    def import_pages(self, layer: int, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write received pages of one layer (of all the model's KV heads) into `block_ids`; at
        tensor-parallel size > 1 each rank takes the heads it holds. Any thread."""
        if self._stages is not None and layer not in self._stages.local_layers:
            k, v = self._pages_for_ranks(len(block_ids), k, v)
            with self._ranks_busy:  # pages land on a receiver's thread, maybe while a step runs
                self._stages.send_pages(PagesPlan(layer, list(block_ids)), k, v)
            return
        if self._parallel is not None and block_ids:
            k, v = self._pages_for_ranks(len(block_ids), k, v)
            with self._ranks_busy:  # pages land on a receiver's thread, maybe while a step runs
                self._parallel.send(PagesPlan(layer, list(block_ids)))
                k, v = self._parallel.kv_heads.scatter(k, v)
        self._cache.scatter_blocks(layer, block_ids, k, v)

    def _pages_for_ranks(self, blocks: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages of all KV heads checked (before any rank sees them) and in the cache's dtype."""
        cache = self._cache.kv_caches[0][0]
        check_pages(k, v, blocks, self._page_shape, cache.dtype)
        return k.to(cache.device, cache.dtype), v.to(cache.device, cache.dtype)
