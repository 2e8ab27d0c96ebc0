"""LoRA adapters at the gateway, from the workers' load reports (LoadReport.lora_adapters): which
names are served and which conflict, which workers a request for an adapter is offered and paired
on, how its prompt is hashed for the exact prefix index, and what a worker's load of it costs."""

from __future__ import annotations

import asyncio

import pytest
from tandem.v1 import common_pb2

from engine.kv_cache.block_hash import PROBE_TEXT, first_block_key, prompt_block_hashes
from services.gateway.adapters import COPY_S, READ_S, AdapterRef, AdapterTable, WorkerAdapter, WorkerAdapters
from services.gateway.registry import WorkerRegistry
from services.gateway.router import NoWorkerError
from services.gateway.workers import RemoteWorker

PROMPT = list(range(1000, 1064))  # 4 blocks of 16
SALT = b"fingerprint"
PROBE = [ord(c) for c in PROBE_TEXT]  # the gateway's "tokenizer" in these tests: code points
SQL, CHAT = b"\x01" * 16, b"\x02" * 16


def _adapter(name: str, fingerprint: bytes, **state: bool) -> WorkerAdapter:
    return WorkerAdapter(name, fingerprint, f"/adapters/{name}", **state)


def test_workers_that_agree_serve_an_adapter_and_those_that_differ_conflict_by_name() -> None:
    table = AdapterTable.of([
        WorkerAdapters("w1:1", "m@a", (_adapter("sql", SQL), _adapter("chat", CHAT))),
        WorkerAdapters("w2:1", "m@a", (_adapter("sql", SQL, in_slot=True), _adapter("chat", SQL))),
        WorkerAdapters("w3:1", "m@b", (_adapter("docs", CHAT),)),
        WorkerAdapters("w4:1", "m@a", (_adapter("docs", CHAT),)),
    ])
    assert set(table.served) == {"sql"}
    assert table.served["sql"].base == "m@a" and set(table.served["sql"].workers) == {"w1:1", "w2:1"}
    assert "different weights" in table.conflicts["chat"] and "w2:1" in table.conflicts["chat"]
    assert "different base versions" in table.conflicts["docs"] and "m@b on w3:1" in table.conflicts["docs"]


def test_an_adapter_named_as_a_model_is_a_conflict() -> None:
    table = AdapterTable.of([WorkerAdapters("w1:1", "m@a", (_adapter("m", SQL),))], models={"m", "m@a"})
    assert not table.served and "shares its name with a served model" in table.conflicts["m"]


def test_a_load_costs_nothing_in_a_slot_a_copy_in_memory_and_a_read_otherwise() -> None:
    assert [_adapter("sql", SQL, **state).load_s for state in ({"in_slot": True}, {"in_memory": True}, {})] == [
        0.0, COPY_S, READ_S]


def _report(worker: RemoteWorker, adapters: list[common_pb2.LoraAdapterState], role: str = "colocated",
            hashes: list[bytes] = (), **fields) -> None:
    """The worker's load stream delivers a first report: its adapters, the probe's hashes, and a
    snapshot of `hashes` on its device (what RemoteWorker._watch_load does with one)."""
    worker.serving = True
    worker._receive(common_pb2.LoadReport(
        role=role, total_kv_blocks=100, free_kv_blocks=100, model_name="m", model_version="a", block_size=16,
        block_hash_salt=SALT, kv_events_reset=True, probe_block_hashes=prompt_block_hashes(PROBE, 16, SALT),
        kv_events=[common_pb2.KVBlockEvent(tier="device", stored=True, block_hashes=hashes)],
        lora_adapters=adapters, **{"max_loras": 2, **fields}))


def _state(name: str, fingerprint: bytes, **state: bool | int) -> common_pb2.LoraAdapterState:
    return common_pb2.LoraAdapterState(name=name, fingerprint=fingerprint, path=f"/adapters/{name}", **state)


def _registry(**pools: list[str]) -> WorkerRegistry:
    registry = WorkerRegistry(**pools)
    registry.probe.probe_tokens = lambda version_key: PROBE
    return registry


def test_a_request_for_an_adapter_is_offered_only_workers_serving_it_alike() -> None:
    async def scenario() -> None:
        registry = _registry(colocated=["10.0.7.1:1", "10.0.7.2:1", "10.0.7.3:1"])
        same, other, none = registry.workers
        _report(same, [_state("sql", SQL)])
        _report(other, [_state("sql", CHAT)])
        _report(none, [])
        sql = AdapterRef("sql", SQL)
        for _ in range(3):  # every turn of the rotation
            decision = registry.decide(registry.route_request(PROMPT, 8, version_key="m@a", adapter=sql))
            assert (decision.decode, decision.prefill) == (same.address, None)
        # The base model is served by all three.
        assert len(registry.decide(registry.route_request(PROMPT, 8, version_key="m@a")).reasons) > 1
        await registry.close()

    asyncio.run(scenario())


