"""Lower KV tiers under a real engine on the shipped model: a conversation's second turn whose
prefix comes back from the host tier or the disk tier answers exactly as a fresh compute, and a
damaged or missing block only costs its recompute (engine.kv_tiers, engine.kv_connector.tier_mover)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_runs import output_tokens, run_requests

from engine.config import CacheConfig, KVTierConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# 12 blocks of 16 tokens: one filler prompt pushes the first turn out of the device cache.
SMALL_CACHE = CacheConfig(num_blocks=12, block_size=16)
QUESTION = [{"role": "user", "content": "Name three rivers of Europe and say which country each one flows through."}]


def second_turn(engine: Engine) -> list[int]:
    """The conversation's second turn: the first turn, the model's answer to it, a new question."""
    first = engine.tokenizer.encode_chat(QUESTION)
    answer = output_tokens(run_requests(engine, {"turn-1": (first, GREEDY)})["turn-1"])
    messages = [*QUESTION, {"role": "assistant", "content": engine.tokenizer.decode(answer)},
                {"role": "user", "content": "Which of them is the longest?"}]
    return engine.tokenizer.encode_chat(messages)


def answer(engine: Engine, prompt: list[int], request_id: str = "turn-2") -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens that came from a cache (device or lower tier)."""
    outputs = run_requests(engine, {request_id: (prompt, GREEDY)})[request_id]
    return output_tokens(outputs), outputs[-1].num_cached_tokens


@pytest.fixture(scope="module")
def fresh(make_engine):
    """The second turn and its answer computed from scratch (no cache of any kind)."""
    engine = make_engine(cache=dataclasses.replace(SMALL_CACHE, enable_prefix_caching=False))
    prompt = second_turn(engine)
    return prompt, answer(engine, prompt)[0]


@pytest.fixture(scope="module")
def written(make_engine, fresh, tmp_path_factory):
    """A disk tier a worker filled with the first turn (and a filler that pushed it out of the
    device cache) before it stopped; each test reads a copy of it."""
    directory = tmp_path_factory.mktemp("tier") / "disk"
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=KVTierConfig(disk_dir=str(directory)))
    assert second_turn(engine) == fresh[0]
    filler = engine.tokenizer.encode("Filler: " + "the quick brown fox jumps over the lazy dog. " * 30)[:180]
    run_requests(engine, {"filler": (filler, SamplingParams(max_tokens=1))})
    engine.close()
    return directory


def copied(written: Path, tmp_path: Path) -> KVTierConfig:
    """Tiers of a copy of the written disk tier."""
    return KVTierConfig(disk_dir=str(shutil.copytree(written, tmp_path / "disk")))


@pytest.fixture
def host_owner(tmp_path):
    """The node's host tier owner process (`tandem kv-host-tier`)."""
    path = tmp_path / "host.sock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    owner = subprocess.Popen([sys.executable, "-m", "services.cli", "kv-host-tier", "--socket", str(path),
                              "--capacity-mib", "256"], env=env)
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline and owner.poll() is None, "the owner did not start"
        time.sleep(0.05)
    yield str(path)
    owner.kill()
    owner.wait()


def test_second_turn_from_the_disk_tier_after_a_restart_answers_as_fresh(make_engine, fresh, written,
                                                                         tmp_path) -> None:
    prompt, expected = fresh
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=copied(written, tmp_path))
    tokens, cached = answer(engine, prompt)
    assert tokens == expected
    stats = engine.stats()
    assert cached == stats.external_prefix_cache_hits > 0
    assert stats.kv_tiers["disk"].hits * SMALL_CACHE.block_size == cached
    engine.close()


def test_second_turn_from_the_host_tier_answers_as_fresh_on_another_worker(make_engine, fresh, host_owner) -> None:
    prompt, expected = fresh
    tiers = KVTierConfig(host_socket=host_owner)
    first = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)
    second_turn(first)
    first.close()  # its mover finishes what it was writing
    neighbour = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)  # another worker of the same node
    tokens, cached = answer(neighbour, prompt)
    assert tokens == expected
    assert cached > 0 and neighbour.stats().kv_tiers["host"].hits * SMALL_CACHE.block_size == cached
    neighbour.close()


@pytest.mark.parametrize("damaged", [0, 2])
def test_a_damaged_block_costs_its_recompute_not_the_answer(make_engine, fresh, written, tmp_path, damaged) -> None:
    prompt, expected = fresh
    tiers = copied(written, tmp_path)
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)
    path = Path(tiers.disk_dir) / f"{engine.kv.prefix_hashes(prompt)[damaged].hex()}.kvb"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a byte in the middle of its pages
    path.write_bytes(bytes(data))
    tokens, cached = answer(engine, prompt)
    assert tokens == expected
    assert cached == damaged * SMALL_CACHE.block_size  # the blocks before it loaded; it and the rest were computed
    assert engine.stats().kv_tiers["disk"].corrupt == 1
    engine.close()


def test_a_request_aborted_while_its_prefix_loads_leaks_no_block(make_engine, fresh, written, tmp_path) -> None:
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=copied(written, tmp_path))
    engine.add_request("loading", fresh[0], GREEDY)
    engine.step()  # admitted: its prefix starts loading
    assert engine.scheduler.tier_loading.requests
    assert engine.abort("loading")
    while engine.has_unfinished():
        engine.step()
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.close()
