"""A mesh serving two versions of the shipped model from one repository file: the q4 version (the
file's own 4-bit blocks) on a prefill and a decode worker, the fp32 version on a colocated worker,
one gateway over all three. Requests name a model or a version; the split is sticky per user; each
version runs only on its own workers; start-up refuses a bad repository by name."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.leak_check import load_report
from harness.ports import free_port
from harness.repository_files import two_versions
from harness.worker import start_worker
from services.client import TandemClient
from services.repository.config import load_repository
from services.repository.split import choose_version

REPOSITORY = two_versions()
FLAGS = ["--threads", "1", "--kv-cache-mib", "64"]
APP_KEY, ADMIN_KEY = "sk-app-key", "sk-admin-key"
KEYS = f"""
[[key]]
name = "app"
secret = "{APP_KEY}"

[[key]]
name = "ops"
secret = "{ADMIN_KEY}"
admin = true
"""
TIMEOUT_S = 120
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def repository_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("repository") / "models.toml"
    path.write_text(REPOSITORY)
    return str(path)


@pytest.fixture(scope="module")
def mesh(repository_file, tmp_path_factory):
    ports = {name: free_port() for name in ("prefill", "decode", "colocated")}
    repo = ["--model-repository", repository_file]
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    processes = [
        start_worker(["prefill", "--port", str(ports["prefill"]), *FLAGS, *repo, "--pool", "smollm2-q4"], wait=False),
        start_worker(["decode", "--port", str(ports["decode"]), *FLAGS, *repo, "--model-version", "smollm2@q4"],
                     wait=False),
        # Given its version by pool, the colocated worker follows the file: a hot swap in its process.
        start_worker(["worker", "--port", str(ports["colocated"]), *FLAGS, *repo, "--pool", "smollm2-fp32",
                      "--memory-limit-mib", "8192"], wait=False),
        # Objectives no loaded two-core machine misses: admission must not refuse what this tests.
        start_worker(["gateway", "--port", "0", "--http-port", "0", *repo, "--ttft-slo-ms", "600000",
                      "--tpot-slo-ms", "600000", "--api-key-file", str(keys),
                      "--prefill", f"127.0.0.1:{ports['prefill']}", "--decode", f"127.0.0.1:{ports['decode']}",
                      "--colocated", f"127.0.0.1:{ports['colocated']}"], wait=False),
    ]
    try:
        for process in processes:
            process.wait_ready()
        # The gateway serves once one version's workers report; the tests need every worker: a
        # version is listed as serving once any of its workers is, and a q4 request needs its decode
        # worker too (a clean-clone run once got 503 for q4 with only its prefill worker routable).
        gateway = processes[-1]
        deadline = time.monotonic() + TIMEOUT_S
        while not all(f" worker 127.0.0.1:{port} is SERVING" in gateway.log_path.read_text(errors="replace")
                      for port in ports.values()):
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        while {entry["state"] for entry in _http(gateway, "/v1/models")[2]["data"]} != {"serving"}:
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        yield processes
    finally:
        for process in reversed(processes):
            process.stop(timeout=30)


def _http(gateway, path: str, body: dict | None = None, key: str = APP_KEY,
          method: str | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://{gateway.http_address}{path}",
                                     data=None if body is None else json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def _complete(gateway, model: str, user: str | None = None, max_tokens: int = 4) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
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
    with TandemClient(str(gateway.address), api_key=APP_KEY) as client:
        assert {(info.id, info.version, info.state) for info in client.list_models(timeout=TIMEOUT_S)} == {
            ("smollm2", "q4", "serving"), ("smollm2", "fp32", "serving")}


def test_a_version_runs_only_on_its_own_workers_and_the_reply_names_it(mesh):
    prefill, decode, colocated, gateway = mesh
    # The pair of a version reports the same KV page layout, which the gateway pairs by.
    assert load_report(prefill).kv_layout == load_report(decode).kv_layout != ""
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
    with TandemClient(str(gateway.address), api_key=APP_KEY) as client:
        stream = client.generate(PROMPT, model="smollm2@fp32", max_tokens=2, temperature=0.0, timeout=TIMEOUT_S)
        assert "".join(chunk.text for chunk in stream)
        assert stream.model_version() == "smollm2@fp32"


def _series(address: str, family: str, **labels: str) -> float:
    """The sum of `family`'s samples carrying these labels, from a /metrics page."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=TIMEOUT_S) as response:
        lines = response.read().decode().splitlines()
    wanted = [f'{name}="{value}"' for name, value in labels.items()]
    return sum(float(line.rpartition(" ")[2]) for line in lines
               if line.startswith(family + "{") and all(pair in line for pair in wanted))


