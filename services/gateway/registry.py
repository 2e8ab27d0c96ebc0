"""The gateway's workers by pool, and the placement of requests on them.

The registry turns its workers' live views into router decisions (services.gateway.router), and a
decision into a Placement that counts the request against the chosen workers at once, so the next
decision sees it even before the workers' own reports do. It is the Placer that admission uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence

from tandem.v1 import common_pb2

from engine.kv_cache.block_hash import first_block_key, prompt_block_hashes
from engine.kv_cache.kv_events import TIERS
from services.common.channels import PLAINTEXT, Channels
from services.gateway.adapters import AdapterRef
from services.gateway.approximate_index import ApproximateIndex, PrefixIndexKind
from services.gateway.block_index import BlockIndex, TierEvent
from services.gateway.hash_probe import HashProbe, ProbeReport
from services.gateway.pool_load import RecentRequests
from services.gateway.router import (
    DEFAULT_SLO,
    Decision,
    Loadable,
    NoWorkerError,
    Role,
    RouteRequest,
    SloTargets,
    WorkerView,
    held_tokens,
    route,
    slo_use,
)
from services.gateway.routing_policy import DEFAULT_POLICY, RoutingPolicy
from services.gateway.tpot_slack import DecodeProgress
from services.gateway.workers import RemoteWorker

_RETIRE_POLL_S = 0.1


class Placement:
    """A request placed on a decode worker (and a prefill worker, or none for local prefill):
    counted against them until `release`; its prompt counts in their queue until `prefilled`."""

    def __init__(self, decision: Decision, decode: RemoteWorker, prefill: RemoteWorker | None, request: RouteRequest,
                 on_release: Callable[[], None]) -> None:
        self.decision = decision
        self.decode = decode
        self.prefill = prefill
        self._prefilling = prefill or decode
        address = self._prefilling.address
        self._uncached = request.prompt_tokens - held_tokens(request, address)
        # The prompt tokens the prefill site holds, by the tier they come from (for the metrics).
        loadable = request.loadable.get(address)
        self.prefix_hit_tokens: dict[str, int] = {"device": request.cached_tokens.get(address, 0),
                                                  **(loadable.tokens_by_tier if loadable is not None else {})}
        self._context = request.prompt_tokens + request.max_tokens // 2
        self._on_release = on_release
        self._released = False
        self.progress = DecodeProgress(request.max_tokens, request.slo.tpot_s)
        decode.decoding.add(self.progress)
        decode.pending_context_tokens += self._context
        self._prefilling.pending_prompt_tokens += self._uncached
        self._prefilling.prompt_tokens_sent += self._uncached

    def prefilled(self) -> None:
        """The first token came back: the prompt no longer loads its prefill worker's queue."""
        self._prefilling.pending_prompt_tokens -= self._uncached
        self._uncached = 0

    def delivered(self, tokens: int) -> None:
        """`tokens` more of its tokens reached the client (its TPOT clock starts at the first)."""
        self.progress.delivered(tokens, time.monotonic())

    def release(self) -> None:
        """The request ended (or this attempt did): its load leaves the workers."""
        if self._released:
            return
        self._released = True
        self.prefilled()
        self.decode.decoding.discard(self.progress)
        self.decode.pending_context_tokens -= self._context
        self._on_release()


