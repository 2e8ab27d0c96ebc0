"""The gateway's registry of workers, kept current by streams from each of them.

Per worker the gateway holds one channel and two subscriptions: gRPC health Watch (is it
SERVING?) and WatchLoad (its latest LoadReport). Either stream breaking (worker down, draining,
not started yet) marks the worker unusable until a resubscription succeeds. Workers come from
static lists or are added and removed at run time (Kubernetes discovery); a removed worker gets
no new requests, finishes the streams it has, then its channel closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from services.common.server import channel_options
from services.gateway.router import NoWorkerError, WorkerLoad, decode_load, prefill_load, rank

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

_RESUBSCRIBE_S = 0.5
_RETIRE_POLL_S = 0.1
_LOAD_INTERVAL_MS = 200
# gRPC's default reconnect backoff grows to two minutes; a restarted worker should be seen in seconds.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class Worker:
    """One worker as the gateway sees it: health, latest load, and what this gateway sent it since."""

    def __init__(self, address: str, role: Role) -> None:
        self.address = address
        self.role = role
        self.channel = grpc.aio.insecure_channel(address, options=channel_options() + _RECONNECT_OPTIONS)
        stub_class = decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub
        self.stub = stub_class(self.channel)
        self.serving = False
        self.report: common_pb2.LoadReport | None = None
        self.in_flight = 0  # decode: requests this gateway is streaming from it
        self.pending_prompt_tokens = 0  # prefill: prompt tokens sent its way, first token not yet back
        self.prompt_tokens_sent = 0  # prefill: every prompt token sent its way (the planner's arrival rate)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Subscribe to its health and load (on the running event loop)."""
        self._tasks = [asyncio.create_task(self._watch_health()), asyncio.create_task(self._watch_load())]

    async def close(self) -> None:
        """End the subscriptions and the channel."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    def view(self) -> WorkerLoad:
        """Its load for routing: the latest report, raised to what this gateway knows it sent since."""
        report = self.report
        requests = report.running_requests + report.waiting_requests + report.reserved_requests if report else 0
        return WorkerLoad(
            address=self.address,
            serving=self.serving,
            requests=max(requests, self.in_flight),
            free_kv_blocks=report.free_kv_blocks if report else 0,
            queued_prompt_tokens=max(report.queued_prompt_tokens if report else 0, self.pending_prompt_tokens),
        )

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            log.info("%s worker %s is %s", self.role, self.address, "SERVING" if serving else "NOT serving")
        self.serving = serving

    async def _watch_health(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest(service="")):
                    self._set_serving(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError as error:
                log.debug("%s worker %s: health watch: %s: %s", self.role, self.address, error.code().name,
                          error.details())
            self._set_serving(False)
            await asyncio.sleep(_RESUBSCRIBE_S)

    async def _watch_load(self) -> None:
        request = common_pb2.WatchLoadRequest(interval_ms=_LOAD_INTERVAL_MS)
        while True:
            try:
                async for report in self.stub.WatchLoad(request):
                    self.report = report
            except grpc.aio.AioRpcError as error:
                log.debug("%s worker %s: load watch: %s: %s", self.role, self.address, error.code().name,
                          error.details())
            self.report = None
            await asyncio.sleep(_RESUBSCRIBE_S)


class WorkerRegistry:
    """The prefill and decode pools, ranked for each request."""

    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (), retire_after_s: float = 10.0) -> None:
        """Addresses (host:port) of each pool's first workers; channels open on `start`. A removed
        worker's channel stays open at least `retire_after_s`: a request that ranked the pool
        before the removal may still retry there, and must get the worker's own answer (a
        retryable UNAVAILABLE once it drains) rather than a closed channel."""
        self._retire_after_s = retire_after_s
        self._prefill = {address: Worker(address, "prefill") for address in prefill}
        self._decode = {address: Worker(address, "decode") for address in decode}
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self._started = False
        self._retiring: dict[asyncio.Task, Worker] = {}

    @property
    def workers(self) -> list[Worker]:
        """Every worker, prefill pool first."""
        return [*self._prefill.values(), *self._decode.values()]

    def start(self) -> None:
        """Subscribe to every worker's health and load (and to those added later, as they come)."""
        self._started = True
        for worker in self.workers:
            worker.start()

    def addresses(self, role: Role) -> set[str]:
        """The addresses of a pool's current workers (not those being removed)."""
        return set(self._pool(role))

    def add(self, role: Role, address: str) -> None:
        """Route to a new worker (once it is SERVING); a no-op for one already in the pool."""
        pool = self._pool(role)
        if address not in pool:
            pool[address] = worker = Worker(address, role)
            if self._started:
                worker.start()

    def remove(self, role: Role, address: str) -> None:
        """Send a worker no new requests; its in-flight streams finish, then its channel closes."""
        worker = self._pool(role).pop(address, None)
        if worker is not None:
            task = asyncio.create_task(self._retire(worker, self._retire_after_s))
            self._retiring[task] = worker
            task.add_done_callback(self._retiring.pop)

    @staticmethod
    async def _retire(worker: Worker, after_s: float) -> None:
        # The gateway streams only from decode workers (prefill workers are called by them), so a
        # prefill worker's count is always 0.
        await asyncio.sleep(after_s)
        while worker.in_flight:
            await asyncio.sleep(_RETIRE_POLL_S)
        await worker.close()

    def _pool(self, role: Role) -> dict[str, Worker]:
        return self._decode if role == "decode" else self._prefill

    async def wait_routable(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until each pool has a SERVING worker that reported its
        load; whether that happened."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.routable():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def routable(self) -> bool:
        """Whether each pool has a SERVING worker whose load is known."""
        return all(
            any(worker.serving and worker.report is not None for worker in pool.values())
            for pool in (self._prefill, self._decode)
        )

    async def close(self) -> None:
        """End every subscription and channel, those of workers being removed included."""
        retiring = list(self._retiring.values())
        for task in self._retiring:
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await asyncio.gather(*(worker.close() for worker in [*self.workers, *retiring]))

    def decode_order(self) -> list[Worker]:
        """Serving decode workers, the one to try first first; NoWorkerError if none."""
        return self._order(self._decode, "decode")

    def prefill_order(self) -> list[Worker]:
        """Serving prefill workers, least loaded first; NoWorkerError if none."""
        return self._order(self._prefill, "prefill")

    def _order(self, pool: dict[str, Worker], role: Role) -> list[Worker]:
        load = decode_load if role == "decode" else prefill_load
        try:
            ranked = rank([worker.view() for worker in pool.values()], load, next(self._turns[role]))
        except NoWorkerError:
            raise NoWorkerError(f"no {role} worker is serving") from None
        return [pool[address] for address in ranked]


@contextlib.contextmanager
def dispatched(decode: Worker, prefill: Worker, prompt_tokens: int) -> Iterator[Dispatch]:
    """Count a request against the workers it was sent to, for as long as it runs there."""
    dispatch = Dispatch(prefill, prompt_tokens)
    decode.in_flight += 1
    try:
        yield dispatch
    finally:
        decode.in_flight -= 1
        dispatch.prefilled()


class Dispatch:
    """A request's share of its prefill worker's queue, removed when the first token comes back."""

    def __init__(self, prefill: Worker, prompt_tokens: int) -> None:
        self._prefill = prefill
        self._prompt_tokens = prompt_tokens
        prefill.pending_prompt_tokens += prompt_tokens
        prefill.prompt_tokens_sent += prompt_tokens

    def prefilled(self) -> None:
        """The prompt is computed (or the attempt ended): it no longer loads the prefill worker."""
        self._prefill.pending_prompt_tokens -= self._prompt_tokens
        self._prompt_tokens = 0
