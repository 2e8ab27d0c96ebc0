"""Which worker gets the next request: pure rules over snapshots of the workers' load.

Decode workers are ranked by the requests they hold (fewest first), then by free KV blocks (most
first); prefill workers by the prompt tokens waiting in their queue. Workers whose load is equal
take turns, so an idle pool still spreads requests evenly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


class NoWorkerError(Exception):
    """No worker of a pool is healthy (gRPC health SERVING)."""


@dataclass(frozen=True)
class WorkerLoad:
    """What the gateway knows of one worker when it routes a request.

    The counts are the larger of the worker's latest report and what this gateway itself has sent
    there since: reports arrive every few hundred milliseconds, a burst of requests does not wait.
    """

    address: str
    serving: bool
    requests: int = 0  # running + waiting + reserved
    free_kv_blocks: int = 0
    queued_prompt_tokens: int = 0


def decode_load(worker: WorkerLoad) -> tuple[int, int]:
    """Sort key of a decode worker: fewest requests, then most free KV blocks."""
    return worker.requests, -worker.free_kv_blocks


def prefill_load(worker: WorkerLoad) -> tuple[int]:
    """Sort key of a prefill worker: fewest queued prompt tokens."""
    return (worker.queued_prompt_tokens,)


def rank(workers: Sequence[WorkerLoad], load: Callable[[WorkerLoad], tuple[int, ...]], turn: int) -> list[str]:
    """Addresses of the serving workers, least loaded first.

    Workers with equal load keep their given order rotated by `turn`, so successive calls with an
    increasing `turn` take them in round-robin. Raises NoWorkerError when none is serving.
    """
    groups: dict[tuple[int, ...], list[str]] = {}
    for worker in workers:
        if worker.serving:
            groups.setdefault(load(worker), []).append(worker.address)
    if not groups:
        raise NoWorkerError("no worker is serving")
    ranked: list[str] = []
    for key in sorted(groups):
        tied = groups[key]
        shift = turn % len(tied)
        ranked.extend(tied[shift:] + tied[:shift])
    return ranked
