"""LoRA adapters through the gateway's real HTTP app, key middleware and core, in process: a worker's
load reports (delivered as its load stream delivers them) say which adapters it serves; the worker
itself is an address where nothing listens, so a request let through ends UNAVAILABLE (503) having
been counted under the model it named. What needs a worker's LoraAdapters service (a load or unload
fanned out and undone) is tested with real workers, in tests/integration."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from gateway_calls import generate_failures
from starlette.testclient import TestClient
from tandem.v1 import common_pb2, gateway_pb2

from services.gateway.adapters import AdapterRef
from services.gateway.api_keys import ApiKeyMiddleware
from services.gateway.catalog import ModelCatalog
from services.gateway.handler import GatewayServicer, generate_request_from_proto
from services.gateway.key_file import load_api_keys
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.openai_api.app import create_app
from services.gateway.registry import WorkerRegistry
from services.gateway.service import GatewayService

SQL, OTHER = b"\x01" * 16, b"\x02" * 16
KEYS = """
[[key]]
name = "admin"
secret = "sk-admin"
admin = true

[[key]]
name = "sql-only"
secret = "sk-sql"
models = ["sql"]
"""


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serving(registry: WorkerRegistry, adapters: dict[str, list[tuple[str, bytes]]]) -> None:
    for worker in registry.workers:
        worker.serving = True
        worker._receive(common_pb2.LoadReport(
            role="colocated", block_size=16, total_kv_blocks=100, free_kv_blocks=100, model_name="smollm2",
            max_loras=2, lora_adapters=[common_pb2.LoraAdapterState(name=name, fingerprint=fingerprint,
                                                                   path=f"/adapters/{name}")
                                        for name, fingerprint in adapters[worker.address]]))


@pytest.fixture
def gateway(tmp_path: Path, tokenizer):
    """A gateway of one model over two workers: both serve `sql` alike, `chat` with different weights."""
    key_file = tmp_path / "keys.toml"
    key_file.write_text(KEYS)
    keys = load_api_keys(key_file, {})
    a, b = f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{_closed_port()}"
    service = GatewayService(WorkerRegistry(), GatewayMetrics("smollm2"))
    service.catalog = ModelCatalog.single(ServedModel("smollm2", 8192, tokenizer))
    app = ApiKeyMiddleware(create_app(service), keys, metrics_auth=False)

    async def add_workers() -> None:  # on the app's event loop, where their channels must live
        for address in (a, b):
            service.registry.add("colocated", address)

    with TestClient(app) as client:
        client.portal.call(add_workers)
        _serving(service.registry, {a: [("sql", SQL), ("chat", SQL)], b: [("sql", SQL), ("chat", OTHER)]})
        yield service, client


def _as(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_an_adapter_runs_on_its_base_under_its_own_name(gateway) -> None:
    service, _ = gateway
    target = service.resolve("sql")
    assert (target.model.id, target.answered_as, target.adapter) == ("smollm2", "sql", AdapterRef("sql", SQL))
    assert target.fingerprint == "smollm2+sql" and target.served_name == "sql"
    assert service.resolve("smollm2").adapter is None


def test_models_lists_adapters_with_their_parent_as_vllm_does(gateway) -> None:
    _, client = gateway
    data = {entry["id"]: entry for entry in client.get("/v1/models", headers=_as("sk-admin")).json()["data"]}
    assert set(data) == {"smollm2", "sql"}  # `chat` is not routed: its workers disagree
    assert data["sql"]["parent"] == "smollm2" and data["sql"]["root"] == "/adapters/sql"
    assert data["sql"]["object"] == "model" and data["smollm2"]["parent"] is None


def test_list_models_over_grpc_names_an_adapters_parent(gateway) -> None:
    service, client = gateway

    async def listed() -> gateway_pb2.ListModelsResponse:
        return await GatewayServicer(service).ListModels(gateway_pb2.ListModelsRequest(), None)

    models = {model.id: model for model in client.portal.call(listed).models}
    assert (models["sql"].parent, models["smollm2"].parent) == ("smollm2", "")


def test_unknown_and_conflicting_adapters_are_refused_naming_them(gateway) -> None:
    _, client = gateway
    unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "Hi"}, headers=_as("sk-admin"))
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model" and "`nope` does not exist" in unknown.json()["error"]["message"]
    conflict = client.post("/v1/completions", json={"model": "chat", "prompt": "Hi"}, headers=_as("sk-admin"))
    assert conflict.status_code == 503 and "different weights" in conflict.json()["error"]["message"]
    health = client.get("/health").json()
    assert "different weights" in health["lora_adapter_conflicts"]["chat"]
    assert 'tandem:lora_adapter_conflict{adapter="chat"} 1.0' in client.get("/metrics").text


def test_a_key_limited_to_some_models_gets_403_naming_another_and_usage_counts_by_adapter(gateway) -> None:
    _, client = gateway
    for model in ("smollm2", "", "nope"):
        refused = client.post("/v1/completions", json={"model": model, "prompt": "Hi"}, headers=_as("sk-sql"))
        assert refused.status_code == 403, model
        assert refused.json()["error"]["type"] == "PermissionDeniedError"
        assert f"`{model or 'smollm2'}`" in refused.json()["error"]["message"]
    let_in = client.post("/v1/completions", json={"model": "sql", "prompt": "Hi", "max_tokens": 2},
                         headers=_as("sk-sql"))
    assert let_in.status_code == 503  # past the key and the resolution; nothing listens at the workers
    metrics = client.get("/metrics").text
    assert 'tandem:key_requests_total{key="sql-only",model_name="sql",model_version=""} 1.0' in metrics


def test_the_adapter_routes_ask_for_an_admin_key_and_name_what_is_wrong(gateway) -> None:
    _, client = gateway

    def load(body: dict, secret: str = "sk-admin"):
        return client.post("/v1/load_lora_adapter", json=body, headers=_as(secret))

    assert load({"lora_name": "x", "lora_path": "/x"}, "sk-sql").status_code == 403
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=_as("sk-sql")).status_code == 403
    for body, param, words in [
        ({"lora_name": "x"}, "lora_path", "must be provided"),
        ({"lora_name": "x", "lora_path": 3}, "lora_path", "must be a string"),
        ({"lora_name": "x", "lora_path": "/x", "rank": 8}, "rank", "unknown field"),
        ({"lora_name": "smollm2", "lora_path": "/x"}, "lora_name", "name of a served model"),
        ({"lora_name": "sql", "lora_path": "/x"}, "lora_name", "has already been loaded"),
        ({"lora_name": "chat", "lora_path": "/x"}, "lora_name", "has already been loaded"),
        ({"lora_name": "x", "lora_path": "/x", "base_model_name": "other"}, "base_model_name", "not `other`"),
    ]:
        answer = load(body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["param"] == param and words in answer.json()["error"]["message"], body
    # Nothing listens at the workers' addresses: neither can take it now.
    unreachable = load({"lora_name": "x", "lora_path": "/x"})
    assert unreachable.status_code == 503
    assert "`x` cannot be loaded now" in unreachable.json()["error"]["message"]
    unknown = client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=_as("sk-admin"))
    assert unknown.status_code == 404 and "`nope` cannot be found" in unknown.json()["error"]["message"]


def test_over_grpc_another_model_is_permission_denied_and_an_unknown_adapter_not_found(gateway, tmp_path) -> None:
    service, client = gateway
    key_file = tmp_path / "keys.toml"
    key_file.write_text(KEYS)
    keys = load_api_keys(key_file, {})

    async def codes() -> list[str]:
        calls = [("sk-sql", gateway_pb2.GenerateRequest(text="Hi", model="smollm2")),
                 ("sk-admin", gateway_pb2.GenerateRequest(text="Hi", model="nope"))]
        return [f"{error.code().name}: {error.details()}" for error in await generate_failures(service, keys, calls)]

    denied, unknown = client.portal.call(codes)
    assert denied.startswith("PERMISSION_DENIED") and "`smollm2`" in denied
    assert unknown.startswith("NOT_FOUND") and "`nope`" in unknown


def test_a_grpc_client_names_an_adapter_by_model_not_by_sampling_lora_name() -> None:
    request = gateway_pb2.GenerateRequest(text="Hi", model="smollm2")
    request.sampling.lora_name = "sql"
    with pytest.raises(ValueError, match=r"sampling\.lora_name: name a LoRA adapter by `model`"):
        generate_request_from_proto(request)


def test_a_key_file_limits_a_key_to_models_named_without_versions(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.toml"
    for models, words in [('"sql"', "must be a list"), ("[]", "allows no model"), ('["m@a"]', "without @VERSION")]:
        key_file.write_text(f'[[key]]\nname = "k"\nsecret = "s"\nmodels = {models}\n')
        with pytest.raises(ValueError, match=words):
            load_api_keys(key_file, {})
    key_file.write_text('[[key]]\nname = "k"\nsecret = "s"\nmodels = ["m", "sql"]\n')
    caller = load_api_keys(key_file, {}).keys[0].caller
    assert caller.may_use("sql") and not caller.may_use("other")

