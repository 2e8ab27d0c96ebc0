"""The LoRA adapters the gateway's workers serve, as their load reports say (LoadReport.lora_adapters).

A worker lists every adapter it serves with the fingerprint of what it computes
(engine.lora.adapter). Over all workers one name must mean one adapter on one base version: a name
served with two fingerprints, or over two base versions, is a conflict, and the gateway routes no
request for it until the workers agree, since a request moved between them (a prefill worker and a
decode worker, a migration) would mix two adapters' KV with no error. Pure: no grpc, no protobuf.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

# What a request for an adapter costs a worker before its prompt computes, when the adapter is not
# in one of its slots: a copy from memory, or a read from disk and a copy. Fixed estimates, not
# measured: they only need to order the workers (one holding the adapter in a slot first) without
# outweighing a queue. A rank-16 adapter on every projection of the shipped base is about 20 MB in
# fp32: a few milliseconds to copy, tens to read and check.
COPY_S = 0.002
READ_S = 0.030


@dataclass(frozen=True)
class AdapterRef:
    """The adapter a request runs under: the name its workers serve it as, and the fingerprint its
    prompt's first KV block is hashed with (engine.kv_cache.block_hash.first_block_key)."""

    name: str
    fingerprint: bytes


@dataclass(frozen=True)
class WorkerAdapter:
    """One adapter as one worker reports it."""

    name: str
    fingerprint: bytes
    path: str  # the directory the worker read it from
    in_slot: bool = False  # in one of its slots now: a request starts without a load
    in_memory: bool = False  # read and kept: a load into a slot is a copy, not a read
    requests: int = 0  # its requests on the worker, running or waiting: its slot is not free

    @property
    def load_s(self) -> float:
        """Seconds a request for it waits for it to be in a slot (COPY_S, READ_S)."""
        return 0.0 if self.in_slot else COPY_S if self.in_memory else READ_S


def waits_for_slot(adapters: Iterable[WorkerAdapter], max_loras: int, name: str) -> bool:
    """Whether a request for the adapter `name` would wait on a worker serving `adapters` with
    `max_loras` slots until another adapter's requests all finish: it is not in a slot and every slot
    holds an adapter with requests (the engine evicts only idle slots, engine.lora.registry). That
    wait is a whole request's length, not a load's milliseconds, so the router treats such a worker
    as one without room: the last resort (the Gateway API Inference Extension's LoRA affinity filters
    pods alike)."""
    held = [a for a in adapters if a.in_slot]
    if any(a.name == name for a in held):
        return False
    return sum(1 for a in held if a.requests) >= max_loras


@dataclass(frozen=True)
class WorkerAdapters:
    """What one routable worker serves: its address, its model version (NAME@VERSION) and adapters."""

    address: str
    version_key: str | None
    adapters: tuple[WorkerAdapter, ...]


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter every worker reporting it serves alike: its base version and fingerprint, and each
    of those workers' own state of it, by address."""

    name: str
    base: str | None  # NAME@VERSION of the base version (None: a worker that reported none)
    fingerprint: bytes
    path: str
    workers: Mapping[str, WorkerAdapter]

    @property
    def ref(self) -> AdapterRef:
        """What a request for it carries to routing."""
        return AdapterRef(self.name, self.fingerprint)


@dataclass(frozen=True)
class AdapterTable:
    """The adapters served, by name, and the names refused for a conflict (with why)."""

    served: Mapping[str, ServedAdapter]
    conflicts: Mapping[str, str]

    @classmethod
    def of(cls, workers: Iterable[WorkerAdapters], models: Collection[str] = ()) -> AdapterTable:
        """The table over these workers' reports; an adapter named as one of `models` (the names
        the gateway serves models under) is a conflict: the model keeps its name."""
        by_name: dict[str, list[tuple[WorkerAdapters, WorkerAdapter]]] = {}
        for worker in workers:
            for adapter in worker.adapters:
                by_name.setdefault(adapter.name, []).append((worker, adapter))
        served: dict[str, ServedAdapter] = {}
        conflicts: dict[str, str] = {}
        for name, holders in by_name.items():
            reason = f"the adapter `{name}` shares its name with a served model" if name in models else \
                _conflict(name, holders)
            if reason is not None:
                conflicts[name] = reason
                continue
            first_worker, first = holders[0]
            served[name] = ServedAdapter(name, first_worker.version_key, first.fingerprint, first.path,
                                         {worker.address: adapter for worker, adapter in holders})
        return cls(served, conflicts)


def _conflict(name: str, holders: list[tuple[WorkerAdapters, WorkerAdapter]]) -> str | None:
    """Why the workers' reports of `name` disagree, naming the workers; None when they agree."""
    fingerprints: dict[bytes, list[str]] = {}
    bases: dict[str | None, list[str]] = {}
    for worker, adapter in holders:
        fingerprints.setdefault(adapter.fingerprint, []).append(worker.address)
        bases.setdefault(worker.version_key, []).append(worker.address)
    if len(fingerprints) > 1:
        groups = "; ".join(f"{fingerprint.hex()[:16]} on {', '.join(addresses)}"
                           for fingerprint, addresses in fingerprints.items())
        return f"the adapter `{name}` is served with different weights: {groups}"
    if len(bases) > 1:
        groups = "; ".join(f"{base} on {', '.join(addresses)}" for base, addresses in bases.items())
        return f"the adapter `{name}` is served over different base versions: {groups}"
    return None
