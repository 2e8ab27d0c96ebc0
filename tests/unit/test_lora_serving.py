"""What a worker asks of an engine serving LoRA adapters (engine.lora.serving, identity, states):
adapters added and removed while it serves, with every refusal leaving the served set as it was;
each adapter's state for load reports; and a prompt computed for another worker only under the
adapter that worker runs it under. Random peft adapters over the shipped base."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, LoraConfig
from engine.kv_connector.export import KVExport
from engine.lora.adapter import AdapterError
from engine.lora.registry import AdapterInUse, AdapterMismatch, AdaptersBusy, LoraDisabled, UnknownAdapter
from engine.lora.serving import serve_adapters
from engine.offline import generate
from engine.outputs import KVReservation
from engine.sampling_params import SamplingParams
from harness.lora_adapters import save_adapter
from services.common.engine_loop import EngineLoop
from services.common.errors import status_of


class _Sink:
    def layer_done(self, layer, pages) -> None:
        pass

    def kept(self, kept) -> None:
        pass


@pytest.fixture(scope="module")
def adapter_dirs(model_files, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = model_files.config
    narrow = dataclasses.replace(base, hidden_size=base.hidden_size // 2, head_dim=base.head_dim // 2)
    return {"a": save_adapter(root / "a", base, 8, seed=1), "b": save_adapter(root / "b", base, 4, seed=2),
            "big": save_adapter(root / "big", base, 32, seed=3),
            "other-base": save_adapter(root / "other-base", narrow, 4, seed=4)}


@pytest.fixture(scope="module")
def engine(make_engine, adapter_dirs):
    return make_engine(cache=CacheConfig(num_blocks=64),
                       lora=LoraConfig(max_loras=1, max_lora_rank=16, modules=(("a", str(adapter_dirs["a"])),)))


def _greedy(name: str = "", max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=name)


def _served(engine) -> dict[str, bytes]:
    return {state.name: state.fingerprint for state in engine.stats().lora_adapters}


def test_adapters_are_added_reported_and_removed_while_serving(engine, adapter_dirs, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    assert engine.stats().max_loras == 1
    (a,) = engine.stats().lora_adapters
    assert (a.name, a.rank, a.path, a.in_slot, a.in_memory) == ("a", 8, str(adapter_dirs["a"]), False, True)
    engine.add_adapter(engine.read_adapter("b", adapter_dirs["b"]))
    assert set(_served(engine)) == {"a", "b"} and _served(engine)["a"] != _served(engine)["b"]
    under_b = generate(engine, [prompt], _greedy("b", max_tokens=8))[0].token_ids
    assert under_b != generate(engine, [prompt], _greedy(max_tokens=8))[0].token_ids
    states = {state.name: state for state in engine.stats().lora_adapters}
    assert states["b"].in_slot and not states["a"].in_slot  # one slot, b used last
    engine.add_request("running-a", prompt, _greedy("a", max_tokens=8))
    engine.add_request("waiting-b", prompt, _greedy("b", max_tokens=8))
    engine.step()
    states = {state.name: state for state in engine.stats().lora_adapters}
    assert (states["a"].running_requests, states["b"].waiting_requests) == (1, 1)  # b waits for the one slot
    with pytest.raises(AdapterInUse, match="'a'"):
        engine.remove_adapter("a")
    # Every adapter held in memory (--max-cpu-loras: 1) has requests: a load is refused, for now.
    served = _served(engine)
    with pytest.raises(AdaptersBusy, match=r"'c'.*--max-cpu-loras 1") as busy:
        engine.add_adapter(engine.read_adapter("c", adapter_dirs["b"]))
    assert status_of(busy.value)[0] == grpc.StatusCode.UNAVAILABLE and _served(engine) == served
    while engine.has_unfinished():
        engine.step()
    engine.remove_adapter("b")
    assert set(_served(engine)) == {"a"}
    with pytest.raises(UnknownAdapter, match="'b'"):
        engine.add_request("gone", prompt, _greedy("b"))
    with pytest.raises(UnknownAdapter, match="'b'"):
        engine.remove_adapter("b")


@pytest.mark.parametrize(("name", "directory", "error", "message"), [
    ("c", "big", AdapterError, "'c'.*rank 32 is above --max-lora-rank 16"),
    ("c", "other-base", AdapterError, "'c'.*another base"),
    ("c", "missing", AdapterError, "'c'.*not a directory"),
])
def test_an_adapter_that_cannot_be_served_is_refused_naming_it(engine, adapter_dirs, tmp_path, name, directory,
                                                               error, message):
    before = _served(engine)
    with pytest.raises(error, match=message):
        engine.read_adapter(name, adapter_dirs.get(directory, tmp_path / directory))
    assert _served(engine) == before


def test_a_name_taken_by_an_adapter_or_the_model_is_refused(engine, adapter_dirs):
    before = _served(engine)
    with pytest.raises(ValueError, match="'a' is already loaded"):
        engine.add_adapter(engine.read_adapter("a", adapter_dirs["b"]))
    with pytest.raises(ValueError, match="served model's name"):
        engine.read_adapter(engine.config.served_name, adapter_dirs["b"])
    assert _served(engine) == before


def test_an_engine_without_adapters_refuses_them_as_a_failed_precondition(make_engine, adapter_dirs):
    engine = make_engine(cache=CacheConfig(num_blocks=16))
    with pytest.raises(LoraDisabled, match="--enable-lora") as refused:
        engine.read_adapter("a", adapter_dirs["a"])
    assert status_of(refused.value)[0] == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(LoraDisabled, match="--enable-lora"):
        engine.remove_adapter("a")


def test_a_prompt_is_computed_for_another_worker_only_under_the_adapter_it_runs_under_there(engine, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    fingerprint = _served(engine)["a"]
    reservation = engine.reserve("reserved", prompt, _greedy("a"))
    assert isinstance(reservation, KVReservation) and reservation.adapter_fingerprint == fingerprint
    engine.abort("reserved")
    free = engine.kv.num_free_blocks
    for name, expected, refusal in (("a", b"\x01" * 16, AdapterMismatch), ("a", b"", AdapterMismatch),
                                    ("nope", fingerprint, UnknownAdapter)):
        with pytest.raises(refusal, match=f"'{name}'"):
            engine.add_request("export", prompt, _greedy(name), export=KVExport(_Sink(), adapter_fingerprint=expected))
        assert engine.kv.num_free_blocks == free and not engine.has_unfinished()
    matching = KVExport(_Sink(), adapter_fingerprint=fingerprint)
    assert engine.add_request("export", prompt, _greedy("a"), export=matching) is None
    engine.abort("export")


def test_adapters_over_context_parallel_ranks_are_refused_naming_the_flag(model_files):
    # Tensor and pipeline parallelism serve them (tests/unit/test_lora_parallel.py).
    config = EngineConfig(lora=LoraConfig(), prefill_context_parallel_size=2, role="prefill")
    with pytest.raises(ValueError, match=r"enable_lora: not served over context-parallel ranks yet "
                                         r"\(--prefill-context-parallel-size 2; model"):
        serve_adapters(config, model=None, model_config=model_files.config, dtype=torch.float32)


def test_a_dropped_adapter_is_read_back_before_its_request_and_gone_files_fail_that_request_alone(
        make_engine, adapter_dirs, tmp_path):
    """Beyond --max-cpu-loras the least recently used idle adapter is dropped from memory; a request
    for it has its worker read it back off the engine thread (EngineLoop.ready_adapter), and when
    its files have gone since, that request alone is refused naming the adapter, while a request
    running under another adapter goes on (a read in the step would have failed every request)."""
    copies = {name: shutil.copytree(adapter_dirs[name], tmp_path / name) for name in ("a", "b")}
    engine = make_engine(cache=CacheConfig(num_blocks=64), lora=LoraConfig(
        max_loras=1, max_lora_rank=16, max_cpu_loras=1, modules=tuple((n, str(p)) for n, p in copies.items())))
    registry = engine.adapters.registry
    assert registry.loaded == ("b",)  # serving b dropped a
    loop = EngineLoop(engine)
    loop.start()

    async def scenario() -> None:
        running = loop.generate("b-1", [5, 6, 7, 8], _greedy("b", max_tokens=24))
        first = await anext(running)
        shutil.rmtree(copies["a"])
        with pytest.raises(AdapterError, match="'a'"):
            await loop.ready_adapter(_greedy("a"))
        rest = [output async for output in running]
        assert not first.finished and rest[-1].finish_reason == "length"
        shutil.copytree(adapter_dirs["a"], copies["a"])
        await loop.ready_adapter(_greedy("a"))
        assert registry.in_memory("a")  # read back before the request goes to the engine
        outputs = [output async for output in loop.generate("a-1", [1, 2, 3, 4], _greedy("a"))]
        assert outputs[-1].finish_reason == "length"

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
