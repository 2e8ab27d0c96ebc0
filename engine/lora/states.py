"""What an engine reports of each adapter it serves: its identity, where it sits, and its requests
(the worker's load reports, LoadReport.lora_adapters, and vLLM's vllm:lora_requests_info)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.lora.registry import AdapterRegistry

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(frozen=True)
class AdapterState:
    """One served adapter now."""

    name: str
    fingerprint: bytes
    rank: int
    path: str
    in_slot: bool  # a request for it starts without copying it into a slot
    in_memory: bool  # read and kept (--max-cpu-loras): a copy into a slot needs no read
    running_requests: int
    waiting_requests: int  # queued, preempted or waiting for their KV from another worker


def adapter_states(registry: AdapterRegistry, requests: Iterable[Request],
                   running: Iterable[Request]) -> tuple[AdapterState, ...]:
    """Every adapter `registry` serves, by name, with its requests among the engine's unfinished
    `requests` (those in the `running` batch, and the rest)."""
    running_ids = {request.request_id for request in running}
    counts: dict[str, list[int]] = {name: [0, 0] for name in registry.known}
    for request in requests:
        name = request.params.lora_name
        if name in counts and not request.is_finished:
            counts[name][0 if request.request_id in running_ids else 1] += 1
    slotted, loaded = set(registry.slotted), set(registry.loaded)
    return tuple(AdapterState(name, served.fingerprint, served.rank, str(served.path), name in slotted,
                              name in loaded, *counts[name])
                 for name, served in sorted(registry.known.items()))
