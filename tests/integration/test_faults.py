"""Faults with real processes: KV transfer faults injected into prefill workers (tests/kv_faults.py),
prefill workers killed with SIGKILL mid-prefill and mid-transfer, and a gateway killed with SIGKILL
while requests stream and prefill. Every request that is not cancelled still gets the greedy output
of an in-process colocated engine (near-ties aside: reference.check_runs), and every test ends with
the leak check.

One mesh for the module: prefill workers A and B (whose fault files the tests write), a decode
worker per KV backend, and two prefill workers that the kill test kills. The decode workers' KV
deadline is short, so that a stalled transfer fails within seconds.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kv_fault_worker import wrapper
from kv_faults import LOG_PREFIX
from parity_prompts import travel_diary
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, ReferenceRun, check_runs, engine_reference
from routing_metrics import increase, poll, prefill_attempts

from engine.sampling_params import SamplingParams
from harness.leak_check import assert_no_leaks, load_report
from harness.worker import WorkerProcess, start_worker
from services.client import TandemClient

WORKER_FLAGS = ["--port", "0", "--threads", "1", "--kv-cache-mib", "64", *PINNED_FLAGS]
# Load reports are read between engine steps, so a prompt is seen mid-prefill only when it takes
# several steps: small chunks make a few hundred tokens take several.
PREFILL_FLAGS = [*WORKER_FLAGS, "--max-num-batched-tokens", "128"]
KV_TIMEOUT_S = "10"  # the decode workers' deadline for a prompt's KV: a stall costs this much
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
RPC_TIMEOUT_S = 300.0
DEADLINE_S = 60.0  # generous bound for conditions polled below; no test asserts elapsed time
BACKENDS = ["torch_dist", "grpc"]


@dataclass
class Mesh:
    prefill: list[WorkerProcess]  # A and B
    fault_files: list[Path]  # their fault files (kv_faults), in the same order
    decode: dict[str, WorkerProcess]  # by KV backend
    victims: list[WorkerProcess]  # prefill workers the kill test kills; their fault files follow
    gateways: dict[str, WorkerProcess]  # A and B in front of each decode worker; "victims" in front of torch_dist's

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.prefill, *self.decode.values()]


def _gateway(prefill: list[WorkerProcess], decode: list[WorkerProcess]) -> WorkerProcess:
    """A gateway over these workers, started (not yet ready)."""
    return start_worker(["gateway", "--port", "0", "--http-port", "0",
                         "--prefill", ",".join(str(w.address) for w in prefill),
                         "--decode", ",".join(str(w.address) for w in decode),
                         "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"], wait=False)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("faults")
    files = [folder / f"prefill-{i}.fault" for i in range(4)]
    prefill = [start_worker(["prefill", *PREFILL_FLAGS], wait=False, wrapper=wrapper(path)) for path in files]
    decode = {backend: start_worker(["decode", *WORKER_FLAGS, "--kv-backend", backend, "--kv-timeout", KV_TIMEOUT_S],
                                    wait=False) for backend in BACKENDS}
    started = [*prefill, *decode.values()]
    gateways: dict[str, WorkerProcess] = {}
    try:
        for worker in started:
            worker.wait_ready()
        for backend in BACKENDS:
            gateways[backend] = _gateway(prefill[:2], [decode[backend]])
        gateways["victims"] = _gateway(prefill[2:], [decode["torch_dist"]])
        for gateway in gateways.values():
            gateway.wait_ready()
        yield Mesh(prefill[:2], files, decode, prefill[2:], gateways)
    finally:
        for worker in [*gateways.values(), *started]:
            worker.stop()


@pytest.fixture(scope="module")
def reference(make_engine) -> Callable[[list[int]], ReferenceRun]:
    """Greedy run of a prompt (tokens, top-2 margins) on an in-process colocated engine: the mesh
    computes it in other batch shapes, so outputs are compared by the near-tie rule (_check)."""
    engine = make_engine()
    return lambda prompt: engine_reference(engine, [prompt], [SamplingParams(**GREEDY)])[0]


def _check(tokens: list[int], expected: ReferenceRun, label: str) -> None:
    check_runs([tokens], [expected], label)


def _token_ids(gateway: WorkerProcess, prompt: list[int]) -> list[int]:
    with TandemClient(str(gateway.address)) as client:
        return [i for chunk in client.generate(token_ids=prompt, **GREEDY, timeout=RPC_TIMEOUT_S)
                for i in chunk.token_ids]


def _routed(gateway: WorkerProcess) -> dict[str, float]:
    """The gateway's attempts so far (retries included) per prefill worker ("local": none)."""
    with urllib.request.urlopen(f"http://{gateway.http_address}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return prefill_attempts(text_string_to_metric_families(text))


def _poll(condition: Callable[[], bool], what: str) -> None:
    poll(condition, what, DEADLINE_S)


@pytest.mark.parametrize("fault", ["corrupt", "drop", "stall"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_transfer_fault_is_retried_on_the_other_prefill_worker(mesh, tokenizer, reference, backend, fault):
    gateway = mesh.gateways[backend]
    prompt = tokenizer.encode(f"Fault {fault} over {backend}.\n" + travel_diary()[:600])
    expected = reference(prompt)
    before = _routed(gateway)
    _check(_token_ids(gateway, prompt), expected, "before the fault")
    [first] = increase(before, _routed(gateway))  # the prefill worker that served it now holds its prefix
    index = [str(w.address) for w in mesh.prefill].index(first)
    other = str(mesh.prefill[1 - index].address)
    mesh.fault_files[index].write_text(fault)
    try:
        before = _routed(gateway)
        # Its prefix sends the request to the faulty worker again; the fault makes the gateway retry.
        _check(_token_ids(gateway, prompt), expected, f"retried after {fault}")
    finally:
        mesh.fault_files[index].write_text("")
    assert increase(before, _routed(gateway)) == {first: 1, other: 1}
    assert f"{LOG_PREFIX}: {fault}" in mesh.prefill[index].log_tail(200)
    assert_no_leaks(mesh.workers)


def _busy(worker: WorkerProcess) -> bool:
    report = load_report(worker)
    return bool(report.running_requests or report.waiting_requests)


def _first_busy(workers: list[WorkerProcess]) -> WorkerProcess:
    """The first of `workers` seen running or queueing a request (polled)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for worker in workers:
            if _busy(worker):
                return worker
        assert time.monotonic() < deadline, "no worker started the request"
        time.sleep(0.05)


def _delivering(worker: WorkerProcess) -> bool:
    """Its prompt is computed (nothing runs or waits) but its pages are still held for the transfer."""
    report = load_report(worker)
    return not (report.running_requests or report.waiting_requests) and report.used_kv_blocks > 0


def test_prefill_workers_killed_mid_prefill_then_mid_transfer(mesh, tokenizer, reference):
    gateway = mesh.gateways["victims"]
    # Mid-prefill: the request goes to one victim; killed while computing, the other one serves it.
    prompt = tokenizer.encode("Killed mid-prefill.\n" + travel_diary()[:1500])
    expected = reference(prompt)
    before = _routed(gateway)
    with TandemClient(str(gateway.address)) as client:
        stream = client.generate(token_ids=prompt, **GREEDY, timeout=RPC_TIMEOUT_S)
        killed = _first_busy(mesh.victims)
        killed.proc.kill()
        _check([i for chunk in stream for i in chunk.token_ids], expected, "killed mid-prefill")
    [survivor] = [v for v in mesh.victims if v is not killed]
    assert increase(before, _routed(gateway)) == {str(killed.address): 1, str(survivor.address): 1}
    assert_no_leaks([survivor, *mesh.workers])

    # Mid-transfer: the survivor's pages stall (kv_faults) and it is killed while holding them;
    # no prefill worker is left, so the decode worker prefills the prompt itself.
    prompt = tokenizer.encode("Killed mid-transfer.\n" + travel_diary()[:300])
    expected = reference(prompt)
    mesh.fault_files[2 + mesh.victims.index(survivor)].write_text("stall")
    before = _routed(gateway)
    with TandemClient(str(gateway.address)) as client:
        stream = client.generate(token_ids=prompt, **GREEDY, timeout=RPC_TIMEOUT_S)
        _poll(lambda: _delivering(survivor), "the survivor never held computed pages")
        survivor.proc.kill()
        _check([i for chunk in stream for i in chunk.token_ids], expected, "killed mid-transfer")
    assert increase(before, _routed(gateway)) == {str(survivor.address): 1, "local": 1}
    assert_no_leaks(mesh.workers)


def test_workers_free_a_killed_gateways_requests_and_serve_a_new_one(mesh, tokenizer, reference):
    decode = list(mesh.decode.values())
    gateway = _gateway(mesh.prefill, decode)
    try:
        gateway.wait_ready()
        with TandemClient(str(gateway.address)) as client:
            streaming = [client.generate(prompt=f"Stream {i}: once upon a time", max_tokens=4000, temperature=0.0,
                                         ignore_eos=True, timeout=RPC_TIMEOUT_S) for i in range(2)]
            for stream in streaming:
                for _ in range(2):
                    assert next(stream).finish_reason is None
            prefilling = [client.generate(prompt=f"Prefill {i}\n{travel_diary()}", **GREEDY,
                                          timeout=RPC_TIMEOUT_S) for i in range(2)]
            _first_busy(mesh.prefill)
            gateway.proc.kill()
            gateway.proc.wait()
            for stream in [*streaming, *prefilling]:
                stream.cancel()
        assert_no_leaks(mesh.workers)
    finally:
        gateway.stop()
    gateway = _gateway(mesh.prefill, decode)
    try:
        gateway.wait_ready()
        prompt = tokenizer.encode("After the restart, the capital of France is")
        _check(_token_ids(gateway, prompt), reference(prompt), "after the restart")
        assert_no_leaks(mesh.workers)
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
