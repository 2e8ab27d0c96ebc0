"""Moving blocks between the KV cache and the lower tiers (engine.kv_tiers.tiers), on a thread of
its own so that neither a write nor a load ever holds up a step.

Stores: the blocks the prefix cache newly hashed are copied out of the cache on the engine thread,
as the step that computed them ends (a memory copy, small beside the step), and written to the tiers
from the copy: the cache's blocks are never held for a tier, so a slow disk never leaves the pool
short. Copies waiting for the thread are bounded (`MAX_QUEUED_BYTES`); past it a store is dropped
and counted, never waited for. Loads: a waiting request's prefix, read and checked block by
block, written into its reserved blocks one layer at a time through the KV connector (the same
ownership rule as pages from a prefill worker: a write into a reservation that ended is refused);
the first block that no tier has intact ends the load there. Loads go before stores: a load is a
request's time to first token, a store only a later one's chance of a hit.

A block travels as one payload: each layer's K page, then its V page, as the cache stores them
(a quantized format's scales inside its rows), so a tier holds exactly the cache's bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import KVTierConfig
from engine.kv_cache.cache_engine import CacheEngine
from engine.kv_tiers.block_record import RecordLayout
from engine.kv_tiers.tiers import KVTiers, LowerTier, TierEvents

log = logging.getLogger(__name__)

# Pages copied out for the tiers and not yet written: beyond this, new stores are dropped (a slow or
# stuck disk then costs later hits, not memory without bound).
MAX_QUEUED_BYTES = 512 * 1024 * 1024

# (request id, ticket, layer, block ids, k, v): write pages under a live reservation (KeyError once
# it ended): the engine's KVConnector.import_pages.
PageWriter = Callable[[str, int, int, Sequence[int], torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class _Load:
    request_id: str
    ticket: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class _Store:
    block_hashes: tuple[bytes, ...]
    payloads: torch.Tensor  # [blocks, payload bytes] uint8, a copy


class TierMover:
    """The lower tiers of one engine and the thread that fills and reads them."""

    def __init__(self, cache: CacheEngine, tiers: KVTiers, write: PageWriter) -> None:
        self._cache = cache
        self._tiers = tiers
        self._write = write
        k_cache = cache.kv_caches[0][0]
        self._page_shape = tuple(k_cache.shape[1:])
        self._dtype = k_cache.dtype
        self._page_bytes = k_cache[0].numel() * k_cache.element_size()
        self._jobs: queue.PriorityQueue[tuple[int, int, _Load | _Store | None]] = queue.PriorityQueue()
        self._order = 0
        self._done_lock = threading.Lock()
        self._done = threading.Condition(self._done_lock)
        self._loaded: list[tuple[str, int]] = []
        self._queued_bytes = 0  # store copies not yet written (under _done_lock)
        self.dropped_blocks = 0  # stores dropped at MAX_QUEUED_BYTES
        self._thread = threading.Thread(target=self._run, name="kv-tier-mover", daemon=True)
        self._thread.start()

    @property
    def tiers(self) -> KVTiers:
        """The tiers moved to and from."""
        return self._tiers

    # ---- the engine thread ----------------------------------------------------------------------
    def available(self, block_hashes: Sequence[bytes]) -> int:
        """See engine.kv_connector.tier_loading.TierLoads."""
        return self._tiers.available(block_hashes)

    def load(self, request_id: str, ticket: int, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """See engine.kv_connector.tier_loading.TierLoads."""
        self._submit(0, _Load(request_id, ticket, tuple(block_ids), tuple(block_hashes)))

    def store(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Copy newly hashed blocks (block id, chain hash) out of the cache for the tiers that lack them."""
        blocks = [(block_id, block_hash) for block_id, block_hash in blocks if not self._tiers.holds(block_hash)]
        if not blocks:
            return
        size = len(blocks) * self._cache.num_layers * 2 * self._page_bytes
        with self._done:
            if self._queued_bytes + size > MAX_QUEUED_BYTES:
                self.dropped_blocks += len(blocks)
                return
            self._queued_bytes += size
        ids = [block_id for block_id, _ in blocks]
        pages = [page.view(torch.uint8).reshape(len(ids), -1) for layer in range(self._cache.num_layers)
                 for page in self._cache.gather_blocks(layer, ids)]
        self._submit(1, _Store(tuple(h for _, h in blocks), torch.cat(pages, dim=1)))

    def done(self, wait_s: float = 0.0) -> list[tuple[str, int]]:
        """The loads that ended (request id, blocks written); waits up to `wait_s` for one when none has."""
        with self._done:
            if not self._loaded and wait_s > 0:
                self._done.wait(wait_s)
            loaded, self._loaded = self._loaded, []
        return loaded

    def close(self) -> None:
        """Stop the thread (after the jobs queued before) and close the tiers."""
        self._submit(2, None)
        self._thread.join()
        self._tiers.close()

    def _submit(self, priority: int, job: _Load | _Store | None) -> None:
        self._order += 1
        self._jobs.put((priority, self._order, job))

    # ---- the mover's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            try:
                if isinstance(job, _Load):
                    written = self._run_load(job)
                else:
                    self._run_store(job)
            except Exception:  # a tier's failure costs a miss or a write, never the engine
                log.exception("KV tier mover: a %s failed", type(job).__name__)
                written = 0
            with self._done:
                if isinstance(job, _Load):
                    self._loaded.append((job.request_id, written))
                    self._done.notify_all()
                else:
                    self._queued_bytes -= job.payloads.numel()

    def _run_store(self, job: _Store) -> None:
        payloads = job.payloads.numpy()
        for index, block_hash in enumerate(job.block_hashes):
            self._tiers.store(block_hash, payloads[index].tobytes())

    def _run_load(self, job: _Load) -> int:
        started = time.perf_counter()
        payloads: list[memoryview] = []
        tiers: list[LowerTier] = []
        for block_hash in job.block_hashes:
            found = self._tiers.load(block_hash)
            if found is None:
                break
            tiers.append(found[0])
            payloads.append(found[1])
        if not payloads:
            return 0
        count = len(payloads)
        data = torch.from_numpy(np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads]))
        data = data.view(count, self._cache.num_layers, 2, self._page_bytes)
        try:
            for layer in range(self._cache.num_layers):
                k, v = (data[:, layer, part].contiguous().view(self._dtype).view(count, *self._page_shape)
                        for part in (0, 1))
                self._write(job.request_id, job.ticket, layer, job.block_ids[:count], k, v)
        except KeyError:
            return 0  # the request ended mid-load: its blocks are no longer its own
        seconds = time.perf_counter() - started
        for tier in set(tiers):
            share = tiers.count(tier)
            self._tiers.record_load(tier, share, seconds * share / count)
        return count


def open_tiers(config: KVTierConfig, cache: CacheEngine, payload_size: int, events: TierEvents,
               write: PageWriter) -> TierMover | None:
    """The engine's lower tiers and their mover, or None when none is configured."""
    if not config.enabled:
        return None
    return TierMover(cache, KVTiers(config, RecordLayout(payload_size, cache.num_layers), events), write)
