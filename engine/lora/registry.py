"""The adapters one engine serves: which it knows (name → directory), which it has read (at most
`max_cpu_loras`, the least recently used idle one dropped beyond, as vLLM does), and which sit in
the model runner's slots (at most `max_loras`: engine.lora.slots). The scheduler's side: no torch.

A request for an adapter takes a slot when it is scheduled and gives it back when it leaves the
running batch (finished or preempted). A slot whose adapter no running request uses is reused, the
least recently used first; the copy into it happens on the runner before the next forward
(`take_loads`). When every slot is in use by another adapter, the request waits in the queue, as
vLLM's scheduler holds back a LoRA that would exceed `max_loras` in a batch.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import LoraConfig

if TYPE_CHECKING:
    from engine.lora.adapter import LoraAdapter
    from engine.request import Request

Reader = Callable[[str, Path], "LoraAdapter"]  # (name, directory) -> the adapter; AdapterError if not servable


class UnknownAdapter(LookupError):
    """A request named an adapter this engine does not know (the API's 404)."""


class AdapterInUse(RuntimeError):
    """An adapter cannot be removed while requests for it are in the engine (the API's 503)."""


class AdaptersBusy(RuntimeError):
    """No adapter can be added now: as many as --max-cpu-loras are held in memory and every one has
    requests in the engine, so none can be dropped for it (the API's 503: retry once one is idle)."""


class AdapterMismatch(RuntimeError):
    """A prompt computed here for another worker would be computed under another adapter than the
    one it runs under there (another fingerprint, or none served by that name): its pages would be
    wrong there, so it is not computed (the worker's FAILED_PRECONDITION)."""


class LoraDisabled(RuntimeError):
    """Adapters were asked of an engine started without them (--enable-lora; FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Served:
    """An adapter the engine serves: where it is read from, and what it computes (kept while the
    adapter itself may be dropped from memory, so that requests and reports need no read)."""

    path: Path
    fingerprint: bytes
    rank: int


@dataclass
class _Slot:
    adapter: str | None = None
    users: int = 0
    last_used: int = 0


class AdapterRegistry:
    """The known, read and slotted adapters of one engine (`read` checks and reads one)."""

    def __init__(self, config: LoraConfig, read: Reader) -> None:
        self.config = config
        self._read = read
        self.known: dict[str, Served] = {}
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._slots = [_Slot() for _ in range(config.max_loras)]
        self._refs: dict[str, int] = {}  # requests in the engine per adapter
        self._loads: dict[int, LoraAdapter] = {}  # slots to fill before the next forward
        self._clock = itertools.count(1)

    # ---- the served set --------------------------------------------------------------------------
    def serve(self, adapter: LoraAdapter) -> LoraAdapter:
        """Serve an adapter already read and checked (engine.lora.serving reads it, on any thread)
        under its name; ValueError naming it (nothing changed) if the name is taken, AdaptersBusy if
        every adapter held in memory has requests and no more may be held."""
        name = adapter.name
        if name in self.known:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded (from {self.known[name].path})")
        capacity = self.config.cpu_capacity
        if len(self._loaded) >= capacity and all(self._refs.get(held) for held in self._loaded):
            raise AdaptersBusy(f"lora_name: cannot load {name!r} now: the {len(self._loaded)} adapters held in memory "
                               f"(--max-cpu-loras {capacity}) all have requests running or waiting; retry once "
                               "one is idle")
        self.known[name] = Served(adapter.path, adapter.fingerprint, adapter.rank)
        self._keep(name, adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name`. UnknownAdapter if not served; AdapterInUse while requests use it."""
        if name not in self.known:
            raise UnknownAdapter(f"lora_name: no adapter named {name!r} is loaded")
        if self._refs.get(name):
            raise AdapterInUse(f"lora_name: adapter {name!r} is in use by {self._refs[name]} request(s)")
        del self.known[name]
        self._loaded.pop(name, None)
        for index, slot in enumerate(self._slots):
            if slot.adapter == name:
                self._slots[index] = _Slot()
                self._loads.pop(index, None)

    def adapter(self, name: str) -> LoraAdapter:
        """The adapter served as `name`, read again if it was dropped (a worker reads it back off the
        engine thread before the request comes, EngineLoop.ready_adapter: this read is the fallback).
        UnknownAdapter if not served."""
        served = self.served(name)
        adapter = self._loaded.get(name)
        if adapter is None:
            adapter = self._read(name, served.path)
        self._keep(name, adapter)
        return adapter

    def in_memory(self, name: str) -> bool:
        """Whether the adapter served as `name` is read and kept (a check any thread may make: a
        membership test, never an iteration, of what the engine thread changes)."""
        return name in self._loaded

    def keep(self, adapter: LoraAdapter) -> None:
        """Keep an adapter read again off the engine thread (it was dropped): unless what is served
        under its name changed meanwhile (removed, or replaced by another fingerprint)."""
        served = self.known.get(adapter.name)
        if served is not None and served.fingerprint == adapter.fingerprint:
            self._keep(adapter.name, adapter)

    @property
    def loaded(self) -> tuple[str, ...]:
        """The adapters read and kept in memory, least recently used first."""
        return tuple(self._loaded)

    @property
    def slotted(self) -> tuple[str | None, ...]:
        """The adapter in each slot (None: empty)."""
        return tuple(slot.adapter for slot in self._slots)

    # ---- requests ----------------------------------------------------------------------------------
    def fingerprint(self, name: str) -> bytes:
        """The identity of the adapter served as `name`, which its requests' KV blocks are hashed
        with (as it was read when added). UnknownAdapter if not served."""
        return self.served(name).fingerprint

    def served(self, name: str) -> Served:
        """What is served as `name`. UnknownAdapter if nothing is."""
        served = self.known.get(name)
        if served is None:
            raise UnknownAdapter(f"model: no adapter named {name!r} (load it first: /v1/load_lora_adapter)")
        return served

    def ref(self, name: str) -> None:
        """A request for `name` entered the engine: it stays served until the request leaves."""
        self._refs[name] = self._refs.get(name, 0) + 1

    def unref(self, name: str) -> None:
        """A request for `name` left the engine."""
        self._refs[name] -= 1
        if not self._refs[name]:
            del self._refs[name]

    def acquire(self, name: str) -> int | None:
        """A slot holding `name` for a request about to run (it keeps it until `release`): the one
        that holds it, else an empty one, else the least recently used one no request uses (filled
        before the next forward); None when every slot is in use by other adapters."""
        slots = self._slots
        index = next((i for i, s in enumerate(slots) if s.adapter == name), None)
        if index is None:
            free = [i for i, s in enumerate(slots) if s.users == 0]
            if not free:
                return None
            index = min(free, key=lambda i: (slots[i].adapter is not None, slots[i].last_used))
            self._loads[index] = self.adapter(name)
            slots[index] = _Slot(name)
        slots[index].users += 1
        slots[index].last_used = next(self._clock)
        return index

    def release(self, slot: int) -> None:
        """A request that held `slot` left the running batch."""
        self._slots[slot].users -= 1

    def take_slot(self, request: Request) -> bool:
        """Whether `request` may run now: always for the base model; under an adapter once it holds a
        slot of it (taken here if it had none: `request.lora_slot`)."""
        if request.lora_slot is None and request.params.lora_name:
            request.lora_slot = self.acquire(request.params.lora_name)
            return request.lora_slot is not None
        return True

    def give_back_slot(self, request: Request) -> None:
        """`request` left the running batch (finished, preempted, expired): its slot is free for others."""
        if request.lora_slot is not None:
            self.release(request.lora_slot)
            request.lora_slot = None

    def take_loads(self) -> list[tuple[int, LoraAdapter]]:
        """The slots to fill, and with what, before the next forward (each handed out once)."""
        loads, self._loads = list(self._loads.items()), {}
        return loads

    def _keep(self, name: str, adapter: LoraAdapter) -> None:
        """Keep `adapter` read, most recently used; beyond the bound drop the least recently used
        one that no slot holds and no request waits for (none: the bound is exceeded until one is)."""
        self._loaded[name] = adapter
        self._loaded.move_to_end(name)
        in_slots = {slot.adapter for slot in self._slots}
        for other in list(self._loaded):
            if len(self._loaded) <= self.config.cpu_capacity:
                break
            if other != name and other not in in_slots and not self._refs.get(other):
                del self._loaded[other]
