"""The registry's bookkeeping per request: which workers' cached prefixes (by their block events) a
request is offered, that its prompt is hashed once per block size and salt however many workers there
are, and which workers may be its prefill site."""

from __future__ import annotations

import asyncio

import pytest
from tandem.v1 import common_pb2

from engine.kv_cache.block_hash import PROBE_TEXT, prompt_block_hashes
from services.gateway import registry as registry_module
from services.gateway.registry import WorkerRegistry
from services.gateway.workers import RemoteWorker

PROMPT = list(range(1000, 1064))  # 4 blocks of 16
SALT = b"fingerprint"
PROBE = [ord(c) for c in PROBE_TEXT]  # the gateway's "tokenizer" in these tests: code points


def _registry(versions: list[str]) -> WorkerRegistry:
    """One prefill worker per version of model "m", each holding the whole prompt's prefix."""
    registry = WorkerRegistry(prefill=[f"10.0.2.{i}:50061" for i in range(len(versions))])
    registry.probe.probe_tokens = lambda version_key: PROBE
    for worker, version in zip(registry.workers, versions, strict=True):
        worker.serving = True
        _report(worker, common_pb2.LoadReport(role="prefill", total_kv_blocks=100, free_kv_blocks=100, model_name="m",
                                              model_version=version, **_holding(prompt_block_hashes(PROMPT, 16, SALT))))
    return registry


def _holding(hashes: list[bytes], tier: str = "device", probe: list[bytes] | None = None) -> dict:
    """A first report's block fields: the probe's hashes, and a snapshot of `hashes` in `tier`."""
    return {"block_size": 16, "block_hash_salt": SALT, "kv_events_reset": True,
            "probe_block_hashes": prompt_block_hashes(PROBE, 16, SALT) if probe is None else probe,
            "kv_events": [common_pb2.KVBlockEvent(tier=tier, stored=True, block_hashes=hashes)]}


def _report(worker: RemoteWorker, report: common_pb2.LoadReport) -> None:
    """The worker's load stream delivers `report` (what RemoteWorker._watch_load does with one)."""
    worker._receive(report)


def test_a_request_for_a_version_is_offered_only_its_own_workers_cached_prefixes() -> None:
    async def scenario() -> None:
        registry = _registry(["a", "b", "a"])
        assert registry.route_request(PROMPT, 8, version_key="m@a").cached_tokens == {
            "10.0.2.0:50061": 64, "10.0.2.2:50061": 64}
        assert len(registry.route_request(PROMPT, 8).cached_tokens) == 3  # a gateway of one model: any
        await registry.close()

    asyncio.run(scenario())


def test_the_prompt_is_hashed_once_per_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def counted(token_ids, block_size, salt, cache_salt):
        calls.append(block_size)
        return prompt_block_hashes(token_ids, block_size, salt, cache_salt)

    monkeypatch.setattr(registry_module, "prompt_block_hashes", counted)

    async def scenario() -> None:
        registry = _registry(["a"] * 8)
        registry.route_request(PROMPT, 8)
        assert calls == [16]
        await registry.close()

    asyncio.run(scenario())


def test_a_colocated_worker_retiring_a_version_computes_no_prompt_of_it_for_another() -> None:
    # c2 swapped to version b and still finishes a's requests: its Prefill service would compute an
    # a request with b's weights, so for a it is a decode site only; for b it is both.
    async def scenario() -> None:
        registry = WorkerRegistry(colocated=["10.0.4.1:50081", "10.0.4.2:50081"])
        for worker, (version, retiring) in zip(registry.workers, [("a", []), ("b", ["m@a"])], strict=True):
            worker.serving = True
            worker.report = common_pb2.LoadReport(role="colocated", block_size=16, total_kv_blocks=100,
                                                  free_kv_blocks=100, model_name="m", model_version=version,
                                                  retiring_versions=retiring)
        decision = registry.decide(registry.route_request(PROMPT, 8, version_key="m@a"))
        sites = {reason.split(": predicted")[0] for reason in decision.reasons}
        assert "prefill 10.0.4.1:50081 -> decode 10.0.4.2:50081" in sites
        assert not any(site.startswith("prefill 10.0.4.2:50081") for site in sites)
        await registry.close()

    asyncio.run(scenario())


def test_a_decode_worker_listed_as_colocated_is_no_prefill_site_for_another() -> None:
    # `--colocated` over decode-role workers (each computes its own prompts): asked to compute one for
    # another worker, the decode worker answered UNIMPLEMENTED and the request failed.
    async def scenario() -> None:
        registry = WorkerRegistry(colocated=["10.0.5.1:50071", "10.0.5.2:50071"])
        for worker in registry.workers:
            worker.serving = True
            worker.report = common_pb2.LoadReport(role="decode", block_size=16, total_kv_blocks=100,
                                                  free_kv_blocks=100, model_name="m")
        for idle in (False, True):
            decision = registry.decide(registry.route_request(PROMPT, 8), idle=idle)
            assert decision.prefill is None
            assert not any(reason.startswith("prefill ") for reason in decision.reasons)
        await registry.close()

    asyncio.run(scenario())


def _colocated(count: int = 2) -> WorkerRegistry:
    registry = WorkerRegistry(colocated=[f"10.0.6.{i}:50081" for i in range(count)])
    registry.probe.probe_tokens = lambda version_key: PROBE
    for worker in registry.workers:
        worker.serving = True
    return registry