def test_the_metrics_name_the_version_that_served(mesh):
    _, decode, colocated, gateway = mesh
    fp32 = {"model_name": "smollm2", "model_version": "fp32"}
    before = _series(str(gateway.http_address), "vllm:request_success_total", **fp32)
    assert _complete(gateway, "smollm2@fp32")[0] == 200
    assert _series(str(gateway.http_address), "vllm:request_success_total", **fp32) == before + 1
    assert _series(str(colocated.metrics_address), "vllm:request_success_total", **fp32) >= 1
    assert _series(str(decode.metrics_address), "vllm:request_success_total", model_version="fp32") == 0
    # A worker labels everything with the version it serves.
    assert _series(str(decode.metrics_address), "tandem:tensor_parallel_size", model_name="smollm2",
                   model_version="q4") == 1


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
    with TandemClient(str(gateway.address), api_key=APP_KEY) as client:
        stream = client.generate(PROMPT, model="smollm2", user=users["fp32"], max_tokens=1, timeout=TIMEOUT_S)
        list(stream)
        assert stream.model_version() == "smollm2@fp32"


def test_an_unknown_model_or_version_is_not_found_by_name(mesh):
    *_, gateway = mesh
    status, _, reply = _complete(gateway, "llama")
    assert status == 404 and "`llama` does not exist" in reply["error"]["message"]
    status, _, reply = _complete(gateway, "smollm2@int8")
    assert status == 404 and "has no version `int8`" in reply["error"]["message"]
    with TandemClient(str(gateway.address), api_key=APP_KEY) as client, pytest.raises(grpc.RpcError) as raised:
        list(client.generate(PROMPT, model="smollm2@int8", max_tokens=1, timeout=TIMEOUT_S))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "int8" in raised.value.details()


def _split(gateway, split: dict, key: str = ADMIN_KEY, model: str = "smollm2") -> tuple[int, dict]:
    status, _, reply = _http(gateway, f"/v1/admin/models/{model}/split", {"split": split}, key, "PUT")
    return status, reply


def test_an_80_20_split_serves_each_version_its_share_of_users_within_a_binomial_bound(mesh):
    """200 users through the mesh at 80/20: the q4 share lies within 4 standard deviations of 160,
    and a user asking again gets the version it got."""
    *_, gateway = mesh
    users = [f"split-user-{index}" for index in range(200)]

    def served(user: str) -> str:
        status, _, reply = _complete(gateway, "smollm2", user, max_tokens=1)
        assert status == 200, reply
        return reply["system_fingerprint"]

    assert _split(gateway, {"q4": 80, "fp32": 20})[0] == 200
    try:
        with ThreadPoolExecutor(6) as pool:
            first = dict(zip(users, pool.map(served, users), strict=True))
            again = dict(zip(users[:20], pool.map(served, users[:20]), strict=True))
    finally:
        assert _split(gateway, {"q4": 50, "fp32": 50})[0] == 200
    q4 = sum(version == "smollm2@q4" for version in first.values())
    assert abs(q4 - 160) <= 4 * math.sqrt(200 * 0.8 * 0.2), q4
    assert set(first.values()) == {"smollm2@q4", "smollm2@fp32"}
    assert again == {user: first[user] for user in users[:20]}


