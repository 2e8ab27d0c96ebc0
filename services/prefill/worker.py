"""The prefill role: a worker that only computes prompts for decode sites (services.common.prefill_site).

Transport-free: failures are WorkerErrors (and ValueError for bad input), which the handler maps
to gRPC statuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.engine import Engine
from kvtransfer.sender import KVSenderPool
from services.common.engine_loop import EngineLoop
from services.common.prefill_site import PrefillSite
from services.common.worker import RoleWorker


class PrefillWorker(RoleWorker):
    """A prefill engine that pushes every request's pages to its decode site, layer by layer."""

    def __init__(
        self,
        address: str,
        engine: Engine,
        draining: asyncio.Event,
        senders: KVSenderPool,
        transfer_timeout: float,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """`senders`: the connections to decode sites' KV receivers (they check the layout when they
        pair). `on_fatal(reason)`: the engine can never step again (services.common.engine_loop)."""
        super().__init__("prefill", address, EngineLoop(engine, on_fatal=on_fatal), draining)
        self.prefill_site = PrefillSite(self.loop, senders, transfer_timeout)

    async def close(self) -> None:
        """Stop the engine thread, then drop the connections to decode sites."""
        await super().close()
        await self.prefill_site.close()
