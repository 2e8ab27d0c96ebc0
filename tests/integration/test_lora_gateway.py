"""LoRA adapters through the gateway with real processes: a prefill and a decode worker started with
--enable-lora (the decode worker with a lower --max-lora-rank, so that one adapter is taken by one
worker and refused by the other) and a gateway behind an API key file. Adapters are loaded and
unloaded at run time through vLLM's routes, all workers or none; a request names one by `model`
and runs under it across the prefill-decode split; a key limited to some models gets 403; usage
is counted under the adapter's name. Then a colocated worker of a model repository whose file
declares an adapter: the gateway has it loaded there, and unloaded once it leaves the file."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from tandem.v1 import lora_pb2, lora_pb2_grpc

from harness.lora_adapters import save_adapter
from harness.mesh import running
from harness.ports import free_port
from harness.worker import WorkerProcess

TIMEOUT_S = 300.0
KEYS = """
[[key]]
name = "ops"
secret = "sk-ops"
admin = true

[[key]]
name = "sql-team"
secret = "sk-sql"
models = ["sql"]
"""
WORKER_FLAGS = ["--threads", "1", "--kv-cache-mib", "64", "--enable-lora", "--max-loras", "2"]


@pytest.fixture(scope="module")
def adapters(model_files, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = model_files.config
    return {"sql": save_adapter(root / "sql", base, 8, seed=1),
            "rank16": save_adapter(root / "rank16", base, 16, seed=2)}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.toml"
    key_file.write_text(KEYS)
    prefill_port, decode_port = free_port(), free_port()
    arg_lists = [
        ["prefill", "--port", str(prefill_port), *WORKER_FLAGS, "--max-lora-rank", "16"],
        ["decode", "--port", str(decode_port), *WORKER_FLAGS, "--max-lora-rank", "8"],
        ["gateway", "--port", "0", "--http-port", "0", "--prefill", f"127.0.0.1:{prefill_port}",
         "--decode", f"127.0.0.1:{decode_port}", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000",
         "--api-key-file", str(key_file)],
    ]
    with running(arg_lists) as processes:
        yield {"prefill": processes[0], "decode": processes[1], "gateway": processes[2]}


def _http(gateway: WorkerProcess, path: str, body: dict | None = None, key: str = "sk-ops") -> tuple[int, str]:
    request = urllib.request.Request(f"http://{gateway.http_address}{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _complete(gateway: WorkerProcess, model: str, key: str = "sk-ops") -> tuple[int, dict]:
    status, text = _http(gateway, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                      "max_tokens": 4, "temperature": 0.0, "logprobs": 1}, key)
    return status, json.loads(text)


def _served_on(worker: WorkerProcess, name: str) -> bool:
    """False when the worker itself does not serve `name` (asked directly: unloading an adapter it
    does not serve is NOT_FOUND); one it serves fails the test."""
    async def ask() -> bool:
        async with grpc.aio.insecure_channel(str(worker.address)) as channel:
            try:
                await lora_pb2_grpc.LoraAdaptersStub(channel).UnloadLoraAdapter(
                    lora_pb2.UnloadLoraAdapterRequest(name=name), timeout=TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.NOT_FOUND, error
                return False
        raise AssertionError(f"{worker.address} served {name}")

    return asyncio.run(ask())


def test_an_adapter_loaded_at_run_time_serves_requests_across_the_split_and_unloads(mesh, adapters) -> None:
    gateway = mesh["gateway"]
    status, base = _complete(gateway, "")
    assert status == 200
    assert _http(gateway, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])}) == (
        200, "Success: LoRA adapter 'sql' added successfully.")
    listed = {entry["id"]: entry for entry in json.loads(_http(gateway, "/v1/models")[1])["data"]}
    assert listed["sql"]["parent"] == listed[base["model"]]["id"] and listed["sql"]["root"] == str(adapters["sql"])
    status, under = _complete(gateway, "sql", "sk-sql")
    assert status == 200 and under["model"] == "sql"
    # A random adapter of rank 8 on every projection changes what the model computes (if not always
    # its greedy choice): the first token's logprob comes from the prefill worker's prompt under it,
    # the later ones from the decode worker's steps under it.
    under_logprobs, base_logprobs = (reply["choices"][0]["logprobs"]["token_logprobs"] for reply in (under, base))
    assert under_logprobs[0] != pytest.approx(base_logprobs[0], abs=1e-3)
    assert under_logprobs[1:] != pytest.approx(base_logprobs[1:], abs=1e-3)
    metrics = _http(gateway, "/metrics")[1]
    assert 'tandem:key_requests_total{key="sql-team",model_name="sql",model_version=""} 1.0' in metrics
    refused = _complete(gateway, "", "sk-sql")
    assert refused[0] == 403 and "`" + base["model"] + "`" in refused[1]["error"]["message"]
    assert _http(gateway, "/v1/unload_lora_adapter", {"lora_name": "sql"}) == (
        200, "Success: LoRA adapter 'sql' removed successfully.")
    status, gone = _complete(gateway, "sql")
    assert status == 404 and "`sql`" in gone["error"]["message"]
    status, text = _http(gateway, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "`sql` cannot be found" in text


def test_a_load_one_worker_refuses_is_undone_on_the_others(mesh, adapters) -> None:
    gateway = mesh["gateway"]
    status, text = _http(gateway, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(adapters["rank16"])})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "lora_name", text
    assert "`wide`" in error["message"] and mesh["decode"].address in error["message"]
    assert "rank" in error["message"] and "nothing changed" in error["message"]
    # The prefill worker took it (its limit is 16), and the gateway took it back.
    assert not _served_on(mesh["prefill"], "wide") and not _served_on(mesh["decode"], "wide")
    assert "wide" not in _http(gateway, "/v1/models")[1]
    status, text = _http(gateway, "/v1/load_lora_adapter", {"lora_name": "nothing", "lora_path": "/absent"})
    assert status == 400 and "`nothing`" in text


REPOSITORY = """
[[model]]
name = "smollm2"