def test_an_admin_key_moves_a_split_at_run_time(mesh, repository_file):
    *_, gateway = mesh
    model = load_repository(repository_file).model("smollm2")
    user = next(f"user-{i}" for i in range(40) if choose_version(model, f"user-{i}").name == "q4")
    status, reply = _split(gateway, {"q4": 0, "fp32": 100}, key=APP_KEY)
    assert status == 403 and "admin" in reply["error"]["message"]
    assert _split(gateway, {"q4": 10, "fp32": 10})[0] == 400
    unknown = _split(gateway, {"q4": 50, "int8": 50})[1]["error"]["message"]
    assert unknown.startswith("model 'smollm2': split: no version 'int8'")
    assert _split(gateway, {"q4": 100}, model="llama")[0] == 404
    assert _complete(gateway, "smollm2", user)[2]["system_fingerprint"] == "smollm2@q4"
    try:
        assert _split(gateway, {"q4": 0, "fp32": 100}) == (200, {"model": "smollm2", "split": {"q4": 0, "fp32": 100}})
        assert _complete(gateway, "smollm2", user)[2]["system_fingerprint"] == "smollm2@fp32"
    finally:
        assert _split(gateway, {"q4": 50, "fp32": 50})[0] == 200
    assert _complete(gateway, "smollm2", user)[2]["system_fingerprint"] == "smollm2@q4"


class _Load:
    """Clients sending requests for the model's name, one after another, until stopped: what each
    reply said, and every failure."""

    def __init__(self, gateway, clients: int = 2) -> None:
        self.served: list[tuple[str, str, int, str]] = []  # (version, finish_reason, completion tokens, text)
        self.failures: list[str] = []
        self._gateway = gateway
        self._stop = threading.Event()
        self._users = itertools.count()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # A new user each time: the split's sticky choice spreads the requests over the versions.
                status, _, reply = _complete(self._gateway, "smollm2", f"user-{next(self._users)}", max_tokens=6)
            except OSError as error:
                self.failures.append(repr(error))
                continue
            if status != 200:
                self.failures.append(json.dumps(reply))
                continue
            [choice] = reply["choices"]
            usage = reply["usage"]
            self.served.append((reply["system_fingerprint"], choice["finish_reason"], usage["completion_tokens"],
                                choice["text"]))

    def wait_for(self, version: str, replies: int = 3) -> None:
        """Until the latest `replies` replies all came from `version`."""
        deadline = time.monotonic() + TIMEOUT_S
        while not (len(self.served) >= replies and {v for v, *_ in self.served[-replies:]} == {version}):
            assert time.monotonic() < deadline, f"traffic never moved to {version}: {self.served[-5:]}"
            assert not self.failures, self.failures
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def _rewrite(path: str, text: str) -> None:
    # As a ConfigMap update lands: the whole file replaced at once.
    with open(path + ".new", "w") as file:
        file.write(text)
    os.replace(path + ".new", path)


def test_a_version_swapped_in_and_out_under_load_fails_no_request(mesh, repository_file):
    """The split moves to fp32 in the file, the q4 workers drain and stop, new q4 workers start and
    the split moves back (the same steps roll a new version out or an old one back): under steady
    load no request fails or ends short."""
    prefill, decode, _, gateway = mesh
    load = _Load(gateway)
    try:
        _rewrite(repository_file, two_versions("q4 = 0, fp32 = 100"))
        load.wait_for("smollm2@fp32")
        for worker in (prefill, decode):
            assert worker.stop() == 0, worker.log_tail()  # SIGTERM: a drain of what they hold
        mesh[0], mesh[1] = (start_worker(worker.args) for worker in (prefill, decode))
        deadline = time.monotonic() + TIMEOUT_S
        while _complete(gateway, "smollm2@q4")[0] != 200:  # until the gateway routes to the new pair
            assert time.monotonic() < deadline, "the new q4 workers never served"
            time.sleep(0.5)
        _rewrite(repository_file, two_versions("q4 = 100, fp32 = 0"))
        load.wait_for("smollm2@q4")
    finally:
        load.stop()
        _rewrite(repository_file, REPOSITORY)
    assert not load.failures, load.failures
    assert {(reason, tokens) for _, reason, tokens, _ in load.served} == {("length", 6)}
    assert {version for version, *_ in load.served} == {"smollm2@q4", "smollm2@fp32"}
    # Greedy: each version answers as it always does, restarted workers included.
    texts = {version: {text for v, *_, text in load.served if v == version} for version, *_ in load.served}
    assert all(len(answers) == 1 for answers in texts.values()), texts