class WorkerRegistry:
    """Prefill, decode and colocated workers by address; routes requests over their views."""

    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (), colocated: Sequence[str] = (),
                 default_slo: SloTargets = DEFAULT_SLO, retire_after_s: float = 10.0, channels: Channels = PLAINTEXT,
                 policy: RoutingPolicy = DEFAULT_POLICY, prefix_index: PrefixIndexKind = "exact",
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Addresses (host:port) of each pool's first workers; channels (opened by `channels`: TLS, message
        sizes) open on `start`; pools may start empty when discovery fills them. A
        removed worker's channel stays open at least `retire_after_s` (waited with `sleep`), then
        until its streams end: a request placed before the removal may still retry there, and must
        get the worker's own answer (a retryable UNAVAILABLE once it drains), not a closed channel.
        `policy` is the router's (services.gateway.router.route); `prefix_index` which index says
        where prompts' prefixes are cached: the workers' block events ("exact") or the gateway's own
        placements ("approximate")."""
        self.default_slo = default_slo
        self._policy = policy
        self._channels = channels
        self._retire_after_s = retire_after_s
        self._sleep = sleep
        self._started = False
        self._retiring: dict[asyncio.Task, RemoteWorker] = {}
        # Which worker holds which block in which tier, from their block events (or, approximate,
        # from where prompts were placed), and whether each worker's hashes agree with the gateway's
        # (set `probe.probe_tokens` once tokenizers load; the approximate index needs no agreement).
        self.prefix_index = prefix_index
        self.blocks: BlockIndex | ApproximateIndex = BlockIndex() if prefix_index == "exact" else ApproximateIndex()
        self.probe = HashProbe()
        self.recent = RecentRequests()
        self._listeners: list[Callable[[], None]] = []
        self._workers: dict[str, RemoteWorker] = {}
        pools: list[tuple[Role, Sequence[str]]] = [("prefill", prefill), ("decode", decode), ("colocated", colocated)]
        for role, addresses in pools:
            for address in addresses:
                if address in self._workers:
                    raise ValueError(f"worker {address} is listed twice")
                self._workers[address] = self._remote(address, role)
        self._turns = itertools.count()

    @property
    def workers(self) -> list[RemoteWorker]:
        """Every worker."""
        return list(self._workers.values())

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever a worker's health or load changed or a placement ended."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Subscribe to every worker's health and load (and to those added later, as they come)."""
        self._started = True
        for worker in self._workers.values():
            worker.start()

    def addresses(self, role: Role) -> set[str]:
        """The addresses of a pool's current workers (not those being removed)."""
        return {address for address, worker in self._workers.items() if worker.role == role}

    def add(self, role: Role, address: str) -> None:
        """Route to a new worker (once it is SERVING); a no-op for one already known."""
        if address not in self._workers:
            self._workers[address] = worker = self._remote(address, role)
            if self._started:
                worker.start()

    def remove(self, role: Role, address: str) -> None:
        """Send a worker of `role` no new requests; its in-flight streams finish, then its channel closes."""
        worker = self._workers.get(address)
        if worker is not None and worker.role == role:
            del self._workers[address]
            self._reported(worker, None)
            task = asyncio.create_task(self._retire(worker, self._retire_after_s))
            self._retiring[task] = worker
            task.add_done_callback(self._retiring.pop)

    async def _retire(self, worker: RemoteWorker, after_s: float) -> None:
        await self._sleep(after_s)
        while worker.in_flight:
            await self._sleep(_RETIRE_POLL_S)
        await worker.close()

    async def close(self) -> None:
        """End every subscription and channel, those of workers being removed included."""
        retiring = list(self._retiring.values())
        for task in self._retiring:
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await asyncio.gather(*(worker.close() for worker in [*self._workers.values(), *retiring]))

    async def wait_routable(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until requests can be placed; whether they can."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.routable():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def routable(self) -> bool:
        """Whether a serving, reporting decode-capable worker exists, and a prefill worker where
        the decode-capable ones cannot prefill themselves."""
        def up(roles: tuple[str, ...]) -> bool:
            return any(w.routable for w in self._workers.values() if w.role in roles)

        return up(("colocated",)) or (up(("decode",)) and up(("prefill",)))

    # ---- placing requests ------------------------------------------------------------------------
    def route_request(self, prompt_token_ids: Sequence[int], max_tokens: int,
                      slo: SloTargets | None = None, version_key: str | None = None,
                      cache_salt: str = "", adapter: AdapterRef | None = None) -> RouteRequest:
        """A request as the router sees it, with the prefix each worker holds on its device and can
        load from its lower tiers (by the prefix index, the prompt hashed with each worker's salt, the
        request's `cache_salt` and its LoRA `adapter`'s fingerprint, as the workers hash its blocks);
        only workers reporting `version_key` (NAME@VERSION; None: any) and serving `adapter` (None:
        the base model) may serve it. With the exact index, a worker whose hashes disagree with the
        gateway's (services.gateway.hash_probe) holds nothing here."""
        cached: dict[str, int] = {}
        loadable: dict[str, Loadable] = {}
        hashes_by_key: dict[tuple[int, bytes], list[bytes]] = {}
        block_hashes: dict[str, list[bytes]] = {}
        adapter_load_s: dict[str, float] = {}
        slots_full: set[str] = set()
        first_key = first_block_key(cache_salt, adapter.fingerprint if adapter is not None else b"")
        for worker in self._workers.values():
            # Not routed to, or another version's or adapter's (decide never offers it this request).
            report = worker.report
            if report is None or not _offers(worker, version_key, adapter) or (
                    self.prefix_index == "exact" and self.probe.refusal(worker.address) is not None):
                continue
            if adapter is not None and (held := worker.adapter(adapter)) is not None and held.load_s:
                adapter_load_s[worker.address] = held.load_s
                if worker.waits_for_slot(adapter):
                    slots_full.add(worker.address)
            block_size = report.block_size
            key = (block_size, report.block_hash_salt)
            hashes = hashes_by_key.get(key)
            if hashes is None:
                hashes = hashes_by_key[key] = prompt_block_hashes(prompt_token_ids, block_size, report.block_hash_salt,
                                                                  first_key)
            block_hashes[worker.address] = hashes
            hit = self.blocks.prefix(worker.address, hashes)
            if hit.device_blocks:
                cached[worker.address] = hit.device_blocks * block_size
            lower = hit.lower_blocks
            if lower:
                # A tier never loaded from has no measured cost: counted as free until it has.
                load_s = sum(blocks * report.kv_load_s_per_block.get(tier, 0.0) for tier, blocks in lower.items())
                loadable[worker.address] = Loadable({tier: blocks * block_size for tier, blocks in lower.items()},
                                                    load_s)
        return RouteRequest(len(prompt_token_ids), max_tokens, slo or self.default_slo, cached, loadable,
                            version_key, block_hashes, adapter, adapter_load_s, frozenset(slots_full))

    def decide(self, request: RouteRequest, idle: bool = False, exclude: frozenset[str] = frozenset()) -> Decision:
        """The router's decision over the workers' current views (or idle ones); NoWorkerError if
        no worker could take it."""
        views = [_for_version(view, w, request.version_key) for w in self._workers.values()
                 if w.address not in exclude and _offers(w, request.version_key, request.adapter)
                 and (view := w.view(idle))]
        return route(request, views, next(self._turns), self._policy)

    def claim(self, request: RouteRequest, decision: Decision) -> Placement:
        """Count the request against the decision's workers (where its prefix goes, their block
        events will say; the approximate index records it at once)."""
        decode = self._workers[decision.decode]
        prefill = self._workers[decision.prefill] if decision.prefill else None
        self.recent.observe(request.prompt_tokens, request.max_tokens)
        if isinstance(self.blocks, ApproximateIndex):
            # The prompt's blocks end up cached where it is computed and where it is decoded.
            for worker in {prefill or decode, decode}:
                hashes = request.block_hashes.get(worker.address)
                if hashes and worker.report is not None:
                    self.blocks.record(worker.address, hashes, worker.report.total_kv_blocks)
        return Placement(decision, decode, prefill, request, self._changed)

    def pool_slo_use(self) -> dict[tuple[str | None, Role], float]:
        """Per pool (model version and role), summed over its routable workers: what the recent
        typical request would use of the default objectives placed on each (services.gateway.pool_load);
        empty before any request was placed."""
        typical = self.recent.typical(self.default_slo)
        use: dict[tuple[str | None, Role], float] = {}
        for worker in self._workers.values():
            view = worker.view() if typical is not None and worker.routable else None
            if view is not None:
                pool = (worker.version_key, worker.role)
                use[pool] = use.get(pool, 0.0) + slo_use(typical, view)
        return use

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def _remote(self, address: str, role: Role) -> RemoteWorker:
        return RemoteWorker(address, role, self._changed, self._channels, self._reported)

    def _reported(self, worker: RemoteWorker, report: common_pb2.LoadReport | None) -> None:
        """Take a worker's block events into the exact index and judge its hashes; None: forget it
        (its stream broke, it restarted or it was removed: its next stream starts with a snapshot, and
        its cache may have been emptied)."""
        if report is None:
            self.blocks.forget(worker.address)
            self.probe.forget(worker.address)
            return
        if not isinstance(self.blocks, BlockIndex):
            return
        events = [TierEvent(event.tier, event.stored, event.block_hashes) for event in report.kv_events
                  if event.tier in TIERS]
        self.blocks.apply(worker.address, report.host_tier_id, events, report.kv_events_reset)
        self.probe.check(worker.address, ProbeReport(worker.version_key, report.block_size, report.block_hash_salt,
                                                     tuple(report.probe_block_hashes)))


def _offers(worker: RemoteWorker, version_key: str | None, adapter: AdapterRef | None) -> bool:
    """Whether the worker may serve a request of `version_key` under `adapter` (None: the base)."""
    return worker.offers(version_key) and (adapter is None or worker.adapter(adapter) is not None)


def _for_version(view: WorkerView, worker: RemoteWorker, version_key: str | None) -> WorkerView:
    """The worker's view for a request of `version_key`: one holding it only as a retiring version
    computes no prompt for another worker (its Prefill service serves its current version)."""
    if version_key is None or worker.version_key == version_key:
        return view
    return dataclasses.replace(view, prefills_for_others=False)


__all__ = ["NoWorkerError", "Placement", "WorkerRegistry"]
