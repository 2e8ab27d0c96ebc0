"""Hot swap inside one worker process (services.decode.model_swap), with real engines on a small
random model: the repository file assigns the worker's pool another version, which loads beside
the serving one when the memory limit allows, takes new requests, and the old one serves what is
routed to it until the repository routes nothing there and its requests are done; rollback, a
memory refusal and a version that does not load leave a serving version, and say why."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from test_model_hf import CONFIGS, VOCAB, save_random_model, save_word_tokenizer

from engine.engine import Engine
from engine.footprint import predict_footprint
from engine.sampling_params import SamplingParams
from kvtransfer.grpc_stream import GrpcReceiver, KVTransferServicer
from services.cli import build_parser
from services.commands.worker import WorkerFlags, swap_settings, worker_config
from services.common.config_flags import from_args
from services.common.failure import Failure, WorkerError
from services.common.worker_metrics import WorkerMetrics
from services.common.worker_rpcs import WorkerRpcs
from services.decode.model_swap import ModelSwap, SwapSettings, memory_refusal
from services.decode.progress import DecodeProgress
from services.decode.served_engines import ServedEngines
from services.decode.worker import DecodeWorker

GIB = 1024**3
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _repository(pool_a: str, pool_b: str, split: str, extra: str = "") -> str:
    return f"""
[[model]]
name = "m"
split = {{ {split} }}

[[model.version]]
name = "a"
path = "weights"
pool = "{pool_a}"

