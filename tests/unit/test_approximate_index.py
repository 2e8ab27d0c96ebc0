"""The approximate prefix index: where the gateway placed each prompt, the longest recorded prefix per
worker, a guessed capacity evicting the least recently placed blocks; the registry feeding it from its
placements (not from block events) in `--prefix-index approximate`, and the flag."""

from __future__ import annotations

import asyncio

import pytest
from tandem.v1 import common_pb2

from engine.kv_cache.block_hash import prompt_block_hashes
from services.cli import build_parser, main
from services.commands.gateway import GatewayFlags
from services.common.config_flags import from_args
from services.gateway.approximate_index import ApproximateIndex
from services.gateway.registry import WorkerRegistry
from services.gateway.router import Decision

SYSTEM = list(range(64))  # 4 blocks of 16
PROMPT = [*SYSTEM, *range(500, 532)]  # 6 blocks
SALT = b"fingerprint"


def _hashes(tokens: list[int]) -> list[bytes]:
    return prompt_block_hashes(tokens, 16, SALT)


def test_the_longest_recorded_prefix_is_found_per_worker() -> None:
    index = ApproximateIndex()
    index.record("a", _hashes([*SYSTEM, *range(900, 916)]), capacity_blocks=100)
    hit = index.prefix("a", _hashes(PROMPT))
    assert hit.blocks == {"device": 4} and hit.lower_blocks == {}  # the system prompt, not the rest
    assert index.prefix("b", _hashes(PROMPT)).blocks == {}
    assert index.prefix("a", _hashes([1, *PROMPT[1:]])).blocks == {}  # a chain: the first block differs
    assert index.counts("a") == {"device": 5} and index.counts("b") == {} and index.size == 5
    index.forget("a")
    assert index.prefix("a", _hashes(PROMPT)).blocks == {} and index.size == 0


def test_a_worker_keeps_its_guessed_capacity_the_least_recently_placed_blocks_going_first() -> None:
    index = ApproximateIndex()
    old, new = _hashes(list(range(32))), _hashes(list(range(1000, 1032)))
    index.record("a", old, capacity_blocks=3)
    index.record("a", new, capacity_blocks=3)
    # old's first block went, so nothing of old is a prefix any more; new is whole.
    assert index.prefix("a", old).blocks == {} and index.prefix("a", new).device_blocks == 2
    index.record("a", old[:1], capacity_blocks=3)  # placed again: the most recent now
    index.record("a", _hashes(list(range(2000, 2016))), capacity_blocks=3)
    assert index.prefix("a", old).device_blocks == 1 and index.prefix("a", new).blocks == {}
    assert index.counts("a") == {"device": 3}
    index.record("a", new, capacity_blocks=0)  # a worker without KV holds nothing
    assert index.size == 0


def _registry(total_kv_blocks: int) -> WorkerRegistry:
    """Two colocated workers in approximate mode whose reports carry block events and probe hashes the
    gateway does not use."""
    registry = WorkerRegistry(colocated=["10.0.7.1:50081", "10.0.7.2:50081"], prefix_index="approximate")
    for worker in registry.workers:
        worker.serving = True
        worker._receive(common_pb2.LoadReport(
            role="colocated", block_size=16, total_kv_blocks=total_kv_blocks, free_kv_blocks=total_kv_blocks,
            model_name="m", block_hash_salt=SALT, probe_block_hashes=[bytes(32)], kv_events_reset=True,
            kv_events=[common_pb2.KVBlockEvent(tier="device", stored=True, block_hashes=_hashes(PROMPT))]))
    return registry


def test_the_registry_records_placements_and_ignores_block_events_in_approximate_mode() -> None:
    async def scenario() -> None:
        registry = _registry(total_kv_blocks=8)
        a, b = registry.workers
        request = registry.route_request(PROMPT, 8)
        assert request.cached_tokens == {}  # the events said both hold it: not believed
        assert registry.probe.refused() == []  # nor their hashes judged: they name nothing here
        placement = registry.claim(request, Decision(decode=b.address, prefill=a.address, ttft_s=0.1, tpot_s=0.01,
                                                     meets_slo=True, cost=0.1))
        placement.release()
        # Computed on a, decoded on b: both cache the prompt's 6 blocks.
        assert registry.route_request(PROMPT, 8).cached_tokens == {a.address: 96, b.address: 96}
        other = [*range(3000, 3064)]
        registry.claim(registry.route_request(other, 8), Decision(decode=a.address, prefill=None, ttft_s=0.1,
                                                                  tpot_s=0.01, meets_slo=True, cost=0.1)).release()
        # a holds at most 8 blocks: the prompt's first 2 gave way to other's 4, so nothing of it is a prefix there.
        assert registry.route_request(PROMPT, 8).cached_tokens == {b.address: 96}
        assert registry.route_request(other, 8).cached_tokens == {a.address: 64}
        assert registry.route_request(PROMPT, 8, cache_salt="tenant").cached_tokens == {}  # another tenant's blocks
        registry._reported(a, None)  # its stream broke: it may have restarted empty
        assert registry.route_request(other, 8).cached_tokens == {}
        await registry.close()

    asyncio.run(scenario())


def test_the_prefix_index_flag_defaults_to_exact_and_refuses_another_name(capsys) -> None:
    def parsed(*extra: str) -> GatewayFlags:
        return from_args(GatewayFlags, build_parser().parse_args(["gateway", "--colocated", "h:1", *extra]))

    assert parsed().prefix_index == "exact"
    assert parsed("--prefix-index", "approximate").prefix_index == "approximate"
    with pytest.raises(SystemExit):
        main(["gateway", "--colocated", "h:1", "--prefix-index", "guessed"])
    assert "--prefix-index" in capsys.readouterr().err