def _wait_for_versions(worker, serving: str, retiring: list[str]) -> None:
    """Until the worker's load reports say it serves `serving` and still holds `retiring` (a version
    leaves the list when it is unloaded)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        report = load_report(worker)
        if (report.model_version, list(report.retiring_versions)) == (serving, retiring):
            return
        assert time.monotonic() < deadline, (report.model_version, report.retiring_versions, worker.log_tail())
        time.sleep(0.3)


def test_a_version_swapped_inside_the_colocated_workers_process_fails_no_request(mesh, repository_file):
    """The file assigns the colocated worker's pool an int8 version: it loads beside fp32 and both are
    served; the split moves to int8 and fp32 is unloaded; then the same two edits roll back. Under
    steady load no request fails, and each version answers as it always does (greedy)."""
    *_, colocated, gateway = mesh
    int8 = '[[model.version]]\nname = "int8"\npath = "shipped"\nquantization = "int8"\npool = "{pool}"\n'
    both = two_versions(fp32_extra='pool = "standby"') + int8.format(pool="smollm2-fp32")
    load = _Load(gateway)
    try:
        _rewrite(repository_file, both)
        _wait_for_versions(colocated, "int8", ["smollm2@fp32"])
        deadline = time.monotonic() + TIMEOUT_S
        while (states := {entry["id"]: entry["state"] for entry in _http(gateway, "/v1/models")[2]["data"]}) != {
                "smollm2@q4": "serving", "smollm2@int8": "serving", "smollm2@fp32": "draining"}:
            assert time.monotonic() < deadline, states  # fp32 is held only as a retiring version
            time.sleep(0.2)
        _rewrite(repository_file, both.replace("fp32 = 50", "int8 = 50"))
        _wait_for_versions(colocated, "int8", [])
        assert _complete(gateway, "smollm2@int8")[0] == 200
        _rewrite(repository_file, two_versions("q4 = 50, int8 = 50") + int8.format(pool="standby"))
        _wait_for_versions(colocated, "fp32", ["smollm2@int8"])
        _rewrite(repository_file, REPOSITORY)
        _wait_for_versions(colocated, "fp32", [])
    finally:
        load.stop()
        _rewrite(repository_file, REPOSITORY)
    assert not load.failures, load.failures
    texts: dict[str, set[str]] = {}
    for version, reason, tokens, text in load.served:
        assert (reason, tokens) == ("length", 6)
        texts.setdefault(version, set()).add(text)
    assert set(texts) >= {"smollm2@q4", "smollm2@fp32", "smollm2@int8"}, texts
    assert all(len(answers) == 1 for answers in texts.values()), texts


def test_a_repository_change_that_does_not_validate_leaves_the_previous_one_serving(mesh, repository_file):
    *_, gateway = mesh
    _rewrite(repository_file, REPOSITORY.replace("fp32 = 50", "fp32 = 70"))
    try:
        deadline = time.monotonic() + 10
        while "split: the weights must sum to 100" not in gateway.log_tail(200):
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        status, _, listing = _http(gateway, "/v1/models")
        assert status == 200 and {entry["id"] for entry in listing["data"]} == {"smollm2@q4", "smollm2@fp32"}
        assert _complete(gateway, "smollm2@fp32")[0] == 200
    finally:
        _rewrite(repository_file, REPOSITORY)


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
