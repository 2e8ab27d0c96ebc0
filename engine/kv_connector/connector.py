"""The KV connector: how an engine takes a prompt's KV from elsewhere and hands its own on.

One engine serves every deployment; a request added with an export hands off on any engine, and
the connector's policy, built from the configuration once (engine.kv_connector.policy), keeps what is
per engine. Its scheduler side (engine.kv_connector.scheduler_side,
consulted by engine.scheduler) keeps the requests that wait for their KV (RequestStatus.WAITING_FOR_KV,
each under a reservation with a ticket and a deadline) and the finished requests that keep their
blocks for a hand-off (until released, or their keep deadline). Its worker side
(engine.kv_connector.worker_side) moves the pages: export layer by layer as a step writes them, import
into reserved blocks, and the tensor-parallel relay through rank 0. The engine frees the blocks of
every request whose deadline passed at its next step, whatever its worker does.

The block-ownership rule. A page written into a block must belong to the block's owner. Pages arrive
on a KV receiver's thread, at any time, for a reservation that may already have ended. So:
- a write names its reservation (request id and ticket: a request id can come back, a ticket never
  does), and lands only while that reservation is live and only in blocks it covers;
- a reservation ends before its blocks can change owner: before they are freed (cancel, abort, deadline,
  release) and before its request is scheduled (StartDecode); ending it waits for a write in progress;
- so a page that arrives after its request was cancelled or timed out is refused (KeyError to the
  receiver, which fails that transfer) and never lands in a block that has a new owner, whatever
  the order in which the worker cancels its transfer and aborts its request.
Both halves are in `KVConnectorScheduler.writing` and `.end`; `KVConnector.import_pages` joins them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_connector.policy import KVConnectorPolicy
from engine.kv_connector.scheduler_side import KVConnectorScheduler
from engine.kv_connector.worker_side import KVConnectorWorker
from engine.outputs import KVReservation


class KVConnector:
    """One engine's connector: `scheduler` (its scheduler side) and `worker` (its worker side)."""

    def __init__(self, policy: KVConnectorPolicy, worker: KVConnectorWorker) -> None:
        self.scheduler = KVConnectorScheduler(policy)
        self.worker = worker

    def import_pages(self, reservation: KVReservation, layer: int, block_ids: Sequence[int],
                     k: torch.Tensor, v: torch.Tensor) -> None:
        """Write received pages of one layer into blocks of a live reservation (any thread): KeyError if
        the reservation has ended, ValueError for a block it does not cover or pages that do not fit."""
        self.write_pages(reservation.request_id, reservation.ticket, layer, block_ids, k, v)

    def write_pages(self, request_id: str, ticket: int, layer: int, block_ids: Sequence[int],
                    k: torch.Tensor, v: torch.Tensor) -> None:
        """`import_pages` by the reservation's request id and ticket (a lower tier's load writes so)."""
        with self.scheduler.writing(request_id, ticket, block_ids):
            self.worker.import_pages(layer, block_ids, k, v)
