"""The scheduler side of the KV connector (engine.scheduler consults it): which requests wait for
their KV from elsewhere, each under a reservation with a ticket and a deadline; which finished
requests keep their blocks, and until when. It enforces the block-ownership rule written in
engine.kv_connector.connector: `writing` admits a write only into a live reservation, and `end`
returns only once no write into the reservation is in progress or can start.

Reservations are made and ended on the engine thread; `writing` runs on any thread (a KV
receiver's). Everything else here is the engine thread's alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.kv_connector.policy import KVConnectorPolicy
from engine.request import Request


@dataclass(eq=False)
class _Reservation:
    ticket: int
    block_ids: frozenset[int]
    deadline: float  # time.monotonic()
    # Held around each write into the blocks; `live` turns False under it, and only once.
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: bool = True


class KVConnectorScheduler:
    """Reservations, hand-offs and their deadlines (see the module docstring)."""

    def __init__(self, policy: KVConnectorPolicy | None = None) -> None:
        self.policy = policy or KVConnectorPolicy()
        self._table = threading.Lock()  # guards _reservations against the receivers' lookups
        self._reservations: dict[str, _Reservation] = {}
        self._handing_off: set[str] = set()  # requests added with a KVExport, until forgotten
        self._kept: dict[str, float] = {}  # finished request id -> when its blocks go
        self._timed_out: set[str] = set()  # reservations the deadline ended, until their request is forgotten
        self._tickets = itertools.count(1)

    # ---- reservations ---------------------------------------------------------------------------
    def reserved(self, request_id: str, block_ids: Iterable[int], timeout_s: float) -> int:
        """A request now waits for the KV of `block_ids` (its blocks beyond its local prefix hit) for at
        most `timeout_s` seconds; the reservation's ticket, which every write into them must name."""
        reservation = _Reservation(next(self._tickets), frozenset(block_ids), time.monotonic() + timeout_s)
        with self._table:
            self._reservations[request_id] = reservation
        self._timed_out.discard(request_id)
        return reservation.ticket

    @contextmanager
    def writing(self, request_id: str, ticket: int, block_ids: Iterable[int]) -> Iterator[None]:
        """Hold reservation `ticket` of `request_id` live while pages are written into `block_ids`:
        KeyError if it has ended (cancelled, timed out, started) or never was, ValueError for a block
        it does not cover. Ending it waits until the write is done."""
        with self._table:
            reservation = self._reservations.get(request_id)
        if reservation is None or reservation.ticket != ticket:
            raise KeyError(f"request {request_id!r} has no live KV reservation {ticket}")
        block_ids = list(block_ids)
        if not reservation.block_ids.issuperset(block_ids):
            raise ValueError(f"block_ids: not all of {block_ids} belong to request {request_id!r}")
        with reservation.lock:
            if not reservation.live:
                raise KeyError(f"request {request_id!r} has no live KV reservation {ticket}")
            yield

    def end(self, request_id: str) -> None:
        """End the request's reservation, if it has one: returns once no write into its blocks is in
        progress, and none starts after. Call it before the blocks are freed or scheduled."""
        with self._table:
            reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            with reservation.lock:
                reservation.live = False

    def check_not_timed_out(self, request_id: str) -> None:
        """TimeoutError if the deadline ended the request's reservation (the engine freed its blocks)."""
        if request_id in self._timed_out:
            raise TimeoutError(f"request {request_id!r}: its KV did not arrive before its deadline")

    # ---- hand-offs ------------------------------------------------------------------------------
    def hand_off(self, request_id: str) -> None:
        """The request (just added, with a KVExport) hands its prompt's KV on: it ends at its first
        token and keeps its blocks, on any engine."""
        self._handing_off.add(request_id)

    def pinned(self, request_id: str) -> bool:
        """Whether the request is an export on an engine that decodes: admitted at once holding every
        block its prompt needs (engine.scheduler.Scheduler.admit_export), never preempted."""
        return self.policy.decodes and request_id in self._handing_off

    def _hands_off(self, request_id: str) -> bool:
        return not self.policy.decodes or request_id in self._handing_off

    def hands_off(self, request: Request) -> bool:
        """Whether the request ends once its prompt is done (it just sampled a token)."""
        return self._hands_off(request.request_id) and not request.is_finished

    def keeps(self, request: Request) -> bool:
        """Whether a request that finished (not aborted) keeps its blocks; if so, until released or
        its keep deadline."""
        if not self._hands_off(request.request_id):
            return False
        self._kept[request.request_id] = time.monotonic() + self.policy.keep_s
        return True

    def forget(self, request_id: str) -> None:
        """The request is gone (released or aborted): end its reservation, drop what is kept of it."""
        self.end(request_id)
        self._handing_off.discard(request_id)
        self._kept.pop(request_id, None)
        self._timed_out.discard(request_id)

    # ---- deadlines ------------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The earliest deadline of a reservation or a kept request (time.monotonic()), None if none."""
        with self._table:
            deadlines = [r.deadline for r in self._reservations.values()]
        deadlines.extend(self._kept.values())
        return min(deadlines, default=None)

    def is_due(self) -> bool:
        """Whether a deadline has passed (the engine's next step acts on it)."""
        deadline = self.next_deadline()
        return deadline is not None and deadline <= time.monotonic()

    def expired(self) -> list[str]:
        """The requests whose deadline passed: their reservations are ended (no page lands after this)
        and nothing is kept of them here; the caller frees their blocks."""
        now = time.monotonic()
        with self._table:
            late = [request_id for request_id, r in self._reservations.items() if r.deadline <= now]
        for request_id in late:
            self.end(request_id)
            self._timed_out.add(request_id)
        dropped = [request_id for request_id, deadline in self._kept.items() if deadline <= now]
        for request_id in dropped:
            del self._kept[request_id]
            self._handing_off.discard(request_id)
        return late + dropped
