"""Moving blocks between the KV cache and the lower tiers (engine.kv_tiers.tiers), on a thread of
its own so that neither a write nor a load ever holds up a step.

Stores: the blocks the prefix cache newly hashed are copied out of the cache on the engine thread,
as the step that computed them ends (a memory copy, small beside the step), and written to the tiers
from the copy: the cache's blocks are never held for a tier, so a slow disk never leaves the pool
short. Copies waiting for the thread are bounded (`MAX_QUEUED_BYTES`); past it a store is dropped
and counted, never waited for. Loads: a request admitted with its prefix in the tiers computes the
rest of its prompt in the same step as its load (engine.kv_connector.tier_loading): the thread
reads every block's header, then layer by layer reads only that layer's bytes of each block, checks
them and writes them into the request's reserved blocks through the KV connector (the same ownership
rule as pages from a prefill worker: a write into a reservation that ended is refused), reporting
each layer written, for which the step's forward waits before that layer's attention
(`wait_for_layer`). So the reading, not only the checking and copying, overlaps the forward: layer 0
waits for the headers and one layer's bytes, and layer i's reads run while layers < i compute. A
block no tier has, or a layer that comes up short or fails its check, fails the whole load: the
engine recomputes the request. Loads go before stores: a load holds up a step, a store only a later
request's chance of a hit.

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

import torch

from engine.config import KVTierConfig
from engine.kv_cache.cache_engine import CacheEngine
from engine.kv_tiers.block_record import RecordLayout
from engine.kv_tiers.tiers import KVTiers, TierEvents

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


@dataclass
class _Progress:
    """How far a load got: layers written, and once it ended whether it succeeded."""

    layers: int = 0
    succeeded: bool | None = None


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
        self._progress: dict[int, _Progress] = {}  # by reservation ticket (never reused), under _done_lock
        self._queued_bytes = 0  # store copies not yet written (under _done_lock)
        self.dropped_blocks = 0  # stores dropped at MAX_QUEUED_BYTES
        # The forwards' time waiting for loads' layers (the engine thread's), and the part of it before
        # a step's first layer: what the overlap did not hide.
        self.wait_s = 0.0
        self.first_layer_wait_s = 0.0
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
        with self._done:
            self._progress[ticket] = _Progress()
        self._submit(0, _Load(request_id, ticket, tuple(block_ids), tuple(block_hashes)))

    def wait_for_layer(self, tickets: Sequence[int], deadline: float, layer: int) -> None:
        """Return once every load of `tickets` wrote `layer` or ended (or at `deadline`, time.monotonic());
        the time waited counts in `wait_s`."""
        def ready() -> bool:
            return all(p.layers > layer or p.succeeded is not None
                       for p in (self._progress.get(t) for t in tickets) if p is not None)

        started = time.perf_counter()
        with self._done:
            self._done.wait_for(ready, max(0.0, deadline - time.monotonic()))
        waited = time.perf_counter() - started
        self.wait_s += waited
        if layer == 0:
            self.first_layer_wait_s += waited

    def finish(self, ticket: int, deadline: float) -> bool:
        """Whether the load of `ticket` wrote every layer of every block (waiting until it ends, or
        `deadline`: a load still going then counts as failed); it is forgotten either way."""
        with self._done:
            self._done.wait_for(lambda: self._progress[ticket].succeeded is not None,
                                max(0.0, deadline - time.monotonic()))
            return bool(self._progress.pop(ticket).succeeded)

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
            succeeded = False
            try:
                if isinstance(job, _Load):
                    succeeded = self._run_load(job)
                else:
                    self._run_store(job)
            except Exception:  # a tier's failure costs a miss or a write, never the engine
                log.exception("KV tier mover: a %s failed", type(job).__name__)
            with self._done:
                if isinstance(job, _Load):
                    progress = self._progress.get(job.ticket)
                    if progress is not None:  # else the engine gave up on it at its deadline
                        progress.succeeded = succeeded
                    self._done.notify_all()
                else:
                    self._queued_bytes -= job.payloads.numel()

    def _run_store(self, job: _Store) -> None:
        payloads = job.payloads.numpy()
        for index, block_hash in enumerate(job.block_hashes):
            self._tiers.store(block_hash, payloads[index].tobytes())

    def _run_load(self, job: _Load) -> bool:
        started = time.perf_counter()
        count = len(job.block_ids)
        with self._tiers.load(job.block_hashes) as load:
            if load is None:
                return False  # a block gone since the lookup (evicted, or its header damaged)
            for layer in range(self._cache.num_layers):
                pages = load.layer(layer)
                if pages is None:
                    return False  # damaged or cut short: the tiers counted and dropped it
                data = torch.from_numpy(pages)  # [blocks, K page then V page] uint8
                k, v = (data[:, part * self._page_bytes:(part + 1) * self._page_bytes].contiguous()
                        .view(self._dtype).view(count, *self._page_shape) for part in (0, 1))
                try:
                    self._write(job.request_id, job.ticket, layer, job.block_ids, k, v)
                except KeyError:
                    return False  # the engine gave up on the load: its blocks are no longer the request's
                with self._done:
                    progress = self._progress.get(job.ticket)
                    if progress is None:
                        return False  # the engine gave up on it at its deadline
                    progress.layers = layer + 1
                    self._done.notify_all()
            tiers = load.tiers
        seconds = time.perf_counter() - started
        for tier in set(tiers):
            share = tiers.count(tier)
            self._tiers.record_load(tier, share, seconds * share / count)
        return True


def open_tiers(config: KVTierConfig, cache: CacheEngine, payload_size: int, events: TierEvents,
               write: PageWriter) -> TierMover | None:
    """The engine's lower tiers and their mover, or None when none is configured."""
    if not config.enabled:
        return None
    return TierMover(cache, KVTiers(config, RecordLayout(payload_size, cache.num_layers), events), write)
