"""The mesh across separate hosts (bench.harness.hosts: network namespaces on one bridge, nothing on
loopback): greedy output equal to the in-process engine's on both KV backends, mutual TLS with
certificates naming the hosts' addresses (a peer from another CA refused), partitions (a host's
link pulled mid-transfer, while pairs are to be made, during streaming) that end in a clean retry
with no block left on any worker and the pair made again once the link is back, a corrupted
torch_dist page caught and retried, and the harness leaving nothing behind.

One mesh for the module: prefill-1 and prefill-2, decode-1 (torch_dist) and decode-2 (grpc), and on
the gateway host a gateway per KV backend plus one in front of both decode workers (migration).
Every internal link is mutual TLS. Skipped where namespaces cannot be made, except under CI=true.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from certs import TestCa
from parity_prompts import travel_diary
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS
from tandem.v1 import decode_pb2, decode_pb2_grpc

from bench.harness.host_mesh import DECODE_HOSTS, HOST_NAMES, PREFILL_HOSTS, HostMesh, start_host_mesh
from bench.harness.hosts import Hosts, namespaces_unavailable, owned_links, owned_namespaces, remove_stale
from bench.harness.leak_check import assert_no_leaks, load_report
from bench.harness.paths import REPO
from bench.harness.worker import WorkerProcess
from engine.offline import generate
from engine.sampling_params import SamplingParams
from kvtransfer.faults import ENV_VAR
from services.client import TandemClient
from services.common.convert import sampling_params_to_proto

KV_TIMEOUT_S = "6"  # both sides' KV deadline: a partition costs this much per attempt
WORKER_FLAGS = ["--threads", "1", "--kv-cache-mib", "64", "--kv-timeout", KV_TIMEOUT_S, *PINNED_FLAGS]
BACKENDS = {"torch_dist": "decode-1", "grpc": "decode-2"}
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
RPC_TIMEOUT_S = 300.0
DEADLINE_S = 90.0  # generous bound for conditions polled below; no test asserts elapsed time
# A slow link keeps a transfer in flight long enough to pull the cable under it: a prompt of about
# 200 tokens is 9 MB of float32 KV, some two seconds at this rate.
SLOW_RATE = "40mbit"


def _require_namespaces() -> None:
    reason = namespaces_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the multi-host tests: {reason}")
        pytest.skip(reason)


@dataclass
class Pki:
    ca: Path
    certs: dict[str, tuple[Path, Path]]  # host (and "client", "stranger") -> (cert, key)
    other_ca: Path

    def flags(self, name: str) -> list[str]:
        cert, key = self.certs[name]
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self.ca)]

    def client_credentials(self, name: str = "client") -> grpc.ChannelCredentials:
        cert, key = self.certs[name]
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), key.read_bytes(), cert.read_bytes())


@dataclass
class World:
    hosts: Hosts
    pki: Pki
    mesh: HostMesh
    fault_files: dict[str, Path]  # prefill host -> its test hook file

    def credentials(self) -> grpc.ChannelCredentials:
        return self.pki.client_credentials()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    _require_namespaces()
    folder = tmp_path_factory.mktemp("hosts")
    hosts = Hosts(HOST_NAMES)
    try:
        ca, other = TestCa(folder / "ca", "Tandem test CA"), TestCa(folder / "other", "Another CA")
        certs = {name: _files(ca.issue(name, (name,), (hosts.address(name),))) for name in HOST_NAMES}
        certs["client"] = _files(ca.issue("client", ("client",), (hosts.client_address,)))
        certs["stranger"] = _files(other.issue("stranger", ("stranger",), (hosts.address("prefill-1"),)))
        pki = Pki(ca.cert_file, certs, other.cert_file)
        faults = {host: folder / f"{host}.fault" for host in PREFILL_HOSTS}
        mesh = start_host_mesh(
            hosts, WORKER_FLAGS,
            decode_flags={host: ["--kv-backend", backend] for backend, host in BACKENDS.items()},
            gateways={"torch_dist": ["decode-1"], "grpc": ["decode-2"], "both": list(DECODE_HOSTS)},
            gateway_flags=["--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"],
            host_flags={name: pki.flags(name) for name in HOST_NAMES},
            host_env={host: {ENV_VAR: str(path)} for host, path in faults.items()},
        )
        try:
            yield World(hosts, pki, mesh, faults)
        finally:
            mesh.stop()
    finally:
        hosts.close()


def _files(issued) -> tuple[Path, Path]:
    return issued.cert_file, issued.key_file


@pytest.fixture(scope="module")
def reference(make_engine) -> Callable[[list[int]], list[int]]:
    """Greedy token ids of a prompt on an in-process colocated engine (what the loopback mesh
    tests already match token for token)."""
    engine = make_engine()
    return lambda prompt, max_tokens=GREEDY["max_tokens"]: generate(
        engine, [prompt], [SamplingParams(**{**GREEDY, "max_tokens": max_tokens})])[0].token_ids


def _client(world: World, gateway: str) -> TandemClient:
    return TandemClient(str(world.mesh.gateways[gateway].address), ca_file=world.pki.ca)


def _token_ids(world: World, gateway: str, prompt: list[int]) -> list[int]:
    with _client(world, gateway) as client:
        return [i for chunk in client.generate(token_ids=prompt, **GREEDY, timeout=RPC_TIMEOUT_S)
                for i in chunk.token_ids]


def _routed(world: World, gateway: str) -> dict[str, float]:
    """The gateway's attempts so far (retries included) per prefill worker ("local": none)."""
    context = ssl.create_default_context(cafile=str(world.pki.ca))
    url = f"https://{world.mesh.gateways[gateway].http_address}/metrics"
    with urllib.request.urlopen(url, timeout=30, context=context) as reply:
        text = reply.read().decode()
    return {sample.labels["worker"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "tandem:routing_decisions"
            for sample in family.samples
            if sample.name.endswith("_total") and sample.labels["pool"] == "prefill"}


def _more(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {worker: count - before.get(worker, 0) for worker, count in after.items() if count > before.get(worker, 0)}


def _poll(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _no_leaks(world: World) -> None:
    assert_no_leaks(world.mesh.workers, credentials=world.credentials())


def _host_of(world: World, worker: WorkerProcess) -> str:
    [host] = [h for h, w in {**world.mesh.prefill, **world.mesh.decode}.items() if w is worker]
    return host


def _prompt(tokenizer, label: str, chars: int = 600) -> list[int]:
    return tokenizer.encode(f"{label}\n" + travel_diary()[:chars])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_greedy_output_across_hosts_equals_the_in_process_engine(world, tokenizer, reference, backend):
    prompt = _prompt(tokenizer, f"Across hosts over {backend}.")
    before = _routed(world, backend)
    assert _token_ids(world, backend, prompt) == reference(prompt)
    [served] = _more(before, _routed(world, backend))
    # A prefill host computed it and its KV crossed the bridge: the decode host did not prefill.
    assert served in {str(world.mesh.prefill[h].address) for h in PREFILL_HOSTS}
    assert all(ipaddress.ip_address(str(w.address).rpartition(":")[0]) in world.hosts.subnet
               for w in world.mesh.processes)
    _no_leaks(world)


def _probe(world: World, on_host: str, target: WorkerProcess, cert: str) -> subprocess.CompletedProcess[str]:
    """`tandem probe` of `target` run on host `on_host`, presenting certificate `cert`."""
    argv = [*world.hosts.exec_argv(on_host), sys.executable, "-m", "services.cli", "probe", str(target.address),
            "--timeout", "10", *world.pki.flags(cert)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_mutual_tls_across_hosts_refuses_a_peer_from_another_ca(world):
    decode = world.mesh.decode["decode-1"]
    assert _probe(world, "prefill-1", decode, "prefill-1").returncode == 0
    refused = _probe(world, "prefill-1", decode, "stranger")
    assert refused.returncode == 1, refused.stderr
    assert "UNAVAILABLE" in refused.stderr
    # A client trusting another CA does not accept the gateway's certificate.
    with TandemClient(str(world.mesh.gateways["grpc"].address), ca_file=world.pki.other_ca) as client:
        with pytest.raises(grpc.RpcError) as error:
            list(client.generate(prompt="Hello", max_tokens=2, timeout=30))
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE
    # Nor does a worker answer a client without a certificate from its CA.
    with pytest.raises(grpc.RpcError) as error:
        load_report(decode, world.pki.client_credentials("stranger"))
    assert error.value.code() is grpc.StatusCode.UNAVAILABLE