def _first_report(worker: RemoteWorker, hashes: list[bytes], tier: str = "device", **fields) -> None:
    _report(worker, common_pb2.LoadReport(role="colocated", total_kv_blocks=100, free_kv_blocks=100, model_name="m",
                                          **{**_holding(hashes, tier), **fields}))


def test_the_index_offers_device_blocks_free_and_lower_tiers_at_their_reported_load_time() -> None:
    async def scenario() -> None:
        registry = _colocated()
        a, b = registry.workers
        hashes = prompt_block_hashes(PROMPT, 16, SALT)
        _first_report(a, hashes[:2], kv_load_s_per_block={"disk": 0.25})
        _report(a, common_pb2.LoadReport(
            role="colocated", total_kv_blocks=100, free_kv_blocks=100, model_name="m", block_size=16,
            block_hash_salt=SALT, probe_block_hashes=prompt_block_hashes(PROBE, 16, SALT),
            kv_load_s_per_block={"disk": 0.25},
            kv_events=[common_pb2.KVBlockEvent(tier="disk", stored=True, block_hashes=hashes[2:])]))
        _first_report(b, hashes[:1])
        request = registry.route_request(PROMPT, 8)
        assert request.cached_tokens == {a.address: 32, b.address: 16}
        assert request.loadable[a.address].tokens_by_tier == {"disk": 32}
        assert request.loadable[a.address].load_s == pytest.approx(0.5)  # two blocks at 0.25 s
        assert b.address not in request.loadable
        # The same prompt under a tenant's cache_salt names other blocks: no worker holds them.
        salted = registry.route_request(PROMPT, 8, cache_salt="tenant")
        assert salted.cached_tokens == {} and salted.loadable == {}
        await registry.close()

    asyncio.run(scenario())


def test_a_host_tier_shared_by_a_node_serves_every_worker_attached_to_it() -> None:
    async def scenario() -> None:
        registry = _colocated(3)
        a, b, c = registry.workers
        hashes = prompt_block_hashes(PROMPT, 16, SALT)
        _first_report(a, hashes, tier="host", host_tier_id="node-1")
        _first_report(b, [], host_tier_id="node-1")
        _first_report(c, [], host_tier_id="node-2")
        loadable = registry.route_request(PROMPT, 8).loadable
        assert {address: held.tokens for address, held in loadable.items()} == {a.address: 64, b.address: 64}
        await registry.close()

    asyncio.run(scenario())


def test_a_reset_replaces_what_a_worker_held_and_a_broken_stream_forgets_it() -> None:
    async def scenario() -> None:
        registry = _colocated()
        a, _ = registry.workers
        hashes = prompt_block_hashes(PROMPT, 16, SALT)
        _first_report(a, hashes)
        assert registry.route_request(PROMPT, 8).cached_tokens == {a.address: 64}
        _first_report(a, hashes[:1])  # a new stream's snapshot: only the first block now
        assert registry.route_request(PROMPT, 8).cached_tokens == {a.address: 16}
        registry._reported(a, None)  # what RemoteWorker._watch_load reports when its stream breaks
        assert registry.route_request(PROMPT, 8).cached_tokens == {}
        assert registry.blocks.size == 0
        await registry.close()

    asyncio.run(scenario())


def test_a_worker_whose_probe_hashes_differ_is_refused_loudly_and_holds_nothing(caplog) -> None:
    async def scenario() -> None:
        registry = _colocated()
        good, bad = registry.workers
        hashes = prompt_block_hashes(PROMPT, 16, SALT)
        _first_report(good, hashes)
        # Another tokenizer: the probe's third block onwards differs.
        other = prompt_block_hashes([*PROBE[:40], 7, *PROBE[41:]], 16, SALT)
        _first_report(bad, hashes, probe_block_hashes=other)
        assert registry.route_request(PROMPT, 8).cached_tokens == {good.address: 64}
        refusal = registry.probe.refusal(bad.address)
        assert refusal is not None and refusal.startswith("refused: probe block 2 differs")
        assert registry.probe.refusal(good.address) is None
        assert registry.probe.refused() == [bad.address] and registry.probe.mismatches == 1
        assert f"worker {bad.address}" in caplog.text and "probe block 2 differs" in caplog.text
        _first_report(bad, hashes, probe_block_hashes=other)  # judged once per distinct report
        assert registry.probe.mismatches == 1
        assert bad.routable  # still routed by its load
        await registry.close()

    asyncio.run(scenario())


def test_a_worker_is_not_trusted_before_the_gateway_can_hash_the_probe() -> None:
    async def scenario() -> None:
        registry = _colocated()
        a, _ = registry.workers
        registry.probe.probe_tokens = lambda version_key: None  # the gateway's tokenizer still loading
        _first_report(a, prompt_block_hashes(PROMPT, 16, SALT))
        assert registry.route_request(PROMPT, 8).cached_tokens == {}
        assert "not yet checked" in (registry.probe.refusal(a.address) or "")
        registry.probe.probe_tokens = lambda version_key: PROBE
        _report(a, common_pb2.LoadReport(role="colocated", total_kv_blocks=100, free_kv_blocks=100, model_name="m",
                                         block_size=16, block_hash_salt=SALT,
                                         probe_block_hashes=prompt_block_hashes(PROBE, 16, SALT)))
        assert registry.route_request(PROMPT, 8).cached_tokens == {a.address: 64}
        assert registry.probe.mismatches == 0
        await registry.close()

    asyncio.run(scenario())
