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

from engine.kv_cache.kv_budget import KeptBlocks
from engine.kv_connector.export import KVExport
from engine.kv_connector.policy import DEFAULT_KV_WAIT_S
from engine.lora.adapter import LoraAdapter
from engine.outputs import EngineStats, KVReservation, NoKVRoom, RequestOutput, ReserveResult
from engine.resume import Resumed
from engine.sampling_params import SamplingParams

T = TypeVar("T")


class Command(Generic[T]):
    """A message to the engine whose result is a T."""


@dataclass(frozen=True)
class AddRequest(Command[NoKVRoom | None]):
    """Queue a request (ValueError naming the field if it cannot be served). `resumed`: it continues
    after output delivered elsewhere; `export`: push its pages layer by layer (NoKVRoom: an engine
    that decodes cannot admit it at once, Engine.add_request)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    resumed: Resumed | None = None
    export: KVExport | None = None


@dataclass(frozen=True)
class Reserve(Command[ReserveResult]):
    """Reserve blocks for a prompt whose KV another worker computes, for at most `kv_timeout_s`
    seconds; the reservation or the reason it was refused (ValueError naming the field for bad input)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    resumed: Resumed | None = None
    kv_timeout_s: float = DEFAULT_KV_WAIT_S


@dataclass(frozen=True)
class ImportPages(Command[None]):
    """Write received pages of one layer into a reservation's blocks.

    Run on the caller's (the KV receiver's) thread, not between steps, so pages land during a step
    instead of after it: the KV connector admits the write only while the reservation is live, and
    ends a reservation before its blocks are freed or scheduled (engine.kv_connector.connector)."""

    reservation: KVReservation
    layer: int
    block_ids: Sequence[int]
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class StartDecode(Command[RequestOutput]):
    """A reserved prompt's KV is complete; join the running batch after the first token, under a
    KV budget with the blocks the sender kept placed where `kept` says (TimeoutError if the
    reservation's deadline passed first)."""

    request_id: str
    first_token: int
    kept: KeptBlocks | None = None


@dataclass(frozen=True)
class Release(Command[None]):
    """Free the blocks a request kept for its hand-off once its pages were delivered (full blocks stay cached)."""

    request_id: str


@dataclass(frozen=True)
class Abort(Command[bool]):
    """Abort a request at any point of its life and free its blocks; False if it was unknown."""

    request_id: str


@dataclass(frozen=True)
class AddAdapter(Command[None]):
    """Serve a LoRA adapter already read and checked (Engine.read_adapter, off the engine thread);
    ValueError naming it if its name is taken, AdaptersBusy while every adapter held in memory has
    requests, LoraDisabled without --enable-lora."""

    adapter: LoraAdapter


@dataclass(frozen=True)
class KeepAdapter(Command[None]):
    """Keep in memory an adapter the engine had dropped (beyond --max-cpu-loras), read again off the
    engine thread for a request about to come (EngineLoop.ready_adapter); ignored if what is served
    under its name changed meanwhile."""

    adapter: LoraAdapter


@dataclass(frozen=True)
class RemoveAdapter(Command[None]):
    """Stop serving a LoRA adapter: UnknownAdapter if not served, AdapterInUse while requests use it,
    LoraDisabled without --enable-lora."""

    name: str


@dataclass(frozen=True)
class GetStats(Command[EngineStats]):
    """The engine's load now."""
