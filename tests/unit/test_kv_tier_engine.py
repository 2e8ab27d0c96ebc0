"""Lower KV tiers under a real engine on the shipped model: a conversation's second turn whose
prefix comes back from the host tier or the disk tier, loaded in the same step that computes the rest
of the prompt, answers exactly as a fresh compute; a damaged block found mid-step, or a load stuck
past its deadline, only costs a recompute, and no late write lands in the cache
(engine.kv_tiers, engine.kv_connector.tier_mover, engine.kv_connector.tier_loading)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_runs import output_tokens, run_requests

from engine.config import CacheConfig, KVTierConfig, LoraConfig
from engine.engine import Engine
from engine.kv_connector.connector import KVConnector
from engine.kv_tiers.block_record import pack_record
from engine.sampling_params import SamplingParams
from harness.lora_adapters import save_adapter

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


def answer(engine: Engine, prompt: list[int], request_id: str = "turn-2") -> tuple[list[int], int, int]:
    """Greedy tokens, the prompt tokens that came from a cache (device or lower tier), and the steps
    it took to the first token (1: a lower tier's load overlapped the compute of the rest)."""
    engine.add_request(request_id, prompt, GREEDY)
    outputs, steps = [], 0
    while engine.has_unfinished():
        steps += not outputs
        outputs.extend(o for o in engine.step() if o.request_id == request_id and o.new_token_ids)
        engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return output_tokens(outputs), outputs[-1].num_cached_tokens, steps


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
    tokens, cached, steps = answer(engine, prompt)
    assert tokens == expected
    assert steps == 1  # the load and the rest of the prompt in one step
    stats = engine.stats()
    assert cached == stats.external_prefix_cache_hits > 0
    assert stats.kv_tiers["disk"].hits * SMALL_CACHE.block_size == cached
    assert 0 < stats.kv_tier_first_layer_wait_s <= stats.kv_tier_load_wait_s  # the forward's wait, measured
    engine.close()


def test_second_turn_from_the_host_tier_answers_as_fresh_on_another_worker(make_engine, fresh, host_owner) -> None:
    prompt, expected = fresh
    tiers = KVTierConfig(host_socket=host_owner)
    first = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)
    second_turn(first)
    first.close()  # its mover finishes what it was writing
    neighbour = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)  # another worker of the same node
    tokens, cached, steps = answer(neighbour, prompt)
    assert tokens == expected and steps == 1
    assert cached > 0 and neighbour.stats().kv_tiers["host"].hits * SMALL_CACHE.block_size == cached
    neighbour.close()


def test_a_layer_found_damaged_mid_step_costs_a_recompute_not_the_answer(make_engine, fresh, written,
                                                                          tmp_path) -> None:
    prompt, expected = fresh
    tiers = copied(written, tmp_path)
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)
    path = Path(tiers.disk_dir) / f"{engine.kv.prefix_hashes(prompt)[1].hex()}.kvb"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a byte of a middle layer's pages: its header and first layers check
    path.write_bytes(bytes(data))
    tokens, cached, steps = answer(engine, prompt)
    assert tokens == expected
    # The step that loaded it computed the request over half-loaded pages: its result was discarded,
    # and the request recomputed from scratch in the next step.
    assert steps == 2 and cached == 0
    disk = engine.stats().kv_tiers["disk"]
    assert (disk.corrupt, disk.loaded_blocks) == (1, 0)
    # Dropped from the tier (the recompute may since have stored the block again, intact).
    assert not path.exists() or path.read_bytes() != bytes(data)
    engine.close()


def test_a_layer_damaged_after_the_load_wrote_layer_0_is_found_and_costs_a_recompute(make_engine, fresh, written,
                                                                                    tmp_path, monkeypatch) -> None:
    prompt, expected = fresh
    tiers = copied(written, tmp_path)
    layers_written: list[int] = []
    write_pages = KVConnector.write_pages

    def write_then_damage(connector, request_id, ticket, layer, block_ids, k, v) -> None:
        write_pages(connector, request_id, ticket, layer, block_ids, k, v)
        layers_written.append(layer)
        if layers_written == [0]:  # a byte of the last layer of a loading block's file, changed in place
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

    monkeypatch.setattr(KVConnector, "write_pages", write_then_damage)
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)
    path = Path(tiers.disk_dir) / f"{engine.kv.prefix_hashes(prompt)[1].hex()}.kvb"
    tokens, cached, steps = answer(engine, prompt)
    assert tokens == expected and steps == 2 and cached == 0
    # The load read the last layer's bytes only after it had written the layers before it.
    assert layers_written == list(range(engine.runner.cache.num_layers - 1))
    disk = engine.stats().kv_tiers["disk"]
    assert (disk.corrupt, disk.loaded_blocks) == (1, 0)
    engine.close()


def test_a_load_stuck_past_its_deadline_is_recomputed_and_its_late_write_refused(make_engine, fresh, written,
                                                                                 tmp_path, monkeypatch) -> None:
    prompt, expected = fresh
    tiers = copied(written, tmp_path)
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)
    block_hash = engine.kv.prefix_hashes(prompt)[0]
    path = Path(tiers.disk_dir) / f"{block_hash.hex()}.kvb"
    path.unlink()
    os.mkfifo(path)  # the mover's open of the first block blocks until the test writes it
    engine.close()
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=tiers)  # finds the pipe as a block at start-up
    monkeypatch.setattr("engine.engine.LOAD_TIMEOUT_S", 1.0)
    try:
        tokens, cached, steps = answer(engine, prompt)
        assert tokens == expected and cached == 0 and steps == 2
        before = [page.clone() for pages in engine.runner.cache.kv_caches for page in pages]
    finally:
        # Now the stuck read returns a record that checks, of other pages: a write of its first layer
        # is refused, and the load ends without reading the rest.
        layout = engine.tiers.tiers.layout
        payload = torch.randint(0, 256, (layout.payload_size,), dtype=torch.uint8).numpy().tobytes()
        bogus = pack_record(block_hash, payload, layout)
        writer = threading.Thread(target=feed, args=(path, bogus), daemon=True)
        writer.start()
        engine.close()  # its mover ends its jobs first
        writer.join(timeout=5)
    assert all(torch.equal(a, b) for a, b in zip(before, (p for ps in engine.runner.cache.kv_caches for p in ps),
                                                  strict=True))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def feed(pipe: Path, data: bytes) -> None:
    """Write `data` into a named pipe, until its reader closes it."""
    with contextlib.suppress(BrokenPipeError):
        pipe.write_bytes(data)


def test_blocks_a_tier_holds_for_the_base_are_never_loaded_for_an_adapter(make_engine, model_files, fresh, written,
                                                                          tmp_path) -> None:
    """The adapter's fingerprint seeds its requests' first block hash (engine.kv_cache.block_hash),
    and the tiers key blocks by that hash: the base's turn on disk is not the adapter's."""
    prompt, expected = fresh
    adapter = save_adapter(tmp_path / "adapter", model_files.config, rank=4, seed=5)
    engine = make_engine(cache=SMALL_CACHE, kv_tiers=copied(written, tmp_path),
                         lora=LoraConfig(modules=(("tenant", str(adapter)),)))
    engine.add_request("under-adapter", prompt, dataclasses.replace(GREEDY, lora_name="tenant"))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert outputs[-1].num_cached_tokens == 0 and engine.stats().kv_tiers["disk"].hits == 0
    tokens, cached, _ = answer(engine, prompt)  # the base's own blocks it loads
    assert tokens == expected and cached > 0
    engine.close()
