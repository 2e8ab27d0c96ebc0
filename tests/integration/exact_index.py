"""The gateway's exact prefix index as integration tests see it: its /health detail per worker, a wait
until it has applied a worker's events, its agreement with the workers' own prefix caches, and a peer
that hashes its blocks differently from the gateway (the misbehaving peer the registration check must
refuse)."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from routing_metrics import poll
from tandem.v1 import common_pb2, decode_pb2_grpc

from harness.leak_check import load_report
from harness.worker import WorkerProcess


def listed_address(worker: WorkerProcess) -> str:
    """The address a gateway started with `--colocated 127.0.0.1:PORT` knows the worker by."""
    return f"127.0.0.1:{worker.args[worker.args.index('--port') + 1]}"


def health_detail(gateway: WorkerProcess) -> dict[str, dict]:
    """The gateway's /health body, by worker address."""
    with urllib.request.urlopen(f"http://{gateway.http_address}/health", timeout=30) as reply:
        return {worker["address"]: worker for worker in json.load(reply)["workers"]}


def wait_until_caught_up(gateway: WorkerProcess, worker: WorkerProcess) -> None:
    """Wait until the gateway's index has applied every block event the worker reported so far."""
    seq = load_report(worker).kv_events_seq
    poll(lambda: (health_detail(gateway)[listed_address(worker)]["kv_events_seq"] or 0) >= seq,
         f"the gateway's index reaching event {seq} of {worker.address}", 60.0)


def wait_until_trusted(gateway: WorkerProcess, workers: Sequence[WorkerProcess]) -> None:
    """Wait until the gateway has checked every worker's probe hashes and uses their block events (a
    worker's first reports may arrive before the gateway's tokenizer for its model has loaded)."""
    poll(lambda: all(health_detail(gateway)[listed_address(w)]["prefix_index"] == "exact" for w in workers),
         "the gateway trusting every worker's block events", 60.0)


def check_index_agrees(gateway: WorkerProcess, workers: Sequence[WorkerProcess]) -> None:
    """The gateway's index holds, for each idle worker, exactly as many device blocks as the worker's
    own prefix cache, once it has caught up with the worker's events."""
    for worker in workers:
        wait_until_caught_up(gateway, worker)
    detail = health_detail(gateway)
    held = {listed_address(w): detail[listed_address(w)]["kv_blocks"].get("device", 0) for w in workers}
    assert held == {listed_address(w): load_report(w).cached_kv_blocks for w in workers}, detail


class _WrongHashes(decode_pb2_grpc.DecodeServicer):
    """The misbehaving peer: load reports whose probe hashes are not the probe text's (as from a
    worker with another tokenizer or hash layout), and a stored block the gateway must not use."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name

    def WatchLoad(self, request: common_pb2.WatchLoadRequest, context: grpc.ServicerContext) -> Iterator:
        stop = threading.Event()
        context.add_callback(stop.set)
        while not stop.is_set():
            yield common_pb2.LoadReport(
                worker_id="colocated@wrong-hashes", role="colocated", block_size=16, total_kv_blocks=64,
                free_kv_blocks=64, model_name=self._model_name, block_hash_salt=b"another salt",
                probe_block_hashes=[bytes([i]) * 32 for i in range(3)], kv_events_reset=True,
                kv_events=[common_pb2.KVBlockEvent(tier="device", stored=True, block_hashes=[bytes(32)])])
            stop.wait(0.2)


def start_wrong_hashing_peer(model_name: str) -> tuple[grpc.Server, str]:
    """A gRPC peer on loopback serving health (SERVING) and WatchLoad with wrong probe hashes; its address."""
    server = grpc.server(ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeServicer_to_server(_WrongHashes(model_name), server)
    status = health.HealthServicer()
    status.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