def test_a_prefill_worker_is_paired_only_with_a_decode_worker_serving_the_adapter_alike() -> None:
    async def scenario() -> None:
        registry = _registry(prefill=["10.0.8.1:1", "10.0.8.2:1"], decode=["10.0.8.3:1"])
        alike, unlike, decode = registry.workers
        _report(alike, [_state("sql", SQL)], role="prefill")
        _report(unlike, [_state("sql", CHAT)], role="prefill")
        _report(decode, [_state("sql", SQL)], role="decode")
        decision = registry.decide(registry.route_request(PROMPT, 8, version_key="m@a", adapter=AdapterRef("sql", SQL)))
        assert decision.prefill == alike.address
        assert not any(unlike.address in reason for reason in decision.reasons)
        await registry.close()

    asyncio.run(scenario())


def test_prefix_hits_are_per_adapter() -> None:
    # One worker holds the prompt's blocks as the base computed them, the other as the adapter did:
    # a request under the adapter hits only the second, a base request only the first. The hashes
    # are the workers' (first_block_key), so this fails if the gateway dropped the adapter.
    async def scenario() -> None:
        registry = _registry(colocated=["10.0.9.1:1", "10.0.9.2:1"])
        base_held, adapter_held = registry.workers
        adapter_hashes = prompt_block_hashes(PROMPT, 16, SALT, first_block_key("", SQL))
        _report(base_held, [_state("sql", SQL)], hashes=prompt_block_hashes(PROMPT, 16, SALT))
        _report(adapter_held, [_state("sql", SQL)], hashes=adapter_hashes)
        under = registry.route_request(PROMPT, 8, version_key="m@a", adapter=AdapterRef("sql", SQL))
        assert under.cached_tokens == {adapter_held.address: 64}
        assert registry.route_request(PROMPT, 8, version_key="m@a").cached_tokens == {base_held.address: 64}
        await registry.close()

    asyncio.run(scenario())


def test_the_router_prefers_a_worker_holding_the_adapter_in_a_slot_and_counts_a_load_elsewhere() -> None:
    async def scenario() -> None:
        registry = _registry(colocated=["10.0.10.1:1", "10.0.10.2:1", "10.0.10.3:1"])
        on_disk, in_memory, in_slot = registry.workers
        _report(on_disk, [_state("sql", SQL)])
        _report(in_memory, [_state("sql", SQL, in_memory=True)])
        _report(in_slot, [_state("sql", SQL, in_memory=True, in_slot=True)])
        request = registry.route_request(PROMPT, 8, version_key="m@a", adapter=AdapterRef("sql", SQL))
        assert request.adapter_load_s == {on_disk.address: READ_S, in_memory.address: COPY_S}
        for _ in range(3):  # whichever worker the rotation starts from
            decision = registry.decide(request)
            assert (decision.decode, decision.prefill) == (in_slot.address, None)
        await registry.close()

    asyncio.run(scenario())


def test_a_worker_whose_every_slot_serves_other_adapters_requests_ranks_last_even_when_less_loaded() -> None:
    async def scenario() -> None:
        registry = _registry(colocated=["10.0.12.1:1", "10.0.12.2:1"])
        full, free = registry.workers
        # `full`: its one slot holds `chat` with a running request, so `sql` would wait for it to finish.
        _report(full, [_state("sql", SQL, in_memory=True), _state("chat", CHAT, in_slot=True, running_requests=1)],
                max_loras=1)
        # `free`: busier, and `sql` must be read from disk, but a slot is free (its adapter is idle).
        _report(free, [_state("sql", SQL), _state("chat", CHAT, in_slot=True)], max_loras=1, running_requests=3)
        request = registry.route_request(PROMPT, 8, version_key="m@a", adapter=AdapterRef("sql", SQL))
        assert request.adapter_slots_full == {full.address}
        for _ in range(3):
            assert registry.decide(request).decode == free.address
        # For `chat`, which is in `full`'s slot, nothing waits: the less loaded worker wins.
        chat = registry.route_request(PROMPT, 8, version_key="m@a", adapter=AdapterRef("chat", CHAT))
        assert chat.adapter_slots_full == frozenset()
        assert registry.decide(chat).decode == full.address
        await registry.close()

    asyncio.run(scenario())


def test_no_worker_serving_the_adapter_leaves_no_way() -> None:
    async def scenario() -> None:
        registry = _registry(colocated=["10.0.11.1:1"])
        _report(registry.workers[0], [_state("sql", SQL)])
        with pytest.raises(NoWorkerError):
            registry.decide(registry.route_request(PROMPT, 8, version_key="m@a", adapter=AdapterRef("chat", CHAT)))
        await registry.close()

    asyncio.run(scenario())