[[model.version]]
name = "q4"
path = "shipped"
{adapter}
"""
ADAPTER_ENTRY = '[[model.version.adapter]]\nname = "sql"\npath = "sql"\n'


@pytest.fixture(scope="module")
def repository_mesh(adapters, tmp_path_factory: pytest.TempPathFactory):
    """A colocated worker of the repository's one version and a gateway; the file declares the
    `sql` adapter over that version (a directory beside the file)."""
    folder = tmp_path_factory.mktemp("repository")
    (folder / "sql").symlink_to(adapters["sql"], target_is_directory=True)
    repository = folder / "models.toml"
    repository.write_text(REPOSITORY.format(adapter=ADAPTER_ENTRY))
    port = free_port()
    arg_lists = [
        ["worker", "--port", str(port), *WORKER_FLAGS, "--model-repository", str(repository), "--pool", "smollm2-q4"],
        ["gateway", "--port", "0", "--http-port", "0", "--model-repository", str(repository),
         "--colocated", f"127.0.0.1:{port}", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"],
    ]
    with running(arg_lists) as processes:
        yield processes[1], repository


def _listed_until(gateway: WorkerProcess, present: bool) -> dict:
    """/v1/models once it lists `sql` (or no longer does): the gateway loads or unloads it as the
    file says, once a second."""
    for _ in range(int(TIMEOUT_S / 0.2)):
        listed = {entry["id"]: entry for entry in json.loads(_http(gateway, "/v1/models")[1])["data"]}
        if ("sql" in listed) == present:
            return listed
        time.sleep(0.2)
    raise AssertionError(gateway.log_tail())


def test_an_adapter_the_repository_declares_is_served_over_its_version_until_it_leaves_the_file(
        repository_mesh) -> None:
    gateway, repository = repository_mesh
    listed = _listed_until(gateway, present=True)
    assert listed["sql"]["parent"] == "smollm2@q4"
    status, reply = _complete(gateway, "sql")
    assert status == 200 and (reply["model"], reply["system_fingerprint"]) == ("sql", "smollm2@q4+sql")
    repository.write_text(REPOSITORY.format(adapter=""))
    _listed_until(gateway, present=False)
    assert _complete(gateway, "sql")[0] == 404
