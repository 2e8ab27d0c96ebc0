"""The prefill engine's layer hook: as soon as a layer has written a step's KV, the pages of every
registered request in that step go to its decode worker's sender, while later layers compute.

Everything here runs on the engine thread (register and unregister are submitted as engine
commands), so the table of pushes needs no lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for
from engine.scheduler import ScheduledChunk
from kvtransfer.sender import KVSender

log = logging.getLogger(__name__)


@dataclass
class KVPush:
    """One request's pages on their way to the decode worker."""

    sender: KVSender
    # Blocks the receiver already holds (its prefix-cache hit); block i goes to target index i - skip.
    skip: int
    # First block never sent. Only blocks at or past it, or touched by a chunk, are sent.
    next_block: int
    # Set by the hook if exporting or sending failed; the request's handler reports it.
    error: Exception | None = None
    # When the first layer of the request's first step was done: ends its queue wait, roughly.
    started_at: float | None = None
    # (layer, perf_counter time, bytes) of each layer's pages handed to the sender, for tracing.
    layers: list[tuple[int, float, int]] = field(default_factory=list)


class KVPushHook:
    """The EngineLoop layer hook of a prefill worker (call it with `(layer, chunks)`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._last_layer = engine.model_config.num_layers - 1
        self._pushes: dict[str, KVPush] = {}

    def register(self, request_id: str, sender: KVSender, num_cached_tokens: int) -> KVPush:
        """Push this request's pages to `sender`, except the first `num_cached_tokens` tokens' blocks."""
        skip = num_cached_tokens // self._engine.kv.block_size
        push = KVPush(sender=sender, skip=skip, next_block=skip)
        self._pushes[request_id] = push
        return push

    def unregister(self, request_id: str) -> KVPush | None:
        """Stop pushing this request's pages (no send for it happens after this returns)."""
        return self._pushes.pop(request_id, None)

    def __call__(self, layer: int, chunks: Sequence[ScheduledChunk]) -> None:
        for chunk in chunks:
            push = self._pushes.get(chunk.request.request_id)
            if push is None or push.error is not None:
                continue
            if push.started_at is None:
                push.started_at = time.perf_counter()
            self._push_chunk(chunk, push, layer)

    def _push_chunk(self, chunk: ScheduledChunk, push: KVPush, layer: int) -> None:
        block_size = self._engine.kv.block_size
        # The chunk wrote tokens [start, start + num_tokens). Its first block may be one an earlier
        # chunk left partly filled (sent again, now fuller); blocks before it that were never sent
        # are this worker's own prefix-cache hits, which no chunk computes.
        first = max(push.skip, min(push.next_block, chunk.start // block_size))
        end = blocks_for(chunk.start + chunk.num_tokens, block_size)
        if first < end:
            request_id = chunk.request.request_id
            try:
                k, v = self._engine.export_kv(request_id, layer, first, end)
                push.sender.send(layer, first - push.skip, k, v)
                push.layers.append((layer, time.perf_counter(), k.nbytes + v.nbytes))
            except Exception as exc:  # a broken transfer fails its own request, never the engine step
                log.warning("KV push of %s failed at layer %d: %s", request_id, layer, exc)
                push.error = exc
                push.sender.abort()
                return
        if layer == self._last_layer:
            push.next_block = max(push.next_block, end)
