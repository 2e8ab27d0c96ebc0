"""A prefill request's pages on their way to its decode worker: the engine hands each layer's new
pages to the request's KVPush (its KVSink) as soon as the layer wrote them, while later layers
compute, and the push hands them to the sender.

Everything here runs on the engine thread, inside the step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.kv_cache.kv_budget import KeptBlocks
from engine.kv_connector.export import LayerPages
from kvtransfer.transport import KVSender

log = logging.getLogger(__name__)


@dataclass
class KVPush:
    """One request's pages on their way to the decode worker (an engine KVSink)."""

    request_id: str
    sender: KVSender
    # Set if sending failed; the request's handler reports it.
    error: Exception | None = None
    # When the first layer of the request's first step was done: ends its queue wait, roughly.
    started_at: float | None = None
    # (layer, perf_counter time, bytes) of each layer's pages handed to the sender, for tracing.
    layers: list[tuple[int, float, int]] = field(default_factory=list)
    # Under the receiver's KV budget: the blocks the prompt kept, which its pages are.
    kept_blocks: KeptBlocks | None = None

    def kept(self, kept: KeptBlocks) -> None:
        """Remember the kept blocks: the prefill's answer names them to the receiver."""
        self.kept_blocks = kept

    def layer_done(self, layer: int, pages: LayerPages | None) -> None:
        """Send the pages a layer wrote (a failure fails this request only, never the engine step)."""
        if self.error is not None:
            return
        if self.started_at is None:
            self.started_at = time.perf_counter()
        if pages is None:
            return
        try:
            self.sender.send(layer, pages.first_block, pages.k, pages.v)
        except Exception as exc:
            log.warning("KV push of %s failed at layer %d: %s", self.request_id, layer, exc)
            self.error = exc
            self.sender.abort()
            return
        self.layers.append((layer, time.perf_counter(), pages.nbytes))