[[model.version]]
name = "b"
path = "weights"
dtype = "bfloat16"
pool = "{pool_b}"
{extra}"""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swap")
    weights = folder / "weights"
    save_random_model(CONFIGS["llama_gqa_tied"](), weights)
    save_word_tokenizer(weights, VOCAB)
    return folder


def _rewrite(path: str, text: str) -> None:
    with open(path + ".new", "w") as file:
        file.write(text)
    os.replace(path + ".new", path)
    # Polled by modification time and size: make the change visible even within one clock tick.
    stamp = os.stat(path).st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


class _Process:
    """What `tandem worker --pool serving` builds in its process, without the gRPC server."""

    def __init__(self, folder, memory_limit_mib: int | None) -> None:
        self.path = str(folder / "models.toml")
        _rewrite(self.path, _repository("serving", "spare", "a = 100, b = 0"))
        limit = [] if memory_limit_mib is None else ["--memory-limit-mib", str(memory_limit_mib)]
        args = build_parser().parse_args(["worker", "--model-repository", self.path, "--pool", "serving",
                                          "--dtype", "float32", "--kv-cache-blocks", "32", *limit])
        self.config = worker_config(from_args(WorkerFlags, args))
        self.settings = self.config.swap
        self.rpcs: WorkerRpcs[DecodeWorker] = WorkerRpcs()
        self.metrics = WorkerMetrics("m", "a")
        self.engines = ServedEngines(self.rpcs, self.metrics)
        self.clock = _Clock()

    async def start(self) -> ModelSwap:
        engine = await asyncio.to_thread(Engine, self.config.served_engine)
        worker = DecodeWorker("127.0.0.1:1", engine, asyncio.Event(), GrpcReceiver("127.0.0.1:1"), 5.0)
        await self.engines.start(worker)
        self.engines.kv_transfer = KVTransferServicer(worker.layout, None)
        self.engines.promote(worker)
        assert self.settings is not None
        return ModelSwap(SwapSettings(self.settings.repository, self.settings.pool, self.settings.memory_limit_bytes,
                                      retire_after_s=5.0), self.engines, self.config.engine, self.clock)

    def versions(self) -> tuple[str, tuple[str, ...]]:
        current = self.engines.current
        assert current is not None
        return current.version_key, tuple(worker.version_key for worker in self.engines.retiring)


async def _tokens(worker: DecodeWorker, request_id: str) -> tuple[int, ...]:
    tokens: list[int] = []
    async for output in worker.generate_local(request_id, [5, 9, 17, 33], GREEDY, DecodeProgress(0.0)):
        tokens += output.new_token_ids
    assert len(tokens) == GREEDY.max_tokens
    return tuple(tokens)


def test_a_version_loads_beside_the_serving_one_takes_new_requests_and_the_old_one_drains(folder, caplog):
    caplog.set_level(logging.INFO, "services.decode.model_swap")
    process = _Process(folder, memory_limit_mib=64 * 1024)

    async def scenario() -> None:
        swap = await process.start()
        old = process.engines.current
        assert old is not None
        before = await _tokens(old, "before")
        _rewrite(process.path, _repository("spare", "serving", "a = 100, b = 0"))
        await swap.poll()
        assert process.versions() == ("m@b", ("m@a",))
        assert process.engines.serving("") is process.engines.serving("m@b") is process.engines.current
        assert process.engines.serving("m@a") is old  # routed before the gateway heard: served by the old
        with pytest.raises(WorkerError) as refused:
            process.engines.serving("m@c")
        assert refused.value.failure is Failure.UNAVAILABLE and "serves m@b, not m@c" in refused.value.message
        assert process.engines.kv_transfer is not None
        assert [layout.page_fingerprint for layout in process.engines.kv_transfer.layouts] == [
            process.engines.current.layout.page_fingerprint, old.layout.page_fingerprint]
        assert await _tokens(old, "after") == before  # the old version still answers as it did
        await _tokens(process.engines.current, "new")

        # The split still routes to a: it stays, however long.
        process.clock.now += 60
        await swap.poll()
        assert process.versions() == ("m@b", ("m@a",))
        # Routed nothing, it goes once the wait is over and its last request is done.
        _rewrite(process.path, _repository("spare", "serving", "a = 0, b = 100"))
        holding = asyncio.Event()
        running = asyncio.ensure_future(old.inflight.run("held", holding.wait()))
        await asyncio.sleep(0)
        await swap.poll()
        process.clock.now += 10
        await swap.poll()
        assert process.versions() == ("m@b", ("m@a",))  # a request still runs there
        holding.set()
        await running
        await swap.poll()
        assert process.versions() == ("m@b", ())
        assert not old.loop._thread.is_alive()
        assert [layout.page_fingerprint for layout in process.engines.kv_transfer.layouts] == [
            process.engines.current.layout.page_fingerprint]
        scraped = {sample.labels["model_version"] for family in process.metrics.registry.collect()
                   if family.name == "vllm:num_requests_running" for sample in family.samples}
        assert scraped == {"b"}

        # Rollback: back to a (loaded again), then to b while b is still loaded: nothing loads.
        _rewrite(process.path, _repository("serving", "spare", "a = 100, b = 0"))
        await swap.poll()
        assert process.versions() == ("m@a", ("m@b",))
        assert await _tokens(process.engines.current, "rolled back") == before
        _rewrite(process.path, _repository("spare", "serving", "a = 100, b = 0"))
        await swap.poll()
        assert process.versions() == ("m@b", ("m@a",))
        await process.engines.close()

    asyncio.run(scenario())
    messages = [record.getMessage() for record in caplog.records]
    assert any("pool serving now serves m@b; m@a retires" in m for m in messages), messages
    assert any("m@a unloaded" in m for m in messages), messages
    assert any("serves m@b again (still loaded)" in m for m in messages), messages


def test_a_swap_beyond_the_memory_limit_or_one_that_does_not_load_leaves_the_old_version_serving(folder, caplog):
    process = _Process(folder, memory_limit_mib=None)

    async def scenario() -> None:
        swap = await process.start()
        _rewrite(process.path, _repository("spare", "serving", "a = 100, b = 0"))
        await swap.poll()
        assert process.versions() == ("m@a", ())
        broken = folder / "broken"
        broken.mkdir()
        for name in os.listdir(folder / "weights"):
            content = (folder / "weights" / name).read_bytes()
            if name == "config.json":  # the MLP is 112 wide
                content = content.replace(b'"intermediate_size": 112', b'"intermediate_size": 96')
            (broken / name).write_bytes(content)
        swap._settings = SwapSettings(process.path, "serving", 64 * GIB)
        _rewrite(process.path, _repository("spare", "other", "a = 100, b = 0",
                                           '[[model.version]]\nname = "c"\npath = "broken"\npool = "serving"\n'))
        await swap.poll()
        assert process.versions() == ("m@a", ())
        await process.engines.close()

    asyncio.run(scenario())
    messages = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
    assert any(m.startswith("hot swap of pool serving to m@b refused, m@a keeps serving: loading a version beside "
                            "the one serving needs --memory-limit-mib") for m in messages), messages
    assert any(m.startswith("hot swap of pool serving to m@c failed, m@a keeps serving: model repository version "
                            "m@c") and "does not load" in m for m in messages), messages


def test_the_memory_refusal_names_what_the_process_holds_what_the_version_needs_and_the_limit(folder):
    settings = SwapSettings("models.toml", "p", 1024 * 1024 * 1024)
    flags_config = _Process(folder, None).config.engine
    from services.repository.config import load_repository

    version = load_repository(str(folder / "models.toml")).find("m@b")
    footprint = predict_footprint(version.serving(flags_config))
    assert footprint.kv_cache_bytes > 0 and footprint.weight_bytes > 0
    assert memory_refusal(settings, "m@a", "m@b", 100 * 1024 * 1024, footprint) is None
    message = memory_refusal(settings, "m@a", "m@b", 1024 * 1024 * 1024, footprint)
    assert message is not None and message.startswith("hot swap of pool p to m@b refused, m@a keeps serving: the "
                                                       "process holds 1024 MiB and m@b needs about ")
    assert message.endswith("exceeds --memory-limit-mib 1024")


def test_the_worker_refuses_a_memory_limit_it_would_never_use():
    with pytest.raises(ValueError, match="--memory-limit-mib: bounds a hot swap"):
        swap_settings(_worker_flags("--memory-limit-mib", "512"))
    with pytest.raises(ValueError, match="must be positive"):
        swap_settings(_worker_flags("--memory-limit-mib", "0"))
    assert swap_settings(_worker_flags()) is None


def _worker_flags(*argv: str) -> WorkerFlags:
    return from_args(WorkerFlags, build_parser().parse_args(["worker", *argv]))
