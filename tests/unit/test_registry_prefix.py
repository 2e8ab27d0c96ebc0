"""The registry's bookkeeping per request: which workers' cached prefixes a request is offered, that
its prompt is hashed once per block size however many workers there are, and which workers may be
its prefill site."""

from __future__ import annotations

import asyncio

import pytest
from tandem.v1 import common_pb2

from engine.kv_cache.block_hash import prompt_block_hashes
from services.gateway import registry as registry_module
from services.gateway.registry import WorkerRegistry

PROMPT = list(range(1000, 1064))  # 4 blocks of 16


def _registry(versions: list[str]) -> WorkerRegistry:
    """One prefill worker per version of model "m", each holding the whole prompt's prefix."""
    registry = WorkerRegistry(prefill=[f"10.0.2.{i}:50061" for i in range(len(versions))])
    for worker, version in zip(registry.workers, versions, strict=True):
        worker.serving = True
        worker.report = common_pb2.LoadReport(role="prefill", block_size=16, total_kv_blocks=100,
                                              free_kv_blocks=100, model_name="m", model_version=version)
        registry.prefix_index.record(worker.address, prompt_block_hashes(PROMPT, 16), 100)
    return registry


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

    def counted(token_ids, block_size):
        calls.append(block_size)
        return prompt_block_hashes(token_ids, block_size)

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
