"""LoRA adapters declared in the model repository file (`[[model.version.adapter]]`): what the file
accepts and refuses by name, how a request names one, and which workers the gateway asks to load
or unload one (services.gateway.adapter_sync). The workers are addresses where nothing listens, so
each call the gateway makes fails UNAVAILABLE and is logged naming the worker and the adapter:
that log is what tells which calls it made."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
from tandem.v1 import common_pb2

from services.common.errors import StatusError
from services.gateway.adapter_sync import AdapterSync
from services.gateway.catalog import CatalogEntry, ModelCatalog
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.registry import WorkerRegistry
from services.gateway.service import GatewayService
from services.repository.config import ModelRepository, parse_repository

SQL = b"\x01" * 16


def _repository(tmp_path: Path, adapters: list[dict], name: str = "m") -> ModelRepository:
    for folder in ("sql", "old"):
        (tmp_path / folder).mkdir(exist_ok=True)
    return parse_repository({"model": [{"name": name, "version": [
        {"name": "a", "path": "shipped", "adapter": adapters}, {"name": "b", "path": "shipped"}]}]},
        str(tmp_path / "models.toml"))


def test_an_adapter_entry_names_a_directory_beside_the_file_under_a_name_of_its_own(tmp_path: Path) -> None:
    repository = _repository(tmp_path, [{"name": "sql", "path": "sql"}])
    assert [(base, adapter.name, adapter.path) for base, adapter in repository.adapters] == [
        ("m@a", "sql", str(tmp_path / "sql"))]
    for adapters, words in [
        ([{"name": "m", "path": "sql"}], "already the name of a model"),
        ([{"name": "sql", "path": "sql"}, {"name": "sql", "path": "sql"}], "already the name"),
        ([{"name": "sql", "path": "absent"}], "path: .*absent is not a directory"),
        ([{"name": "sql"}], "path: required"),
        ([{"name": "sql", "path": "sql", "rank": 8}], "unknown fields: rank"),
        ({"name": "sql"}, "expected \\[\\[model.version.adapter\\]\\] tables"),
    ]:
        with pytest.raises(ValueError, match=words):
            _repository(tmp_path, adapters)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _report(worker, version: str, adapters: list[str]) -> None:
    worker.serving = True
    worker._receive(common_pb2.LoadReport(
        role="colocated", block_size=16, total_kv_blocks=100, free_kv_blocks=100, model_name="m",
        model_version=version, max_loras=2,
        lora_adapters=[common_pb2.LoraAdapterState(name=name, fingerprint=SQL, path="/x") for name in adapters]))


def test_the_gateway_asks_the_workers_of_the_base_missing_an_adapter_and_those_holding_a_removed_one(
        tmp_path: Path, tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    before = _repository(tmp_path, [{"name": "sql", "path": "sql"}, {"name": "old", "path": "old"}])
    declared = _repository(tmp_path, [{"name": "sql", "path": "sql"}])

    async def scenario() -> list[str]:
        registry = WorkerRegistry(colocated=[f"127.0.0.1:{_closed_port()}" for _ in range(4)])
        missing, holding, other_base, stale = registry.workers
        for worker in (missing, holding, stale):
            _report(worker, "a", ["sql", "old"])
        _report(other_base, "b", [])
        catalogs = [ModelCatalog([CatalogEntry(ServedModel("m", 1024, tokenizer), v) for v in repository.versions],
                                 repository) for repository in (before, declared)]
        sync = AdapterSync(registry, lambda: catalogs[0])
        sync.sync()  # every worker of m@a serves what the file declares: nothing to do
        _report(missing, "a", [])
        _report(holding, "a", ["sql"])
        catalogs.pop(0)  # the file changed: `old` left it
        sync.sync()
        sync.sync()  # a call in flight is not made again
        for _ in range(100):  # until both calls failed
            if len(_asked(caplog)) >= 2:
                break
            await asyncio.sleep(0.1)
        sync.sync()  # a refused call waits for its retry
        await asyncio.sleep(0.5)
        await sync.stop()
        await registry.close()
        return [missing.address, stale.address]

    with caplog.at_level(logging.ERROR, logger="services.gateway.adapter_sync"):
        missing, stale = asyncio.run(scenario())
    assert _asked(caplog) == sorted([f"model repository: LoRA adapter sql: worker {missing} refused to load it",
                            f"model repository: LoRA adapter old: worker {stale} refused to unload it"])


def _asked(caplog: pytest.LogCaptureFixture) -> list[str]:
    return sorted(record.getMessage().split(" (")[0] for record in caplog.records
                  if record.name == "services.gateway.adapter_sync")


def test_a_declared_adapter_no_worker_serves_yet_is_unavailable_and_not_the_admin_routes_to_change(
        tmp_path: Path, tokenizer) -> None:
    declared = _repository(tmp_path, [{"name": "sql", "path": "sql"}])
    service = GatewayService(WorkerRegistry(), GatewayMetrics("m"))
    service.catalog = ModelCatalog([CatalogEntry(ServedModel("m", 1024, tokenizer), v) for v in declared.versions],
                                   declared)
    with pytest.raises(StatusError, match="`sql` is not served by a worker of m@a yet") as refused:
        service.resolve("sql")
    assert refused.value.code.name == "UNAVAILABLE"
    from services.gateway.adapter_admin import AdapterAdmin

    admin = AdapterAdmin(service.registry, service.adapters, service.served_catalog)
    with pytest.raises(StatusError, match="has already been loaded"):
        asyncio.run(admin.load("sql", "/x", "m@a"))
    with pytest.raises(StatusError, match="declared in the model repository file"):
        asyncio.run(admin.unload("sql"))
