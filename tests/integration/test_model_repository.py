"""A mesh serving two versions of the shipped model from one repository file: the q4 version (the
file's own 4-bit blocks) on a prefill and a decode worker, the fp32 version on a colocated worker,
one gateway over all three. Requests name a model or a version; the split is sticky per user; each
version runs only on its own workers; start-up refuses a bad repository by name."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from repository_files import two_versions

from bench.harness.leak_check import load_report
from bench.harness.ports import free_port
from bench.harness.worker import start_worker
from services.client import TandemClient
from services.repository.config import load_repository
from services.repository.split import choose_version

REPOSITORY = two_versions()
FLAGS = ["--threads", "1", "--kv-cache-mib", "64"]
TIMEOUT_S = 120
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def repository_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("repository") / "models.toml"
    path.write_text(REPOSITORY)
    return str(path)


@pytest.fixture(scope="module")
def mesh(repository_file):
    ports = {name: free_port() for name in ("prefill", "decode", "colocated")}
    repo = ["--model-repository", repository_file]
    processes = [
        start_worker(["prefill", "--port", str(ports["prefill"]), *FLAGS, *repo, "--pool", "smollm2-q4"], wait=False),
        start_worker(["decode", "--port", str(ports["decode"]), *FLAGS, *repo, "--model-version", "smollm2@q4"],
                     wait=False),
        start_worker(["worker", "--port", str(ports["colocated"]), *FLAGS, *repo, "--model-version", "smollm2@fp32"],
                     wait=False),
        start_worker(["gateway", "--port", "0", "--http-port", "0", *repo,
                      "--prefill", f"127.0.0.1:{ports['prefill']}", "--decode", f"127.0.0.1:{ports['decode']}",
                      "--colocated", f"127.0.0.1:{ports['colocated']}"], wait=False),
    ]
    try:
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        for process in reversed(processes):
            process.stop(timeout=30)


def _http(gateway, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://{gateway.http_address}{path}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def _complete(gateway, model: str, user: str | None = None) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    if user is not None:
        body["user"] = user
    return _http(gateway, "/v1/completions", body)


def test_models_lists_every_version_with_its_state_and_formats(mesh):
    *_, gateway = mesh
    status, _, listing = _http(gateway, "/v1/models")
    assert status == 200
    models = {entry["id"]: entry for entry in listing["data"]}
    assert set(models) == {"smollm2@q4", "smollm2@fp32"}
    assert all(entry["root"] == "smollm2" and entry["state"] == "serving" for entry in models.values())
    assert (models["smollm2@fp32"]["dtype"], models["smollm2@fp32"]["quantization"]) == ("float32", "none")
    assert models["smollm2@q4"]["quantization"] != "none"
    with TandemClient(str(gateway.address)) as client:
        assert {(info.id, info.version, info.state) for info in client.list_models(timeout=TIMEOUT_S)} == {
            ("smollm2", "q4", "serving"), ("smollm2", "fp32", "serving")}


def test_a_version_runs_only_on_its_own_workers_and_the_reply_names_it(mesh):
    prefill, decode, colocated, gateway = mesh
    before = [load_report(worker).finished_requests for worker in (prefill, decode, colocated)]
    for _ in range(2):
        status, headers, reply = _complete(gateway, "smollm2@fp32")
        assert status == 200, reply
        assert (reply["model"], reply["system_fingerprint"]) == ("smollm2@fp32", "smollm2@fp32")
        assert headers["x-tandem-model-version"] == "smollm2@fp32"
    after = [load_report(worker).finished_requests for worker in (prefill, decode, colocated)]
    # The q4 prefill worker never computes an fp32 prompt: the colocated fp32 worker did both.
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 0, 2]
    status, headers, reply = _complete(gateway, "smollm2@q4")
    assert status == 200 and headers["x-tandem-model-version"] == "smollm2@q4"
    assert [load_report(worker).finished_requests for worker in (prefill, decode)] == [after[0] + 1, after[1] + 1]
    with TandemClient(str(gateway.address)) as client:
        stream = client.generate(PROMPT, model="smollm2@fp32", max_tokens=2, temperature=0.0, timeout=TIMEOUT_S)
        assert "".join(chunk.text for chunk in stream)
        assert stream.model_version() == "smollm2@fp32"


def test_the_split_is_sticky_per_user(mesh, repository_file):
    *_, gateway = mesh
    model = load_repository(repository_file).model("smollm2")
    users = {choose_version(model, f"user-{index}").name: f"user-{index}" for index in range(40)}
    assert set(users) == {"q4", "fp32"}
    for version, user in users.items():
        served = set()
        for _ in range(2):
            status, _, reply = _complete(gateway, "smollm2", user)
            assert status == 200 and reply["model"] == "smollm2"  # the name the client asked for
            served.add(reply["system_fingerprint"])
        assert served == {f"smollm2@{version}"}
    with TandemClient(str(gateway.address)) as client:
        stream = client.generate(PROMPT, model="smollm2", user=users["fp32"], max_tokens=1, timeout=TIMEOUT_S)
        list(stream)
        assert stream.model_version() == "smollm2@fp32"


def test_an_unknown_model_or_version_is_not_found_by_name(mesh):
    *_, gateway = mesh
    status, _, reply = _complete(gateway, "llama")
    assert status == 404 and "`llama` does not exist" in reply["error"]["message"]
    status, _, reply = _complete(gateway, "smollm2@int8")
    assert status == 404 and "has no version `int8`" in reply["error"]["message"]
    with TandemClient(str(gateway.address)) as client, pytest.raises(grpc.RpcError) as raised:
        list(client.generate(PROMPT, model="smollm2@int8", max_tokens=1, timeout=TIMEOUT_S))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "int8" in raised.value.details()


@pytest.mark.parametrize(("command", "message"), [
    (["gateway", "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"], "split: the weights must sum to 100"),
    (["decode", "--model-version", "smollm2@q4"], "split: the weights must sum to 100"),
])
def test_start_up_refuses_a_bad_repository_naming_the_entry(tmp_path, command, message):
    bad = tmp_path / "models.toml"
    bad.write_text(REPOSITORY.replace("fp32 = 50", "fp32 = 60"))
    result = subprocess.run([sys.executable, "-m", "services.cli", command[0], "--model-repository", str(bad),
                             *command[1:]], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"model 'smollm2': {message}" in result.stderr
