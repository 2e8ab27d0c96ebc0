"""Every command a worker sends its engine, as a message.

A worker's asyncio handlers never touch the engine: they send these to the engine loop, which runs
each one on the engine thread between steps (one dispatcher, `EngineLoop`), so the engine needs no
locks. Each command names the type of its result (`Command[T]`), so `await loop.call(Reserve(...))`
is typed. `ImportPages` is the one exception to "between steps": see its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from engine.kv_export import KVExport
from engine.outputs import EngineStats, RequestOutput, ReserveResult
from engine.resume import Resumed
from engine.sampling_params import SamplingParams

T = TypeVar("T")


class Command(Generic[T]):
    """A message to the engine whose result is a T."""


@dataclass(frozen=True)
class AddRequest(Command[None]):
    """Queue a request (ValueError naming the field if it cannot be served). `resumed`: it continues
    after output delivered elsewhere; `export` (prefill role): push its pages layer by layer."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    resumed: Resumed | None = None
    export: KVExport | None = None


@dataclass(frozen=True)
class Reserve(Command[ReserveResult]):
    """Decode role: reserve blocks for a prompt whose KV another worker computes; the reservation or
    the reason it was refused (ValueError naming the field for bad input)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    resumed: Resumed | None = None


@dataclass(frozen=True)
class ImportPages(Command[None]):
    """Decode role: write received pages of one layer into a reservation's blocks.

    Run on the caller's (the KV receiver's) thread, not between steps: the reserved blocks belong to
    a request that no step schedules until `StartDecode`, and the receiver's cancel returns only
    after its last write, before the blocks are freed, so the write races with nothing while pages
    land during a step instead of after it."""

    request_id: str
    layer: int
    block_ids: Sequence[int]
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class StartDecode(Command[RequestOutput]):
    """Decode role: the prompt's KV is complete; join the running batch after the first token."""

    request_id: str
    first_token: int


@dataclass(frozen=True)
class Release(Command[None]):
    """Prefill role: free a request's blocks once its pages were delivered (full blocks stay cached)."""

    request_id: str


@dataclass(frozen=True)
class Abort(Command[bool]):
    """Abort a request at any point of its life and free its blocks; False if it was unknown."""

    request_id: str


@dataclass(frozen=True)
class GetStats(Command[EngineStats]):
    """The engine's load now."""
